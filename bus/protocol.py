"""The AGB/1 wire protocol: frames, the routing header, control bodies and their codecs.

A message is `[SIGNATURE, header, *body]` (the ROUTER side sees the peer's routing id first;
published events have a topic frame first). The header is a MessagePack map decoded into
`Header`; the hub routes on it alone and forwards body frames untouched. docs/protocol.md is the
normative description; keep the two in step.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Final, TypeVar

import msgspec

MAJOR: Final = 1  # in the signature: a peer of another major is refused at its first frame
SIGNATURE: Final = b"AGB/%d" % MAJOR
MINOR: Final = 0

# Message kinds (header `kind`).
HELLO: Final = "hello"  # peer -> hub: Hello body
WELCOME: Final = "welcome"  # hub -> peer: Welcome body
REGISTER: Final = "register"  # peer -> hub: Register body
UNREGISTER: Final = "unregister"  # peer -> hub: Unregister body
REQUEST: Final = "request"  # requester -> hub -> server; header.service, header.id, body opaque
PARTIAL: Final = "partial"  # server -> hub -> requester; header.id; body opaque
REPLY: Final = "reply"  # server -> hub -> requester; final; header.id; body opaque
ERROR: Final = "error"  # server or hub -> requester; final; header.id, code, error
CANCEL: Final = "cancel"  # requester -> hub -> server; header.id
EVENT: Final = "event"  # peer -> hub -> subscribers; header.type/agent/run; body = Event
HEARTBEAT: Final = "heartbeat"  # both ways, and on the event socket (header.seq = latest)
BYE: Final = "bye"  # peer -> hub: leaving
RECONNECT: Final = "reconnect"  # hub -> peer: "I do not know you; say hello again"

KINDS: Final = frozenset(
    {HELLO, WELCOME, REGISTER, UNREGISTER, REQUEST, PARTIAL, REPLY, ERROR, CANCEL, EVENT}
    | {HEARTBEAT, BYE, RECONNECT}
)

# Error codes carried by `error` replies.
NO_SERVICE: Final = "no_service"
PEER_LOST: Final = "peer_lost"
DEADLINE: Final = "deadline_exceeded"
CANCELLED: Final = "cancelled"
OVERLOADED: Final = "overloaded"
BAD_REQUEST: Final = "bad_request"
HANDLER_ERROR: Final = "handler_error"
HUB_LOST: Final = "hub_lost"
LOG_UNAVAILABLE: Final = "log_unavailable"  # hub -> publisher: event refused, log not writable
UNAUTHORIZED: Final = "unauthorized"  # hub -> peer: its CURVE key is no longer authorised
FORBIDDEN: Final = "forbidden"  # hub -> peer: its roles do not allow that register or event
BAD_EVENT: Final = "bad_event"  # hub -> publisher: event refused (a hub-only type, or a lying header)
# hub -> peer: this hub is a standby (or a deposed primary), not the leader: move to the next hub
# endpoint (docs/protocol.md section 5, "Following the hub"); `error` names the leader if known
NOT_LEADER: Final = "not_leader"

# Services the hub serves itself.
HUB_STATUS: Final = "hub.status"
HUB_REPLAY: Final = "hub.replay"

# Most body frames one `event` message may carry (each its own event; docs/protocol.md §4):
# bounds the hub's work per message, as DRAIN_LIMIT bounds its messages per pass.
MAX_EVENT_BODIES: Final = 1024
# An `event` header's `type` when its bodies are events of several types: each body is an event
# of its own `type` (docs/protocol.md §4; only to a hub whose welcome has `mixed_types`).
MIXED_TYPES: Final = "*"

# Topic of the idle heartbeat on the event socket.
HEARTBEAT_TOPIC: Final = b"hb"


class Header(msgspec.Struct, omit_defaults=True):
    """The routing header. Unknown keys are ignored, so a newer minor version decodes here."""

    kind: str
    id: str = ""
    v: int = MINOR
    peer: str = ""
    session: str = ""
    parent: str = ""
    service: str = ""
    deadline: float = 0.0
    # requests: the peer id the requester would like to serve it (a preference: see
    # docs/protocol.md section 5, "Preferred server")
    prefer: str = ""
    # requests: seconds it may wait for a server of its service to register while none serves
    # it (0: until the deadline; see docs/protocol.md section 5, "Waiting for a server")
    wait: float = 0.0
    # requests: an idempotency key (docs/protocol.md section 5, "Following the hub"): a
    # requester re-sends a keyed request on the next hub when it lost the hub before the final
    # answer; a server that has seen the key (for a non-idempotent service) answers the repeat
    # from the first run instead of running it again. "" (omitted): not keyed.
    key: str = ""
    code: str = ""
    error: str = ""
    # events
    type: str = ""
    agent: str = ""
    run: str = ""
    experiment: str = ""
    seq: int = 0
    ts: float = 0.0
    # events of a type the hub restricts to a right (the experiment journal): the right it
    # checked before logging it, `*` or the role pattern that allowed it; set by the hub alone
    # (docs/protocol.md section 8, "Roles"), meaningless on other types
    granted: str = ""


class ServiceSpec(msgspec.Struct, omit_defaults=True):
    name: str
    capacity: int = 1
    idempotent: bool = False
    meta: dict[str, Any] = msgspec.field(default_factory=dict)


class Hello(msgspec.Struct, omit_defaults=True):
    name: str
    session: str
    pid: int = 0
    host: str = ""
    role: str = ""
    # A secret naming this process's roles in a hub given a credentials table (`busctl up`
    # makes one per process kind; docs/protocol.md section 8, "Roles"). Never shown in status.
    credential: str = ""


class Welcome(msgspec.Struct, omit_defaults=True):
    peer: str
    hub_session: str
    events: str
    heartbeat_interval: float
    liveness: int
    max_message_bytes: int
    # Most body frames (events) the hub takes in one `event` message; absent (1) from a hub
    # that predates multi-body events, so a newer peer never sends one there.
    event_bodies: int = 1
    # True: the hub takes an `event` message whose header `type` is `MIXED_TYPES`, each body
    # an event of its own body's type; absent (False) from a hub that predates that.
    mixed_types: bool = False
    # The leader's lease epoch (issue 52): grows with every takeover, so a peer that saw a newer
    # epoch never goes back to an older leader. 0 from a hub without a lease (one machine).
    epoch: int = 0


class Register(msgspec.Struct):
    services: list[ServiceSpec]


class Unregister(msgspec.Struct):
    services: list[str]


class ReplayRequest(msgspec.Struct, omit_defaults=True):
    since: int = 0
    limit: int = 2000
    topics: list[str] = msgspec.field(default_factory=list)
    experiment: str = ""  # only this experiment's events ("": every event); docs/protocol.md


class ReplayGap(msgspec.Struct):
    """Seqs `first`..`last` are no longer in the log; `reason` names the retention setting."""

    first: int
    last: int
    reason: str


class ReplayBatch(msgspec.Struct, omit_defaults=True):
    """Reply to `hub.replay`: (header, body) pairs of logged events in (since, upto], and the log
    head. Replay is finished only when `upto == head`: a batch with few or no events is not the
    end (it stops at `replay_bytes`, or its rows did not match the topics). `gap`: part of the
    range was pruned by retention."""

    events: list[tuple[bytes, bytes]]
    upto: int
    head: int
    gap: ReplayGap | None = None


class ServiceLoad(msgspec.Struct, omit_defaults=True):
    name: str
    capacity: int
    load: int
    idempotent: bool = False
    meta: dict[str, Any] = msgspec.field(default_factory=dict)


class PeerInfo(msgspec.Struct, omit_defaults=True):
    peer: str
    name: str
    host: str = ""
    pid: int = 0
    session: str = ""
    role: str = ""
    since: float = 0.0
    last_seen: float = 0.0
    services: list[ServiceLoad] = msgspec.field(default_factory=list)


class ServiceInfo(msgspec.Struct, omit_defaults=True):
    name: str
    peers: int
    capacity: int
    load: int
    queued: int
    idempotent: bool = False
    meta: dict[str, Any] = msgspec.field(default_factory=dict)


class Budget(msgspec.Struct, omit_defaults=True):
    """One of the hub's memory budgets (docs/reliability.md, "Memory budgets"): its configured
    limit and what is in use now (or the most seen, for per-message limits)."""

    limit: int
    used: int = 0


class Status(msgspec.Struct, omit_defaults=True):
    hub_session: str
    endpoint: str
    events: str
    uptime: float
    seq: int
    peers: list[PeerInfo]
    services: list[ServiceInfo]
    counters: dict[str, int]
    state_dir: str = ""
    log_error: str = ""  # why events are being refused (event log not writable); "" when fine
    budgets: dict[str, Budget] = msgspec.field(default_factory=dict)
    # With a leader lease (issue 52): "primary" (a standby answers no status: `not_leader`)
    # and the lease's epoch; "" and 0 on a hub without a lease (one machine)
    role: str = ""
    epoch: int = 0


# --- codecs: one encoder/decoder per type, built once --------------------------------------

_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(Header)
_decoders: dict[type, msgspec.msgpack.Decoder[Any]] = {}


def encode(obj: Any) -> bytes:
    return _encoder.encode(obj)


def decode_header(data: bytes | memoryview) -> Header:
    return _header_decoder.decode(data)


_T = TypeVar("_T")


def decode(data: bytes | memoryview, type_: type[_T]) -> _T:
    """`data` as a `type_`; raises msgspec.ValidationError/DecodeError when it is not one."""
    # The cache holds a Decoder[type_] under each type_, which a dict's type cannot say.
    decoder: msgspec.msgpack.Decoder[_T] | None = _decoders.get(type_)
    if decoder is None:
        decoder = msgspec.msgpack.Decoder(type_)
        _decoders[type_] = decoder
    return decoder.decode(data)


def new_id() -> str:
    # 128 random bits as 32 hex digits, as uuid4().hex gave, in a quarter of its time (a
    # request's key and an event message's id each: 2.6% of the coordinator's CPU at 1,000
    # sessions, bench/bench_scale.py under py-spy)
    return os.urandom(16).hex()


def new_session() -> str:
    return os.urandom(6).hex()


def hostname() -> str:
    return socket.gethostname()


_host_pid = 0  # `set_host_pid`'s: 0 while this process's own pid is the host's


def host_pid() -> int:
    """This process's pid as seen from its host (a hello's `pid`, what `busctl ps` shows and a
    user can signal): `os.getpid()`, unless `set_host_pid` named another."""
    return _host_pid or os.getpid()


def set_host_pid(pid: int) -> None:
    """A process in a PID namespace of its own (a sandboxed worker is pid 1 there) names the
    pid the host knows it by: its sandbox's, whose signals reach it (tools/sandbox.py)."""
    global _host_pid
    _host_pid = pid


def event_topic(family: str, agent: str, run: str, type_: str) -> bytes:
    """`family/agent/run/type`: subscribe to a prefix of it (e.g. `agent/assistant/`)."""
    return f"{family}/{agent}/{run}/{type_}".encode()
