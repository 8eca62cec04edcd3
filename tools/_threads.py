"""The threads sync tools run in: one hand-over to an idle thread and one wake-up of the loop
when the function returns, nothing else.

`anyio.to_thread.run_sync` costs about three times as much CPU on the event loop per call
(measured ~150 vs ~50 us on the loaded 2-core test machine, a trivial function): a checkpoint
(an extra loop pass) before starting, a cancel-shielded checkpoint (another) when taking the
limiter's token, two cancel scopes, and a `queue.Queue` with its condition variable. For an echo
tool that was a fifth of the worker's CPU per call.

Kept from anyio's behaviour: each call runs in a copy of the caller's context (contextvars
reach the tool) in which sniffio names no async library; a job whose future was cancelled
before a thread took it is skipped; a busy thread is never given a second job (an abandoned
call keeps its thread, the next call gets another); threads idle for `MAX_IDLE` seconds are
stopped. Unlike anyio's, the threads are daemons: a worker leaving after it abandoned a tool
that never returns exits instead of hanging at interpreter shutdown. They are not anyio worker
threads: inside a tool, `anyio.from_thread.run(...)` needs `token=` (`ToolContext.progress`
passes it; `ctx.cancelled` replaces `anyio.from_thread.check_cancelled`).
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time
from collections import deque
from collections.abc import Callable
from queue import SimpleQueue
from typing import Any

import sniffio

#: Seconds an idle thread is kept for the next call (anyio's `WorkerThread.MAX_IDLE_TIME`).
MAX_IDLE = 10.0


class Job:
    """One function call handed to a thread; its fields other than the inputs are only touched
    on the event loop's thread (`_report` runs there)."""

    __slots__ = ("loop", "context", "fn", "kwargs", "future", "done", "on_done")

    def __init__(self, loop: asyncio.AbstractEventLoop, fn: Callable[..., Any],
                 kwargs: dict[str, Any]) -> None:
        context = contextvars.copy_context()
        context.run(sniffio.current_async_library_cvar.set, None)  # the thread is not async
        self.loop = loop
        self.context = context
        self.fn = fn
        self.kwargs = kwargs
        # (value, None) or (None, exception): the exception is raised by the caller's task.
        self.future: asyncio.Future[tuple[Any, BaseException | None]] = loop.create_future()
        self.done = False  # the function returned (or raised), reported on the loop
        self.on_done: Callable[[], None] | None = None  # a cancelled caller waiting for it


class _Thread:
    __slots__ = ("jobs", "idle_since")

    def __init__(self) -> None:
        self.jobs: SimpleQueue[Job | None] = SimpleQueue()
        self.idle_since = 0.0


class _Idle(threading.local):
    """The idle threads of the event loop running in this OS thread (only that loop's thread
    touches them: jobs are handed out there and threads report back there)."""

    def __init__(self) -> None:
        self.threads: deque[_Thread] = deque()


_idle = _Idle()


def submit(job: Job) -> None:
    """Give `job` to an idle thread (a new one when none is); call from `job.loop`'s thread."""
    idle = _idle.threads
    if idle:
        worker = idle.pop()  # the most recently used: the others can expire
        _expire(idle)
    else:
        worker = _Thread()
        threading.Thread(target=_serve, args=(worker,), name="tool thread",
                         daemon=True).start()
    worker.jobs.put(job)


def _expire(idle: deque[_Thread]) -> None:
    now = time.monotonic()
    while idle and now - idle[0].idle_since >= MAX_IDLE:
        idle.popleft().jobs.put(None)


def _serve(worker: _Thread) -> None:
    """A thread's life: run the jobs it is given until told to stop or the loop is gone."""
    while True:
        job = worker.jobs.get()
        if job is None:
            return
        value: Any = None
        error: BaseException | None = None
        if not job.future.cancelled():  # (a read of its state; anyio does the same)
            try:
                value = job.context.run(job.fn, **job.kwargs)
            except BaseException as exc:  # handed to the caller as is
                error = exc
        try:
            job.loop.call_soon_threadsafe(_report, worker, job, value, error)
        except RuntimeError:  # the loop is closed: an abandoned call outlived it
            return


def _report(worker: _Thread, job: Job, value: Any, error: BaseException | None) -> None:
    """On the loop: the thread is idle again; the caller gets the outcome (unless cancelled)."""
    worker.idle_since = time.monotonic()
    _idle.threads.append(worker)
    job.done = True
    future = job.future
    if not future.done():
        future.set_result((value, error))
    if job.on_done is not None:
        job.on_done()
