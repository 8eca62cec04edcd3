"""The peer client: how every process (and every test) talks to the hub, on anyio/asyncio.

`async with connect(hub, name=...) as peer:` says hello, keeps heartbeats going both ways, and
reconnects (re-registering its services) when the hub restarts. Replies are matched to requests
by id. Subscriptions use their own SUB socket and are read by the consumer's task.

How the sockets are driven (the hot path): the DEALER is a plain (blocking-type) pyzmq socket
whose notification fd is watched with the asyncio loop's `add_reader`. Each wake-up drains every
ready message with NOBLOCK receives and dispatches them synchronously (a reply resolves its
caller's future; a request starts a handler task). Sends are NOBLOCK and succeed at once unless
the high-water mark is reached, in which case the sender waits for the socket to become writable.
The zmq fd is edge-triggered: any send or `EVENTS` read may consume the edge, so after sending we
check `EVENTS` and schedule a drain ourselves when input is waiting. This needs anyio's asyncio
backend (pyzmq has no trio support).

Published events are held until the end of the current event-loop iteration and then sent back
to back (`_hold`): on an idle socket every send wakes ZeroMQ's I/O thread (and then the hub),
which costs far more than the send itself, so a burst of events (a streamed reply's deltas, a
turn's lifecycle events) is cheaper sent together. Every other send flushes them first, so this
peer's messages keep their order; `publish` still waits for the connection and the HWM as before.

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
import dataclasses
import itertools
import logging
import math
import os
import random
import socket
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.abc
import msgspec
import zmq
import zmq.asyncio
from zmq.backend import Socket as _BackendSocket

from bus import events as ev
from bus import protocol as p
from bus.errors import (
    DeadlineExceeded,
    HubLost,
    HubUnreachable,
    Overloaded,
    ProtocolError,
    RequestError,
    error_for,
)
from bus.security import CurveClient
from bus.transport import FastTransport, PortableTransport, Transport, recv_frames, transport_kind

log = logging.getLogger("bus.client")

DEFAULT_HUB = "tcp://127.0.0.1:7400"
HUB_ENV = "BUSCTL_HUB"
CONNECT_TIMEOUT = 4.0  # a welcome takes milliseconds; CLI commands must fail within 5 s
REPLY_GRACE = 1.0  # how long past a deadline we wait for the hub's own deadline error
HOUSEKEEPING = 0.1  # seconds between checks of hub silence, heartbeats and client-side expiry
DRAIN_BATCH = 512  # messages handled per wake-up before yielding to other tasks
HOLD_MAX = 1024  # published events held for the end of the loop iteration at most
YIELD_EVERY = 256  # sends between cooperative yields (a send that succeeds at once never yields)
BYE_LINGER_MS = 200
REPLAY_RETRY_FOR = 30.0  # a subscription asks `hub.replay` again this long (hub restarting)
FLUSH_TIMEOUT = 10.0  # aclose() waits at most this long for the hub to confirm published events
CONFIRM_EVERY = 1.0  # seconds between background confirmations while events flow
# A replay that starts past any seq: the reply carries no events, only the log's head.
_CONFIRM_BODY = p.encode(p.ReplayRequest(since=2**62, limit=1))

_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)
_EVENTS = int(zmq.EVENTS)
_NOBLOCK = int(zmq.NOBLOCK)
_MORE_NOBLOCK = int(zmq.NOBLOCK | zmq.SNDMORE)
# pyzmq's send_multipart/recv_multipart spend ~3 us per message on Python-level flag (enum)
# handling; the backend calls with int flags cost a fraction of that.
_bsend = _BackendSocket.send
_brecv = _BackendSocket.recv
_bget = _BackendSocket.get


# The subscription's SUB socket still reads through these (bus/transport.py has the DEALER's).
_recv_frames = recv_frames
_SIG = p.SIGNATURE
_BYTES = (bytes, bytearray, memoryview)
_SERVE_TASK = "bus.client: serve a request"  # a fixed name: anyio would derive one per spawn
_REPLY_KINDS = frozenset({p.REPLY, p.PARTIAL, p.ERROR})


def default_hub() -> str:
    return os.environ.get(HUB_ENV) or DEFAULT_HUB


@dataclass(slots=True)
class IncomingRequest:
    """A request this peer serves. Reply by returning bytes from the handler; stream with `partial`."""

    id: str
    service: str
    header: p.Header
    body: bytes
    deadline: float  # unix time; 0 when none
    _peer: Peer
    # Cancelled on a CANCEL from the hub (the requester, or the deadline). Made before the
    # handler's task starts, so a CANCEL that arrives first still lands: the scope is entered
    # already cancelled. A scope, not `Task.cancel()`: anyio re-delivers a scope's cancellation
    # at every checkpoint until the scope exits, where a native cancel can be swallowed by an
    # anyio scope the handler is in (the shell then keeps running and no reply goes out).
    _scope: anyio.CancelScope = dataclasses.field(default_factory=anyio.CancelScope)
    _cancelled: anyio.Event | None = None

    @property
    def cancelled(self) -> anyio.Event:
        """Set when the requester (or the hub, at the deadline) cancels this request."""
        if self._cancelled is None:  # made on first use: most requests never look
            self._cancelled = anyio.Event()
        return self._cancelled

    async def partial(self, body: bytes) -> None:
        await self._peer._send([p.encode(p.Header(kind=p.PARTIAL, id=self.id)), body], wait=False)


Handler = Callable[[IncomingRequest], Awaitable[bytes]]


@dataclass(slots=True)
class _Served:
    spec: p.ServiceSpec
    handler: Handler


class Envelope(msgspec.Struct):
    """One event as a subscriber sees it: the stamped header and the decoded body."""

    header: p.Header
    event: ev.Event


class _Call:
    """One outstanding request: replies queue here until its task takes them (no stream object)."""

    __slots__ = ("id", "items", "waiter", "expires", "done")

    def __init__(self, req_id: str, expires: float) -> None:
        self.id = req_id
        self.items: deque[tuple[p.Header, list[bytes]]] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.expires = expires  # monotonic; inf when none
        self.done = False  # a final reply (or error) was taken

    def put(self, item: tuple[p.Header, list[bytes]]) -> None:
        self.items.append(item)
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> tuple[p.Header, list[bytes]]:
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return self.items.popleft()


class _Replies:
    """The iterator `Peer.stream` yields: partial bodies, then the final reply body."""

    def __init__(self, call: _Call, service: str, timeout: float | None) -> None:
        self._call = call
        self._service = service
        self._timeout = timeout

    def __aiter__(self) -> _Replies:
        return self

    async def __anext__(self) -> bytes:
        call = self._call
        if call.done:
            raise StopAsyncIteration
        header, frames = await call.get()
        kind = header.kind
        if kind == p.ERROR:
            call.done = True
            raise error_for(header.code, header.error or header.code)
        if kind == p.REPLY:
            call.done = True
        return frames[0] if frames else b""


class _FdWaiter:
    """Wake one waiting task when a zmq socket's notification fd fires (edge-triggered)."""

    def __init__(self, sock: zmq.Socket[Any], on_ready: Callable[[], None] | None = None) -> None:
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self.fd = sock.getsockopt(zmq.FD)
        self.waiter: asyncio.Future[None] | None = None
        self._on_ready = on_ready
        self.loop.add_reader(self.fd, self._fired)

    def _fired(self) -> None:
        if self.sock.closed:
            return
        if self._on_ready is not None:
            self._on_ready()
            return
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        else:
            _bget(self.sock, _EVENTS)  # consume the edge; the reader will find the messages

    async def wait(self) -> None:
        self.waiter = self.loop.create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    def close(self) -> None:
        try:
            self.loop.remove_reader(self.fd)
        except (ValueError, OSError, RuntimeError):
            pass
        self.sock.close(linger=0)
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)  # the reader sees the socket gone and stops


