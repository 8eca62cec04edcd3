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
import threading
from collections.abc import Awaitable
from typing import Any

import anyio
import anyio.to_thread

from bus.messages import ToolCallRequest, ToolResult, error_result
from bus.tracecontext import tool_traceparent
from tools._context import ProgressCallback, ToolContext
from tools._exceptions import ArgumentsError
from tools._results import exception_result, to_result
from tools._tool import Tool

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
) -> ToolResult:
    """Run one call of `t` and return its result; tool failures never raise.

    `workspace` and `allow_shell` are the worker's settings, passed to the tool's `ToolContext`.
    `on_progress` receives each `ctx.progress(...)` update as a partial ToolResult (sync or async;
    it should not raise, failures are logged and the update dropped). `limiter` bounds the worker
    threads of sync tools (default: anyio's default thread limiter). Cancellation of the calling
    task is re-raised after the tool was told (see the module docstring).
    """
    try:
        kwargs = t.parse_arguments(request.arguments)
    except ArgumentsError as exc:
        return error_result(f"Error: {exc}")
    ctx = _make_context(t, request, workspace, allow_shell, on_progress)
    if t.context_param is not None:
        kwargs[t.context_param] = ctx
    try:
        if t.timeout is None:  # no timeout: no cancel scope to enter and leave
            return await _execute(t, kwargs, ctx, limiter)
        with anyio.move_on_after(t.timeout):
            return await _execute(t, kwargs, ctx, limiter)
    finally:
        ctx._close()
    return error_result(f"Tool '{t.name}' timed out after {t.timeout:g}s")


def _make_context(
    t: Tool,
    request: ToolCallRequest,
    workspace: str | os.PathLike[str],
    allow_shell: bool,
    on_progress: ProgressCallback | None,
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
    t: Tool, kwargs: dict[str, Any], ctx: ToolContext, limiter: anyio.CapacityLimiter | None
) -> ToolResult:
    if t.is_async:
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
    t: Tool, kwargs: dict[str, Any], ctx: ToolContext, limiter: anyio.CapacityLimiter | None
) -> ToolResult:
    """Run in a worker thread; on cancellation flag `ctx`, allow CANCEL_GRACE, then abandon it."""
    finished = anyio.Event()
    loop = asyncio.get_running_loop()
    lock = threading.Lock()
    state = {"done": False, "waiting": False}

    def target() -> Any:
        try:
            return t.fn(**kwargs)
        finally:
            # The loop is told only when a cancellation waits for this thread: no round trip
            # through the event loop (`anyio.from_thread.run_sync` blocked this thread on one)
            # and no extra wake-up of the loop on the normal path.
            with lock:
                state["done"] = True
                waiting = state["waiting"]
            if waiting:
                try:
                    loop.call_soon_threadsafe(finished.set)
                except RuntimeError:  # the event loop is gone (an abandoned thread outliving it)
                    pass

    try:
        return await _settle(anyio.to_thread.run_sync(target, limiter=limiter, abandon_on_cancel=True))
    except anyio.get_cancelled_exc_class():
        ctx._cancel()
        with lock:
            state["waiting"] = True
            done = state["done"]
        if not done:
            with anyio.move_on_after(CANCEL_GRACE, shield=True):
                await finished.wait()
        raise


async def _settle(pending: Awaitable[Any]) -> ToolResult:
    """Await the tool and map its value or exception (cancellation passes through)."""
    try:
        return to_result(await pending)
    except Exception as exc:
        return exception_result(exc)
