"""The hub process: one ROUTER for requests and registrations, one PUB for the event stream.

The hot loop is a blocking `zmq.Poller` loop (Majordomo style): each wake-up drains every ready
message, routes requests and replies on the header alone (body frames are forwarded untouched,
never decoded; zero-copy from 64 kB up), appends the pass's events to the SQLite log in one
transaction, publishes them, then does the periodic work (heartbeats, expiry, purging dead peers).
Nothing a peer sends can raise out of the loop: bad input is counted, logged and dropped.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fnmatch
import functools
import hashlib
import json
import logging
import math
import os
import signal
import time
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, cast

import msgspec
import zmq
from zmq.backend import Socket as _BackendSocket
from zmq.utils.monitor import parse_monitor_message

from agent_bus.bus import events as ev
from agent_bus.bus import protocol as p
from agent_bus.bus.errors import ConfigError, Overloaded
from agent_bus.bus.pauses import PauseWatch
from agent_bus.bus.pipeline import EventPipeline
from agent_bus.bus.probing import ProbeSchedule
from agent_bus.bus.registry import Counters, Limits, PeerState, Registry, error_frames, no_service_text
from agent_bus.bus.replay_reader import PEER_REPLAY_QUEUE, REPLAY_PRIORITIES
from agent_bus.bus.security import (
    FULL_RIGHTS,
    ROLES_FILE,
    CurveServer,
    InsecureBindError,
    KeyDirAuthenticator,
    check_bind,
    curve_peer_id,
    peer_user_id,
    private_ipc,
)
from agent_bus.bus.store import Retention, Row, StoreError, StoreUrlError, parse_store_url

if typing.TYPE_CHECKING:
    from agent_bus.bus.store.leader import Leadership

log = logging.getLogger("bus.hub")

DRAIN_LIMIT = 4096  # messages read per socket per pass, so periodic work still runs under load
TICK = 0.1  # seconds between expiry scans (request deadlines and peer liveness)
DEPARTED_KEEP = 10.0  # seconds a peer dropped for a closed connection is remembered (see _handle)
REBIND_TIMEOUT = 1.0  # seconds to get the event socket's address back after a reset
EVENT_BATCH_BYTES = 1024 * 1024  # a pass ends once its events' bodies pass this (logged, published)
# ...or once it stamped this many events (at most a quarter of a subscriber's queue, see
# `_pass_events`). A flood read in one pass was published in one burst after it: 100,000 small
# events were one pass as long as logging them all, a subscriber that reads as fast as the hub
# publishes heard nothing meanwhile, then lost all but its queue's 8,192, and the batch was too
# big for the `recent` window, so its gap waited for the log's reader (bench_bus unpaced:
# 0.15-0.36x raw). 512, not 1,024: a request's round trip beside a flood waits for the pass in
# hand (p50 ~0.65x of 1,024's; events/s within the runs' spread).
PASS_EVENTS = 512
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
TRIM_DELAY = 1.0  # seconds after a peer is dropped before freed memory is given back (_trim)
KiB = 1024
MiB = 1024 * KiB

# pyzmq's `send_multipart` costs ~3 us per message in Python-level flag (enum) handling; the
# backend's `send` with plain int flags costs ~0.2 us per frame. Received frames are copied into
# bytes (cheaper than `zmq.Frame` objects below pyzmq's 64 kB copy threshold), and sent with
# copy=True below that size too; larger bodies go out zero-copy.
_bsend = _BackendSocket.send
_brecv = _BackendSocket.recv
_NOBLOCK = int(zmq.NOBLOCK)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
# pyzmq's stubs type every option's value as `int | bytes`; EVENTS is an int.
_bget = cast(Callable[[Any, int], int], _BackendSocket.get)
_MORE_NOBLOCK = int(zmq.NOBLOCK | zmq.SNDMORE)
_COPY_THRESHOLD = 65536


def _find_malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim` (returns freed heap memory, all arenas, to the OS), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return cast(Callable[[int], int], libc.malloc_trim)
    except (OSError, AttributeError):
        return None


_malloc_trim = _find_malloc_trim()

# Per-event hot path: the codec methods bound once (same output as `p.encode`/`p.decode_header`).
_decode_header = msgspec.msgpack.Decoder(p.Header).decode
_SIG = p.SIGNATURE
_HELLO = p.HELLO
# A handler of one message kind (`Hub._handlers`): (hub, ident, its peer, header, frames). Only a
# hello's may be of no known peer (`Hub._handle_stranger` answers the others itself).
_Handler = Callable[["Hub", bytes, PeerState, p.Header, list[bytes]], None]

# Bus events only the hub may publish: they state what the hub saw (peers, services, losses).
# `process_restarted`/`process_gave_up` come from the supervisor (`busctl up`), a peer.
HUB_EVENT_TYPES = ev.BUS_TYPES - {"process_restarted", "process_gave_up"}


# Events about a call, published by the peer serving it (not by the agent's coordinator): the
# service-name prefix a peer with roles must serve to publish each (see `_refuse_speaker`). A
# tool's progress is not among them: its server sends `partial`s, which the caller publishes
# (docs/protocol.md section 5), so a tool peer's own `tool_execution_update` is refused (one
# copy of each update, never two).
_SERVER_PROGRESS = {"message_update": "llm", "llm_retry": "llm"}
_PROGRESS_HINT = ("; a tool sends its progress as `partial` replies and its caller publishes "
                  "them")

# The experiment journal (agents/experiment/runner.py): only the identity that runs experiment
# `E` writes its journal: full rights, or a role matching `experiment.E`. The hub stamps the
# right it checked in the header (`granted`); readers take no entry without it.
JOURNAL_TYPES = ev.JOURNAL_TYPES
JOURNAL_ROLE = "experiment."


def _speaks_for(served: set[str], agent: str) -> bool:
    """Whether a peer that registered `served` serves agent `agent`: `agent.<agent>` itself or
    an instance of it (`agent.<agent>@...`); never a name it merely starts (`agent.bob2` does
    not serve `bob`)."""
    return f"agent.{agent}" in served or any(s.startswith(f"agent.{agent}@") for s in served)


class _BodyType(msgspec.Struct):
    """An event body read for its `type` alone (the other fields are skipped, not built)."""

    type: str = ""


_decode_body_type = msgspec.msgpack.Decoder(_BodyType).decode


def _body_type(body: bytes) -> str | None:
    """The body's `type` ("" when it has none), or None when it is not a MessagePack map with
    a string `type`."""
    try:
        return _decode_body_type(body).type
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None


# The door (docs/protocol.md, section 6): a body of a known type must decode as that type with
# the same typed decoders the readers use (bus/events.py), so one malformed event can never
# break a reader of the log. One prebuilt decoder per type: a decode is also the `type` check.
_EVENT_DECODERS: dict[str, Callable[[bytes], Any]] = {
    str(cls.__struct_config__.tag): msgspec.msgpack.Decoder(cls).decode
    for cls in typing.get_args(ev.Event)
}


def _schema_fault(type_: str, body: bytes) -> str | None:
    """Why a body of the known type `type_` is not a valid one ("" if it is); None when the
    type is not known (only its `type` field is checked then)."""
    decode = _EVENT_DECODERS.get(type_)
    if decode is None:
        return None
    try:
        decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        return f"`{type_[:64]}` body does not match its schema: {str(exc)[:200]}"
    return ""


def _typed_event_fault(type_: str, body: bytes) -> str:
    """Why a body may not be published as an event of the header's `type_` ("" if it may)."""
    if type_ in HUB_EVENT_TYPES:
        return f"`{type_[:64]}` is a bus event only the hub publishes"
    fault = _schema_fault(type_, body)  # decoded once: it is the costly part of a refusal
    if fault == "":  # a known type, valid: its tag matched too
        return ""
    body_type = _body_type(body)
    if body_type == type_:
        return fault or ""
    if body_type is None:
        return f"`{type_[:64]}` body is not a MessagePack map with a string `type`"
    return f"header `type` `{type_[:64]}` differs from the body's `type` `{body_type[:64]}`"


def _valid_body_check(type_: str) -> Callable[[bytes], bool] | None:
    """A check that passes a body `_typed_event_fault(type_, body)` would pass ("") and fails
    most others (then the caller asks `_typed_event_fault` why): the prebuilt decoder of a known
    type, or the `type` field read of an unknown one. None for a hub-only type (always refused)."""
    check = _VALID_CHECKS.get(type_)
    if check is not None or type_ in HUB_EVENT_TYPES:
        return check
    return functools.partial(_has_type, type_)


