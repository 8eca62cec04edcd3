"""How the client drives its DEALER socket: a fast path where the event loop allows it, a portable
one everywhere else.

`FastTransport` (the default on Unix) uses a plain pyzmq socket through `zmq.backend.Socket` with
int flags (pyzmq's enum handling costs ~3 us per message) and watches its notification fd with
the asyncio loop's `add_reader`. The fd is edge-triggered: any send or `EVENTS` read may consume
the edge, so the peer checks `input_waiting()` after sending and drains by itself.

`PortableTransport` uses only public pyzmq API (`zmq.asyncio`, which also works on Windows'
Proactor loop, where `add_reader` does not exist): a watcher task awaits `poll(POLLIN)` and calls
the same `on_ready` callback. It is chosen automatically when the loop has no `add_reader`, and
can be forced with `BUSCTL_TRANSPORT=portable` (the bus tests run both ways).
"""

from __future__ import annotations

import abc
import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

import anyio
import anyio.abc
import zmq
import zmq.asyncio
from zmq.backend import Socket as _BackendSocket

if TYPE_CHECKING:
    from agent_bus.bus.security import CurveClient

TRANSPORT_ENV = "BUSCTL_TRANSPORT"
KINDS = ("fast", "portable")

_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)
_EVENTS = int(zmq.EVENTS)
_NOBLOCK = int(zmq.NOBLOCK)
_MORE_NOBLOCK = int(zmq.NOBLOCK | zmq.SNDMORE)
_bsend = _BackendSocket.send
_brecv = _BackendSocket.recv
# pyzmq's stubs type every option's value as `int | bytes`; EVENTS and FD are ints (FD is a
# SOCKET on Windows, an int too). Cast once here, not per call: this is the hot path.
_bget = cast(Callable[[Any, int], int], _BackendSocket.get)
_S = TypeVar("_S", bound=zmq.Socket[Any])  # a plain or a zmq.asyncio socket


def socket_fd(sock: zmq.Socket[Any]) -> int:
    """The socket's notification fd (an int; see the cast above)."""
    return _bget(sock, int(zmq.FD))


def send_frames(sock: zmq.Socket[Any], frames: list[Any]) -> None:
    """Send one multipart message without blocking (zmq.Again, on the first frame, at the HWM)."""
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        _bsend(sock, frame, _MORE_NOBLOCK if i < last else _NOBLOCK)


def recv_frames(sock: zmq.Socket[Any]) -> list[bytes]:
    """Receive one multipart message without blocking (zmq.Again when there is none)."""
    frame = _brecv(sock, _NOBLOCK, False)
    frames = [frame.bytes]
    while frame.more:
        frame = _brecv(sock, _NOBLOCK, False)
        frames.append(frame.bytes)
    return frames


def transport_kind(loop: asyncio.AbstractEventLoop) -> str:
    """`fast` or `portable`: $BUSCTL_TRANSPORT when set, else `fast` where `add_reader` works."""
    forced = os.environ.get(TRANSPORT_ENV, "").strip().lower()
    if forced:
        if forced not in KINDS:
            raise ValueError(f"{TRANSPORT_ENV}={forced!r} is not a transport; use one of "
                             f"{', '.join(KINDS)} (or leave it unset to choose automatically)")
        return forced
    return "portable" if isinstance(loop, getattr(asyncio, "ProactorEventLoop", ())) else "fast"


class FdWaiter:
    """Wake one waiting task when a plain zmq socket's notification fd fires (edge-triggered);
    or, with `on_ready`, call it instead. The subscription's SUB socket is read through this."""

    def __init__(self, sock: zmq.Socket[Any], on_ready: Callable[[], None] | None = None) -> None:
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self.fd = socket_fd(sock)
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


class PollWaiter:
    """`FdWaiter` on public pyzmq API: wait for input with a `zmq.asyncio` poll (the portable
    transport's way; works where the loop has no `add_reader`)."""

    def __init__(self, sock: zmq.asyncio.Socket) -> None:
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self.waiter: asyncio.Future[None] | None = None
        self._poll: asyncio.Future[int] | None = None

    async def wait(self) -> None:
        if self.sock.closed:
            return
        # zmq.asyncio's `Socket.poll(timeout=None, flags=POLLIN)` returns a future; pyzmq's
        # stub gives it the poller's signature instead (no `flags`). It is awaited through a
        # future of our own, so that `close` (from any task) can end the wait without
        # cancelling the waiting task.
        poll = self._poll = cast(Callable[..., "asyncio.Future[int]"], self.sock.poll)(
            flags=zmq.POLLIN)
        waiter = self.waiter = self.loop.create_future()

        def wake(_: object) -> None:
            if not waiter.done():
                waiter.set_result(None)

        poll.add_done_callback(wake)
        try:
            await waiter
        finally:
            self.waiter = self._poll = None
            poll.cancel()

    def close(self) -> None:
        poll, waiter = self._poll, self.waiter
        if poll is not None:
            poll.cancel()
        if waiter is not None and not waiter.done():
            waiter.set_result(None)  # the reader sees the socket gone and stops
        if not self.sock.closed:
            self.sock.close(linger=0)


