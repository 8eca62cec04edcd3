"""The peer: one connection to the hub — its lifecycle, its one reader, and everything it sends.

(`bus/client.py` is the public face; requests are in `bus/rpc.py`, serving in `bus/serving.py`,
subscriptions in `bus/subscription.py`, the held messages in `bus/outbox.py`, the publish
accounting in `bus/ledger.py`, the periodic duties (heartbeats, the hub's silence, expiry) in
`bus/housekeeping.py`, the socket transports in `bus/transport.py`.)

Lifecycle (`Peer.state`, a `PeerState`): CONNECTING until the first welcome, READY while
welcomed, RECONNECTING after a lost connection until the next welcome (retried with
`RECONNECT_BACKOFF`), CLOSING while `aclose()` flushes and says bye, CLOSED after. Whether the
current socket is welcomed is `welcome is not None` (`connected`): during CLOSING the link may
still be up, and the flush needs it.

Following the hub (docs/protocol.md section 5, "Following the hub"): `hub` may name several
endpoints (bus/endpoints.py), a primary and its standby. The connection loop moves to the next
when the hub goes silent or answers `not_leader` (to the endpoint its text names, when it is one
of ours; `_not_leader`), stays after a RECONNECT (that hub is alive), and backs off once every
endpoint was tried without a welcome. A welcome whose `epoch` is below the highest seen is
refused like `not_leader` (`stale_leader`). Every welcome re-registers the services, re-sends the
keyed requests kept across the loss (`Calls.resend`; with one endpoint none is kept, as before
lists) and points the subscriptions at the welcome's event endpoint (`Subscription.follow`).

How the DEALER is driven (the hot path): its transport (`bus/transport.py`) calls `drain` when
input may be waiting. Each call drains every ready message with NOBLOCK receives and dispatches
them synchronously (a reply resolves its caller's call; a request starts a handler task). Sends
are NOBLOCK and succeed at once unless the high-water mark is reached, in which case the sender
waits for the socket to become writable. The fast transport's fd is edge-triggered: any send or
`EVENTS` read may consume the edge, so after sending we check `EVENTS` and schedule a drain
ourselves when input is waiting. This needs anyio's asyncio backend (pyzmq has no trio support).

Published events, and the replies and partial replies of requests this peer serves (and a request
made behind them or beside other calls in flight, `Calls.begin`), are held until the end of the
current event-loop iteration and then sent back to back (`Peer.hold`, the `Outbox`): on an idle
socket every send wakes ZeroMQ's I/O thread (and then the hub), which costs far more than the send
itself, so a burst (a streamed reply's deltas, a turn's lifecycle events, the answers of handlers
that finished together) is cheaper sent together. Events held alone linger a little longer
(`EVENT_LINGER`, 2 ms) for the next request or answer to take them along, unless nothing was
sent for that long (then nothing is coming: they go at the iteration's end). Partial replies to one
request held meanwhile go out as one `partial` message with a body frame each
(`IncomingRequest.partial`), and consecutive held events that differ only by id (or, to a hub that
takes mixed types, by id and type: header type `*`) as one `event` message with a body frame each
(docs/protocol.md §4; only to a hub whose welcome says it takes them): the hub still logs and
publishes one event per body. `before_send` (the coordinator's journal commit) runs before held
messages go out.
Every other send flushes the held messages first, so this peer's messages keep their order;
`publish` still waits for the connection and the HWM as before. A lost connection drops held
replies and partials (`reply_lost`; the hub answers their requesters itself) but keeps held
events for the next one.

What the hub has logged (docs/reliability.md, "Publish guarantees"): a `hub.replay` request is
answered only after the hub has committed every event it read before it, and ZeroMQ keeps one
connection's messages in order, so its reply confirms every event this peer sent before it on
the same socket. `confirm()` is that round trip; `aclose()` does it (bounded by
`flush_timeout`) before saying bye, and the housekeeping task does it about once a second
while events flow. A socket closed on a reconnect (linger 0) discards what it still queued: the
events sent on it since the last confirmation are counted in `counters["events_unconfirmed"]`
(not resent: some may be in the log already, and the hub does not deduplicate), and the next
`confirm()` raises `HubLost` naming how many. Events still held (never sent) survive a
reconnect and go out on the new connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc
import msgspec
import zmq
import zmq.asyncio

from agent_bus.bus import events as ev
from agent_bus.bus import protocol as p
from agent_bus.bus.backoff import Backoff
from agent_bus.bus.endpoints import hub_list
from agent_bus.bus.errors import (
    DeadlineExceeded,
    HubLost,
    HubUnreachable,
)
from agent_bus.bus.housekeeping import Housekeeping
from agent_bus.bus.ledger import Ledger
from agent_bus.bus.link import PeerState
from agent_bus.bus.outbox import Outbox
from agent_bus.bus.paths import credential_for, hub_refusal, local_alias
from agent_bus.bus.rpc import Calls, Replies
from agent_bus.bus.security import CurveClient
from agent_bus.bus.serving import Handler, Serving, body_limit
from agent_bus.bus.subscription import Subscription
from agent_bus.bus.transport import Transport, open_dealer

log = logging.getLogger("bus.client")

DEFAULT_HUB = "tcp://127.0.0.1:7400"
HUB_ENV = "BUSCTL_HUB"
CONNECT_TIMEOUT = 4.0  # a welcome takes milliseconds; CLI commands must fail within 5 s
DRAIN_BATCH = 512  # messages handled per wake-up before yielding to other tasks
INLINE_CHECKS = 4  # sends that each look for input at once before one look is deferred
YIELD_EVERY = 256  # sends between cooperative yields (a send that succeeds at once never yields)
BYE_LINGER_MS = 200
FLUSH_TIMEOUT = 10.0  # aclose() waits at most this long for the hub to confirm published events
# Between connection attempts: 50 ms doubling to 2 s, each ±50% so that peers that lost the
# same hub do not come back in step; back to 50 ms after a connection that was welcomed.
RECONNECT_BACKOFF = Backoff(first=0.05, factor=2.0, cap=2.0, jitter=0.5)

_SIG = p.SIGNATURE
_IS_IT_UP = f"(is `busctl up` or `busctl hub` running there? set --hub or {HUB_ENV})"
_CURVE_HINT = ("; with CURVE, also check that this client's public key is in the hub's "
               "authorised directory and that --curve-server-key is the hub's key")
_REPLY_KINDS = frozenset({p.REPLY, p.PARTIAL, p.ERROR})
_REGISTER_REFUSED = frozenset({p.FORBIDDEN, p.BAD_REQUEST})  # a register's refusals (§5)
_EVENT_REFUSED = frozenset({p.LOG_UNAVAILABLE, p.BAD_EVENT, p.FORBIDDEN})  # an event's (§6, §8)
# The leader's address in a `not_leader` error's text (docs/protocol.md §5, "Following the hub").
_NAMED_ENDPOINT = re.compile(r"\b(?:tcp|ipc)://[^\s,;()\[\]`'\"]+")
# A leader named outside the peer's list is joined with CURVE only, up to this many endpoints.
MAX_HUBS = 8


def default_hub() -> str:
    return os.environ.get(HUB_ENV) or DEFAULT_HUB


class Peer:
    """A connection to one hub. Use `connect()`; see the module docstring."""

    #: Called before held messages, or an event sent at once, are handed to the socket: what
    #: they announce can be made durable first without every publisher waiting for it (the
    #: coordinator commits its run journal here: "journaled before published").
    before_send: Callable[[], None] | None = None

    def __init__(
        self,
        hub: str | Sequence[str],
        *,
        name: str,
        role: str = "",
        curve: CurveClient | None = None,
        connect_timeout: float = CONNECT_TIMEOUT,
        flush_timeout: float = FLUSH_TIMEOUT,
    ) -> None:
        # One endpoint or several (bus/endpoints.py): the peer follows the hub along the list
        # (`_connection_loop`). `tcp://127.0.0.1:PORT` of this user's local topology leads to
        # its private ipc socket (`HOST:PORT` and `PORT` are read as busctl reads them; a bad
        # list is raised as HubUnreachable on entry, naming the entry).
        try:
            endpoints = hub_list(hub)
            self._problem = ""
        except ValueError as exc:
            endpoints = [hub if isinstance(hub, str) else ",".join(hub)]
            self._problem = str(exc)
        self.hubs = [local_alias(e) if curve is None else e for e in endpoints]
        self.hub = self.hubs[0]  # the endpoint of the current (or next) connection
        self.epoch = 0  # the highest leader epoch a welcome carried: never settle below it
        self._prefer_next = ""  # the endpoint a `not_leader` named: tried next
        self._stay = False  # the hub said RECONNECT: it is alive, say hello there again
        self._last_hub = self.hub  # the endpoint of the last welcome
        self.name = name
        self.role = role
        self.curve = curve
        self.connect_timeout = connect_timeout
        self.flush_timeout = flush_timeout
        self.session = p.new_session()
        self.welcome: p.Welcome | None = None
        self.ctx = zmq.asyncio.Context()
        self.sock: Transport | None = None  # the DEALER of the current connection
        self.loop: asyncio.AbstractEventLoop | None = None
        self._drain_scheduled = False
        self._check_scheduled = False  # a look for input after sends is due (`send_now`)
        self._unchecked = 0  # sends since the last drain or scheduled look (`send_now`)
        self._ledger = Ledger(self)  # what the hub confirmed of the events published
        self._writable: list[asyncio.Future[None]] = []
        # The lifecycle (see PeerState); whether the current socket is welcomed is `welcome`.
        self._state = PeerState.CONNECTING
        self._state_changed = anyio.Event()  # set (and replaced) on every state or link change
        self._lost = anyio.Event()
        self.last_heard = time.monotonic()  # when the hub was last heard from
        self._calls = Calls(self)  # requests this peer made, in flight
        # Messages held until the end of the current event-loop iteration (`hold`): always
        # sent, in order, before anything else this peer sends.
        self.outbox = Outbox(self.session, self._calls.new_id, self.flush_soon)
        self._housekeeping = Housekeeping(self, self._calls, self._ledger)  # heartbeats, expiry
        self._serving = Serving(self)  # services it offers, requests it serves (in `_tg`)
        self._sends = 0
        self.subscriptions: weakref.WeakSet[Subscription] = weakref.WeakSet()
        self._tg: anyio.abc.TaskGroup | None = None
        self.counters: dict[str, int] = {}

    @property
    def peer_id(self) -> str:
        return self.welcome.peer if self.welcome else ""

    @property
    def connected(self) -> bool:
        """Welcomed by the hub on the current connection (requests and events can flow)."""
        return self.welcome is not None

    @property
    def state(self) -> PeerState:
        """Where this peer is in its lifecycle (read-only; see PeerState)."""
        return self._state

    @property
    def closing(self) -> bool:
        return self._state is PeerState.CLOSING or self._state is PeerState.CLOSED

    @property
    def requests_in_flight(self) -> int:
        """Requests this peer made that have no final answer yet."""
        return len(self._calls.pending)

    @property
    def events_endpoint(self) -> str:
        if self.welcome is None:
            raise HubUnreachable(f"not connected to the hub at {self.hub}")
        return self.welcome.events

    # --- lifecycle -----------------------------------------------------------------------

    async def __aenter__(self) -> Peer:
        problem = self._problem or self._first_reachable()
        if problem:
            self._set_state(PeerState.CLOSED)
            self.ctx.term()
            raise HubUnreachable(problem) from None
        self._tg = tg = anyio.create_task_group()
        await tg.__aenter__()
        tg.start_soon(self._connection_loop, tg)
        tg.start_soon(self._housekeeping.run, tg)
        # Each endpoint of a list that stays silent costs its silence window before the next
        # is tried: the first welcome may take that much longer.
        timeout = self.connect_timeout * len(self.hubs)
        with anyio.move_on_after(timeout):
            await self._wait_connected()
        if self.welcome is None:
            await self.aclose()
            where = self.hub if len(self.hubs) == 1 else f"any of {', '.join(self.hubs)}"
            raise HubUnreachable(
                f"no answer from the hub at {where} within {timeout:g}s "
                f"{_IS_IT_UP}" + (_CURVE_HINT if self.curve is not None else ""))
        return self

    def _first_reachable(self) -> str:
        """Start at the first endpoint that does not refuse a connection; "" when one does not,
        else why none can be reached (a CLI command fails at once rather than after a timeout)."""
        refusals = []
        for hub in self.hubs:
            try:
                refused = hub_refusal(hub)
            except ValueError as exc:
                return str(exc)
            if not refused:
                self.hub = hub
                return ""
            refusals.append(f"{hub}: {refused}" if len(self.hubs) > 1 else refused)
        if len(self.hubs) == 1:
            return f"cannot reach the hub at {self.hub}: {refusals[0]} {_IS_IT_UP}"
        return f"cannot reach any hub ({'; '.join(refusals)}) {_IS_IT_UP}"

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self.closing:
            return
        self._set_state(PeerState.CLOSING)  # still connected: the flush needs the link
        await self._ledger.flush_on_close(self.flush_timeout)
        bye_sent = False
        if self.sock is not None and self.welcome is not None:
            try:
                self._flush_held()
                self.sock.send([_SIG, p.encode(p.Header(kind=p.BYE))])
                bye_sent = True
            except zmq.ZMQError:
                pass
        self._calls.fail_all(HubLost("peer closed", p.HUB_LOST))
        for sub in list(self.subscriptions):
            sub._close()
        await self._serving.close()  # handlers end before the socket closes
        try:
            if self._tg is not None:
                self._tg.cancel_scope.cancel()
                await self._tg.__aexit__(None, None, None)
        finally:
            # Also when the group's exit raises: a cancellation of the caller arriving while
            # its tasks end is re-raised there, once they have ended. Skipping this left the
            # socket and context to the garbage collector (a ResourceWarning).
            self._close_socket(linger=BYE_LINGER_MS if bye_sent else 0)
            self.welcome = None
            self._set_state(PeerState.CLOSED)
            self.ctx.term()

    # --- connection ----------------------------------------------------------------------

    def _set_state(self, state: PeerState) -> None:
        self._state = state
        self._changed()

    def _changed(self) -> None:
        """Wake the tasks waiting for the state or the link (`_wait_connected`)."""
        changed, self._state_changed = self._state_changed, anyio.Event()
        changed.set()

    async def _wait_connected(self) -> None:
        while self.welcome is None:
            await self._state_changed.wait()

    async def _connection_loop(self, tg: anyio.abc.TaskGroup) -> None:
        """Connect, say hello, wait until the connection is lost; then the next endpoint
        (`_move_on`). The backoff runs once every endpoint was tried without a welcome (with
        one endpoint: after every try, as before lists)."""
        delays = RECONNECT_BACKOFF.delays()
        failures = 0  # tries in a row without a welcome
        while not self.closing:
            self._lost = anyio.Event()
            sock = self._open_socket(tg)
            welcomed = False
            try:
                # Straight to the socket: events held over from the last connection must
                # follow the hello, not precede it.
                with contextlib.suppress(zmq.Again):  # no hello: the silence ends this try
                    sock.send([_SIG, p.encode(p.Header(kind=p.HELLO, id=p.new_id())),
                               p.encode(self._hello())])
                await self._lost.wait()
                welcomed = self.welcome is not None
            finally:
                self._on_lost()
            if welcomed:  # it was up: the next try starts soon again
                delays = RECONNECT_BACKOFF.delays()
                failures = 0
            else:
                failures += 1
            self._move_on()
            if failures % len(self.hubs) == 0:
                await anyio.sleep(next(delays))

    def _move_on(self) -> None:
        """Pick the endpoint of the next connection: the same after a RECONNECT (that hub is
        alive), the one a `not_leader` named, else the next in the list (cycling)."""
        stay, self._stay = self._stay, False
        prefer, self._prefer_next = self._prefer_next, ""
        if stay or len(self.hubs) == 1:
            return
        at = self.hubs.index(prefer) if prefer else (self.hubs.index(self.hub) + 1) % len(self.hubs)
        if self.hubs[at] != self.hub:
            log.info("%s: moving from the hub at %s to %s", self.name, self.hub, self.hubs[at])
        self.hub = self.hubs[at]

    def reconnect(self) -> None:
        """Drop the current connection (the hub's silence, its RECONNECT): the connection loop
        makes the next."""
        self._lost.set()

    def _not_leader(self, header: p.Header) -> None:
        """The hub is a standby or a deposed primary (`not_leader`): move on, to the endpoint
        its text names when that is one of ours. A request it refused stays with its caller
        until the connection is gone (`_on_lost`: re-sent when keyed, else `hub_lost`)."""
        self.count("not_leader")
        named = _NAMED_ENDPOINT.search(header.error or "")
        if named is not None:
            endpoint = local_alias(named.group(0)) if self.curve is None else named.group(0)
            if endpoint != self.hub and (endpoint in self.hubs or self._learn(endpoint)):
                self._prefer_next = endpoint
        log.info("%s: the hub at %s is not the leader (%s); moving on", self.name, self.hub,
                 header.error or "no leader named")
        self.reconnect()

    def _learn(self, endpoint: str) -> bool:
        """Add a leader a `not_leader` named that is not in the list: a hub its engine brought
        back at another address (Ray, on another node) after this peer was given the list. Only
        a tcp:// hub under CURVE: it must present the same server key as the hub that named it,
        so only a holder of the pair's secret key can lead the peer there."""
        if self.curve is None or not endpoint.startswith("tcp://") or len(self.hubs) >= MAX_HUBS:
            return False
        log.info("%s: learned the leader's endpoint %s from a not_leader", self.name, endpoint)
        self.hubs.append(endpoint)
        return True

    def _on_lost(self) -> None:
        """The connection ended (silence, RECONNECT, or closing): fail what waits on it."""
        if not self.closing:  # when closing, aclose() closes the socket (letting `bye` out)
            self._close_socket(linger=0)
        self.welcome = None
        if self._state is PeerState.READY:
            self._state = PeerState.RECONNECTING
        self._changed()
        # With other endpoints to go to, a keyed request is kept for the next hub
        # (`Calls.resend`); the others fail here (with one endpoint, every one: as before lists).
        self._calls.on_lost(HubLost(f"lost the hub at {self.hub}", p.HUB_LOST),
                            keep=len(self.hubs) > 1)

    def _open_socket(self, tg: anyio.abc.TaskGroup) -> Transport:
        self.loop = self.outbox.loop = asyncio.get_running_loop()
        self.sock = link = open_dealer(self.ctx, self.hub, self.curve, self.drain, tg)
        self.last_heard = time.monotonic()
        self._schedule_drain()
        return link

    def _close_socket(self, linger: int) -> None:
        link, self.sock = self.sock, None
        self._ledger.socket_closed()
        if link is not None:
            link.close(linger)
        self._wake_writers()

    def _hello(self) -> p.Hello:
        return p.Hello(name=self.name, session=self.session, pid=p.host_pid(), host=p.hostname(),
                       role=self.role, credential=credential_for(self.hub))

    # --- receiving -----------------------------------------------------------------------

    def _schedule_drain(self) -> None:
        if not self._drain_scheduled and self.loop is not None:
            self._drain_scheduled = True
            self.loop.call_soon(self.drain)

    def drain(self) -> None:
        """Handle every message ready on the DEALER (up to a batch), then wake blocked senders.

        The transport calls it when input may be waiting; so do sends that find some waiting
        (`send_now`), and the housekeeping before it takes the hub's silence for a lost link."""
        self._drain_scheduled = False
        self._unchecked = 0
        sock = self.sock
        if sock is None:
            return
        try:
            if self._receive(sock):
                self._heard()
            self._unblock(sock)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.ENOTSOCK:
                log.warning("%s: socket error: %s", self.name, exc)

    def _receive(self, sock: Transport) -> int:
        """Receive and dispatch up to DRAIN_BATCH messages (a full batch schedules the next
        drain); returns how many. One that fails is dropped and counted: the reader goes on."""
        dispatch = self._dispatch
        handled = 0
        while handled < DRAIN_BATCH:
            try:
                frames = sock.recv()
            except zmq.Again:
                return handled
            handled += 1
            try:
                dispatch(frames)
            except (msgspec.DecodeError, msgspec.ValidationError, IndexError,
                    RecursionError) as exc:
                self.count("malformed")
                log.warning("%s: dropped a malformed message from the hub: %s", self.name, exc)
            except Exception:  # a bug must not stop the reader
                self.count("dispatch_errors")
                log.exception("%s: failed to handle a message from the hub", self.name)
            if handled == 1 and not sock.input_waiting():
                # One message (a lone round trip's reply or request): an EVENTS read
                # (~1.5 us) ends the drain cheaper than the recv that fails (~4 us).
                return handled
        self._schedule_drain()
        return handled

    def _heard(self) -> None:
        """After a drain that handled messages: the hub is alive, and what the drain started
        (requests served, callers woken by replies) runs in the next loop pass and sends: look
        for input once after all of it, in that same pass (scheduled after their tasks),
        instead of once per send."""
        self.last_heard = time.monotonic()
        loop = self.loop
        if not self._check_scheduled and not self._drain_scheduled and loop is not None:
            self._check_scheduled = True
            loop.call_soon(self._check_input)

    def _unblock(self, sock: Transport) -> None:
        """After a drain: send the messages the HWM held back, wake the senders waiting for
        room (`send_blocked`)."""
        outbox = self.outbox
        if outbox.items and outbox.stalled():
            self._flush_held()
        if self._writable and sock.writable():
            self._wake_writers()

    def _wake_writers(self) -> None:
        for waiter in self._writable:
            if not waiter.done():
                waiter.set_result(None)
        self._writable.clear()

    def _dispatch(self, frames: list[bytes]) -> None:
        """One message from the hub: a reply to one of this peer's calls or a request to serve
        (the traffic), else one of the hub's own (`_on_control`)."""
        if len(frames) < 2 or frames[0] != _SIG:
            self.count("malformed")
            return
        header = p.decode_header(frames[1])
        kind = header.kind
        if kind in _REPLY_KINDS:
            if kind == p.ERROR and header.code == p.NOT_LEADER:
                self._not_leader(header)
                return
            if not self._calls.deliver(header, frames):
                self._on_unmatched(header)
            return
        if kind == p.REQUEST:
            self._serving.start(header, frames)
            return
        self._on_control(header, frames)

    def _on_control(self, header: p.Header, frames: list[bytes]) -> None:
        """A message of the hub's own: a cancel of a request served here, a welcome, a
        RECONNECT, a heartbeat (its arrival is all it says)."""
        kind = header.kind
        if kind == p.CANCEL:
            self._serving.cancel(header.id)
        elif kind == p.WELCOME:
            self._on_welcome(p.decode(frames[2], p.Welcome))
        elif kind == p.RECONNECT:
            self._stay = True
            self.reconnect()
        elif kind != p.HEARTBEAT:
            self.count("unknown_kind")

    def _on_unmatched(self, header: p.Header) -> None:
        """An answer to no pending call: late (stale), the hub refusing one of our registers, or
        one of our events."""
        if header.code in _REGISTER_REFUSED and self._serving.on_refused(header):
            return
        # bad_event: docs/protocol.md §6; forbidden not of a register: an event this peer's roles
        # may not publish (§8; a request's answer matches its call, unless it is stale).
        if header.code in _EVENT_REFUSED:
            self._ledger.refused(header)
        else:
            self.count("stale_replies")

    def _on_welcome(self, welcome: p.Welcome) -> None:
        if welcome.epoch < self.epoch:  # an older leader than one seen: as `not_leader`
            self.count("stale_leader")
            log.warning("%s: the hub at %s welcomed with epoch %d, older than %d seen: moving "
                        "on", self.name, self.hub, welcome.epoch, self.epoch)
            self.reconnect()
            return
        self.epoch = welcome.epoch
        self.welcome = welcome
        frames = self._serving.reregister_frames()
        if frames is not None and not self.send_now(frames):
            log.warning("%s: could not re-register (send queue full)", self.name)
        self._calls.resend()  # after the registers: a request to this peer finds its service
        for sub in list(self.subscriptions):
            sub.follow(welcome.events)  # a moved hub publishes elsewhere
        if self._state is PeerState.RECONNECTING:
            moved = self.hub != self._last_hub
            log.warning("%s: %s", self.name, f"moved to the hub at {self.hub}" if moved else
                        f"the hub at {self.hub} is back; reconnected")
        self._last_hub = self.hub
        if self._state is PeerState.CONNECTING or self._state is PeerState.RECONNECTING:
            self._state = PeerState.READY
        self._changed()

    def count(self, name: str) -> None:
        self.counters[name] = self.counters.get(name, 0) + 1

    # --- sending -------------------------------------------------------------------------

    def send_now(self, frames: list[Any]) -> bool:
        """Send a whole message (signature included) without blocking; False at the HWM.

        Held events go first (order is kept); while some are still held, nothing is sent."""
        sock = self.sock
        if sock is None:
            raise HubLost(f"not connected to the hub at {self.hub}", p.HUB_LOST)
        if self.outbox.items and not self._flush_held():
            return False
        try:
            sock.send(frames)
        except zmq.Again:
            return False
        self.outbox.sent_at = time.monotonic()
        # The send may have consumed the fd's edge for input that arrived meanwhile, so look (an
        # EVENTS read, ~1.5 us). Past INLINE_CHECKS sends since the last drain or look, once
        # after this iteration's callbacks instead (the loop does not block before it runs): an
        # extra loop pass costs ~5 us, less than a look per send in a burst (256 requests).
        if self._check_scheduled or self._drain_scheduled:
            return True
        self._unchecked += 1
        loop = self.loop
        if self._unchecked > INLINE_CHECKS and loop is not None:
            self._check_scheduled = True
            loop.call_soon(self._check_input)
        elif sock.input_waiting():
            self._schedule_drain()
        return True

    def _check_input(self) -> None:
        """After a burst of sends: drain when input is waiting (see `send_now`)."""
        self._check_scheduled = False
        self._unchecked = 0
        sock = self.sock
        if sock is None or self._drain_scheduled:
            return
        try:
            waiting = sock.input_waiting()
        except zmq.ZMQError as exc:  # closed meanwhile
            if exc.errno != zmq.ENOTSOCK:
                log.warning("%s: socket error: %s", self.name, exc)
            return
        if waiting:
            self.drain()

    def hold(self, frames: list[Any], *, linger: bool = False) -> bool:
        """Hold a whole message (a reply, a partial reply with `linger`, or a request) for the end
        of this event-loop iteration (bus/outbox.py says why); False: not connected, or the
        outbox is full: send it now. Any direct send flushes the held messages first, so order
        is kept. (A request is held only behind other held messages or beside other calls in
        flight, `Calls.begin`; alone it goes at once, so the other side starts sooner.)"""
        return (self.welcome is not None and self.sock is not None
                and self.outbox.hold(frames, linger=linger))

    def flush_soon(self) -> None:
        """The outbox's scheduled flush (its linger ended, or the loop iteration did)."""
        try:
            self._flush_held()
        except zmq.ZMQError as exc:
            if exc.errno != zmq.ENOTSOCK:
                log.warning("%s: socket error: %s", self.name, exc)

    def _flush_held(self) -> bool:
        """Send the held messages (`Outbox.flush`); False when the HWM stopped it."""
        sock = self.sock
        if sock is None:
            return False  # events wait for the next connection (replies are dropped on close)
        if self.outbox.items:
            self._before_send()
        if not self.outbox.flush(sock, self.welcome):
            return False
        if not self._drain_scheduled and sock.input_waiting():
            self._schedule_drain()
        return True

    def _before_send(self) -> None:
        hook = self.before_send
        if hook is not None:
            try:
                hook()
            except Exception:  # what it guards is its owner's; sending must go on
                log.exception("%s: before_send failed", self.name)

    async def send(self, frames: list[Any], *, wait: bool = True,
                    deadline: float = float("inf")) -> None:
        """Send `[SIGNATURE, *frames]`; wait for the connection (when `wait`) and the HWM."""
        if wait and self.welcome is None:
            await self.wait_connection(deadline)
        message = [_SIG, *frames]
        if not self.send_now(message):
            await self.send_blocked(message, deadline)
        self._sends += 1
        if self._sends % YIELD_EVERY == 0:
            await anyio.lowlevel.checkpoint()

    async def wait_connection(self, deadline: float) -> None:
        """Wait until connected (at most until `deadline`, monotonic), else raise HubLost."""
        with anyio.move_on_after(max(0.0, deadline - time.monotonic())):
            await self._wait_connected()
        if self.welcome is None:
            raise HubLost(f"not connected to the hub at {self.hub}", p.HUB_LOST)

    async def send_blocked(self, message: list[Any], deadline: float) -> None:
        while True:
            if time.monotonic() >= deadline:
                raise DeadlineExceeded("send queue to the hub stayed full", p.DEADLINE)
            await self._wait_writable()
            if self.send_now(message):
                return

    async def _wait_writable(self) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._writable.append(waiter)
        with anyio.move_on_after(0.05):  # the edge may have been consumed elsewhere: re-check
            await waiter

    # --- requests ------------------------------------------------------------------------

    def stream(
        self, service: str, body: bytes, *, timeout: float | None = 30.0, parent: str = "",
        prefer: str = "", wait: float = 0.0, key: str = ""
    ) -> contextlib.AbstractAsyncContextManager[Replies]:
        """Send a request; iterate its partial replies; the iterator ends after the final reply.

        `async with peer.stream(...) as replies:` The final reply's body is yielded last; then
        `replies.served_by` names the peer that served it. Leaving the block early (or being
        cancelled) cancels the request at the hub and the serving peer. `prefer`: a peer id the
        hub sends the request to while that peer serves the service and has a free slot (else
        to another, as usual; docs/protocol.md section 5, "Preferred server"). `wait`: when no
        peer serves the service, how long (s) the hub holds the request for one to register
        before it fails `no_service` (0: until the timeout; docs/protocol.md section 5, "Waiting
        for a server"). `key`: an idempotency key (docs/protocol.md section 5, "Following the
        hub"): the request is re-sent with it on the next hub when this one is lost before the
        final answer, instead of failing `hub_lost`; the server answers a repeat of a key once.
        """
        return self._calls.stream(service, body, timeout, parent, prefer, wait, key)

    async def request(self, service: str, body: bytes, *, timeout: float | None = 30.0,
                      parent: str = "", prefer: str = "", wait: float = 0.0,
                      key: str = "") -> bytes:
        """Send a request and return the final reply body (partials are discarded); `prefer`,
        `wait` and `key` as for `stream`."""
        return await self._calls.request(service, body, timeout, parent, prefer, wait, key)

    async def status(self, timeout: float = 5.0) -> p.Status:
        return p.decode(await self.request(p.HUB_STATUS, b"", timeout=timeout), p.Status)

    # --- serving -------------------------------------------------------------------------

    async def serve(self, service: str, handler: Handler, *, capacity: int = 1,
                    idempotent: bool = False, meta: dict[str, Any] | None = None,
                    confirm: bool = True) -> None:
        """Register `handler` for `service`; it stays registered across hub restarts.

        Raises `RegisterRefused` when the hub refuses it (this peer's roles may not serve it, or
        a bad spec); the service is then not served. A success has no answer (docs/protocol.md
        §4), so this waits for one round trip to the hub after the register: the refusal, sent
        at once, comes before its answer. `confirm=False` sends the register alone: a peer
        registering many services calls `confirm_registers()` once after them (one round trip)."""
        spec = p.ServiceSpec(service, capacity, idempotent, meta or {})
        await self._serving.register(spec, handler, confirm=confirm, timeout=CONNECT_TIMEOUT)

    async def confirm_registers(self) -> None:
        """One round trip to the hub after `serve(..., confirm=False)` calls: raises
        `RegisterRefused` for the first service the hub refused (every refused one is dropped,
        logged and counted)."""
        await self._serving.confirm_registers(CONNECT_TIMEOUT)

    async def unserve(self, service: str) -> None:
        await self._serving.unregister(service)

    # --- events --------------------------------------------------------------------------

    async def publish(self, event: ev.Event, *, agent: str = "", run: str = "",
                      experiment: str = "", parent: str = "", confirm: bool = False) -> None:
        """Send an event; with `confirm`, return once the hub has logged it (`confirm()`)."""
        await self.publish_raw(ev.event_type(event), ev.encode_event(event), agent=agent, run=run,
                               experiment=experiment, parent=parent, confirm=confirm)

    async def publish_raw(self, type_: str, body: bytes, *, agent: str = "", run: str = "",
                          experiment: str = "", parent: str = "", confirm: bool = False) -> None:
        limit = body_limit(self)
        if limit and len(body) > limit:
            # the hub would drop this connection (and every call on it): the event is lost alone
            self.count("events_too_large")
            log.warning("%s: event `%s` of %d bytes not sent: over the hub's max_message_bytes",
                        self.name, type_, len(body))
            return
        key = (type_, agent, run, experiment, parent)
        outbox = self.outbox
        if not (self.welcome is not None and self.sock is not None
                and outbox.hold_event(body, key)):
            message = [_SIG, outbox.event_header(key), body]
            if self.welcome is None:
                await self.wait_connection(float("inf"))
            self._before_send()
            if not self.send_now(message):
                await self.send_blocked(message, float("inf"))
            self.outbox.events_sent += 1
        self._sends += 1
        if confirm:
            await self.confirm()
        elif self._sends % YIELD_EVERY == 0:
            await anyio.lowlevel.checkpoint()

    async def confirm(self) -> int:
        """Wait until the hub has logged every event this peer published before the call;
        return the log's latest seq.

        Raises `HubLost` when the connection is lost first, or when some events published since
        the previous `confirm()` may be missing from the log: they went out on a connection that
        closed before the hub confirmed them (`counters["events_unconfirmed"]`), or the hub
        refused them (`counters["events_refused"]`; its answers precede the confirmation).
        No timeout of its own: a dead hub is noticed within its liveness window; wrap the call
        in `anyio.fail_after` for a tighter bound.
        """
        return await self._ledger.confirm()

    def subscribe(self, topics: list[str] | tuple[str, ...] = (), *, since: int | None = None,
                  fill_gaps: bool = True) -> Subscription:
        """Live events matching any topic prefix (all when empty), optionally replayed from `since`."""
        return Subscription(self, list(topics), since, fill_gaps)


@asynccontextmanager
async def connect(hub: str | Sequence[str] | None = None, *, name: str = "client",
                  role: str = "", curve: CurveClient | None = None,
                  connect_timeout: float = CONNECT_TIMEOUT) -> AsyncIterator[Peer]:
    """Connect a peer to `hub` (default: $BUSCTL_HUB or tcp://127.0.0.1:7400): one address, or
    several (a list, or one string with commas) that the peer follows when the hub moves."""
    peer = Peer(hub or default_hub(), name=name, role=role, curve=curve,
                connect_timeout=connect_timeout)
    async with peer:
        yield peer
