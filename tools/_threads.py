"""The threads sync tools run in: one hand-over to an idle thread and, for a tool that returns
quickly, a short wait for it on the event loop's thread; else one wake-up of the loop when the
function returns.

`anyio.to_thread.run_sync` costs about three times as much CPU on the event loop per call
(measured ~150 vs ~50 us on the loaded 2-core test machine, a trivial function): a checkpoint
(an extra loop pass) before starting, a cancel-shielded checkpoint (another) when taking the
limiter's token, two cancel scopes, and a `queue.Queue` with its condition variable. For an echo
tool that was a fifth of the worker's CPU per call.

The short wait (`settle`, at most `QUICK_WAIT`): the loop thread blocks on a lock (without the
GIL) while the thread runs the function. When it returns in time, the outcome is read at once:
no wake-up of the loop through its self-pipe, no future, and two loop passes fewer (the
wake-up's, and the task's resumption after it); concurrent calls of a quick tool then share one
thread instead of waking one each. Otherwise the loop gives up waiting and the thread reports
through the loop as before. The caller waits only for functions whose last run was quick (see
`runner`), so a slow tool costs the loop nothing and a quick one at most `QUICK_WAIT`.

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
#: Longest wait (s) of the loop thread for a quick function (`settle`).
QUICK_WAIT = 0.0005
#: A function whose run took at most this long (s) is waited for on its next call.
QUICK_RUN = 0.0002


class Job:
    """One function call handed to a thread.

    The thread writes `value`, `error` and `run_time`, then takes `_claim`; the loop, giving
    up its wait, takes it too: whoever gets it first decides how the outcome is delivered (the
    thread: through `_signal` to the waiting loop; the loop: through `future`, which the thread
    then completes on the loop with `_report`). The other fields are only touched on the event
    loop's thread."""

    __slots__ = ("loop", "context", "fn", "kwargs", "future", "done", "on_done", "value",
                 "error", "run_time", "_worker", "_claim", "_signal")

    def __init__(self, loop: asyncio.AbstractEventLoop, fn: Callable[..., Any],
                 kwargs: dict[str, Any]) -> None:
        context = contextvars.copy_context()
        context.run(sniffio.current_async_library_cvar.set, None)  # the thread is not async
        self.loop = loop
        self.context = context
        self.fn = fn
        self.kwargs = kwargs
        # (value, None) or (None, exception), for a caller that stopped waiting (`settle`): the
        # exception is raised by the caller's task. None until then.
        self.future: asyncio.Future[tuple[Any, BaseException | None]] | None = None
        self.done = False  # the function returned (or raised), and the loop knows
        self.on_done: Callable[[], None] | None = None  # a cancelled caller waiting for it
        self.value: Any = None
        self.error: BaseException | None = None
        self.run_time = 0.0  # seconds the function ran
        self._worker: _Thread | None = None
        self._claim = threading.Lock()
        self._signal = threading.Lock()
        self._signal.acquire()  # released by the thread for a loop still waiting


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
    job._worker = worker
    worker.jobs.put(job)


def settle(job: Job, wait: float) -> bool:
    """After `submit`, on the loop's thread: block up to `wait` s for the function to return.

    True: it did, its outcome is in `job.value` / `job.error` and its thread is idle again.
    False: it still runs; `job.future` (made here) gets the outcome through the loop.
    """
    if wait > 0 and job._signal.acquire(timeout=wait):
        _finished(job)
        return True
    job.future = job.loop.create_future()
    if job._claim.acquire(blocking=False):
        return False  # the thread will see the claim taken and report through the loop
    _finished(job)  # it returned meanwhile and claimed first: the outcome is written
    return True


def _finished(job: Job) -> None:
    """On the loop: the function returned and its outcome was read there: the thread is idle."""
    job.done = True
    worker = job._worker
    if worker is not None:
        worker.idle_since = time.monotonic()
        _idle.threads.append(worker)


def _expire(idle: deque[_Thread]) -> None:
    now = time.monotonic()
    while idle and now - idle[0].idle_since >= MAX_IDLE:
        idle.popleft().jobs.put(None)


def _serve(worker: _Thread) -> None:
    """A thread's life: run the jobs it is given until told to stop or the loop is gone."""
    clock = time.perf_counter
    while True:
        job = worker.jobs.get()
        if job is None:
            return
        future = job.future  # (a read of its state; anyio does the same)
        if future is None or not future.cancelled():
            started = clock()
            try:
                job.value = job.context.run(job.fn, **job.kwargs)
            except BaseException as exc:  # handed to the caller as is
                job.error = exc
            job.run_time = clock() - started
        if job._claim.acquire(blocking=False):  # the loop still waits (or will find it done)
            job._signal.release()
            continue
        try:
            job.loop.call_soon_threadsafe(_report, job)
        except RuntimeError:  # the loop is closed: an abandoned call outlived it
            return


def _report(job: Job) -> None:
    """On the loop: the thread is idle again; the caller gets the outcome (unless cancelled)."""
    _finished(job)
    future = job.future
    if future is not None and not future.done():
        future.set_result((job.value, job.error))
    if job.on_done is not None:
        job.on_done()
