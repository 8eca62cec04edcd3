"""Requests this peer serves: registered handlers, exactly one answer per request; an `async def`
handler's request in a task of its own, inside its own cancel scope.

A handler that is a plain function (not `async def`) is called at once, in the reader, and its
answer sent from there: no task, no scope (nothing can cancel a call that ends before the next
message is read). That saves about 20 us of the ~22 us of Python a served request costs, and
the loop pass the task would wait for; it suits handlers that answer from memory (an echo, a
lookup). One that returns an awaitable is awaited in a task as an `async def` handler is.

A `cancel` from the hub (the requester left, or the deadline passed) cancels that request's
scope; the handler's answer is then `error/cancelled`. A scope and not `Task.cancel()`: anyio
re-delivers a scope's cancellation at every checkpoint until the scope exits, where a native
cancel can be swallowed by an anyio scope the handler is in (a shell tool then keeps running and
no answer goes out). Closing the peer cancels every request's scope and waits for the handlers
to end (`Serving.close`): no answer, the hub reports the peer gone.

Each request runs in a plain asyncio task (not a task group's: anyio's `start_soon` costs about
12 us more per request, a third of a served request's CPU in the echo benchmark); the tasks are
found through `in_service`, which holds every request whose task has not ended.

An answer goes out at once when nothing is held (`Peer.hold`, bus/outbox.py); otherwise, like
partial replies, it is held behind what is and goes out at the end of the event-loop iteration.
Partials of one request held meanwhile become one `partial` message with one body frame each, in
order (docs/protocol.md §4): a model's streamed deltas parsed from one read cost one message
through the hub instead of one each.

A keyed request (an idempotency key: a requester re-sends it on the next hub when it lost the
hub) of a service not registered `idempotent` is looked up in this process's `KeyWindow`
(bus/keyed.py): a repeat attaches to the run of its key, or is answered from it, and never runs
the handler twice here. Its answers are recorded and sent to every id attached; one that cannot
be sent (the hub is gone) is counted `reply_lost` and waits in the window for the repeat. An
idempotent service's keyed request simply runs again. A request without a key costs one
attribute test more.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import anyio
import zmq

from agent_bus.bus import protocol as p
from agent_bus.bus.errors import HubLost, RegisterRefused, RequestError
from agent_bus.bus.keyed import Final, Keyed, KeyWindow
from agent_bus.bus.ledger import CONFIRM_BODY

if TYPE_CHECKING:
    from agent_bus.bus.link import PeerLink

log = logging.getLogger("bus.client")

_SIG = p.SIGNATURE
_BYTES = (bytes, bytearray, memoryview)
REPLY_SEND_TIMEOUT = 5.0  # how long an answer waits for room in a full send queue
# Error code: the answer (or a partial) is over the hub's `max_message_bytes`. Sent instead of
# it: the hub drops the connection of a peer that sends a bigger message, and with it every
# request that peer serves.
TOO_LARGE = "too_large"
HEADER_ROOM = 4096  # of `max_message_bytes`, left for the signature and header frames


@dataclass(slots=True)
class IncomingRequest:
    """A request this peer serves. Reply by returning bytes from the handler; stream with `partial`."""

    id: str
    service: str
    header: p.Header
    body: bytes
    deadline: float  # unix time; 0 when none
    _peer: PeerLink
    # Cancelled on a CANCEL from the hub. Made before the handler's task starts, so a CANCEL
    # that arrives first still lands: the scope is entered already cancelled. None for a plain
    # function's call, which ends before a CANCEL can be read.
    _scope: anyio.CancelScope | None = None
    _cancelled: anyio.Event | None = None
    # The `partial` message of this request still held by the peer (more bodies join it while
    # the peer's `outbox.gen` is the one it was held under), else None.
    _held_partial: list[Any] | None = None
    _held_gen: int = -1
    _held_bytes: int = 0  # of its bodies: one message stays under the hub's limit
    _task: asyncio.Task[None] | None = None  # the task serving it (`Serving.close` waits for it)
    # A keyed request's entry in the window (bus/keyed.py): its answers go to every id there.
    _keyed: Keyed | None = None
    _window: KeyWindow | None = None

    @property
    def cancelled(self) -> anyio.Event:
        """Set when the requester (or the hub, at the deadline) cancels this request."""
        if self._cancelled is None:  # made on first use: most requests never look
            self._cancelled = anyio.Event()
        return self._cancelled

    async def partial(self, body: bytes) -> None:
        """Send a partial reply: held up to `EVENT_LINGER` (2 ms), together with the request's
        other partials meanwhile (one message, a body frame each), for the next send to take
        it along: a fast stream's partials then reach the requester with its reply, one wake-up
        of the hub and of the requester instead of two."""
        peer = self._peer
        limit = body_limit(peer)
        if limit and len(body) > limit:
            raise RequestError(_too_large("a partial answer", self.service, len(body), limit),
                               TOO_LARGE)
        keyed = self._keyed
        if keyed is not None:
            assert self._window is not None
            self._window.partial(keyed, body)  # for a repeat of the key
            if keyed.ids != [self.id]:  # a repeat is attached: one message per id
                await self._keyed_partial(body)
                return
        held = self._held_partial
        if held is not None and self._held_gen == peer.outbox.gen and (
                not limit or self._held_bytes + len(body) <= limit):
            held.append(body)  # still unsent: the body goes out with it, after its bodies
            self._held_bytes += len(body)
            return
        message = [_SIG, p.encode(p.Header(kind=p.PARTIAL, id=self.id)), body]
        if peer.hold(message, linger=True):
            self._held_partial, self._held_gen = message, peer.outbox.gen
            self._held_bytes = len(body)
            return
        self._held_partial = None
        try:
            await peer.send(message[1:], wait=False)
        except (HubLost, zmq.ZMQError):
            if keyed is None:
                raise
            peer.count("reply_lost")  # recorded: the repeat on the next hub gets it

    async def _keyed_partial(self, body: bytes) -> None:
        """Send it to every id attached; lost with the hub: counted (the repeat on the next
        hub gets it from the window's record)."""
        entry, peer = self._keyed, self._peer
        assert entry is not None
        for req_id in list(entry.ids):
            try:
                await peer.send([p.encode(p.Header(kind=p.PARTIAL, id=req_id)), body],
                                wait=False)
            except (HubLost, zmq.ZMQError):
                peer.count("reply_lost")


Handler = Callable[[IncomingRequest], Awaitable[bytes] | bytes]
AsyncHandler = Callable[[IncomingRequest], Awaitable[bytes]]


def body_limit(peer: PeerLink) -> int:
    """The most the bodies of one message may weigh to go through `peer`'s hub: its
    `max_message_bytes` (from the welcome) less room for the signature and header frames; 0
    while not known (between connections)."""
    welcome = peer.welcome
    return welcome.max_message_bytes - HEADER_ROOM if welcome is not None else 0


def _too_large(what: str, service: str, size: int, limit: int) -> str:
    return (f"{what} of `{service}` is {size} bytes, over the hub's message limit of "
            f"{limit + HEADER_ROOM} bytes (`max_message_bytes`)")


@dataclass(slots=True)
class Served:
    spec: p.ServiceSpec
    handler: Handler
    # An `async def` handler is called in its request's task; any other callable at once, in
    # the reader (`Serving.start`).
    in_task: bool = False

    def __post_init__(self) -> None:
        self.in_task = inspect.iscoroutinefunction(self.handler)


def _awaiting(pending: Awaitable[bytes]) -> AsyncHandler:
    """An `async def` handler awaiting what a plain function's handler returned (an awaitable,
    from a callable object or a lambda around an `async def`)."""
    async def handler(_: IncomingRequest) -> bytes:
        return await pending
    return handler


def _final_frames(final: Final, req_id: str, peer_id: str) -> list[bytes]:
    """A recorded final answer, addressed to `req_id`."""
    if final.kind == p.REPLY:
        return [_SIG, p.encode(p.Header(kind=p.REPLY, id=req_id, peer=peer_id)), final.body]
    return [_SIG, error_header(req_id, final.code, final.error)]


def error_header(req_id: str, code: str, text: str) -> bytes:
    return p.encode(p.Header(kind=p.ERROR, id=req_id, code=code, error=text))


class Serving:
    """The services `peer` offers (re-registered on every welcome) and the requests in service."""

    def __init__(self, peer: PeerLink) -> None:
        self._peer = peer
        self.services: dict[str, Served] = {}
        self.in_service: dict[str, IncomingRequest] = {}  # by id; each until its task ends
        self._closed = False
        self._new_scope: Callable[[], anyio.CancelScope] = anyio.CancelScope
        # `register`s awaiting the round trip that tells a refusal: id -> (service, served), and
        # the refusals that came meanwhile: id -> (code, the hub's text)
        self._registering: dict[str, tuple[str, Served]] = {}
        self._refusals: dict[str, tuple[str, str]] = {}
        self.keys = KeyWindow()  # keyed requests seen here (bus/keyed.py)

    async def register(self, spec: p.ServiceSpec, handler: Handler, *, confirm: bool,
                       timeout: float) -> None:
        """`Peer.serve`: register, and with `confirm` wait `timeout` at most for the round trip
        that tells a refusal (raised as `RegisterRefused`)."""
        served = self.services[spec.name] = Served(spec, handler)
        reg_id = p.new_id()
        self._registering[reg_id] = (spec.name, served)
        try:
            await self._peer.send([p.encode(p.Header(kind=p.REGISTER, id=reg_id)),
                                    p.encode(p.Register([spec]))])
        except BaseException:
            del self._registering[reg_id]
            raise
        if confirm:
            await self._confirm({reg_id: self._registering[reg_id]}, timeout)

    async def confirm_registers(self, timeout: float) -> None:
        """`Peer.confirm_registers`: one round trip for every register not confirmed yet."""
        await self._confirm(dict(self._registering), timeout)

    async def _confirm(self, pending: dict[str, tuple[str, Served]], timeout: float) -> None:
        if not pending:
            return
        try:
            with contextlib.suppress(RequestError):  # lost, or overloaded: see below
                await self._peer.request(p.HUB_REPLAY, CONFIRM_BODY, timeout=timeout)
        finally:
            for reg_id in pending:
                self._registering.pop(reg_id, None)
            refusals = [(pending[i], self._refusals.pop(i)) for i in pending
                        if i in self._refusals]
        # Without its round trip a refusal may come later: then it is logged and counted only
        # (`on_refused`), as one of a re-register after a reconnect is.
        for (service, served), _ in refusals:
            if self.services.get(service) is served:
                del self.services[service]  # not re-registered at the next welcome
        if refusals:
            (service, _), (code, reason) = refusals[0]
            raise RegisterRefused(service, code, reason)

    def on_refused(self, header: p.Header) -> bool:
        """The hub refused a service of a register (docs/protocol.md §5: `forbidden`, or
        `bad_request` for a bad spec): logged, counted, and `register` raises it. One without an
        id answers a re-register after a welcome (no caller: logged alone). False: not a
        register's."""
        registering = self._registering.get(header.id)
        service = registering[0] if registering else None
        if service is None and header.id:
            return False
        peer = self._peer
        peer.count("registers_refused")
        if service is not None:
            self._refusals[header.id] = (header.code, header.error)
        log.error("%s: the hub at %s refused to register %s (%s): %s", peer.name, peer.hub,
                  f"`{service}`" if service else "a service again", header.code, header.error)
        return True

    async def unregister(self, service: str) -> None:
        if self.services.pop(service, None) is not None:
            await self._peer.send([p.encode(p.Header(kind=p.UNREGISTER)),
                                    p.encode(p.Unregister([service]))])

    def register_frames(self, specs: list[p.ServiceSpec]) -> list[Any]:
        return [_SIG, p.encode(p.Header(kind=p.REGISTER)), p.encode(p.Register(specs))]

    def reregister_frames(self) -> list[Any] | None:
        """What to send after a welcome: every service again (None when serving nothing)."""
        if not self.services:
            return None
        return self.register_frames([s.spec for s in self.services.values()])

    def start(self, header: p.Header, frames: list[bytes]) -> None:
        """A REQUEST from the hub: start its handler (or answer `no_service` at once)."""
        peer = self._peer
        served = self.services.get(header.service)
        loop = peer.loop
        if served is None or loop is None or peer.closing or self._closed:
            peer.count("unserved_requests")
            peer.send_now([_SIG, error_header(header.id, p.NO_SERVICE,
                                               f"`{header.service}` is not served here")])
            return
        req = IncomingRequest(header.id, header.service, header,
                              frames[2] if len(frames) > 2 else b"", header.deadline, peer)
        if header.key and not served.spec.idempotent and self._keyed_start(req):
            return  # a repeat: attached to its key's run, or answered from it
        if served.in_task:
            self._start_task(req, cast(AsyncHandler, served.handler), loop)
            return
        try:
            outcome = served.handler(req)
            if not isinstance(outcome, _BYTES) and inspect.isawaitable(outcome):
                self._start_task(req, _awaiting(outcome), loop)
                return
            reply = self._reply(req, outcome)
        except Exception as exc:
            reply = self._failed(req, exc)
        if req._keyed is not None:
            reply = self._keyed_answer(req, reply)
            if not reply:
                return
        if not self._send_reply(reply):  # the send queue is full: wait for room in a task
            self.in_service[req.id] = req
            req._task = loop.create_task(self._send_later(req, reply))

    def _start_task(self, req: IncomingRequest, handler: AsyncHandler,
                    loop: asyncio.AbstractEventLoop) -> None:
        req._scope = scope = self._new_scope()
        # The next scopes straight from their class (the event loop's backend's): the public
        # constructor looks the backend up on every call (~2 us of a request's ~20).
        self._new_scope = type(scope)
        self.in_service[req.id] = req
        req._task = loop.create_task(self._serve_one(handler, req, scope))

    def _keyed_start(self, req: IncomingRequest) -> bool:
        """A keyed request: True when its key was seen here (the repeat is attached or
        answered); else its entry is made and the caller runs it."""
        header = req.header
        entry = self.keys.get(header.service, header.key)
        if entry is None:
            req._keyed = self.keys.begin(header.service, header.key, req.id)
            req._window = self.keys
            return False
        peer = self._peer
        peer.count("repeats_answered" if entry.final is not None else "repeats_attached")
        if req.id not in entry.ids:  # (a requester re-sends with the id it had: often the same)
            entry.ids.append(req.id)
        for body in entry.partials:
            self._send_reply([_SIG, p.encode(p.Header(kind=p.PARTIAL, id=req.id)), body])
        if entry.final is not None:
            self._send_reply(_final_frames(entry.final, req.id, peer.peer_id))
        return True

    def cancel(self, req_id: str) -> None:
        """A CANCEL from the hub: stop that handler (its answer says `cancelled`)."""
        req = self.in_service.get(req_id)
        if req is None or req._scope is None or req.cancelled.is_set():
            return  # (no scope: its answer is already waiting for room to be sent)
        keyed = req._keyed
        if keyed is not None and len(keyed.ids) > 1:
            keyed.ids.remove(req_id)  # a repeat is attached: the run goes on for it
            return
        req.cancelled.set()
        req._scope.cancel()

    async def close(self) -> None:
        """The peer is closing (its `bye` is sent): cancel every handler's scope and wait until
        all have ended. Their answers are not sent: the hub has dropped this peer."""
        self._closed = True
        tasks = []
        for req in list(self.in_service.values()):
            if req._scope is not None:
                req._scope.cancel()
            if req._task is not None:
                tasks.append(req._task)
        if tasks:
            with anyio.CancelScope(shield=True):  # as a task group's exit: wait for them all
                await asyncio.wait(tasks)

    async def _serve_one(self, handler: AsyncHandler, req: IncomingRequest,
                         scope: anyio.CancelScope) -> None:
        """Run one handler and send its one answer. Never raises but for a cancellation of its
        task from outside (the event loop shutting down)."""
        try:
            reply = await self._answer(handler, req, scope)
            if req._keyed is not None:
                reply = self._keyed_answer(req, reply)
            if reply and not self._closed and not self._send_reply(reply):
                await self._send_reply_blocked(reply)
        except Exception:  # a bug: nobody awaits this task to see it
            log.exception("%s: failed to answer request `%s`", self._peer.name, req.id)
        finally:
            self.in_service.pop(req.id, None)

    async def _send_later(self, req: IncomingRequest, reply: list[bytes]) -> None:
        """A plain function's answer, once the full send queue has room."""
        try:
            if not self._closed:
                await self._send_reply_blocked(reply)
        finally:
            self.in_service.pop(req.id, None)

    async def _answer(self, handler: AsyncHandler, req: IncomingRequest,
                      scope: anyio.CancelScope) -> list[bytes]:
        with scope:
            try:
                return self._reply(req, await handler(req))
            except Exception as exc:
                return self._failed(req, exc)
        # Only reached when the request's own scope caught its cancellation (a CANCEL).
        return [_SIG, error_header(req.id, p.CANCELLED, "cancelled")]

    def _keyed_answer(self, req: IncomingRequest, reply: list[bytes]) -> list[bytes]:
        """A keyed request's final answer: recorded for a repeat, sent to every id attached
        but its own; returns its own answer (`reply`) for the caller to send as any other. (An
        answer lost with the hub waits in the window for the repeat.)"""
        entry = req._keyed
        assert entry is not None
        header = p.decode_header(reply[1])
        final = Final(header.kind, reply[2] if len(reply) > 2 else b"", header.code, header.error)
        self.keys.end(entry, final)
        if self._closed:
            return []
        for req_id in entry.ids:
            if req_id != req.id:
                self._send_reply(_final_frames(final, req_id, self._peer.peer_id))
        return reply if req.id in entry.ids else []

    def _reply(self, req: IncomingRequest, body: object) -> list[bytes]:
        """The answer carrying a handler's `body`; raises TypeError when it is not bytes."""
        if not isinstance(body, _BYTES):  # sending it would raise in the reply path
            raise TypeError(f"the handler returned {type(body).__name__}, expected bytes")
        limit = body_limit(self._peer)
        if limit and len(body) > limit:
            text = _too_large("the answer", req.service, len(body), limit)
            log.warning("%s: %s; answered %s instead", self._peer.name, text, TOO_LARGE)
            self._peer.count("answers_too_large")
            return [_SIG, error_header(req.id, TOO_LARGE, text)]
        # `peer`: who served it, so the requester may prefer this peer next time
        return [_SIG, p.encode(p.Header(kind=p.REPLY, id=req.id, peer=self._peer.peer_id)),
                cast(bytes, body)]

    def _failed(self, req: IncomingRequest, exc: Exception) -> list[bytes]:
        """The answer of a handler that raised `exc`: a RequestError's own code, else
        `handler_error` (logged; called while handling `exc`, so with its traceback)."""
        if isinstance(exc, RequestError):
            return [_SIG, error_header(req.id, exc.code, str(exc))]
        log.exception("%s: handler for `%s` failed", self._peer.name, req.service)
        return [_SIG, error_header(req.id, p.HANDLER_ERROR, f"{type(exc).__name__}: {exc}")]

    def _send_reply(self, reply: list[bytes]) -> bool:
        """Send or hold the answer (False: the send queue is full, wait for room).

        Sent at once when nothing is held: holding it to the end of the iteration would cost a
        loop pass (and a wake-up) per answer and save nothing (handlers that end together still
        send back to back). Behind held messages it is held too, which keeps the order."""
        peer = self._peer
        try:
            if peer.sock is None:
                peer.count("reply_lost")
                return True
            if not peer.outbox.items and peer.welcome is not None:
                return peer.send_now(reply)
            return peer.hold(reply) or peer.send_now(reply)
        except (HubLost, zmq.ZMQError):
            peer.count("reply_lost")
            return True

    async def _send_reply_blocked(self, reply: list[bytes]) -> None:
        peer = self._peer
        try:
            with anyio.move_on_after(REPLY_SEND_TIMEOUT):
                await peer.send_blocked(reply, time.monotonic() + REPLY_SEND_TIMEOUT)
        except (HubLost, zmq.ZMQError):
            peer.count("reply_lost")
