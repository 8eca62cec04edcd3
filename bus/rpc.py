"""Requests this peer makes: the call map (id -> outstanding call), fed by the peer's one reader.

A request's replies (partials, then one `reply` or `error`) are queued on its `Call` by the
reader (`Calls.deliver`, synchronous, no task per message) and taken by the requesting task.
Leaving a request early sends a `cancel`. Calls past their deadline plus a grace period are
failed locally (`expire`) in case the hub's own deadline error never comes; every call fails
with `HubLost` when the connection is lost (`on_lost`) but, for a peer with other hub
endpoints to go to, a keyed one (an idempotency key, docs/protocol.md section 5, "Following the
hub"): it keeps its frames and is sent again, as it was, after the next welcome (`resend`),
failing `hub_lost` when none comes within RESEND_WAIT. The server answers a repeat of the key from the first
run (bus/keyed.py), re-sending every partial from the start: the call skips the ones it has
already delivered, so its requester sees each once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import zmq

from agent_bus.bus import protocol as p
from agent_bus.bus.errors import HubLost, RequestError, error_for

if TYPE_CHECKING:
    from agent_bus.bus.link import PeerLink

log = logging.getLogger("bus.client")

# How long a keyed call kept across the loss of its hub waits for the next welcome (a
# standby's takeover: its lease lapsing, then the silence window and a round trip per endpoint)
# before it fails `hub_lost` after all; its own deadline still applies when sooner.
RESEND_WAIT = 30.0

REPLY_GRACE = 1.0  # how long past a deadline we wait for the hub's own deadline error
_SIG = p.SIGNATURE

# A lone request (nothing else in flight) to a service whose lone round trips have taken at
# most SPIN_MAX waits for its reply by polling the socket, yielding the CPU between looks
# (`Calls._spin`), for up to twice that service's usual round trip (at most SPIN_MAX), and only
# then through the event loop. On this 2-core VM a wake-up from epoll through the loop is much
# of a short round trip: polling took the lone round trip to 0.73-0.83x (bench/ab_bus.py);
# polling without yielding took it to 1.59x (the poller kept the hub and the server off the
# CPU). A request to a slower service (a model call) never polls: its process stays asleep. Nor
# does a `hub.replay` (a subscriber's gap fill, a publish confirmation): its answer may come
# from the hub's idle-priority reader, which a poller would keep off a CPU.
SPIN_MAX = 0.0005  # s
SPIN_SMOOTHING = 0.25  # weight of the newest lone round trip in a service's running estimate
_sched_yield = getattr(os, "sched_yield", lambda: None)


def _fresh_partials(call: Call, frames: list[bytes]) -> bool:
    """A keyed call's `partial` message: drop the bodies a repeat's answer re-sent that were
    delivered before it (`call.skip`), count the rest; False when none is left."""
    bodies = len(frames) - 2
    if call.skip:
        dropped = min(call.skip, bodies)
        call.skip -= dropped
        del frames[2:2 + dropped]
        bodies -= dropped
    call.seen += bodies
    return bodies > 0


class Call:
    """One outstanding request: replies queue here until its task takes them (no stream object)."""

    __slots__ = ("id", "items", "waiter", "expires", "done", "frames", "seen", "skip", "held")

    def __init__(self, req_id: str, expires: float, frames: list[Any] | None = None) -> None:
        self.id = req_id
        self.items: deque[tuple[p.Header, list[bytes]]] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.expires = expires  # monotonic; inf when none
        self.done = False  # a final reply (or error) was taken
        # A keyed request's message, sent again on the next hub (None: not keyed, fails with
        # the connection); with the partial bodies delivered so far, and those of the repeat's
        # answer still to skip (the server re-sends them all).
        self.frames = frames
        if frames is not None:  # (only then read: an unkeyed call costs one slot more)
            self.seen = 0
            self.skip = 0
            self.held: float | None = None  # kept across a loss: its own `expires` meanwhile

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

    async def final(self) -> bytes:
        """The final reply's body (partials are skipped); a final `error` is raised.

        (`get` inlined: one coroutine frame less to resume per reply on the request path.)"""
        items = self.items
        while True:
            while not items:
                waiter = self.waiter = asyncio.get_running_loop().create_future()
                try:
                    await waiter
                finally:
                    self.waiter = None
            header, frames = items.popleft()
            kind = header.kind
            if kind == p.REPLY:
                self.done = True
                return frames[0] if frames else b""
            if kind == p.ERROR:
                self.done = True
                raise error_for(header.code, header.error or header.code)


class Replies:
    """The iterator `Peer.stream` yields: partial bodies, then the final reply body.

    A `partial` message may carry several bodies, one frame each (a server sends the partials
    of one event-loop iteration together): each is yielded in turn. After the final reply,
    `served_by` is the peer id of the server that sent it ("" when it did not say: a server
    from before the reply's `peer`), to `prefer` it for a later request."""

    def __init__(self, call: Call) -> None:
        self._call = call
        self._rest: deque[bytes] = deque()  # further bodies of the last `partial` message
        self.served_by = ""

    def __aiter__(self) -> Replies:
        return self

    async def __anext__(self) -> bytes:
        rest = self._rest
        if rest:
            return rest.popleft()
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
            self.served_by = header.peer
        elif len(frames) > 1:
            rest.extend(frames[1:])
        return frames[0] if frames else b""


class Calls:
    """The requests `peer` has in flight, keyed by id (ids are its session plus a counter)."""

    def __init__(self, peer: PeerLink) -> None:
        self._peer = peer
        self.pending: dict[str, Call] = {}
        self._ids = itertools.count(1)
        self._round_trips: dict[str, float] = {}  # service -> its lone round trip's estimate, s

    def new_id(self) -> str:
        return f"{self._peer.session}{next(self._ids):x}"

    def deliver(self, header: p.Header, frames: list[bytes]) -> bool:
        """Queue a reply, partial or error on its call (False: no such call)."""
        call = self.pending.get(header.id)
        if call is None:
            return False
        if header.kind != p.PARTIAL:
            del self.pending[header.id]
        elif call.frames is not None and not _fresh_partials(call, frames):
            return True  # every body already delivered before the re-send
        call.put((header, frames[2:]))
        return True

    def on_lost(self, error: RequestError, *, keep: bool) -> None:
        """The connection is gone: fail every call but, with `keep` (the peer has other hub
        endpoints to go to), the keyed ones, which wait for the next welcome (`resend`) at most
        RESEND_WAIT, or until their deadline when sooner (`expire`)."""
        pending = self.pending
        if not pending:
            return
        kept = {i: c for i, c in pending.items() if c.frames is not None} if keep else {}
        if len(kept) < len(pending):
            self.pending = {i: c for i, c in pending.items() if i not in kept}
            self.fail_all(error)
            self.pending = kept
        wait_until = time.monotonic() + RESEND_WAIT
        for call in kept.values():
            if call.held is None:
                call.held = call.expires
                call.expires = min(call.expires, wait_until)

    def resend(self) -> None:
        """After a welcome: send each kept keyed call again, the same message (its id, key and
        deadline); the hub stamps who sent it. A full send queue (right after connecting: not
        expected) leaves the call to its deadline."""
        peer = self._peer
        for call in list(self.pending.values()):
            if call.frames is None:
                continue
            call.skip = call.seen
            if call.held is not None:
                call.expires, call.held = call.held, None
            peer.count("requests_resent")
            try:
                if not peer.send_now(call.frames):
                    log.warning("%s: could not re-send request %s (send queue full)",
                                peer.name, call.id)
            except (HubLost, zmq.ZMQError):
                return  # lost again meanwhile: the next welcome re-sends

    def expire(self, now: float) -> None:
        """Fail calls past deadline + grace (the hub normally answers at the deadline itself).

        A scan of the calls in flight (bounded by the caller's concurrency) rather than a heap
        of every request ever sent, which would hold each one until its deadline."""
        if not self.pending:
            return
        expired = [call for call in self.pending.values() if call.expires <= now]
        for call in expired:
            del self.pending[call.id]
            if call.frames is not None and call.held is not None and call.held > now:
                # still waiting for a hub
                call.put((p.Header(kind=p.ERROR, id=call.id, code=p.HUB_LOST,
                                   error=f"lost the hub at {self._peer.hub} and no other hub "
                                         f"took the request within {RESEND_WAIT:g}s"), []))
                continue
            call.put((p.Header(kind=p.ERROR, id=call.id, code=p.DEADLINE,
                               error="no reply before the deadline"), []))

    def first_expiry(self) -> float:
        """When the first call in flight expires (monotonic; inf when none does)."""
        return min((call.expires for call in self.pending.values()), default=float("inf"))

    def fail_all(self, error: RequestError) -> None:
        pending, self.pending = self.pending, {}
        for req_id, call in pending.items():
            call.put((p.Header(kind=p.ERROR, id=req_id, code=error.code, error=str(error)), []))

    async def start(self, service: str, body: bytes, timeout: float | None, parent: str,
                    prefer: str = "", wait: float = 0.0, key: str = "") -> Call:
        call = self.begin(service, body, timeout, parent, prefer, wait, key)
        if isinstance(call, Call):
            return call
        return await self._start_waiting(*call)

    def begin(self, service: str, body: bytes, timeout: float | None, parent: str,
              prefer: str = "", wait: float = 0.0, key: str = ""
              ) -> Call | tuple[str, float, float, list[Any], bool]:
        """Send the request now when the peer is welcomed and the socket takes it (its `Call`);
        else what `_start_waiting` needs to wait for the connection or room, then send it.
        (Synchronous: a request that goes out at once costs no coroutine of its own.)"""
        peer = self._peer
        req_id = self.new_id()
        now = time.monotonic()
        expires = now + timeout + REPLY_GRACE if timeout else float("inf")
        header = p.Header(kind=p.REQUEST, id=req_id, service=service,
                          deadline=time.time() + timeout if timeout else 0.0,
                          parent=parent, peer=peer.peer_id, session=peer.session, prefer=prefer,
                          wait=wait, key=key)
        frames = [_SIG, p.encode(header), body]
        deadline = now + timeout if timeout else float("inf")
        if peer.welcome is not None:
            pending = self.pending
            call = Call(req_id, expires, frames if key else None)
            pending[req_id] = call  # before sending: the reply is read after it
            try:
                # Behind held messages (a turn's events), or beside other calls in flight (the
                # callers woken by one drain's replies send their next requests in the same
                # loop iteration), the request is held and goes out with the others at the
                # end of this iteration: the parallel tool calls of a turn, or a burst of
                # requests, reach the hub back to back (one wake-up of ZeroMQ's I/O thread and
                # of the hub), not one send each between the callers' Python (measured with
                # 256 in flight: 11% less CPU at the requester, 1-4% at the hub). A lone
                # request goes at once: a round trip waits for no loop pass.
                sent = ((bool(peer.outbox.items) or len(pending) > 1) and peer.hold(frames)
                        or peer.send_now(frames))
            except BaseException:
                pending.pop(req_id, None)
                raise
            if sent:
                return call
            pending.pop(req_id, None)
        return req_id, expires, deadline, frames, bool(key)

    async def _start_waiting(self, req_id: str, expires: float, deadline: float,
                             frames: list[Any], keyed: bool) -> Call:
        """Wait for the connection, then send (waiting for room at the HWM)."""
        peer = self._peer
        if peer.welcome is None:
            await peer.wait_connection(deadline)
        call = Call(req_id, expires, frames if keyed else None)
        self.pending[req_id] = call  # before sending: nothing can yield in between
        try:
            if not peer.send_now(frames):
                await peer.send_blocked(frames, deadline)
        except BaseException:
            self.pending.pop(req_id, None)
            raise
        return call

    def end(self, call: Call) -> None:
        """The requester is done with `call`: unless it was answered, cancel it at the hub."""
        if call.done:
            return
        self.pending.pop(call.id, None)
        peer = self._peer
        if peer.welcome is not None and peer.sock is not None:
            try:
                peer.send_now([_SIG, p.encode(p.Header(kind=p.CANCEL, id=call.id))])
            except zmq.ZMQError:
                pass

    async def request(self, service: str, body: bytes, timeout: float | None, parent: str,
                      prefer: str = "", wait: float = 0.0, key: str = "") -> bytes:
        lone = not self.pending
        started = time.perf_counter()
        call = self.begin(service, body, timeout, parent, prefer, wait, key)
        if not isinstance(call, Call):
            call, lone = await self._start_waiting(*call), False
        try:
            if lone and self._polls(service):
                # What is ready runs first (a burst's other requests: then this one is not
                # lone, and the loop must not stop for it); the reply is polled for after.
                await asyncio.sleep(0)
                lone = len(self.pending) == 1
                if lone and not self._spin(call, service):
                    # No reply within the poll (a slow moment, or its server is on this loop,
                    # which the poll kept from running): a few lone round trips without it.
                    self._round_trips[service] = 2 * SPIN_MAX
            reply = await call.final()
        finally:
            self.end(call)
        if lone:
            self._learn(service, time.perf_counter() - started)
        return reply

    def _polls(self, service: str) -> bool:
        """Whether a lone request to `service` polls for its reply (see SPIN_MAX)."""
        usual = self._round_trips.get(service)
        return (usual is None or usual <= SPIN_MAX) and service != p.HUB_REPLAY

    def _spin(self, call: Call, service: str) -> bool:
        """Poll for `call`'s reply for up to twice `service`'s usual lone round trip (at most
        SPIN_MAX); the reader's `drain` queues it on the call. False: polled in vain."""
        sock = self._peer.sock
        if sock is None:
            return True
        usual = self._round_trips.get(service)
        end = time.perf_counter() + (SPIN_MAX if usual is None else min(SPIN_MAX, 2 * usual))
        try:
            while not call.items:
                if sock.input_waiting():
                    self._peer.drain()
                elif time.perf_counter() >= end:
                    return False
                else:
                    _sched_yield()
        except zmq.ZMQError:  # the socket closed under a drain (a reconnect): the loop goes on
            pass
        return True

    def _learn(self, service: str, took: float) -> None:
        usual = self._round_trips.get(service)
        self._round_trips[service] = (took if usual is None
                                      else usual + SPIN_SMOOTHING * (took - usual))

    @asynccontextmanager
    async def stream(self, service: str, body: bytes, timeout: float | None, parent: str,
                     prefer: str = "", wait: float = 0.0, key: str = "") -> AsyncIterator[Replies]:
        call = await self.start(service, body, timeout, parent, prefer, wait, key)
        try:
            yield Replies(call)
        finally:
            self.end(call)