def _decodes(decode: Callable[[bytes], Any], body: bytes) -> bool:
    try:
        decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return False
    return True


def _has_type(type_: str, body: bytes) -> bool:
    return _body_type(body) == type_


# A valid body of each known type that peers may publish passes its prebuilt decoder.
_VALID_CHECKS: dict[str, Callable[[bytes], bool]] = {
    type_: functools.partial(_decodes, decode) for type_, decode in _EVENT_DECODERS.items()
    if type_ not in HUB_EVENT_TYPES
}


def _mixed_body_type(body: bytes) -> tuple[str, str]:
    """A body of a message of mixed types (header `type` "*"): (its own `type`, "") when it
    may be published as that, else ("*", why not)."""
    body_type = _body_type(body)
    if body_type is None:
        return p.MIXED_TYPES, "a `*` (mixed-type) body is not a MessagePack map with a string `type`"
    if not body_type or body_type == p.MIXED_TYPES:
        return p.MIXED_TYPES, f"a `*` (mixed-type) body needs a `type` of its own, not {body_type!r}"
    if body_type in HUB_EVENT_TYPES:
        return p.MIXED_TYPES, f"`{body_type[:64]}` is a bus event only the hub publishes"
    return body_type, _schema_fault(body_type, body) or ""


def _where(index: int, count: int) -> str:
    """Which body of a multi-body event message a refusal is about (nothing for one body)."""
    return f" (body {index} of {count})" if count > 1 else ""


def _recv_frames(sock: zmq.Socket[Any], flags: int = _NOBLOCK) -> list[Any]:
    """Receive one multipart message from the ROUTER (zmq.Again when there is none, with
    NOBLOCK): small frames as bytes, frames from 64 kB up as `zmq.Frame` (forwarded without a
    copy). The routing id is received straight into bytes: a ROUTER always follows it with the
    message, so it needs no `more` check, and a `zmq.Frame` costs ~0.5 us more per frame."""
    frames: list[Any] = [_brecv(sock, flags, True)]
    frame = _brecv(sock, flags, False)
    frames.append(frame.bytes if len(frame) < _COPY_THRESHOLD else frame)
    while frame.more:
        frame = _brecv(sock, flags, False)
        frames.append(frame.bytes if len(frame) < _COPY_THRESHOLD else frame)
    return frames


def _send_frames(sock: zmq.Socket[Any], frames: list[Any]) -> None:
    """Send a multipart message without blocking (EAGAIN is raised on the first frame only)."""
    last = frames[-1]
    for i in range(len(frames) - 1):  # (no enumerate, no per-frame flag choice: ~0.3 us less)
        frame = frames[i]
        _bsend(sock, frame, _MORE_NOBLOCK, len(frame) < _COPY_THRESHOLD)
    _bsend(sock, last, _NOBLOCK, len(last) < _COPY_THRESHOLD)