class Peer:
    """A connection to one hub. Use `connect()`; see the module docstring."""

    def __init__(
        self,
        hub: str,
        *,
        name: str,
        role: str = "",
        curve: CurveClient | None = None,
        connect_timeout: float = CONNECT_TIMEOUT,
        flush_timeout: float = FLUSH_TIMEOUT,
    ) -> None:
        self.hub = hub
        self.name = name
        self.role = role
        self.curve = curve
        self.connect_timeout = connect_timeout
        self.flush_timeout = flush_timeout
        self.session = p.new_session()
        self.welcome: p.Welcome | None = None
        self.ctx = zmq.asyncio.Context()
        self._sock: Transport | None = None  # the DEALER of the current connection
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_scheduled = False
        # Published events held until the end of the current event-loop iteration (see
        # `publish_raw`): always sent, in order, before anything else this peer sends.
        self._held: list[list[Any]] = []
        self._flush_scheduled = False
        # Publish accounting: events handed to a socket, how many of those the hub confirmed
        # (the rest of the current socket's are in flight), and how many unconfirmed ones a
        # closed socket took with it (all; and, with the refused ones, as far as `confirm()` has
        # reported them).
        self._events_sent = 0
        self._confirmed = 0
        self._unconfirmed = 0
        self._unconfirmed_reported = 0
        self._confirming = False  # a background confirmation is in flight
        self._writable: list[asyncio.Future[None]] = []
        self._is_connected = False
        self._state_changed = anyio.Event()  # set (and replaced) on every connect/disconnect
        self._lost = anyio.Event()
        self._closing = False
        self._last_heard = time.monotonic()
        self._pending: dict[str, _Call] = {}
        self._ids = itertools.count(1)
        self._sends = 0
        self._services: dict[str, _Served] = {}
        # Requests being served, each by a task of `_tg` (cancelled with it in aclose()).
        self._serving: dict[str, IncomingRequest] = {}
        self._subs: weakref.WeakSet[Subscription] = weakref.WeakSet()
        self._tg: anyio.abc.TaskGroup | None = None
        self.counters: dict[str, int] = {}
        self._ever_connected = False

    @property
    def peer_id(self) -> str:
        return self.welcome.peer if self.welcome else ""

    @property
    def connected(self) -> bool:
        return self._is_connected

    @property
    def events_endpoint(self) -> str:
        if self.welcome is None:
            raise HubUnreachable(f"not connected to the hub at {self.hub}")
        return self.welcome.events

    # --- lifecycle -----------------------------------------------------------------------

    async def __aenter__(self) -> Peer:
        refused = self._check_endpoint()
        if refused:
            self.ctx.term()
            raise HubUnreachable(
                f"cannot reach the hub at {self.hub}: {refused} (is `busctl up` or "
                f"`busctl hub` running there? set --hub or {HUB_ENV})")
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._connection_loop)
        self._tg.start_soon(self._housekeeping)
        with anyio.move_on_after(self.connect_timeout):
            await self._wait_connected()
        if not self._is_connected:
            await self.aclose()
            raise HubUnreachable(
                f"no answer from the hub at {self.hub} within {self.connect_timeout:g}s "
                f"(is `busctl up` or `busctl hub` running there? set --hub or {HUB_ENV})"
                + ("; with CURVE, also check that this client's public key is in the hub's "
                   "authorised directory and that --curve-server-key is the hub's key"
                   if self.curve is not None else "")
            )
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.aclose()

    def _check_endpoint(self) -> str:
        """Fail fast on a malformed address (raises) or a hub that is plainly not there (returns
        why: nothing listens on the TCP port, or no ipc socket file), instead of retrying for
        the whole connect timeout. Anything less clear-cut is left to the ZeroMQ connection."""
        # (No probe socket on self.ctx: creating one there upsets the fd-driven reader of the
        # SUB sockets made later — seen as a subscriber stalling under load.)
        scheme, sep, rest = self.hub.partition("://")
        ok = sep and rest and scheme in ("tcp", "ipc", "inproc", "ws", "wss", "tipc", "vmci")
        if ok and scheme == "tcp":
            port = rest.rpartition(":")[2]
            ok = ":" in rest and port.isdigit() and 0 < int(port) < 65536
        if not ok:
            self.ctx.term()
            raise HubUnreachable(f"bad hub address {self.hub!r} (use tcp://HOST:PORT or ipc://PATH)")
        if self.hub.startswith("ipc://"):
            path = self.hub[6:]
            if path and not path.startswith("@") and not os.path.exists(path):
                return f"no socket file at {path}"
            return ""
        if self.hub.startswith("tcp://"):
            host, _, port = self.hub[6:].rpartition(":")
            host = host.strip("[]")
            if ";" in host:
                return ""  # a source address: let ZeroMQ handle it
            try:
                with socket.create_connection((host, int(port)), timeout=1.0):
                    pass
            except ConnectionRefusedError:
                return "connection refused"
            except OSError:
                return ""
        return ""

    async def aclose(self) -> None:
        if self._closing:
            return
        self._closing = True
        await self._flush_on_close()
        bye_sent = False
        if self._sock is not None and self._is_connected:
            try:
                self._flush_held()
                self._sock.send([_SIG, p.encode(p.Header(kind=p.BYE))])
                bye_sent = True
            except zmq.ZMQError:
                pass
        self._fail_pending(HubLost("peer closed", p.HUB_LOST))
        for sub in list(self._subs):
            sub._close()
        if self._tg is not None:  # its handlers too: they end before the socket closes
            self._tg.cancel_scope.cancel()
            await self._tg.__aexit__(None, None, None)
        self._close_socket(linger=BYE_LINGER_MS if bye_sent else 0)
        self.ctx.term()

    async def _flush_on_close(self) -> None:
        """Wait, at most `flush_timeout`, until the hub confirms every event published so far:
        closing the socket soon after would discard a backlog still queued in it. What stays
        unconfirmed is counted when the socket closes."""
        if not self._is_connected or (self._events_sent == self._confirmed and not self._held):
            return  # nothing in flight: no round trip (most CLI commands publish nothing)
        with anyio.CancelScope(shield=True), anyio.move_on_after(self.flush_timeout):
            try:
                await self._confirm_sent()
            except RequestError as exc:  # the hub went away: counted at the close below
                log.warning("%s: published events not confirmed before closing: %s",
                            self.name, exc)

    # --- connection ----------------------------------------------------------------------

    def _set_connected(self, value: bool) -> None:
        self._is_connected = value
        changed, self._state_changed = self._state_changed, anyio.Event()
        changed.set()

    async def _wait_connected(self) -> None:
        while not self._is_connected:
            await self._state_changed.wait()

    async def _connection_loop(self) -> None:
        backoff = 0.05
        while not self._closing:
            self._lost = anyio.Event()
            sock = self._open_socket()
            try:
                # Straight to the socket: events held over from the last connection must
                # follow the hello, not precede it.
                with contextlib.suppress(zmq.Again):  # no hello: the silence ends this try
                    sock.send([_SIG, p.encode(p.Header(kind=p.HELLO, id=p.new_id())),
                                        p.encode(self._hello())])
                await self._lost.wait()
                if self._is_connected:
                    backoff = 0.05
            finally:
                was_connected = self._is_connected
                if not self._closing:  # when closing, aclose() closes it (letting `bye` out)
                    self.welcome = None
                    self._close_socket(linger=0)
                if was_connected:
                    self._set_connected(False)
                self._fail_pending(HubLost(f"lost the hub at {self.hub}", p.HUB_LOST))
            await anyio.sleep(backoff * (0.5 + random.random()))
            backoff = min(backoff * 2, 2.0)

    def _open_socket(self) -> Transport:
        self._loop = loop = asyncio.get_running_loop()
        portable = transport_kind(loop) == "portable"
        # The fast transport needs a plain socket (see bus/transport.py); `self.ctx` makes
        # zmq.asyncio ones.
        sock: zmq.Socket[Any] = (self.ctx.socket(zmq.DEALER) if portable
                                 else zmq.Socket(self.ctx, zmq.DEALER))
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        if self.curve is not None:
            self.curve.apply(sock)
        sock.connect(self.hub)
        link: Transport
        if portable:
            link = PortableTransport(sock, self._drain)  # type: ignore[arg-type]
            self._tg.start_soon(link.watch)  # type: ignore[union-attr]
        else:
            link = FastTransport(sock, self._drain)
        self._sock = link
        self._last_heard = time.monotonic()
        self._schedule_drain()
        return link

    def _close_socket(self, linger: int) -> None:
        link, self._sock = self._sock, None
        self._count_unconfirmed()
        if link is not None:
            link.close(linger)
        for waiter in self._writable:
            if not waiter.done():
                waiter.set_result(None)
        self._writable.clear()

    def _count_unconfirmed(self) -> None:
        """The socket is gone with whatever it still queued: count the events sent on it that
        the hub never confirmed. On a reconnect, held events (never sent) wait for the next
        connection; on close they are counted too."""
        lost = self._events_sent - self._confirmed
        self._confirmed = self._events_sent
        if self._closing and self._held:
            lost += len(self._held)
            self._held.clear()
        if not lost:
            return
        self._unconfirmed += lost
        self.counters["events_unconfirmed"] = self._unconfirmed
        log.warning("%s: %d published events were not confirmed by the hub at %s before the "
                    "connection closed; they may be missing from its log", self.name, lost,
                    self.hub)

    def _hello(self) -> p.Hello:
        return p.Hello(name=self.name, session=self.session, pid=os.getpid(), host=p.hostname(),
                       role=self.role)

    async def _housekeeping(self) -> None:
        hb = [_SIG, p.encode(p.Header(kind=p.HEARTBEAT))]
        next_beat = next_confirm = time.monotonic()
        while True:
            await anyio.sleep(HOUSEKEEPING)
            now = time.monotonic()
            self._expire(now)
            if self._sock is None:
                continue
            welcome = self.welcome
            if welcome is not None:
                interval = welcome.heartbeat_interval
                expiry = interval * welcome.liveness
            else:
                interval, expiry = 1.0, 3.0
            if now - self._last_heard > expiry:
                say = log.warning if self._ever_connected else log.debug  # first connect: quiet
                say("%s: no word from the hub at %s for %.1fs; reconnecting", self.name,
                    self.hub, expiry)
                self._lost.set()
                continue
            if self._held and not self._flush_scheduled:
                self._flush_soon()  # events held back by the HWM
            if now >= next_confirm and self._should_confirm():
                next_confirm = now + CONFIRM_EVERY
                self._confirming = True
                self._tg.start_soon(self._confirm_in_background)  # type: ignore[union-attr]
            if self._is_connected and now >= next_beat:
                next_beat = now + interval
                try:
                    self._send_now(hb)
                except zmq.ZMQError:
                    pass

    def _should_confirm(self) -> bool:
        return (self._is_connected and not self._confirming and not self._closing
                and self._events_sent > self._confirmed)

    async def _confirm_in_background(self) -> None:
        """Confirm what was sent so far, so that a lost connection counts only the events sent
        since (about a second's worth), not every event it ever carried."""
        try:
            await self._confirm_sent()
        except RequestError:
            pass  # the connection was lost: closing it counted the unconfirmed events
        finally:
            self._confirming = False

    def _expire(self, now: float) -> None:
        """Fail calls past deadline + grace (the hub normally answers at the deadline itself).

        A scan of the calls in flight (bounded by the caller's concurrency) rather than a heap
        of every request ever sent, which would hold each one until its deadline."""
        if not self._pending:
            return
        expired = [call for call in self._pending.values() if call.expires <= now]
        for call in expired:
            del self._pending[call.id]
            call.put((p.Header(kind=p.ERROR, id=call.id, code=p.DEADLINE,
                               error="no reply before the deadline"), []))

    # --- receiving -----------------------------------------------------------------------

    def _schedule_drain(self) -> None:
        if not self._drain_scheduled and self._loop is not None:
            self._drain_scheduled = True
            self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        """Handle every message ready on the DEALER (up to a batch), then wake blocked senders."""
        self._drain_scheduled = False
        sock = self._sock
        if sock is None:
            return
        dispatch = self._dispatch
        handled = 0
        try:
            while handled < DRAIN_BATCH:
                try:
                    frames = sock.recv()
                except zmq.Again:
                    break
                handled += 1
                try:
                    dispatch(frames)
                except (msgspec.DecodeError, msgspec.ValidationError, IndexError,
                        RecursionError) as exc:
                    self._count("malformed")
                    log.warning("%s: dropped a malformed message from the hub: %s", self.name, exc)
                except Exception:  # a bug must not stop the reader
                    self._count("dispatch_errors")
                    log.exception("%s: failed to handle a message from the hub", self.name)
            else:
                self._schedule_drain()
            if handled:
                self._last_heard = time.monotonic()
            if self._held and not self._flush_scheduled:
                self._flush_held()
            if self._writable and sock.writable():
                for waiter in self._writable:
                    if not waiter.done():
                        waiter.set_result(None)
                self._writable.clear()
        except zmq.ZMQError as exc:
            if exc.errno != zmq.ENOTSOCK:
                log.warning("%s: socket error: %s", self.name, exc)

    def _dispatch(self, frames: list[bytes]) -> None:
        if len(frames) < 2 or frames[0] != _SIG:
            self._count("malformed")
            return
        header = p.decode_header(frames[1])
        kind = header.kind
        if kind in _REPLY_KINDS:
            call = self._pending.get(header.id)
            if call is None:
                self._on_unmatched(header)
                return
            if kind != p.PARTIAL:
                del self._pending[header.id]
            call.put((header, frames[2:]))
        elif kind == p.REQUEST:
            self._start_serving(header, frames)
        elif kind == p.CANCEL:
            self._cancel_serving(header.id)
        elif kind == p.WELCOME:
            self._on_welcome(p.decode(frames[2], p.Welcome))
        elif kind == p.RECONNECT:
            self._lost.set()
        elif kind != p.HEARTBEAT:
            self._count("unknown_kind")

    def _on_unmatched(self, header: p.Header) -> None:
        """An answer to no pending call: late (stale), or the hub refusing one of our events."""
        if header.code not in (p.LOG_UNAVAILABLE, p.BAD_EVENT):  # bad_event: docs/protocol.md §6
            self._count("stale_replies")
            return
        self._count("events_refused")
        n = self.counters["events_refused"]
        if n == 1 or n % 1000 == 0:
            log.warning("%s: the hub refused an event (#%d): %s", self.name, n, header.error)

    def _on_welcome(self, welcome: p.Welcome) -> None:
        self.welcome = welcome
        if self._services:
            frames = [_SIG, p.encode(p.Header(kind=p.REGISTER)),
                      p.encode(p.Register([s.spec for s in self._services.values()]))]
            if not self._send_now(frames):
                log.warning("%s: could not re-register (send queue full)", self.name)
        self._ever_connected = True
        if not self._is_connected:
            self._set_connected(True)

    def _fail_pending(self, error: RequestError) -> None:
        pending, self._pending = self._pending, {}
        for req_id, call in pending.items():
            call.put((p.Header(kind=p.ERROR, id=req_id, code=error.code, error=str(error)), []))

    def _count(self, name: str) -> None:
        self.counters[name] = self.counters.get(name, 0) + 1

    # --- sending -------------------------------------------------------------------------

    def _send_now(self, frames: list[Any]) -> bool:
        """Send a whole message (signature included) without blocking; False at the HWM.

        Held events go first (order is kept); while some are still held, nothing is sent."""
        sock = self._sock
        if sock is None:
            raise HubLost(f"not connected to the hub at {self.hub}", p.HUB_LOST)
        if self._held and not self._flush_held():
            return False
        try:
            sock.send(frames)
        except zmq.Again:
            return False
        # The send may have consumed the fd's edge for input that arrived meanwhile.
        if not self._drain_scheduled and sock.input_waiting():
            self._schedule_drain()
        return True

    def _hold(self, message: list[Any]) -> bool:
        """Queue an event for the end of this event-loop iteration (False: send it now).

        Everything held meanwhile then goes out back to back: a burst (a streamed reply's
        deltas parsed from one read, a turn's lifecycle events) costs one wake-up of ZeroMQ's
        I/O thread and of the hub instead of one per event, an isolated send being the costly
        kind. Any direct send flushes the held events first, so order is kept. (Requests and
        replies are not held: sending them at once lets the other side start sooner.)
        """
        if self._is_connected and self._sock is not None and len(self._held) < HOLD_MAX:
            self._held.append(message)
            self._schedule_flush()
            return True
        return False

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled and self._loop is not None:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush_soon)

    def _flush_soon(self) -> None:
        self._flush_scheduled = False
        try:
            self._flush_held()
        except zmq.ZMQError as exc:
            if exc.errno != zmq.ENOTSOCK:
                log.warning("%s: socket error: %s", self.name, exc)

    def _flush_held(self) -> bool:
        """Send the held events, in order; False when the HWM stopped it (the rest stay held
        and go out when the socket is writable again, before anything else)."""
        held = self._held
        sock = self._sock
        if sock is None:
            return False  # they wait for the next connection
        sent = 0
        try:
            for message in held:
                sock.send(message)
                sent += 1
        except zmq.Again:
            del held[:sent]
            self._events_sent += sent
            return False
        except BaseException:
            del held[:sent]
            self._events_sent += sent
            raise
        self._events_sent += sent
        held.clear()
        if not self._drain_scheduled and sock.input_waiting():
            self._schedule_drain()
        return True

    async def _send(self, frames: list[Any], *, wait: bool = True,
                    deadline: float = float("inf")) -> None:
        """Send `[SIGNATURE, *frames]`; wait for the connection (when `wait`) and the HWM."""
        if wait and not self._is_connected:
            await self._connection(deadline)
        message = [_SIG, *frames]
        if not self._send_now(message):
            await self._send_blocked(message, deadline)
        self._sends += 1
        if self._sends % YIELD_EVERY == 0:
            await anyio.lowlevel.checkpoint()

    async def _connection(self, deadline: float) -> None:
        """Wait until connected (at most until `deadline`, monotonic), else raise HubLost."""
        with anyio.move_on_after(max(0.0, deadline - time.monotonic())):
            await self._wait_connected()
        if not self._is_connected:
            raise HubLost(f"not connected to the hub at {self.hub}", p.HUB_LOST)

    async def _send_blocked(self, message: list[Any], deadline: float) -> None:
        while True:
            if time.monotonic() >= deadline:
                raise DeadlineExceeded("send queue to the hub stayed full", p.DEADLINE)
            await self._wait_writable()
            if self._send_now(message):
                return

    async def _wait_writable(self) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._writable.append(waiter)
        with anyio.move_on_after(0.05):  # the edge may have been consumed elsewhere: re-check
            await waiter

    # --- requests ------------------------------------------------------------------------

    async def _start_call(self, service: str, body: bytes, timeout: float | None,
                          parent: str) -> _Call:
        req_id = f"{self.session}{next(self._ids):x}"
        now = time.monotonic()
        expires = now + timeout + REPLY_GRACE if timeout else float("inf")
        header = p.Header(kind=p.REQUEST, id=req_id, service=service,
                          deadline=time.time() + timeout if timeout else 0.0,
                          parent=parent, peer=self.peer_id, session=self.session)
        frames = [_SIG, p.encode(header), body]
        deadline = now + timeout if timeout else float("inf")
        if not self._is_connected:
            await self._connection(deadline)
        call = _Call(req_id, expires)
        self._pending[req_id] = call  # before sending: nothing can yield in between
        try:
            if not self._send_now(frames):
                await self._send_blocked(frames, deadline)
        except BaseException:
            self._pending.pop(req_id, None)
            raise
        return call

    def _end_call(self, call: _Call) -> None:
        if call.done:
            return
        self._pending.pop(call.id, None)
        if self._is_connected and self._sock is not None:
            try:
                self._send_now([_SIG, p.encode(p.Header(kind=p.CANCEL, id=call.id))])
            except zmq.ZMQError:
                pass

    @asynccontextmanager
    async def stream(
        self, service: str, body: bytes, *, timeout: float | None = 30.0, parent: str = ""
    ) -> AsyncIterator[AsyncIterator[bytes]]:
        """Send a request; iterate its partial replies; the iterator ends after the final reply.

        The final reply's body is yielded last. Leaving the block early (or being cancelled)
        cancels the request at the hub and at the serving peer.
        """
        call = await self._start_call(service, body, timeout, parent)
        try:
            yield _Replies(call, service, timeout)
        finally:
            self._end_call(call)

    async def request(self, service: str, body: bytes, *, timeout: float | None = 30.0,
                      parent: str = "") -> bytes:
        """Send a request and return the final reply body (partials are discarded)."""
        call = await self._start_call(service, body, timeout, parent)
        try:
            while True:
                header, frames = await call.get()
                kind = header.kind
                if kind == p.REPLY:
                    call.done = True
                    return frames[0] if frames else b""
                if kind == p.ERROR:
                    call.done = True
                    raise error_for(header.code, header.error or header.code)
        finally:
            self._end_call(call)

    async def status(self, timeout: float = 5.0) -> p.Status:
        return p.decode(await self.request(p.HUB_STATUS, b"", timeout=timeout), p.Status)

    # --- serving -------------------------------------------------------------------------

    async def serve(self, service: str, handler: Handler, *, capacity: int = 1,
                    idempotent: bool = False, meta: dict[str, Any] | None = None) -> None:
        """Register `handler` for `service`; it stays registered across hub restarts."""
        spec = p.ServiceSpec(service, capacity, idempotent, meta or {})
        self._services[service] = _Served(spec, handler)
        await self._send([p.encode(p.Header(kind=p.REGISTER)), p.encode(p.Register([spec]))])

    async def unserve(self, service: str) -> None:
        if self._services.pop(service, None) is not None:
            await self._send([p.encode(p.Header(kind=p.UNREGISTER)),
                              p.encode(p.Unregister([service]))])

    def _start_serving(self, header: p.Header, frames: list[bytes]) -> None:
        served = self._services.get(header.service)
        if served is None or self._tg is None or self._closing:
            self._count("unserved_requests")
            self._send_now([_SIG, _error_header(header.id, p.NO_SERVICE,
                                                f"`{header.service}` is not served here")])
            return
        req = IncomingRequest(header.id, header.service, header,
                              frames[2] if len(frames) > 2 else b"", header.deadline, self)
        self._serving[req.id] = req
        self._tg.start_soon(self._serve_one, served.handler, req, name=_SERVE_TASK)

    def _cancel_serving(self, req_id: str) -> None:
        """A CANCEL from the hub: stop that handler (its reply says `cancelled`)."""
        req = self._serving.get(req_id)
        if req is None or req.cancelled.is_set():
            return
        req.cancelled.set()
        req._scope.cancel()

    async def _serve_one(self, handler: Handler, req: IncomingRequest) -> None:
        """Run one handler in the peer's task group and send its one answer.

        Never raises but for the cancellation of the whole group (closing): an exception here
        would cancel every other task of the peer."""
        try:
            reply = await self._answer(handler, req)
            await self._send_reply(reply)
        finally:
            self._serving.pop(req.id, None)

    async def _answer(self, handler: Handler, req: IncomingRequest) -> list[bytes]:
        with req._scope:
            try:
                body = await handler(req)
                if not isinstance(body, _BYTES):  # sending it would raise in the reply path
                    raise TypeError(f"the handler returned {type(body).__name__}, "
                                    "expected bytes")
                return [_SIG, p.encode(p.Header(kind=p.REPLY, id=req.id)), body]
            except RequestError as exc:
                return [_SIG, _error_header(req.id, exc.code, str(exc))]
            except Exception as exc:
                log.exception("%s: handler for `%s` failed", self.name, req.service)
                return [_SIG, _error_header(req.id, p.HANDLER_ERROR,
                                            f"{type(exc).__name__}: {exc}")]
        # Only reached when the request's own scope caught its cancellation (a CANCEL): this
        # answer says why the handler stopped. (Closing cancels the task group instead, which
        # this scope does not catch: no answer, the hub reports the peer gone.)
        return [_SIG, _error_header(req.id, p.CANCELLED, "cancelled")]

    async def _send_reply(self, reply: list[bytes]) -> None:
        try:
            if self._sock is None:
                self._count("reply_lost")
                return
            if not self._send_now(reply):
                with anyio.move_on_after(5):
                    await self._send_blocked(reply, time.monotonic() + 5)
        except (HubLost, zmq.ZMQError):
            self._count("reply_lost")

    # --- events --------------------------------------------------------------------------

    async def publish(self, event: ev.Event, *, agent: str = "", run: str = "",
                      experiment: str = "", parent: str = "", confirm: bool = False) -> None:
        """Send an event; with `confirm`, return once the hub has logged it (`confirm()`)."""
        await self.publish_raw(ev.event_type(event), ev.encode_event(event), agent=agent, run=run,
                               experiment=experiment, parent=parent, confirm=confirm)

    async def publish_raw(self, type_: str, body: bytes, *, agent: str = "", run: str = "",
                          experiment: str = "", parent: str = "", confirm: bool = False) -> None:
        header = p.Header(kind=p.EVENT, id=f"{self.session}{next(self._ids):x}", type=type_,
                          agent=agent, run=run, experiment=experiment, parent=parent,
                          session=self.session)
        message = [_SIG, p.encode(header), body]
        if not self._hold(message):
            if not self._is_connected:
                await self._connection(float("inf"))
            if not self._send_now(message):
                await self._send_blocked(message, float("inf"))
            self._events_sent += 1
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
        try:
            head = await self._confirm_sent()
        finally:
            missing = self._unconfirmed + self.counters.get("events_refused", 0)
            lost = missing - self._unconfirmed_reported
            self._unconfirmed_reported = missing
        if lost:
            raise HubLost(f"{lost} events published since the last `confirm()` may be missing "
                          f"from the log of the hub at {self.hub}: their connection closed "
                          "before the hub confirmed them (counted in `events_unconfirmed`) or "
                          "the hub refused them (`events_refused`)", p.HUB_LOST)
        return head

    async def _confirm_sent(self) -> int:
        """One `hub.replay` round trip: its reply follows the events sent before it on the same
        socket, logged. (Held events are sent before the request, so they count too.)"""
        mark = self._events_sent + len(self._held)
        reply = await self.request(p.HUB_REPLAY, _CONFIRM_BODY, timeout=None)
        self._confirmed = max(self._confirmed, mark)
        return p.decode(reply, p.ReplayBatch).head

    def subscribe(self, topics: list[str] | tuple[str, ...] = (), *, since: int | None = None,
                  fill_gaps: bool = True) -> Subscription:
        """Live events matching any topic prefix (all when empty), optionally replayed from `since`."""
        return Subscription(self, list(topics), since, fill_gaps)