Waiter = FdWaiter | PollWaiter


class Transport(abc.ABC):
    """One connected DEALER. `send`/`recv` never block (zmq.Again); `on_ready` is called when
    input may be waiting (the peer then drains with `recv` until zmq.Again)."""

    sock: zmq.Socket[Any]

    @abc.abstractmethod
    def send(self, frames: list[Any]) -> None: ...

    @abc.abstractmethod
    def recv(self) -> list[bytes]: ...

    def input_waiting(self) -> bool:
        """Whether a message is ready (a send may have consumed the readiness edge)."""
        return bool(_bget(self.sock, _EVENTS) & _POLLIN)

    def writable(self) -> bool:
        return bool(_bget(self.sock, _EVENTS) & _POLLOUT)

    @abc.abstractmethod
    def close(self, linger: int) -> None: ...


class FastTransport(Transport):
    """A plain socket driven by backend calls; readiness from the loop's `add_reader`."""

    def __init__(self, sock: zmq.Socket[Any], on_ready: Callable[[], None]) -> None:
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self.fd = socket_fd(sock)
        self._on_ready = on_ready
        self.loop.add_reader(self.fd, self._fired)

    def _fired(self) -> None:
        if not self.sock.closed:
            self._on_ready()

    def send(self, frames: list[Any]) -> None:
        send_frames(self.sock, frames)

    def recv(self) -> list[bytes]:
        return recv_frames(self.sock)

    def input_waiting(self) -> bool:
        return bool(_bget(self.sock, _EVENTS) & _POLLIN)

    def writable(self) -> bool:
        return bool(_bget(self.sock, _EVENTS) & _POLLOUT)

    def close(self, linger: int) -> None:
        try:
            self.loop.remove_reader(self.fd)
        except (ValueError, OSError, RuntimeError):
            pass
        if not self.sock.closed:
            self.sock.close(linger=linger)


class PortableTransport(Transport):
    """A `zmq.asyncio` socket; a watcher task (started with `watch`) awaits readability."""

    def __init__(self, sock: zmq.asyncio.Socket, on_ready: Callable[[], None]) -> None:
        self.sock = sock
        # The async socket's own send/recv return futures; non-blocking calls go through a
        # plain shadow of the same libzmq socket.
        self._plain: zmq.Socket[Any] = zmq.Socket.shadow(sock.underlying)
        self._on_ready = on_ready
        self._scope = anyio.CancelScope()

    async def watch(self) -> None:
        """Call `on_ready` whenever input is waiting, until `close`."""
        with self._scope:
            while not self.sock.closed:
                # zmq.asyncio's poll returns a future; its stub says int (the sync one's type).
                await cast(Awaitable[int], self.sock.poll(flags=zmq.POLLIN))
                if self.sock.closed:
                    return
                self._on_ready()
                await anyio.lowlevel.checkpoint()  # the drain may leave messages for later

    def send(self, frames: list[Any]) -> None:
        self._plain.send_multipart(frames, flags=zmq.NOBLOCK)

    def recv(self) -> list[bytes]:
        return self._plain.recv_multipart(flags=zmq.NOBLOCK)

    def input_waiting(self) -> bool:
        return bool(_bget(self._plain, _EVENTS) & _POLLIN)

    def writable(self) -> bool:
        return bool(_bget(self._plain, _EVENTS) & _POLLOUT)

    def close(self, linger: int) -> None:
        self._scope.cancel()
        if not self.sock.closed:
            self.sock.close(linger=linger)


def open_dealer(ctx: zmq.asyncio.Context, hub: str, curve: CurveClient | None,
                on_ready: Callable[[], None], tg: anyio.abc.TaskGroup) -> Transport:
    """A new DEALER connected to `hub`, behind the transport this loop takes (`transport_kind`);
    a portable one's watcher runs in `tg`."""
    if transport_kind(asyncio.get_running_loop()) == "portable":
        portable = PortableTransport(_dealer(ctx.socket(zmq.DEALER), hub, curve), on_ready)
        tg.start_soon(portable.watch)
        return portable
    # a plain socket (see above); `ctx`, a zmq.asyncio context, makes zmq.asyncio ones
    return FastTransport(_dealer(zmq.Socket(ctx, zmq.DEALER), hub, curve), on_ready)


def _dealer(sock: _S, hub: str, curve: CurveClient | None) -> _S:
    """Set up and connect a new DEALER to the hub."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
    if curve is not None:
        curve.apply(sock)
    sock.connect(hub)
    return sock
