"""The Inspect bridge's bus client on an event loop of its own, in a thread of its own.

Why: a peer's heartbeats, its reads and its calls' deadlines run on the loop that connected it.
Inspect runs the bridge's `generate()` on *its* loop, and that loop can stall (Inspect writing
its log or scoring, synchronously, on a loaded machine) past the hub's liveness window (3
heartbeats: 3 s by default): the hub then drops the peer, the peer reconnects, and every call in
flight fails `HubLost`, so the sample fails though its session was fine. Here the bus work runs
on a loop no Inspect code runs on, and Inspect's coroutines only await its results: however busy
Inspect's thread is, Python switches threads every few ms (`sys.getswitchinterval()`), so the
peer keeps its heartbeats.

One loop per process (`BusThread`), started at the first call, stopped at exit (or `close()`).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import threading
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from typing import TypeVar, TypeVarTuple

import anyio.from_thread

T = TypeVar("T")
Args = TypeVarTuple("Args")


class BusThread:
    """An asyncio loop in a daemon thread (anyio's blocking portal) for `call`s, started by the
    first one; `close()` (run at exit too) cancels the calls still running and ends the thread.

    A daemon thread on purpose: the interpreter joins non-daemon threads *before* it runs
    `atexit`, so one would keep the process from exiting; anyio >= 4.14 (Inspect's own minimum)
    makes the portal's thread a daemon."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._pid = 0  # the process that started the thread (a forked child has no such thread)
        self._cm: AbstractContextManager[anyio.from_thread.BlockingPortal] | None = None
        self._portal: anyio.from_thread.BlockingPortal | None = None

    async def call(self, func: Callable[[*Args], Awaitable[T]], *args: *Args) -> T:
        """`await func(*args)` on the thread's loop, from the caller's (asyncio) loop. Its result
        or exception is the caller's; cancelling the caller cancels it there."""
        future = self._started().start_task_soon(func, *args)
        # cancelling the wrapper cancels the future, and anyio then cancels the task
        return await asyncio.wrap_future(future)

    @property
    def running(self) -> bool:
        return self._portal is not None and self._pid == os.getpid()

    def _started(self) -> anyio.from_thread.BlockingPortal:
        with self._lock:
            if self._portal is None or self._pid != os.getpid():
                self._cm = anyio.from_thread.start_blocking_portal("asyncio", name=self.name)
                self._portal = self._cm.__enter__()
                self._pid = os.getpid()
                atexit.register(self.close)
            return self._portal

    def close(self) -> None:
        """Cancel the calls still running (their runs are aborted, their connections closed),
        wait for that, and end the thread. Idempotent; a later `call` starts a new thread."""
        with self._lock:
            cm, portal, ours = self._cm, self._portal, self._pid == os.getpid()
            self._cm = self._portal = None
        atexit.unregister(self.close)
        if cm is None or portal is None or not ours:
            return
        with contextlib.suppress(RuntimeError):  # the loop ended already
            portal.call(portal.stop, True)
        cm.__exit__(None, None, None)  # joins the thread


__all__ = ["BusThread"]