class HubConfig(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    endpoint: str = "tcp://127.0.0.1:7400"
    events: str = ""  # default: tcp port + 1, or "<ipc path>.events"
    state_dir: str = ""  # "" keeps the event log in memory
    # The event store (bus/store/): "" is SQLite in `state_dir`; nats://HOST:PORT,... a NATS
    # JetStream stream with 3 replicas (bus/store/url.py has the URL's form)
    store: str = ""
    # The leader lease (a JetStream `store` only; bus/store/leader.py): `standby` leaves it to
    # the other hub at the start; `lease_ttl` 0 is the default (leader.DEFAULT_TTL)
    standby: bool = False
    lease_ttl: float = 0.0
    heartbeat_interval: float = 1.0
    liveness: int = 3
    max_message_bytes: int = 16 * 1024 * 1024
    queue_limit: int = 10_000
    router_hwm: int = 100_000  # replies/requests queued to one peer
    # Messages read ahead from one peer's connection: libzmq counts messages, not bytes, so this
    # bounds a flooding peer's backlog in the hub at router_rcvhwm x its message size.
    router_rcvhwm: int = 256
    pub_hwm: int = 100_000
    curve: CurveServer | None = None
    insecure: bool = False  # allow a non-loopback bind without CURVE
    # A JSON table {sha256 hex of a credential: {"name": ..., "roles": [service patterns]}}
    # (`busctl up` writes it): a peer's hello credential gives its roles; with a table, a peer
    # without a known credential (nor a CURVE key) serves nothing. "": every peer full rights.
    credentials: str = ""
    # Byte budgets: beyond each the hub refuses (counted, and answered `overloaded`).
    request_bytes: int = 128 * MiB  # requests held (queued or being served), all requesters
    peer_request_bytes: int = 64 * MiB  # ...of them, from one requester
    queued_services: int = 1000  # distinct unserved service names with queued requests
    max_event_bytes: int = 1 * MiB  # a bigger event body is counted `oversize_events`, dropped
    # A bigger body goes out on the live stream as a stub (an empty body frame; subscribers read
    # the event from the log), so every published message is small and a message count bounds
    # bytes: per subscriber, PUB SNDHWM = subscriber_bytes // publish_inline_bytes (8,192).
    publish_inline_bytes: int = 8 * KiB
    subscriber_bytes: int = 64 * MiB  # 0: SNDHWM = pub_hwm, no byte bound
    replay_bytes: int = 256 * 1024  # a `hub.replay` batch ends past this (always >= 1 event)
    # The newest logged events kept in memory (headers and bodies), from which a replay that
    # starts within them (a live subscriber's gap) is answered at once (bus/recent.py); 0: none.
    # 8 MiB: the hub's CPU per event as without (16 MiB cost 7-9% in bursts: memory the
    # allocator no longer reuses hot), and a subscriber 40,000 small events behind still fills
    # from it (2 MiB did not: bench/results/2026-12-06.md).
    recent_bytes: int = 8 * MiB
    # Bytes a second of `hub.status` (and other non-replay hub-service) answers to one peer
    # (a token bucket, burst the same): beyond it the peer is answered `overloaded`.
    peer_service_bytes: int = 16 * MiB
    # Event log retention (docs/reliability.md, "Event log retention"); 0 disables a bound.
    retain_days: float = 7.0
    retain_bytes: int = 0
    retain_deltas_until_end: bool = False  # drop a run's message_update once message_end is logged
    max_redispatch: int = 1  # times a call whose server was lost is re-dispatched
    # The replay reader's scheduling class: "idle" (SCHED_IDLE; replaced at nice 10 while the
    # machine starves it) or "low" (nice 10 only). See bus/replay_reader.py.
    replay_priority: str = "idle"
    # Bytes a second of `hub.replay` answers while requests are being routed (0: no pacing);
    # on an idle bus they go at once. See bus/replay_pacing.py.
    replay_pace_bytes: int = 4 * MiB

    def subscriber_hwm(self) -> int:
        """zmq counts a subscriber's queue in messages: this many of the largest events fit
        its byte budget (at most `pub_hwm`)."""
        if not self.subscriber_bytes:
            return self.pub_hwm
        return max(1, min(self.pub_hwm, self.subscriber_bytes // self.publish_inline_bytes))


class HubConfigError(ConfigError, ValueError):
    """A hub configuration that must not run (e.g. an exposed bind without CURVE)."""


BUDGETS = ("request_bytes", "peer_request_bytes", "queued_services", "queue_limit",
           "max_event_bytes", "publish_inline_bytes", "subscriber_bytes", "replay_bytes",
           "recent_bytes", "peer_service_bytes", "max_redispatch")


def check_config(config: HubConfig) -> None:
    """Refuse a config that must not run: checked here, so every way of starting a hub does."""
    for name in BUDGETS:
        least = 0 if name in ("max_redispatch", "subscriber_bytes", "recent_bytes") else 1
        if getattr(config, name) < least:
            raise HubConfigError(f"hub budget `{name}` is {getattr(config, name)}: it must be "
                                 f">= {least} (see docs/reliability.md, \"Memory budgets\")")
    if config.replay_pace_bytes < 0:
        raise HubConfigError(f"hub `replay_pace_bytes` is {config.replay_pace_bytes}: it must be "
                             ">= 0 (0 turns pacing off; docs/reliability.md, \"Event log: replay "
                             "and retention\")")
    if config.replay_priority not in REPLAY_PRIORITIES:
        raise HubConfigError(f"hub `replay_priority` is {config.replay_priority!r}: use one of "
                             f"{', '.join(REPLAY_PRIORITIES)} (docs/reliability.md, \"Event log: "
                             "replay and retention\")")
    _check_store(config)
    try:
        check_bind({"`endpoint`": config.endpoint, "`events`": config.events},
                   curve=config.curve is not None, insecure=config.insecure,
                   fix="set `curve` (busctl hub --curve-secret/--curve-authorized), or set "
                       "`insecure` (--insecure) on a trusted network.")
    except InsecureBindError as exc:
        raise HubConfigError(str(exc)) from None


LEASE_TTL_RANGE = (1.0, 300.0)
ROLE_FILE = "role.json"  # in the state dir, with a lease: this hub's role (`Hub._write_role`)


def _check_store(config: HubConfig) -> None:
    if not config.store:
        for key, flag, given in (("standby", "--standby", config.standby),
                                 ("lease_ttl", "--lease-ttl", config.lease_ttl)):
            if given:
                raise HubConfigError(f"hub `{key}` ({flag}) needs a replicated event store, so "
                                     "that the other hub reads the same log: give `store` "
                                     "(--store nats://HOST:PORT,...), a NATS JetStream cluster; "
                                     "the SQLite log is one machine's")
        return
    low, high = LEASE_TTL_RANGE
    if config.lease_ttl and not low <= config.lease_ttl <= high:
        raise HubConfigError(f"hub `lease_ttl` (--lease-ttl) is {config.lease_ttl:g}: give "
                             f"{low:g} to {high:g} seconds (0: the default)")
    try:
        parse_store_url(config.store, "hub `store` (--store)")
    except StoreUrlError as exc:
        raise HubConfigError(str(exc)) from None
    if config.retain_deltas_until_end:
        raise HubConfigError("hub `retain_deltas_until_end` (--retain-deltas-until-end) deletes "
                             "single events, which a JetStream `store` does not do: turn one off")


_UNKNOWN = object()


def load_credentials(path: str) -> dict[str, tuple[str, ...] | None]:
    """The credentials table (see `HubConfig.credentials`): sha256 hex -> service patterns
    (None for `*`, full rights). A file that cannot be read is a configuration error."""
    try:
        table = msgspec.json.decode(Path(path).read_bytes(),
                                    type=dict[str, dict[str, str | list[str]]])
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise HubConfigError(f"hub `credentials` {path}: cannot read it ({exc}); `busctl up` "
                             "writes it at every start") from None
    out: dict[str, tuple[str, ...] | None] = {}
    for digest, entry in table.items():
        roles = entry.get("roles", [])
        patterns = tuple(roles) if isinstance(roles, list) else ()
        out[digest] = None if "*" in patterns else patterns
    return out


def default_events_endpoint(endpoint: str) -> str:
    if endpoint.startswith("ipc://"):
        return endpoint + ".events"
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint[6:].rpartition(":")
        if port in ("0", "*"):
            return f"tcp://{host}:*"
        return f"tcp://{host}:{int(port) + 1}"
    raise ValueError(f"unsupported endpoint {endpoint!r}: use tcp://HOST:PORT or ipc://PATH")


def _bindable(endpoint: str) -> str:
    """tcp port 0 means "any free port", which libzmq spells `*`."""
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        return endpoint[:-1] + "*"
    return endpoint


class Hub:
    """Routes requests, tracks liveness, stamps/logs/publishes events. Call `run()` in a process."""

    def __init__(self, config: HubConfig) -> None:
        check_config(config)
        self.config = config
        self.session = p.new_session()
        self.started = time.time()
        self.counters = Counters()
        self._new_registry()
        self._batch_bytes = 0  # event bodies read this pass (it ends past EVENT_BATCH_BYTES)
        # events stamped per pass: a burst never overflows a subscriber that keeps up
        self._pass_events = max(1, min(PASS_EVENTS, config.subscriber_hwm() // 4))
        self._status_size = 0  # bytes of the last `hub.status` answer (the next one's estimate)
        self._trim_at = math.inf  # when to give freed memory back to the OS (see _trim)
        self._stopping = False
        state = Path(config.state_dir) if config.state_dir else None
        self.ctx = zmq.Context()
        self._auth: KeyDirAuthenticator | None = None
        self._user_id = ""  # CURVE: the authenticated key of the message being handled
        self._credentials = load_credentials(config.credentials) if config.credentials else None
        self._restricted = config.curve is not None or self._credentials is not None
        self._keys_generation = 0  # the authenticator's key set last checked (see _drop_revoked)
        self._known_keys: frozenset[bytes] = frozenset()  # the keys of that set
        self.router = self.ctx.socket(zmq.ROUTER)
        # XPUB: subscriptions reach the hub, which answers each new one with an event-socket
        # heartbeat at once, so a subscriber knows within milliseconds that it is in place.
        self.pub = self.ctx.socket(zmq.XPUB)
        self._configure_sockets()
        self.endpoint = self._bind(self.router, config.endpoint)
        self.events_endpoint = self._bind(
            self.pub, config.events or default_events_endpoint(config.endpoint)
        )
        # stamp -> log -> publish, heartbeats on the XPUB, retention, and the replay reader
        self.events = EventPipeline(
            self.ctx, self.pub, state / "events.db" if state else None, self.session,
            self.counters.bump, self._refuse_batch, config.replay_bytes,
            config.publish_inline_bytes,
            Retention(config.retain_days, config.retain_bytes, config.retain_deltas_until_end),
            config.replay_priority, config.replay_pace_bytes, config.store,
            config.max_event_bytes, config.recent_bytes)
        self._hb_header = p.encode(p.Header(kind=p.HEARTBEAT))
        # Fast peer-loss detection: libzmq reports a dropped connection (e.g. a SIGKILLed peer)
        # at once on a monitor socket, without saying whose it was; with ROUTER_MANDATORY a send
        # to a peer whose connection is gone fails with EHOSTUNREACH, so after each drop we probe
        # the peers for a moment. Missed heartbeats remain the fallback (silent network loss).
        # A connection that failed its handshake is reported too (then closed): it was nobody's,
        # e.g. a client's reachability check (`Peer._unreachable`: a bare TCP connect).
        self._monitor = self.router.get_monitor_socket(zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED)
        self._probes = ProbeSchedule()  # after the ROUTER reports closed connections
        self._reconnect_header = p.encode(p.Header(kind=p.RECONNECT))
        # Peers dropped because their connection closed, by routing id (never reused): what they
        # sent before closing may still be queued in the ROUTER behind the hub's backlog, and
        # their events must still be logged. Forgotten after DEPARTED_KEEP seconds.
        self._departed: dict[bytes, tuple[float, PeerState]] = {}
        # When the hub itself was paused, its peers' silence is not judged for a window after
        # (bus/pauses.py): their heartbeats were waiting unread.
        self._pauses = PauseWatch(allowance=config.heartbeat_interval)
        self._pass_due = time.monotonic()  # when the current pass's poll was due to end
        # The leader lease (a JetStream store; bus/store/leader.py): None on one machine, where
        # this hub is simply the hub (epoch 0). With it, the hub starts as a standby and is the
        # primary only while it holds the lease (`_check_role`, every pass of the loop).
        self.epoch = 0
        self._standby = False
        self._leadership: Leadership | None = None
        if config.store:
            self._start_leadership(config)

    # --- setup ---------------------------------------------------------------------------

    def _new_registry(self) -> None:
        """Routing state (services, slots, queues, deadlines, cancels) lives in the Registry,
        which has no sockets: it answers through `_send` and announces through `_emit`. A new
        one at the start, and when a primary stands down (its peers move to the new one)."""
        config = self.config
        self.registry = Registry(
            Limits(queue_limit=config.queue_limit, request_bytes=config.request_bytes,
                   peer_request_bytes=config.peer_request_bytes,
                   queued_services=config.queued_services,
                   max_redispatch=config.max_redispatch),
            self.counters, self._send, self._emit)
        self.peers = self.registry.peers  # the registry's own dicts, which it never rebinds
        self.services = self.registry.services

    def _start_leadership(self, config: HubConfig) -> None:
        from agent_bus.bus.store.leader import DEFAULT_TTL, Leadership

        self._standby = True
        self.events.hold()
        try:
            self._leadership = Leadership(parse_store_url(config.store), config.lease_ttl
                                          or DEFAULT_TTL, self.endpoint, config.standby)
        except StoreError:
            self.events.close()  # (the caller never gets the hub to close)
            raise
        self._check_role()
        if self._standby:
            self._write_role()

    def _configure_sockets(self) -> None:
        cfg = self.config
        if cfg.curve is not None:
            self._auth = cfg.curve.start_authenticator(self.ctx)
            self._known_keys = self._auth.keys
            cfg.curve.apply(self.router)
            cfg.curve.apply(self.pub)
        for sock in (self.router, self.pub):
            sock.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.SNDHWM, cfg.router_hwm)
        self.router.setsockopt(zmq.RCVHWM, cfg.router_rcvhwm)
        # libzmq drops a connection whose single frame exceeds this, before allocating it.
        self.router.setsockopt(zmq.MAXMSGSIZE, cfg.max_message_bytes + 65536)
        self.pub.setsockopt(zmq.SNDHWM, cfg.subscriber_hwm())  # bytes, see `subscriber_bytes`
        self.pub.setsockopt(zmq.MAXMSGSIZE, 65536)  # subscribers only send subscriptions
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # pass up every subscribe, also repeated ones

    def _bind(self, sock: zmq.Socket[Any], endpoint: str) -> str:
        with private_ipc(endpoint):  # ipc: 0700 parent dir when created, 0600 socket file
            sock.bind(_bindable(endpoint))
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    # --- main loop -----------------------------------------------------------------------

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self.pub, zmq.POLLIN)
        poller.register(self.events.reader.sock, zmq.POLLIN)
        interval = self.config.heartbeat_interval
        next_beat = time.monotonic() + interval
        next_tick = time.monotonic() + TICK
        probes = self._probes
        pacer = self.events.pacer
        allowance = self._pauses.allowance
        while not self._stopping:
            now = time.monotonic()
            if now - self._pass_due > allowance:  # the last pass overslept or took long
                self._paused(now)
            next_sub_beat = self.events.sub_beat_at
            wake = min(next_beat, next_tick, probes.next_at, next_sub_beat, pacer.next_at)
            timeout = max(0.0, wake - now)
            self._pass_due = now + timeout  # (its work after the poll counts as lateness)
            try:
                ready = dict(poller.poll(math.ceil(timeout * 1000)))
            except zmq.ZMQError as exc:
                if exc.errno == errno.EINTR:  # (pyzmq has no zmq.EINTR)
                    continue
                raise
            if self._leadership is not None:  # (one machine: no lease, no check)
                self._check_role()
            if self.router in ready:
                self._drain()
            if self.pub in ready:
                self.events.drain_subscriptions()
            if self.events.reader.sock in ready:
                pacer.add(self.events.reader.answers())
            if self._monitor in ready:
                probes.closed(self._drain_monitor(), time.monotonic())
            self.events.flush()
            now = time.monotonic()
            if len(pacer):  # replay answers are waiting: those that may go now
                self._forward_replays(pacer.release(now))
            if probes.due(now):
                probes.found(self._probe())
                probes.probed(now)
            if now >= next_tick:
                self.events.tick(now)
                pacer.add(self.events.reader.check(now))  # a reader that died: its jobs' errors
                self.registry.expire(now)
                self._expire_peers(now)
                self._drop_revoked()
                if now >= self._trim_at:
                    self._trim(now)
                next_tick = now + TICK
            if now >= next_beat:
                self._beat(now)
                next_beat = now + interval
            elif now >= self.events.sub_beat_at and not self._standby:
                self.events.publish_heartbeat()
            self.events.flush()

    def stop(self) -> None:
        self._stopping = True

    # --- the lease: primary or standby -------------------------------------------------------

    @property
    def role(self) -> str:
        """"primary" or "standby" with a lease; "" on one machine (no lease: the only hub)."""
        if self._leadership is None:
            return ""
        return "standby" if self._standby else "primary"

    def _check_role(self) -> None:
        """Take over once the lease task holds the lease; stand down at once when it lapsed
        (not renewed in time: this hub may have been paused, and another may hold it now)."""
        lead = self._leadership
        assert lead is not None
        held = time.monotonic() < lead.until
        if self._standby:
            if held:
                self._take_over(lead)
            else:
                self.events.seq = lead.head  # following the log (shown in status)
            return
        if not held:  # (the lease task keeps trying: a late renewal that the store takes
            # proves nobody held the lease since, and this hub takes over again, same epoch)
            self._step_down("its lease lapsed: not renewed within the lease's ttl", fenced=False)

    def _take_over(self, lead: Leadership) -> None:
        """Continue the log from the store's head, and write the epoch marker first: it fences
        a previous primary that missed the lapse of its lease (its next append expects the log
        to end before the marker, and the store refuses it)."""
        try:
            head = self.events.log.last_seq()
        except StoreError as exc:
            log.error("took the lease (epoch %d) but cannot read the log's head (%s): "
                      "leaving the lease", lead.epoch, exc)
            lead.resign()
            return
        self._standby, self.epoch = False, lead.epoch
        self.events.resume(head)
        self._emit(ev.HubLeader(epoch=lead.epoch, endpoint=self.endpoint, head=head))
        self.events.flush()
        if self._standby:  # the marker was refused: another writer is ahead (stood down)
            return
        if self.events.refusing:  # the store did not acknowledge it: no primary without it
            self._step_down(f"its epoch marker was not written ({self.events.log_error})")
            return
        self.counters.bump("takeovers")
        self._write_role()
        log.warning("primary now: lease epoch %d, the log continues from seq %d", lead.epoch,
                    head + 1)

    def _step_down(self, why: str, fenced: bool = True) -> None:
        """No longer the primary: write nothing more, tell every peer to reconnect (they say
        hello again, are answered `not_leader`, and move to the next hub), forget the routing
        state, and follow the log as a standby. `fenced` (another writer is ahead in the log):
        leave the lease too, and stay out of it for a while."""
        lead = self._leadership
        assert lead is not None
        if fenced:
            lead.resign()
        self._standby = True
        self.counters.bump("stand_downs")
        log.warning("standing down as primary (epoch %d): %s; answering %s", self.epoch, why,
                    p.NOT_LEADER)
        self._refuse_rows(self.events.hold(), p.NOT_LEADER, self._not_leader_text())
        for ident in list(self.peers):
            self._send([ident, p.SIGNATURE, self._reconnect_header])
        self._departed.clear()
        self._new_registry()
        self._write_role()

    def _write_role(self) -> None:
        """`role.json` in the state dir: this hub's role and epoch for `busctl ps` (a standby
        answers no `hub.status`), replaced whole at every change."""
        if not self.config.state_dir:
            return
        path = Path(self.config.state_dir) / ROLE_FILE
        tmp = path.with_name(path.name + ".tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(msgspec.json.encode({"role": self.role, "epoch": self.epoch,
                                                 "endpoint": self.endpoint, "pid": os.getpid()}))
            tmp.replace(path)
        except OSError as exc:  # only `ps` reads it
            log.warning("cannot write %s: %s", path, exc)

    def _not_leader_text(self) -> str:
        """The `error` text of a `not_leader` answer: the leader's endpoint first when known
        (docs/protocol.md, "Following the hub: the hub's side")."""
        lead = self._leadership
        assert lead is not None
        if lead.leader and lead.leader != self.endpoint:
            return (f"{lead.leader} leads (epoch {lead.leader_epoch}); this hub {self.endpoint} "
                    "is a standby: send to the leader")
        return (f"no hub leads now (the lease is free or being taken); this hub "
                f"{self.endpoint} is a standby: try the next hub endpoint")

    def _answer_standby(self, ident: bytes, header: p.Header) -> None:
        """A standby's answer to anything a peer sends: `not_leader` to what expects an answer
        (hello, request, event, register, unregister, cancel); nothing to the rest."""
        if header.kind in (p.HEARTBEAT, p.BYE, p.REPLY, p.ERROR, p.PARTIAL):
            return
        self.counters.bump("not_leader")
        self._send_error(ident, header.id, p.NOT_LEADER, self._not_leader_text())

    def close(self) -> None:
        try:
            self.router.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(0)
        self.router.close(0)
        self.pub.close(0)
        if self._leadership is not None:
            self._leadership.close()  # gives the lease up: a standby takes over at its next look
        self.events.close()  # joins the replay reader, whose socket must close before term()
        if self._auth is not None:
            self._auth.stop()
        self.ctx.term()

    def _recv_curve(self, flags: int) -> list[Any]:
        """With CURVE: `_recv_frames`, and the connection's ZAP User-Id (its key) read from the
        first frame after the routing id, which is received as a `zmq.Frame` anyway (receiving
        every frame as one, then copying each into bytes, cost the hub ~20 us a request)."""
        sock = self.router
        frames: list[Any] = [_brecv(sock, flags, True)]
        frame = _brecv(sock, flags, False)
        self._user_id = peer_user_id(frame)
        frames.append(frame.bytes if len(frame) < _COPY_THRESHOLD else frame)
        while frame.more:
            frame = _brecv(sock, flags, False)
            frames.append(frame.bytes if len(frame) < _COPY_THRESHOLD else frame)
        return frames

    def _drain(self) -> None:
        router = self.router
        recv: Callable[[], list[Any]] = (
            functools.partial(self._recv_curve, _NOBLOCK) if self._auth is not None
            else functools.partial(_recv_frames, router))
        handle = self._handle
        events = self.events
        pass_events = self._pass_events
        self._batch_bytes = 0
        for n in range(DRAIN_LIMIT):
            if self._batch_bytes > EVENT_BATCH_BYTES or len(events.rows) >= pass_events:
                # The pass ends here (the loop logs and publishes the batch, then beats and
                # ticks): a backlog of big events never keeps the heartbeats from peers
                # (tests/fault/test_hub_beats.py), and a flood of small ones reaches
                # subscribers as it is read, not in one burst past their queues.
                return
            try:
                frames = recv()
            except zmq.Again:
                return
            try:
                handle(frames)
            except (msgspec.DecodeError, msgspec.ValidationError, IndexError, UnicodeDecodeError,
                    RecursionError) as exc:
                self._reject("malformed", frames[0], f"bad body: {type(exc).__name__}: {exc}"[:300])
            except Exception:  # a bug must not take the hub down; it is counted and logged
                self._reject("internal_errors", frames[0], "handler failed", exc_info=True)
            if n == 0 and not _bget(router, _EVENTS) & _POLLIN:
                # A pass of one message (each hop of a lone round trip): an EVENTS read (~1.5 us)
                # ends it cheaper than the recv that fails (~4-5 us: pyzmq raises zmq.Again).
                return

    # --- input validation ----------------------------------------------------------------

    def _handle(self, frames: list[bytes]) -> None:
        ident = frames[0]  # bytes (see _recv_frames and _recv_curve)
        if len(frames) < 3:
            return self._reject("malformed", ident, f"{len(frames)} frames, expected >= 3")
        if frames[1] != _SIG:
            signature = frames[1] if isinstance(frames[1], bytes) else b"<large frame>"
            reason = "wrong_version" if signature.startswith(b"AGB/") else "malformed"
            return self._reject(reason, ident, f"signature {signature[:16]!r}")
        size = sum(map(len, frames))
        if size > self.config.max_message_bytes:
            self._reject("oversize", ident, f"{size} bytes")
            return self._refuse_oversize(ident, frames[2], size)
        try:
            header = _decode_header(frames[2])
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
            return self._reject("malformed", ident, f"bad header: {type(exc).__name__}: {exc}"[:300])
        kind = header.kind
        handler = self._handlers.get(kind)
        if handler is None:
            return self._reject("unknown_kind", ident, f"kind {kind[:32]!r}")
        peer = self.peers.get(ident)
        if peer is None or kind == _HELLO:  # the rare cases, off the routing path
            return self._handle_stranger(ident, peer, header, frames, handler)
        if peer.user_id and self._key_mismatch(peer, ident):
            return None
        peer.last_seen = time.monotonic()
        handler(self, ident, peer, header, frames)
        return None

    def _key_mismatch(self, peer: PeerState, ident: bytes) -> bool:
        """With CURVE: whether a known routing id now speaks with another key (then it is dropped:
        the ROUTER refuses duplicate ids, so the key's own connection is gone)."""
        if self._user_id == peer.user_id:
            return False
        self._drop_peer(peer, "its routing id was taken by another key")
        self._reject("key_mismatch", ident, "routing id reused by another key")
        return True

    def _handle_stranger(self, ident: bytes, peer: PeerState | None, header: p.Header,
                         frames: list[bytes], handler: _Handler) -> None:
        """A hello, or anything from a peer the hub does not know (revoked, departed, unknown).
        A standby knows no peer: everything comes here, and is answered `not_leader`."""
        if self._standby:
            return self._answer_standby(ident, header)
        if self._refuse_revoked(ident, peer, header):
            return
        if peer is None and header.kind != p.HELLO:
            departed = self._departed.get(ident)
            if departed is not None and self._on_departed(ident, departed[1], header, frames):
                return
            self.counters.bump("unknown_peer")
            if header.kind in (p.REPLY, p.ERROR, p.PARTIAL):
                # e.g. a peer that hung past its liveness window, answering once continued:
                # its requests were failed or re-dispatched, so this answer goes nowhere
                self.counters.bump("stale_replies")
            if header.kind == p.REQUEST:
                self._send_error(ident, header.id, p.HUB_LOST, "hub does not know this peer; say hello")
            self._send([ident, p.SIGNATURE, self._reconnect_header])
            return
        if peer is None:  # a hello from a new peer
            self._on_hello(ident, None, header, frames)
            return
        if peer.user_id and self._key_mismatch(peer, ident):
            return
        peer.last_seen = time.monotonic()
        handler(self, ident, peer, header, frames)

    def _refuse_revoked(self, ident: bytes, peer: PeerState | None, header: p.Header) -> bool:
        """With CURVE: refuse a hello, or anything from a peer the hub does not know, that comes
        on a connection whose key was removed from the authorised keys after its handshake (ZAP
        only checks at the handshake). Known peers are dropped by `_drop_revoked` instead, so
        their hot path pays nothing. The sender is told to reconnect; ZAP refuses that."""
        auth = self._auth
        if auth is None or not self._user_id or auth.is_authorized(self._user_id):
            return False
        if peer is not None:
            self._drop_peer(peer, "its CURVE key is no longer authorised")
        who = curve_peer_id(self._user_id, ident)
        self._reject("revoked_key", ident, f"{header.kind} from {who}, whose key was revoked")
        if header.kind == p.REQUEST and header.id:
            self._send_error(ident, header.id, p.UNAUTHORIZED,
                             f"the CURVE key of {who} is no longer authorised by this hub (put "
                             "its `.key` file back in the hub's authorised directory)")
        self._send([ident, p.SIGNATURE, self._reconnect_header])
        return True

    def _on_departed(self, ident: bytes, peer: PeerState, header: p.Header,
                     frames: list[bytes]) -> bool:
        """A message a peer sent before its connection closed, read after the hub dropped it.
        Events are logged as usual; its bye and heartbeats are moot; a late reply is stale."""
        kind = header.kind
        if kind == p.EVENT:
            self.counters.bump("late_events")
            self._on_event(ident, peer, header, frames)
            return True
        if kind == p.BYE:
            self._departed.pop(ident, None)
            return True
        if kind == p.HEARTBEAT:
            return True
        if kind in (p.REPLY, p.ERROR, p.PARTIAL):
            self.counters.bump("stale_replies")
            return True
        return False

    def _refuse_oversize(self, ident: bytes, header_frame: bytes, size: int) -> None:
        """An oversized request gets an error reply, so its sender does not wait it out."""
        try:
            header = p.decode_header(header_frame)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            return
        if header.kind == p.REQUEST and header.id and ident in self.peers:
            self._send_error(ident, header.id, p.BAD_REQUEST,
                             f"message of {size} bytes is over the hub's limit of "
                             f"{self.config.max_message_bytes} (`max_message_bytes`)")

    def _reject(self, counter: str, ident: bytes, why: str, exc_info: bool = False) -> None:
        n = self.counters.bump(counter)
        if n <= 10 or n % 1000 == 0:
            log.warning("dropped message from %s (%s #%d): %s", ident.hex(), counter, n, why,
                        exc_info=exc_info)

    # --- handlers ------------------------------------------------------------------------

    def _on_hello(self, ident: bytes, peer: PeerState | None, header: p.Header,
                  frames: list[bytes]) -> None:
        hello = p.decode(frames[3], p.Hello) if len(frames) > 3 else None
        if hello is None:
            return self._reject("malformed", ident, "hello without body")
        user_id = self._user_id if self._auth is not None else ""
        if self._auth is not None and not user_id:
            return self._reject("malformed", ident, "hello without an authenticated key")
        peer_id = curve_peer_id(user_id, ident) if user_id else ident.hex()
        credential, hello.credential = hello.credential, ""  # kept out of status and events
        peer = self.registry.add_peer(ident, peer_id, hello, user_id)
        self._credential_roles(peer, credential)
        welcome = p.Welcome(
            peer=peer.id,
            hub_session=self.session,
            events=self.events_endpoint,
            heartbeat_interval=self.config.heartbeat_interval,
            liveness=self.config.liveness,
            max_message_bytes=self.config.max_message_bytes,
            event_bodies=p.MAX_EVENT_BODIES,
            mixed_types=True,
            epoch=self.epoch,
        )
        self._send([ident, p.SIGNATURE, p.encode(p.Header(kind=p.WELCOME, id=header.id)),
                    p.encode(welcome)])
        return None

    def _on_register(self, ident: bytes, peer: PeerState, header: p.Header,
                     frames: list[bytes]) -> None:
        reg = p.decode(frames[3], p.Register)
        roles = self._roles(peer)
        if roles is not None:  # a peer with roles serves only the services they name
            allowed = []
            for spec in reg.services:
                if any(fnmatch.fnmatchcase(spec.name, pattern) for pattern in roles):
                    allowed.append(spec)
                    continue
                self._forbid("forbidden_registers", ident, header.id,
                             f"register refused: {peer.id} may not serve `{spec.name[:128]}` "
                             f"(its roles: {', '.join(roles) or 'none'}; from its credential "
                             f"or the hub's `{ROLES_FILE}`: docs/protocol.md section 8, Roles)")
            reg.services = allowed
        self.registry.register(peer, reg, header.id)

    def _credential_roles(self, peer: PeerState, credential: str) -> None:
        table = self._credentials
        if table is None or not credential:
            return
        roles = table.get(hashlib.sha256(credential.encode()).hexdigest(), _UNKNOWN)
        if roles is _UNKNOWN:
            self.counters.bump("unknown_credentials")
            return
        peer.roles, peer.by_credential = cast(tuple[str, ...] | None, roles), True

    def _roles(self, peer: PeerState) -> tuple[str, ...] | None:
        """The service patterns `peer` may serve; None: full rights. A known credential in its
        hello says; else with CURVE the roles file beside the keys; else, when the hub has a
        credentials table, none; else (a hub without either) full rights."""
        if peer.by_credential:
            return peer.roles
        auth = self._auth
        if auth is not None and peer.user_id:
            return auth.roles_for(peer.user_id)
        return () if self._credentials is not None else None

    def _forbid(self, counter: str, ident: bytes, req_id: str, text: str) -> None:
        self._reject(counter, ident, text)
        self._send_error(ident, req_id, p.FORBIDDEN, text)

    def _refuse_speaker(self, ident: bytes, peer: PeerState, header: p.Header) -> bool:
        """A peer with roles publishes `agent` events only for the agents it serves (has
        registered `agent.<name>` or `agent.<name>@...` on this connection); an `llm` server's
        `message_update` and `llm_retry` too. A tool's progress is its caller's to publish (from
        the `partial`s), never the tool peer's. Refused: `forbidden_events`."""
        type_ = header.type
        if ev.event_family(type_) != "agent":
            return False
        roles = self._roles(peer)
        if roles is None:
            return False
        served = peer.served
        agent = header.agent
        if _speaks_for(served, agent):
            return False
        if type_ in _SERVER_PROGRESS and any(s.startswith(_SERVER_PROGRESS[type_])
                                             for s in served):
            return False
        self._forbid("forbidden_events", ident, header.id,
                     f"event refused, neither logged nor published: {peer.id} does not serve "
                     f"agent `{agent[:64]}`, so it may not publish its `{type_[:64]}`"
                     f"{_PROGRESS_HINT if type_ == 'tool_execution_update' else ''} "
                     f"(docs/protocol.md section 8, roles)")
        return True

    def _refuse_journal(self, ident: bytes, peer: PeerState, header: p.Header) -> bool:
        """Only the runner writes the journal: an `experiment_plan` / `experiment_sample` of
        experiment `E` is taken from a peer with full rights or a role matching
        `experiment.E`, and stamped with that right (`granted`, which readers require);
        anything else is refused, counted `forbidden_events`. A check of journal events alone
        (one a cell): other events pay a set lookup."""
        roles = self._roles(peer)
        if roles is None:
            header.granted = FULL_RIGHTS
            return False
        experiment = header.experiment
        right = f"{JOURNAL_ROLE}{experiment}"
        for pattern in roles if experiment else ():
            if fnmatch.fnmatchcase(right, pattern):
                header.granted = pattern
                return False
        self._forbid("forbidden_events", ident, header.id,
                     f"journal event refused, neither logged nor published: {peer.id} may not "
                     f"write the journal of experiment `{experiment[:64]}` (`{header.type}`): "
                     f"only the identity that runs it does, with full rights or a role "
                     f"matching `{right[:80]}` (its roles: {', '.join(roles) or 'none'}; "
                     "docs/protocol.md section 8, Roles)")
        return True

    def _on_unregister(self, ident: bytes, peer: PeerState, header: p.Header,
                       frames: list[bytes]) -> None:
        self.registry.unregister(peer, p.decode(frames[3], p.Unregister).services)

    def _on_request(self, ident: bytes, peer: PeerState, header: p.Header,
                    frames: list[bytes]) -> None:
        counters = self.counters  # (inline: this runs for every request)
        counters["requests"] = counters.get("requests", 0) + 1
        if self.registry.request(peer, header, frames):  # a `hub.` service: served here
            self._serve_builtin(ident, peer, header, frames)
        else:  # live traffic: replay answers are paced for a moment (bus/replay_pacing.py)
            self.events.pacer.routed(peer.last_seen)

    def _on_reply(self, ident: bytes, peer: PeerState, header: p.Header,
                  frames: list[bytes]) -> None:
        self.registry.answer(peer, header, frames)

    def _on_cancel(self, ident: bytes, peer: PeerState, header: p.Header,
                   frames: list[bytes]) -> None:
        self.registry.cancel(ident, header.id)

    def _on_event(self, ident: bytes, peer: PeerState, header: p.Header,
                  frames: list[bytes]) -> None:
        """One event per body frame (docs/protocol.md §4, §6): each is checked, stamped, logged
        and published on its own, so subscribers and the log see exactly what N single-body
        messages would have given them. A refused body does not take its siblings with it."""
        count = len(frames) - 3
        if count < 1 or not header.type:
            self._reject("malformed", ident, "event needs a type and at least one body frame")
            return
        if count > p.MAX_EVENT_BODIES:
            self._reject("malformed", ident, f"event message of {count} bodies")
            self._send_error(ident, header.id, p.BAD_EVENT,
                             f"event message refused, nothing logged: {count} body frames, over "
                             f"the limit of {p.MAX_EVENT_BODIES} (docs/protocol.md, section 4)")
            return
        header.peer = peer.id  # the authenticated sender, whatever the header or body claim
        mixed = header.type == p.MIXED_TYPES
        # What is the same for every body of the message is looked up once: the check that
        # passes a valid body of the header's type (anything else takes the slow path, which
        # says why), and whether the speaker check applies.
        valid = None if mixed else _valid_body_check(header.type)
        if count == 1:
            self._stamp_body(ident, peer, header, frames[3], 0, 1, mixed, valid)
            return
        base = header.id
        stamp_body = self._stamp_body
        for i in range(count):
            header.id = f"{base}.{i}"  # each event's own id (its `error`, if refused, names it)
            if mixed:
                header.type = p.MIXED_TYPES  # the previous body's type is not this one's
            stamp_body(ident, peer, header, frames[3 + i], i, count, mixed, valid)

    def _stamp_body(self, ident: bytes, peer: PeerState, header: p.Header, body: bytes,
                    index: int, count: int, mixed: bool,
                    valid: Callable[[bytes], bool] | None = None) -> None:
        """Check body `index` of `count` and add it to the pass's batch, or refuse it. In a
        message of `mixed` types, the body's own `type` is set into the header first. `valid`
        (from `_valid_body_check`) passes a valid body without building the refusal's reason."""
        events = self.events
        if events.refusing:
            self.counters.bump("events_refused")
            self._send_error(ident, header.id, p.LOG_UNAVAILABLE, self._log_refusal())
            return
        if len(body) > self.config.max_event_bytes:
            # every subscriber's queue is sized for events up to this (`subscriber_bytes`)
            return self._reject("oversize_events", ident,
                                f"event `{header.type[:64]}`{_where(index, count)} body of "
                                f"{len(body)} bytes is over `max_event_bytes` "
                                f"({self.config.max_event_bytes})")
        if not isinstance(body, bytes):
            body = body.bytes
        if (valid is None or not valid(body)) and self._refuse_event(ident, header, body, index,
                                                                     count, mixed):
            return
        # (`granted` is read on journal types alone, where it is always the hub's: other
        # types pay this one set lookup, not a store to clear it)
        if header.type in JOURNAL_TYPES and self._refuse_journal(ident, peer, header):
            return
        if self._restricted and self._refuse_speaker(ident, peer, header):
            return
        self._batch_bytes += len(body)
        events.stamp(header, body)

    def _refuse_event(self, ident: bytes, header: p.Header, body: bytes, index: int = 0,
                      count: int = 1, mixed: bool = False) -> bool:
        """Only the hub speaks for the bus, and a publisher cannot lie about what it publishes:
        a hub-only type, or a header `type` other than the body's (in a mixed-type message, a
        body without a type of its own), is refused (counted `bad_events`, answered `bad_event`
        with the event's id) and neither logged nor published."""
        if mixed:  # the event's type is its body's (the header is stamped per body)
            header.type, why = _mixed_body_type(body)
        else:
            why = _typed_event_fault(header.type, body)
        if not why:
            return False
        why += _where(index, count)
        self._reject("bad_events", ident, why)
        self._send_error(ident, header.id, p.BAD_EVENT, f"event refused, neither logged nor "
                         f"published: {why} (docs/protocol.md, section 6)")
        return True

    def _on_heartbeat(self, ident: bytes, peer: PeerState, header: p.Header,
                      frames: list[bytes]) -> None:
        return None

    def _on_bye(self, ident: bytes, peer: PeerState, header: p.Header,
                frames: list[bytes]) -> None:
        self._probes.expect_close(time.monotonic())
        self._drop_peer(peer, "said bye")

    def _on_unexpected(self, ident: bytes, peer: PeerState | None, header: p.Header,
                       frames: list[bytes]) -> None:
        self._reject("unexpected_kind", ident, f"kind {header.kind!r} is hub-to-peer only")

    _handlers: dict[str, _Handler] = {
        p.HELLO: _on_hello,
        p.REGISTER: _on_register,
        p.UNREGISTER: _on_unregister,
        p.REQUEST: _on_request,
        p.PARTIAL: _on_reply,
        p.REPLY: _on_reply,
        p.ERROR: _on_reply,
        p.CANCEL: _on_cancel,
        p.EVENT: _on_event,
        p.HEARTBEAT: _on_heartbeat,
        p.BYE: _on_bye,
        p.WELCOME: _on_unexpected,
        p.RECONNECT: _on_unexpected,
    }

    @staticmethod
    def _no_service_text(service: str) -> str:
        return no_service_text(service)

    # --- liveness ------------------------------------------------------------------------

    def _drain_monitor(self) -> int:
        """How many closed connections the ROUTER's monitor reported since the last call; a
        failed handshake (always reported before its connection's close) tells the probe
        schedule that one of them needs no probe."""
        closed = 0
        while True:
            try:
                event = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return closed
            if event["event"] & _HANDSHAKE_FAILED:
                self._probes.expect_close(time.monotonic())
            else:
                closed += 1

    def _probe(self) -> int:
        """Drop every peer the ROUTER can no longer route to (its connection is gone): how many.
        When to probe is `bus/probing.py`'s.

        Only peers with a routing id the ROUTER generated (5 bytes, first byte 0) are probed:
        such an id dies with its connection (a reconnecting DEALER gets a new one). A peer that
        set its own routing id may come back under it, so it is left to the heartbeat deadline.
        """
        dropped = 0
        for ident in list(self.peers):
            if ident[:1] != b"\x00":
                continue
            try:
                _send_frames(self.router, [ident, p.SIGNATURE, self._hb_header])
            except zmq.Again:
                continue
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
                peer = self.peers.get(ident)
                if peer is not None:
                    self.counters.bump("peers_disconnected")
                    self._departed[ident] = (time.monotonic() + DEPARTED_KEEP, peer)
                    self._drop_peer(peer, "connection closed")
                    dropped += 1
        return dropped

    def _paused(self, now: float) -> None:
        """Note a pause when the current pass, due to end its poll at `_pass_due`, runs so late
        at `now` that the hub itself was not running (bus/pauses.py). The loop calls it only
        when it is that late (the same comparison, inline: no call per pass)."""
        due = self._pass_due
        if not self._pauses.ran(now, due):
            return
        self._pass_due = now  # counted once
        late = now - due
        n = self.counters.bump("hub_paused")
        if n <= 10 or n % 100 == 0:
            log.info("the hub's loop ran %.2fs late (#%d: paused, or a slow disk): peers' "
                     "silence is not judged for %.1fs", late, n,
                     self.config.heartbeat_interval * self.config.liveness)

    def _expire_peers(self, now: float) -> None:
        """Drop peers silent for `liveness` heartbeat intervals (checked every tick, so a dead
        peer is noticed at most one tick after its expiry), unless the hub was itself paused
        within that window (bus/pauses.py)."""
        if self._departed:
            for ident in [i for i, (until, _) in self._departed.items() if until <= now]:
                del self._departed[ident]
        expiry = self.config.heartbeat_interval * self.config.liveness
        if now - self._pass_due > self._pauses.allowance:  # paused in this very pass
            self._paused(now)
        if not self._pauses.may_judge(now, expiry):
            return
        for peer in self.registry.expired_peers(now, expiry):
            self.counters.bump("peers_expired")
            self._drop_peer(peer, f"missed {self.config.liveness} heartbeats")

    def _drop_revoked(self) -> None:
        """After a reload changed the authorised keys: drop the live peers whose key is gone
        (their calls are re-dispatched or failed `peer_lost`, as for any lost peer), forget the
        departed ones, and tell each to reconnect, which ZAP then refuses."""
        auth = self._auth
        if auth is None or auth.generation == self._keys_generation:
            return
        self._keys_generation = auth.generation
        keys = auth.keys
        removed, self._known_keys = self._known_keys - keys, keys
        if removed:
            self._reconnect_subscribers()
        for ident in [i for i, (_, peer) in self._departed.items()
                      if not auth.is_authorized(peer.user_id)]:
            del self._departed[ident]
        revoked = [peer for peer in self.peers.values() if not auth.is_authorized(peer.user_id)]
        for peer in revoked:
            self.counters.bump("peers_revoked")
            self._drop_peer(peer, "its CURVE key was removed from the authorised keys")
            self._send([peer.ident, p.SIGNATURE, self._reconnect_header])
        if revoked:
            log.warning("dropped %d peer(s) whose CURVE key was revoked: %s", len(revoked),
                        ", ".join(f"{peer.hello.name} ({peer.id})" for peer in revoked))

    def _reconnect_subscribers(self) -> None:
        """A key was revoked: close every event-stream connection (ZeroMQ cannot close one
        subscriber), by unbinding the event socket and binding it again. Subscribers reconnect at
        once and fill the moment's gap from the log; the revoked key's handshake is refused (ZAP).
        The unbind completes in ZeroMQ's I/O thread, so the bind is retried briefly."""
        endpoint = self.events_endpoint
        self.pub.unbind(endpoint)
        deadline = time.monotonic() + REBIND_TIMEOUT
        while True:
            try:
                self._bind(self.pub, endpoint)
                break
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    raise
                time.sleep(0.005)
        self.counters.bump("subscribers_reset")
        log.warning("a CURVE key was revoked: event-stream connections reset on %s", endpoint)

    def _beat(self, now: float) -> None:
        self._expire_peers(now)
        for ident in list(self.peers):
            self._send([ident, p.SIGNATURE, self._hb_header])
        if not self._standby:  # a standby's event stream is silent: nobody should follow it
            self.events.publish_heartbeat()

    def _drop_peer(self, peer: PeerState, reason: str) -> None:
        self.registry.drop_peer(peer, reason)
        # libzmq frees the peer's send queue once its connection is torn down (I/O thread):
        # then hand the freed memory back, so a peer that made the hub grow does not leave it so
        self._trim_at = min(self._trim_at, time.monotonic() + TRIM_DELAY)

    def _trim(self, now: float) -> None:
        self._trim_at = math.inf
        if _malloc_trim is not None:
            _malloc_trim(0)

    # --- sending -------------------------------------------------------------------------

    def _send(self, frames: list[Any]) -> bool:
        try:
            _send_frames(self.router, frames)
        except zmq.Again:
            self.counters.bump("send_dropped_hwm")
            return False
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self.counters.bump("unroutable")
            return False
        return True

    def _send_error(self, ident: bytes, req_id: str, code: str, text: str) -> None:
        self._send(error_frames(ident, req_id, code, text))

    # --- events --------------------------------------------------------------------------

    @property
    def seq(self) -> int:
        return self.events.seq

    def _emit(self, event: ev.Event) -> None:
        self.events.emit(event)

    def _refuse_batch(self, rows: list[Row]) -> None:
        """The store refused a batch. With a lease, a refusal because another writer is ahead
        (`fenced`) means another hub took over: this one stands down at once."""
        if self._leadership is not None and self.events.log.fenced:
            self._refuse_rows(rows, p.NOT_LEADER, self._not_leader_text())
            self._step_down("the store refused its write: another hub wrote the log since")
            return
        self._refuse_rows(rows, p.LOG_UNAVAILABLE, self._log_refusal())

    def _refuse_rows(self, rows: list[Row], code: str, text: str) -> None:
        idents = {peer.id: peer.ident for peer in self.peers.values()}
        for row in rows:
            header = _decode_header(row[6])
            ident = idents.get(header.peer)
            if ident is not None:  # the hub's own events have no publisher to tell
                self._send_error(ident, header.id, code, text)

    def _log_refusal(self) -> str:
        return self.events.refusal_text(self.config.state_dir)

    # --- built-in services ---------------------------------------------------------------

    def _serve_builtin(self, ident: bytes, peer: PeerState, header: p.Header,
                       frames: list[bytes]) -> None:
        if header.service == p.HUB_STATUS:
            if not self._within_service_budget(peer, self._status_size):
                self.counters.bump("overloaded_service_bytes")
                self._send_error(ident, header.id, p.OVERLOADED,
                                 f"`{p.HUB_STATUS}` answers to this peer would pass the hub budget "
                                 f"`peer_service_bytes` ({self.config.peer_service_bytes} bytes a "
                                 "second); read the answers, then ask again")
                return
            body = p.encode(self.status())
            self._status_size = len(body)
            peer.service_tokens -= len(body)
        elif header.service == p.HUB_REPLAY:
            try:
                request = (p.decode(frames[3], p.ReplayRequest) if len(frames) > 3
                           else p.ReplayRequest())
            except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
                self.counters.bump("malformed")
                self._send_error(ident, header.id, p.BAD_REQUEST, f"bad ReplayRequest: {exc}")
                return
            # its share of the reader's queue (a publish confirmation reads nothing: answered
            # whatever the peer's subscriptions have waiting)
            if peer.replays >= PEER_REPLAY_QUEUE and not self.events.reads_nothing(request):
                self.counters.bump("replay_overloaded_peer")
                self._send_error(ident, header.id, p.OVERLOADED,
                                 f"`{p.HUB_REPLAY}`: {PEER_REPLAY_QUEUE} replays of this peer are "
                                 "already waiting for the log reader; ask again after one is "
                                 "answered")
                return
            try:
                reply = self.events.replay(ident, header.id, request)
            except Overloaded as exc:
                self.counters.bump("replay_overloaded")
                self._send_error(ident, header.id, p.OVERLOADED, str(exc))
                return
            if reply is None:
                peer.replays += 1  # until `_forward_replays` sends the reader's answer
                return
            body = reply
        else:
            self._send_error(ident, header.id, p.NO_SERVICE, self._no_service_text(header.service))
            return
        self._send([ident, p.SIGNATURE, p.encode(p.Header(kind=p.REPLY, id=header.id)), body])

    def _within_service_budget(self, peer: PeerState, size: int) -> bool:
        """Whether `peer` may be sent a hub-service answer of about `size` bytes now: a token
        bucket of `peer_service_bytes` (refilled at that many bytes a second). A peer that asks
        and never reads would otherwise grow the hub's send queue by every answer it asks for
        (libzmq counts that queue in messages: `router_hwm` of them)."""
        now = time.monotonic()
        rate = self.config.peer_service_bytes
        peer.service_tokens = min(rate, peer.service_tokens + (now - peer.service_at) * rate)
        peer.service_at = now
        return peer.service_tokens >= size

    def _forward_replays(self, answers: list[tuple[bytes, str, bytes, Any]]) -> None:
        """Send the reader's finished replays (a bounded number per pass); bodies are
        `zmq.Frame`s, forwarded without a copy."""
        peers = self.peers
        for ident, req_id, code, body in answers:
            waiting = peers.get(ident)
            if waiting is not None and waiting.replays > 0:
                waiting.replays -= 1
            if code:
                self.counters.bump("replay_errors")
                self._send_error(ident, req_id, code.decode(), bytes(body).decode())
                continue
            self.events.replay_peak = max(self.events.replay_peak, len(body))
            self._send([ident, p.SIGNATURE, p.encode(p.Header(kind=p.REPLY, id=req_id)), body])

    def status(self) -> p.Status:
        peers = []
        for peer in self.peers.values():
            loads = []
            for name in sorted(peer.services):
                service = self.services[name]
                slot = service.slots[peer.ident]
                loads.append(p.ServiceLoad(name, slot.capacity, slot.load, service.idempotent,
                                           slot.meta))
            h = peer.hello
            peers.append(p.PeerInfo(peer.id, h.name, h.host, h.pid, h.session, h.role, peer.since,
                                    time.time() - (time.monotonic() - peer.last_seen), loads))
        services = [
            p.ServiceInfo(s.name, len(s.slots), sum(x.capacity for x in s.slots.values()),
                          sum(x.load for x in s.slots.values()), s.queued, s.idempotent, s.meta)
            for s in sorted(self.services.values(), key=lambda s: s.name)
        ]
        counters = dict(self.counters)
        if self.events.pacer.waited:
            counters["replay_paced"] = self.events.pacer.waited
        if self.events.rows:  # stamped this pass, not yet flushed
            counters["events"] = counters.get("events", 0) + len(self.events.rows)
        if self._auth is not None:
            counters.update(self._auth.counters())  # auth_refused: refused CURVE handshakes
        reader = self.events.reader
        for name, value in (("replay_reader_restarts", reader.restarts),
                            ("replay_reader_starved", reader.starved)):
            if value:
                counters[name] = value
        return p.Status(self.session, self.endpoint, self.events_endpoint,
                        time.time() - self.started, self.seq, peers, services, counters,
                        self.config.state_dir, self.events.log_error, self.budgets(),
                        role=self.role, epoch=self.epoch)

    def budgets(self) -> dict[str, p.Budget]:
        """Each budget's limit and use. A subscriber's queue lives inside libzmq, which does not
        say how full it is: its bound is shown as bytes and as the message count it becomes."""
        cfg = self.config
        peer_max = max((peer.request_bytes for peer in self.peers.values()), default=0)
        return {
            "request_bytes": p.Budget(cfg.request_bytes, self.registry.request_bytes),
            "peer_request_bytes": p.Budget(cfg.peer_request_bytes, peer_max),
            "queued_services": p.Budget(cfg.queued_services, self.registry.unserved()),
            "max_event_bytes": p.Budget(cfg.max_event_bytes),
            "publish_inline_bytes": p.Budget(cfg.publish_inline_bytes),
            "subscriber_bytes": p.Budget(cfg.subscriber_bytes),
            "subscriber_messages": p.Budget(cfg.subscriber_hwm()),
            "replay_bytes": p.Budget(cfg.replay_bytes, self.events.replay_peak),
            "recent_bytes": p.Budget(cfg.recent_bytes, self.events.recent.bytes),
            "peer_service_bytes": p.Budget(cfg.peer_service_bytes, self._status_size),
            # a rate, not a size: bytes a second while requests flow; used: answers' bytes held
            "replay_pace_bytes": p.Budget(cfg.replay_pace_bytes, self.events.pacer.held_bytes),
            "max_redispatch": p.Budget(cfg.max_redispatch),
        }


def serve(config: HubConfig, ready: Iterable[Any] = ()) -> None:
    """Run a hub until SIGTERM/SIGINT; print one JSON `ready` line on stdout once bound."""
    os.umask(0o077)  # the event log holds every prompt and reply: its owner's alone
    hub = Hub(config)
    signal.signal(signal.SIGTERM, lambda *_: hub.stop())
    signal.signal(signal.SIGINT, lambda *_: hub.stop())
    auth = hub._auth
    if auth is not None:  # re-read the authorised keys now (they are also polled)
        signal.signal(signal.SIGHUP, lambda *_: auth.request_reload())
    line: dict[str, Any] = {"ready": "hub", "endpoint": hub.endpoint,
                            "events": hub.events_endpoint, "pid": os.getpid(), "seq": hub.seq}
    if hub.role:  # a hub with a leader lease: which it is at its start
        line.update(role=hub.role, epoch=hub.epoch)
    print(json.dumps(line), flush=True)
    log.info("hub listening on %s, events on %s", hub.endpoint, hub.events_endpoint)
    try:
        hub.run()
    finally:
        hub.close()
