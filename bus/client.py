"""The peer client: how every process (and every test) talks to the hub, on anyio/asyncio.

`async with connect(hub, name=...) as peer:` says hello, keeps heartbeats going both ways, and
reconnects (re-registering its services) when the hub restarts. One reader task owns the DEALER
socket's receive side; replies are matched to requests by id. Subscriptions use their own SUB
socket and are read by the consumer's task.
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec
import zmq
import zmq.asyncio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from bus import events as ev
from bus import protocol as p
from bus.errors import DeadlineExceeded, HubLost, HubUnreachable, RequestError, error_for
from bus.security import CurveClient

log = logging.getLogger("bus.client")

DEFAULT_HUB = "tcp://127.0.0.1:7400"
HUB_ENV = "BUSCTL_HUB"
CONNECT_TIMEOUT = 5.0
REPLY_GRACE = 1.0  # how long past a deadline we wait for the hub's own deadline error


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
    cancelled: anyio.Event = field(default_factory=anyio.Event)

    async def partial(self, body: bytes) -> None:
        await self._peer._send([p.encode(p.Header(kind=p.PARTIAL, id=self.id)), body])


Handler = Callable[[IncomingRequest], Awaitable[bytes]]


@dataclass(slots=True)
class _Served:
    spec: p.ServiceSpec
    handler: Handler


class Envelope(msgspec.Struct):
    """One event as a subscriber sees it: the stamped header and the decoded body."""

    header: p.Header
    event: ev.Event


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
    ) -> None:
        self.hub = hub
        self.name = name
        self.role = role
        self.curve = curve
        self.connect_timeout = connect_timeout
        self.session = p.new_session()
        self.welcome: p.Welcome | None = None
        self.ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._connected = anyio.Event()
        self._lost = anyio.Event()
        self._closing = False
        self._last_heard = time.monotonic()
        self._pending: dict[str, MemoryObjectSendStream[tuple[p.Header, list[bytes]]]] = {}
        self._services: dict[str, _Served] = {}
        self._serving: dict[str, tuple[IncomingRequest, anyio.CancelScope]] = {}
        self._tg: anyio.abc.TaskGroup | None = None
        self.counters: dict[str, int] = {}

    @property
    def peer_id(self) -> str:
        return self.welcome.peer if self.welcome else ""

    @property
    def events_endpoint(self) -> str:
        if self.welcome is None:
            raise HubUnreachable(f"not connected to the hub at {self.hub}")
        return self.welcome.events

    # --- lifecycle -----------------------------------------------------------------------

    async def __aenter__(self) -> Peer:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._connection_loop)
        with anyio.move_on_after(self.connect_timeout):
            await self._connected.wait()
        if not self._connected.is_set():
            await self.aclose()
            raise HubUnreachable(
                f"no answer from the hub at {self.hub} within {self.connect_timeout:g}s "
                f"(is `busctl up` or `busctl hub` running there? set --hub or {HUB_ENV})"
            )
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._closing:
            return
        self._closing = True
        with anyio.move_on_after(1, shield=True):
            if self._sock is not None and self._connected.is_set():
                try:
                    await self._sock.send_multipart(
                        [p.SIGNATURE, p.encode(p.Header(kind=p.BYE))], flags=zmq.NOBLOCK
                    )
                except zmq.ZMQError:
                    pass
        self._fail_pending(HubLost("peer closed", p.HUB_LOST))
        if self._tg is not None:
            self._tg.cancel_scope.cancel()
            await self._tg.__aexit__(None, None, None)
        if self._sock is not None:
            self._sock.close(linger=0)
        self.ctx.term()

    # --- connection ----------------------------------------------------------------------

    async def _connection_loop(self) -> None:
        backoff = 0.05
        while not self._closing:
            self._lost = anyio.Event()
            sock = self._new_socket()
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._reader, sock)
                    tg.start_soon(self._heartbeat, sock)
                    await self._send_on(sock, [p.encode(p.Header(kind=p.HELLO, id=p.new_id())),
                                               p.encode(self._hello())])
                    await self._lost.wait()
                    tg.cancel_scope.cancel()
            finally:
                was_connected = self._connected.is_set()
                self._connected = anyio.Event()
                self.welcome = None if not self._closing else self.welcome
                sock.close(linger=0)
                self._sock = None
                if was_connected:
                    self._fail_pending(HubLost(f"lost the hub at {self.hub}", p.HUB_LOST))
            await anyio.sleep(backoff * (0.5 + random.random()))
            backoff = min(backoff * 2, 2.0)

    def _new_socket(self) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        if self.curve is not None:
            self.curve.apply(sock)
        sock.connect(self.hub)
        self._sock = sock
        self._last_heard = time.monotonic()
        return sock

    def _hello(self) -> p.Hello:
        return p.Hello(name=self.name, session=self.session, pid=os.getpid(), host=p.hostname(),
                       role=self.role)

    async def _heartbeat(self, sock: zmq.asyncio.Socket) -> None:
        interval = 1.0
        hb = [p.encode(p.Header(kind=p.HEARTBEAT))]
        while True:
            if self.welcome is not None:
                interval = self.welcome.heartbeat_interval
                expiry = interval * self.welcome.liveness
            else:
                expiry = max(3.0, interval * 3)
            await anyio.sleep(interval if self.welcome else 0.25)
            if time.monotonic() - self._last_heard > expiry:
                log.warning("%s: no word from the hub at %s for %.1fs; reconnecting", self.name,
                            self.hub, expiry)
                self._lost.set()
                return
            if self._connected.is_set():
                await self._send_on(sock, hb)

    async def _reader(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            self._last_heard = time.monotonic()
            try:
                await self._dispatch(frames)
            except (msgspec.DecodeError, msgspec.ValidationError, IndexError) as exc:
                self._count("malformed")
                log.warning("%s: dropped a malformed message from the hub: %s", self.name, exc)

    async def _dispatch(self, frames: list[bytes]) -> None:
        if len(frames) < 2 or frames[0] != p.SIGNATURE:
            self._count("malformed")
            return
        header = p.decode_header(frames[1])
        kind = header.kind
        if kind in (p.REPLY, p.PARTIAL, p.ERROR):
            stream = self._pending.get(header.id)
            if stream is None:
                self._count("stale_replies")
                return
            stream.send_nowait((header, frames[2:]))
        elif kind == p.REQUEST:
            self._start_serving(header, frames)
        elif kind == p.CANCEL:
            entry = self._serving.get(header.id)
            if entry is not None:
                entry[0].cancelled.set()
                entry[1].cancel()
        elif kind == p.WELCOME:
            await self._on_welcome(p.decode(frames[2], p.Welcome))
        elif kind == p.RECONNECT:
            self._lost.set()
        elif kind != p.HEARTBEAT:
            self._count("unknown_kind")

    async def _on_welcome(self, welcome: p.Welcome) -> None:
        self.welcome = welcome
        if self._services:
            await self._send([p.encode(p.Header(kind=p.REGISTER)),
                              p.encode(p.Register([s.spec for s in self._services.values()]))],
                             wait=False)
        self._connected.set()

    def _fail_pending(self, error: RequestError) -> None:
        for req_id, stream in list(self._pending.items()):
            header = p.Header(kind=p.ERROR, id=req_id, code=error.code, error=str(error))
            try:
                stream.send_nowait((header, []))
            except (anyio.WouldBlock, anyio.ClosedResourceError, anyio.BrokenResourceError):
                pass

    def _count(self, name: str) -> None:
        self.counters[name] = self.counters.get(name, 0) + 1

    # --- sending -------------------------------------------------------------------------

    async def _send(self, frames: list[Any], *, wait: bool = True) -> None:
        if wait and not self._connected.is_set():
            await self._connected.wait()
        sock = self._sock
        if sock is None:
            raise HubLost(f"not connected to the hub at {self.hub}", p.HUB_LOST)
        await self._send_on(sock, frames)

    @staticmethod
    async def _send_on(sock: zmq.asyncio.Socket, frames: list[Any]) -> None:
        await sock.send_multipart([p.SIGNATURE, *frames])

    # --- requests ------------------------------------------------------------------------

    @asynccontextmanager
    async def stream(
        self, service: str, body: bytes, *, timeout: float | None = 30.0, parent: str = ""
    ) -> AsyncIterator[AsyncIterator[bytes]]:
        """Send a request; iterate its partial replies; the iterator ends after the final reply.

        The final reply's body is yielded last. Leaving the block early cancels the request.
        """
        req_id = p.new_id()
        send, receive = anyio.create_memory_object_stream[tuple[p.Header, list[bytes]]](math.inf)
        self._pending[req_id] = send
        deadline = time.time() + timeout if timeout else 0.0
        header = p.Header(kind=p.REQUEST, id=req_id, service=service, deadline=deadline,
                          parent=parent, peer=self.peer_id, session=self.session)
        finished = False
        try:
            with anyio.fail_after(timeout + REPLY_GRACE if timeout else None):
                await self._send([p.encode(header), body])

            async def replies() -> AsyncIterator[bytes]:
                nonlocal finished
                async for reply_header, frames in _with_deadline(receive, timeout):
                    if reply_header.kind == p.ERROR:
                        finished = True
                        raise error_for(reply_header.code, reply_header.error or reply_header.code)
                    if reply_header.kind == p.REPLY:
                        finished = True
                    yield frames[0] if frames else b""
                    if finished:
                        return

            try:
                yield replies()
            except TimeoutError:
                raise DeadlineExceeded(
                    f"no reply from `{service}` within {timeout:g}s", p.DEADLINE
                ) from None
        finally:
            self._pending.pop(req_id, None)
            send.close()
            receive.close()
            if not finished and self._connected.is_set() and self._sock is not None:
                with anyio.CancelScope(shield=True):
                    try:
                        await self._send_on(self._sock,
                                            [p.encode(p.Header(kind=p.CANCEL, id=req_id))])
                    except zmq.ZMQError:
                        pass

    async def request(self, service: str, body: bytes, *, timeout: float | None = 30.0,
                      parent: str = "") -> bytes:
        """Send a request and return the final reply body (partials are discarded)."""
        last = b""
        async with self.stream(service, body, timeout=timeout, parent=parent) as replies:
            async for last in replies:
                pass
        return last

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
        if served is None or self._tg is None:
            self._count("unserved_requests")
            self._tg_send_error(header.id, p.NO_SERVICE, f"`{header.service}` is not served here")
            return
        req = IncomingRequest(header.id, header.service, header, frames[2] if len(frames) > 2
                              else b"", header.deadline, self)
        self._tg.start_soon(self._serve_one, served.handler, req)

    def _tg_send_error(self, req_id: str, code: str, text: str) -> None:
        if self._tg is not None:
            frames = [p.encode(p.Header(kind=p.ERROR, id=req_id, code=code, error=text))]
            self._tg.start_soon(self._send, frames)

    async def _serve_one(self, handler: Handler, req: IncomingRequest) -> None:
        scope = anyio.CancelScope()
        self._serving[req.id] = (req, scope)
        reply: list[bytes]
        try:
            with scope:
                try:
                    body = await handler(req)
                    reply = [p.encode(p.Header(kind=p.REPLY, id=req.id)), body]
                except RequestError as exc:
                    reply = [_error_header(req.id, exc.code, str(exc))]
                except Exception as exc:
                    log.exception("%s: handler for `%s` failed", self.name, req.service)
                    reply = [_error_header(req.id, p.HANDLER_ERROR, f"{type(exc).__name__}: {exc}")]
            if scope.cancelled_caught:
                reply = [_error_header(req.id, p.CANCELLED, "cancelled")]
            with anyio.CancelScope(shield=True):
                await self._send(reply, wait=False)
        except (HubLost, zmq.ZMQError):
            self._count("reply_lost")
        finally:
            self._serving.pop(req.id, None)

    # --- events --------------------------------------------------------------------------

    async def publish(self, event: ev.Event, *, agent: str = "", run: str = "",
                      experiment: str = "", parent: str = "") -> None:
        await self.publish_raw(ev.event_type(event), ev.encode_event(event), agent=agent, run=run,
                               experiment=experiment, parent=parent)

    async def publish_raw(self, type_: str, body: bytes, *, agent: str = "", run: str = "",
                          experiment: str = "", parent: str = "") -> None:
        header = p.Header(kind=p.EVENT, id=p.new_id(), type=type_, agent=agent, run=run,
                          experiment=experiment, parent=parent, session=self.session)
        await self._send([p.encode(header), body])

    def subscribe(self, topics: list[str] | tuple[str, ...] = (), *, since: int | None = None,
                  fill_gaps: bool = True) -> Subscription:
        """Live events matching any topic prefix (all when empty), optionally replayed from `since`."""
        return Subscription(self, list(topics), since, fill_gaps)


def _error_header(req_id: str, code: str, text: str) -> bytes:
    return p.encode(p.Header(kind=p.ERROR, id=req_id, code=code, error=text))


async def _with_deadline(
    receive: MemoryObjectReceiveStream[tuple[p.Header, list[bytes]]], timeout: float | None
) -> AsyncIterator[tuple[p.Header, list[bytes]]]:
    deadline = time.monotonic() + timeout + REPLY_GRACE if timeout else math.inf
    while True:
        with anyio.fail_after(None if deadline == math.inf else max(0, deadline - time.monotonic())):
            item = await receive.receive()
        yield item


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
        self._sock: zmq.asyncio.Socket | None = None
        self._backlog: list[Envelope] = []
        self._pending_first: list[bytes] | None = None

    async def __aenter__(self) -> Subscription:
        sock = self.peer.ctx.socket(zmq.SUB)
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
        await self._await_subscription()
        if self.since is not None:
            await self._replay_until(None)
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    async def _await_subscription(self) -> None:
        """Hold the first live message: once one arrives the subscription is in place."""
        assert self._sock is not None
        interval = self.peer.welcome.heartbeat_interval if self.peer.welcome else 1.0
        with anyio.move_on_after(interval * 3):
            frames = await self._sock.recv_multipart()
            self._pending_first = frames
            return
        self._pending_first = None

    async def _replay_until(self, until: int | None) -> None:
        """Append logged events after last_seq (and before `until`) to the backlog."""
        cursor = max(self.last_seq, 0)
        while True:
            request = p.ReplayRequest(since=cursor, topics=self.topics)
            batch = p.decode(await self.peer.request(p.HUB_REPLAY, p.encode(request)),
                             p.ReplayBatch)
            for header_bytes, body in batch.events:
                envelope = self._decode(header_bytes, body)
                if envelope is None:
                    continue
                if until is not None and envelope.header.seq >= until:
                    return
                self._backlog.append(envelope)
                self.last_seq = envelope.header.seq
            cursor = batch.upto
            if until is not None and cursor >= until - 1:
                self.last_seq = until - 1
                return
            if cursor >= batch.head:
                self.last_seq = max(self.last_seq, cursor) if until is None else self.last_seq
                return

    def _decode(self, header_bytes: bytes, body: bytes) -> Envelope | None:
        try:
            header = p.decode_header(header_bytes)
            event = ev.decode_event(body)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.unknown += 1
            return None
        if event is None:
            self.unknown += 1
            return None
        return Envelope(header, event)

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Envelope:
        while True:
            if self._backlog:
                return self._backlog.pop(0)
            envelope = await self._next_live()
            if envelope is not None:
                return envelope

    async def _next_live(self) -> Envelope | None:
        if self._sock is None:
            raise StopAsyncIteration
        frames = self._pending_first
        if frames is not None:
            self._pending_first = None
        else:
            frames = await self._sock.recv_multipart()
        if len(frames) < 3 or frames[1] != p.SIGNATURE:
            self.unknown += 1
            return None
        if frames[0] == p.HEARTBEAT_TOPIC:
            hb = p.decode_header(frames[2])
            if not self.topics and self.last_seq >= 0 and hb.seq > self.last_seq:
                await self._on_gap(hb.seq + 1)
            elif self.last_seq < 0:
                self.last_seq = hb.seq
            return None
        if len(frames) != 4:
            self.unknown += 1
            return None
        envelope = self._decode(frames[2], frames[3])
        if envelope is None:
            return None
        seq = envelope.header.seq
        if seq <= self.last_seq:
            return None  # already delivered by a replay
        if not self.topics and self.last_seq >= 0 and seq > self.last_seq + 1:
            await self._on_gap(seq)
            self._backlog.append(envelope)
            self.last_seq = seq
            return None
        self.last_seq = seq
        return envelope

    async def _on_gap(self, next_seq: int) -> None:
        first = self.last_seq + 1
        if self.fill_gaps:
            before = len(self._backlog)
            await self._replay_until(next_seq)
            self.filled += len(self._backlog) - before
            return
        self._backlog.append(Envelope(p.Header(kind=p.EVENT, type="gap", seq=0),
                                      ev.Gap(first=first, last=next_seq - 1)))
        self.last_seq = next_seq - 1


@asynccontextmanager
async def connect(hub: str | None = None, *, name: str = "client", role: str = "",
                  curve: CurveClient | None = None,
                  connect_timeout: float = CONNECT_TIMEOUT) -> AsyncIterator[Peer]:
    """Connect a peer to `hub` (default: $BUSCTL_HUB or tcp://127.0.0.1:7400)."""
    peer = Peer(hub or default_hub(), name=name, role=role, curve=curve,
                connect_timeout=connect_timeout)
    async with peer:
        yield peer