def _error_header(req_id: str, code: str, text: str) -> bytes:
    return p.encode(p.Header(kind=p.ERROR, id=req_id, code=code, error=text))


class Subscription:
    """Async iterator of `Envelope`s with no hole and no duplicate (see docs/protocol.md).

    With `since`, logged events after that seq are replayed first, then the stream continues
    live. Without topic filters, a jump in `seq` (a slow reader's dropped messages, or a loss
    at the tail noticed from the hub's heartbeat) is filled from the log when `fill_gaps`, or
    reported as a `Gap` event otherwise.
    """

    def __init__(self, peer: Peer, topics: list[str], since: int | None, fill_gaps: bool) -> None:
        self.peer = peer
        self.topics = topics
        self.since = since
        self.fill_gaps = fill_gaps
        self.last_seq = since if since is not None else -1
        self.filled = 0
        self.unknown = 0
        self._sock: zmq.Socket[Any] | None = None
        self._fdw: _FdWaiter | None = None
        self._backlog: deque[Envelope] = deque()
        self._held: list[bytes] | None = None

    async def __aenter__(self) -> Subscription:
        sock: zmq.Socket[Any] = zmq.Socket(self.peer.ctx, zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        if self.peer.curve is not None:
            self.peer.curve.apply(sock)
        for topic in self.topics or [""]:
            sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        if self.topics:
            sock.setsockopt(zmq.SUBSCRIBE, p.HEARTBEAT_TOPIC)
        sock.connect(self.peer.events_endpoint)
        self._sock = sock
        self._fdw = _FdWaiter(sock)
        self.peer._subs.add(self)
        try:
            await self._await_subscription()
            if self.since is not None:
                await self._replay_until(None)
        except BaseException:
            self._close()
            raise
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        self._close()

    def _close(self) -> None:
        fdw, self._fdw, self._sock = self._fdw, None, None
        if fdw is not None:
            fdw.close()

    async def _recv(self) -> list[bytes]:
        while True:
            sock, fdw = self._sock, self._fdw
            if sock is None or fdw is None:
                raise StopAsyncIteration
            try:
                return _recv_frames(sock)
            except zmq.Again:
                pass
            await fdw.wait()

    async def _await_subscription(self) -> None:
        """Hold the first live message: once one arrives the subscription is in place.

        The hub publishes a heartbeat (topic `hb`, carrying the latest seq) every heartbeat
        interval, so this takes at most about one interval.
        """
        interval = self.peer.welcome.heartbeat_interval if self.peer.welcome else 1.0
        with anyio.move_on_after(interval * 3):
            self._held = await self._recv()
            return
        log.warning("no message on %s within %.1fs; events before now may be missed",
                    self.peer.events_endpoint, interval * 3)

    async def _replay_until(self, until: int | None) -> None:
        """Queue logged events with last_seq < seq (< until, when given) on the backlog.

        Replay is finished only when a batch reaches the head it names (`upto >= head`) or
        `until`: a batch may end early (`replay_bytes`) or hold no matching event at all, and
        neither means "caught up". A range the log no longer holds is queued as a `Gap`."""
        cursor = max(self.last_seq, 0)
        stop = math.inf if until is None else until - 1  # the last seq wanted
        while cursor < stop:
            batch = await self._replay_batch(cursor)
            if batch.gap is not None:
                self._missed(batch.gap.first, min(batch.gap.last, stop), batch.gap.reason)
            self._queue_replayed(batch.events, stop)
            if batch.upto >= batch.head:
                cursor = batch.head
                break
            if batch.upto <= cursor:  # a hub that does not move on would loop us forever
                raise ProtocolError(f"`hub.replay` from {cursor} answered upto={batch.upto} "
                                    f"< head={batch.head} without progress")
            cursor = batch.upto
        # Everything up to the cursor has been seen in the log (filtered ones are not ours).
        self.last_seq = max(self.last_seq, min(cursor, stop))
        if until is not None and self.last_seq < stop:  # announced, yet not in the log
            self._missed(self.last_seq + 1, until - 1, "not in the hub's event log")

    async def _replay_batch(self, cursor: int) -> p.ReplayBatch:
        """One `hub.replay` round trip. It is idempotent, so a hub that is restarting (the
        peer is not welcomed yet) is asked again until REPLAY_RETRY_FOR has passed."""
        body = p.encode(p.ReplayRequest(since=cursor, topics=self.topics))
        give_up = time.monotonic() + REPLAY_RETRY_FOR
        while True:
            try:
                return p.decode(await self.peer.request(p.HUB_REPLAY, body), p.ReplayBatch)
            except (HubLost, Overloaded):
                if time.monotonic() >= give_up:
                    raise
            await anyio.sleep(0.05)  # backoff while the peer reconnects / the reader drains

    def _queue_replayed(self, events: list[tuple[bytes, bytes]], stop: float) -> None:
        for header_bytes, body in events:
            envelope = self._decode(header_bytes, body)
            if envelope is None:
                continue
            seq = envelope.header.seq
            if seq > stop:
                return
            if seq > self.last_seq:
                self._backlog.append(envelope)
                self.last_seq = seq

    def _missed(self, first: int, last: float, reason: str) -> None:
        """Queue a `Gap` for seqs the log no longer holds (never for what it can replay)."""
        first = max(first, self.last_seq + 1)
        if last < first:
            return
        gap = ev.Gap(first=first, last=int(last), reason=reason)
        self._backlog.append(Envelope(p.Header(kind=p.EVENT, type="gap", seq=0), gap))
        self.last_seq = int(last)

    def _decode(self, header_bytes: bytes, body: bytes) -> Envelope | None:
        try:
            header = p.decode_header(header_bytes)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.unknown += 1
            return None
        try:
            event = ev.decode_event(body)
        except (msgspec.DecodeError, msgspec.ValidationError):
            event = None
        if event is None:
            self.unknown += 1
            return None
        return Envelope(header, event)

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Envelope:
        while True:
            if self._backlog:
                return self._backlog.popleft()
            envelope = await self._next_live()
            if envelope is not None:
                return envelope

    async def _next_live(self) -> Envelope | None:
        frames = self._held
        if frames is not None:
            self._held = None
        else:
            frames = await self._recv()
        if len(frames) < 3 or frames[1] != p.SIGNATURE:
            self.unknown += 1
            return None
        if frames[0] == p.HEARTBEAT_TOPIC:
            try:
                hb = p.decode_header(frames[2])
            except (msgspec.DecodeError, msgspec.ValidationError):
                self.unknown += 1
                return None
            if self.last_seq < 0:
                self.last_seq = hb.seq
            elif not self.topics and hb.seq > self.last_seq:
                await self._on_gap(hb.seq + 1)
            return None
        if len(frames) != 4:
            self.unknown += 1
            return None
        try:
            header = p.decode_header(frames[2])
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.unknown += 1
            return None
        seq = header.seq
        if seq <= self.last_seq:
            return None  # already delivered by a replay
        if not self.topics and self.last_seq >= 0 and seq > self.last_seq + 1:
            await self._on_gap(seq)
            if seq <= self.last_seq:
                return None
        if not frames[3]:  # a stub: the body was too large for the live stream; read the log
            await self._replay_until(seq + 1)
            return None
        try:
            event = ev.decode_event(frames[3])
        except (msgspec.DecodeError, msgspec.ValidationError):
            event = None
        self.last_seq = seq
        if event is None:
            self.unknown += 1
            return None
        envelope = Envelope(header, event)
        if self._backlog:  # the gap's events go first
            self._backlog.append(envelope)
            return None
        return envelope

    async def _on_gap(self, next_seq: int) -> None:
        """Seqs last_seq+1 .. next_seq-1 were not seen: fill them from the log, or report them."""
        first = self.last_seq + 1
        if self.fill_gaps:
            before = len(self._backlog)
            await self._replay_until(next_seq)
            self.filled += len(self._backlog) - before
            return
        self._missed(first, next_seq - 1, "")


@asynccontextmanager
async def connect(hub: str | None = None, *, name: str = "client", role: str = "",
                  curve: CurveClient | None = None,
                  connect_timeout: float = CONNECT_TIMEOUT) -> AsyncIterator[Peer]:
    """Connect a peer to `hub` (default: $BUSCTL_HUB or tcp://127.0.0.1:7400)."""
    peer = Peer(hub or default_hub(), name=name, role=role, curve=curve,
                connect_timeout=connect_timeout)
    async with peer:
        yield peer
