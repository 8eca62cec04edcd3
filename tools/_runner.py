"""`run_tool`: one tool call from request to `ToolResult`, in three stages.

prepare (validate arguments, build the context) -> execute (event loop or worker thread, under the
tool's timeout) -> finalize (map the return value or exception to a ToolResult).

Cancellation contract: if the task running `run_tool` is cancelled, the context's `cancelled` flag
is set, a sync tool's thread gets up to `CANCEL_GRACE` seconds to notice and return, and then the
cancellation is re-raised (never turned into a result): the caller, which cancelled, decides what to
reply. A thread that ignores the flag is abandoned (it finishes in the background, its result
dropped). A timeout is not a cancellation of the caller: it returns the error result
`Tool '<name>' timed out after <t>s`.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread

from agent_bus.bus.messages import ToolCallRequest, ToolResult, error_result
from agent_bus.bus.tracecontext import tool_traceparent
from agent_bus.tools import _threads
from agent_bus.tools._context import ProgressCallback, ToolContext
from agent_bus.tools._exceptions import ArgumentsError
from agent_bus.tools._results import exception_result, to_result
from agent_bus.tools._tool import Tool
from agent_bus.tools.sandbox import DEFAULT_POLICY, SandboxPolicy

#: Seconds a cancelled sync tool gets to notice `ctx.cancelled` before its thread is abandoned.
CANCEL_GRACE = 1.0


async def run_tool(
    t: Tool,
    request: ToolCallRequest,
    *,
    workspace: str | os.PathLike[str] = ".",
    allow_shell: bool = False,
    on_progress: ProgressCallback | None = None,
    limiter: anyio.CapacityLimiter | None = None,
    policy: SandboxPolicy = DEFAULT_POLICY,
) -> ToolResult:
    """Run one call of `t` and return its result; tool failures never raise.

    `workspace`, `allow_shell` and `policy` (the worker's `SandboxPolicy`) are the worker's
    settings, passed to the tool's `ToolContext`.
    `on_progress` receives each `ctx.progress(...)` update as a partial ToolResult (sync or async;
    it should not raise, failures are logged and the update dropped). `limiter` bounds the worker
    threads of sync tools (default: anyio's default thread limiter). Cancellation of the calling
    task is re-raised after the tool was told (see the module docstring).
    """
    try:
        kwargs = t.parse_arguments(request.arguments)
    except ArgumentsError as exc:
        return error_result(f"Error: {exc}")
    ctx = None  # a tool without a ToolContext parameter gets none: nothing to build
    if t.context_param is not None:
        ctx = kwargs[t.context_param] = _make_context(t, request, workspace, allow_shell,
                                                      on_progress, policy)
    try:
        if t.timeout is None:  # no timeout: no cancel scope to enter and leave
            return await _execute(t, kwargs, ctx, limiter)
        with anyio.move_on_after(t.timeout):
            return await _execute(t, kwargs, ctx, limiter)
    finally:
        if ctx is not None:
            ctx._close()
    return error_result(f"Tool '{t.name}' timed out after {t.timeout:g}s")


def _make_context(
    t: Tool,
    request: ToolCallRequest,
    workspace: str | os.PathLike[str],
    allow_shell: bool,
    on_progress: ProgressCallback | None,
    policy: SandboxPolicy,
) -> ToolContext:
    ctx = ToolContext(
        call_id=request.call_id,
        tool_name=t.name,
        agent=request.agent,
        run_id=request.run_id,
        experiment=request.experiment,
        workspace=workspace,
        allow_shell=allow_shell,
        on_progress=on_progress,
        traceparent=traceparent_of(request),
        run_workspace=request.workspace.id if request.workspace is not None else "",
        policy=policy,
    )
    ctx._bind()
    return ctx


def traceparent_of(request: ToolCallRequest) -> str:
    """The W3C `traceparent` naming the call's `execute_tool` span (the id `busctl otel`
    exports for it), "" for a call outside any run (no span is exported for it)."""
    if not request.run_id or not request.call_id:
        return ""
    root = request.trace.root_run_id if request.trace is not None else ""
    return tool_traceparent(request.run_id, request.call_id, root)


async def _execute(
    t: Tool, kwargs: dict[str, Any], ctx: ToolContext | None,
    limiter: anyio.CapacityLimiter | None,
) -> ToolResult:
    if t.is_async:
        if ctx is None:  # nobody could see a cancellation flag: no watcher task to run
            return await _settle(t.fn(**kwargs))
        return await _run_async(t, kwargs, ctx)
    return await _run_in_thread(t, kwargs, ctx, limiter)


async def _run_async(t: Tool, kwargs: dict[str, Any], ctx: ToolContext) -> ToolResult:
    """Run on the event loop; a sibling task flags `ctx` the moment cancellation arrives.

    (So a tool blocked on its own non-abandoning thread sees `ctx.cancelled` and can stop.)
    """
    settled = False

    async def flag_on_cancel() -> None:
        try:
            await anyio.sleep_forever()
        finally:
            if not settled:
                ctx._cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(flag_on_cancel)
        result = await _settle(t.fn(**kwargs))
        settled = True
        tg.cancel_scope.cancel()
    return result


async def _run_in_thread(
    t: Tool, kwargs: dict[str, Any], ctx: ToolContext | None,
    limiter: anyio.CapacityLimiter | None,
) -> ToolResult:
    """Run in a thread (`tools/_threads.py`) holding a token of `limiter`; on cancellation flag
    `ctx`, give the thread CANCEL_GRACE to return, then abandon it (its token is freed at once,
    as anyio's `abandon_on_cancel` does)."""
    await anyio.lowlevel.checkpoint_if_cancelled()  # cancelled before it started: never runs
    if limiter is None:
        limiter = anyio.to_thread.current_default_thread_limiter()
    job = _threads.Job(asyncio.get_running_loop(), t.fn, kwargs)
    try:  # a free token is taken without a pass through the loop (`acquire` would yield)
        limiter.acquire_on_behalf_of_nowait(job)
    except anyio.WouldBlock:
        await limiter.acquire_on_behalf_of(job)
    try:
        try:
            _threads.submit(job)
            if _threads.settle(job, _threads.QUICK_WAIT if t.quick_in_thread else 0.0):
                value, error = job.value, job.error
            else:
                assert job.future is not None  # made by `settle`
                value, error = await job.future
        finally:
            limiter.release_on_behalf_of(job)
    except anyio.get_cancelled_exc_class():
        if ctx is not None:
            ctx._cancel()
        await _grace(job)
        raise
    t.quick_in_thread = job.run_time <= _threads.QUICK_RUN
    try:
        if error is not None:
            raise error
        return to_result(value)
    except Exception as exc:
        return exception_result(exc)


async def _grace(job: _threads.Job) -> None:
    """A cancelled call: wait up to CANCEL_GRACE for its thread to return (shielded)."""
    if job.done:
        return
    finished = anyio.Event()
    job.on_done = finished.set
    with anyio.move_on_after(CANCEL_GRACE, shield=True):
        await finished.wait()


async def _settle(pending: Awaitable[Any]) -> ToolResult:
    """Await the tool and map its value or exception (cancellation passes through)."""
    try:
        return to_result(await pending)
    except Exception as exc:
        return exception_result(exc)
