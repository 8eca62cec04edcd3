"""`ToolContext`: what a running tool may know about its call, and how it reports back.

A tool receives one by declaring a parameter annotated `ToolContext` (any name; it is left out of
the schema). The runner creates one per call on the event loop thread; tools running in a worker
thread use the same object from there (`cancelled`, `progress` and `wait_cancelled_blocking` are
thread-safe).
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Generator
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel

from agent_bus.bus.messages import ToolResult
from agent_bus.bus.paths import inside_state_dir
from agent_bus.tools._exceptions import WorkspaceError
from agent_bus.tools._results import to_content
from agent_bus.tools.sandbox import DEFAULT_POLICY, SandboxPolicy, check_writable

logger = logging.getLogger(__name__)

#: Receives each progress update as a partial ToolResult; may be sync or async.
ProgressCallback = Callable[[ToolResult], "Awaitable[None] | None"]


#: Guards the making of a context's blocking-wait event against its setting (all contexts: a
#: cancellation is rare, contention negligible).
_EVENT_LOCK = threading.Lock()


class _Ready:
    """An awaitable that is already finished (what `progress` returns when nothing is left to do)."""

    def __await__(self) -> Generator[Any, None, None]:
        return
        yield  # pragma: no cover - makes this a generator


class ToolContext:
    """Per-call facts and channels for a tool.

    Attributes: `call_id`, `tool_name`, `agent`, `run_id`, `experiment` (from the request),
    `workspace` (resolved Path the file tools are confined to), `allow_shell` (whether the
    worker enabled shell commands) and `traceparent` (W3C trace context naming the call's
    `execute_tool` span in the run's trace, "" for a call outside any run; `trace_carrier`
    holds it for `opentelemetry.propagate.extract`), `run_workspace` (the id of the run's own
    workspace, `<worker workspace>/.runs/<id>/`, when the call has one: `workspace` is then that
    folder; "" otherwise), `policy` (the worker's `SandboxPolicy`: what `resolve_path` refuses
    to write, how `run_shell` is contained).
    """

    def __init__(
        self,
        *,
        call_id: str = "",
        tool_name: str = "",
        agent: str = "",
        run_id: str = "",
        experiment: str = "",
        workspace: str | os.PathLike[str] = ".",
        allow_shell: bool = False,
        on_progress: ProgressCallback | None = None,
        traceparent: str = "",
        run_workspace: str = "",
        policy: SandboxPolicy = DEFAULT_POLICY,
    ) -> None:
        self.call_id = call_id
        self.run_workspace = run_workspace
        self.tool_name = tool_name
        self.agent = agent
        self.run_id = run_id
        self.experiment = experiment
        # Resolved on first use (a symlink-walking `resolve()` per call was a fifth of an echo
        # call's CPU, and most tools never look); a relative path is resolved now, against the
        # current directory of the call's start.
        self._workspace_given = Path(workspace)
        self._workspace: Path | None = (
            None if self._workspace_given.is_absolute() else self._workspace_given.resolve())
        self.allow_shell = allow_shell
        self.policy = policy
        self.traceparent = traceparent
        self._on_progress = on_progress
        # `_cancelled_flag` is the truth; `_cancelled_event` (for blocking waits) is made on
        # first use, under `_EVENT_LOCK` (see `wait_cancelled_blocking`).
        self._cancelled_flag = False
        self._cancelled_event: threading.Event | None = None
        self._cancelled_async: anyio.Event | None = None
        self._closed = False
        self._loop_thread = threading.get_ident()
        self._token: Any = None

    @property
    def trace_carrier(self) -> dict[str, str]:
        """The trace context as OpenTelemetry's propagators read it: a tool instrumented with
        OpenTelemetry starts its spans under the call's `execute_tool` span with
        `tracer.start_as_current_span(name, context=propagate.extract(ctx.trace_carrier))`."""
        return {"traceparent": self.traceparent} if self.traceparent else {}

    @property
    def workspace(self) -> Path:
        """The resolved workspace the file tools are confined to."""
        resolved = self._workspace
        if resolved is None:
            resolved = self._workspace = self._workspace_given.resolve()
        return resolved

    # --- cancellation --------------------------------------------------------------------

    @property
    def cancelled(self) -> bool:
        """True once the call was cancelled or timed out; sync tools poll it and stop early."""
        return self._cancelled_flag

    async def wait_cancelled(self) -> None:
        """Return when the call is cancelled (for async tools watching in a side task)."""
        if self._cancelled_flag:
            return
        if self._cancelled_async is None:
            self._cancelled_async = anyio.Event()
        await self._cancelled_async.wait()

    def wait_cancelled_blocking(self, timeout: float | None = None) -> bool:
        """From a worker thread: sleep up to `timeout` s, waking early on cancellation.

        Returns True if the call was cancelled. Use it instead of `time.sleep` in sync tools.
        """
        with _EVENT_LOCK:  # made here or set by `_cancel`, never both missed (the flag is first)
            event = self._cancelled_event
            if event is None:
                event = self._cancelled_event = threading.Event()
            if self._cancelled_flag:
                event.set()
        return event.wait(timeout)

    def _cancel(self) -> None:
        """Called by the runner, on the event loop thread."""
        self._cancelled_flag = True
        with _EVENT_LOCK:
            if self._cancelled_event is not None:
                self._cancelled_event.set()
        if self._cancelled_async is not None:
            self._cancelled_async.set()

    # --- progress ------------------------------------------------------------------------

    def progress(self, update: Any) -> Awaitable[None]:
        """Stream a partial result (mapped like a return value) to the caller.

        Async tools: `await ctx.progress(obj)`. Sync tools in a worker thread: `ctx.progress(obj)`
        blocks until the update is handed over (the returned awaitable is already done). Updates
        after the call ended, or with no listener, are dropped.
        """
        if self._closed or self._on_progress is None:
            return _Ready()
        partial = ToolResult(content=to_content(update))
        if threading.get_ident() == self._loop_thread:
            return self._deliver(partial)
        try:
            anyio.from_thread.run(self._deliver, partial, token=self._token)
        except RuntimeError:  # the event loop is gone: the call is over, drop the update
            pass
        return _Ready()

    async def _deliver(self, partial: ToolResult) -> None:
        if self._closed or self._on_progress is None:
            return
        try:
            pending = self._on_progress(partial)
            if inspect.isawaitable(pending):
                await pending
        except Exception:  # best effort, like the event stream: a bad listener must not fail the tool
            logger.exception("progress callback failed for tool call %s", self.call_id)

    def _bind(self) -> None:
        """Called by the runner on the event loop: lets worker threads reach this loop."""
        self._loop_thread = threading.get_ident()
        self._token = anyio.lowlevel.current_token()

    def _close(self) -> None:
        self._closed = True

    # --- workspace -----------------------------------------------------------------------

    def resolve_path(self, path: str | os.PathLike[str], *, write: bool = True) -> Path:
        """`path` (relative to the workspace, or absolute inside it) as a resolved Path.

        Raises WorkspaceError if it resolves, through `..` or symlinks, outside the workspace;
        with `write` (the default: a tool that only reads says so), also if it is one of the
        protected paths (`tools.sandbox.check_writable`: the bus's Python environment, `.git`,
        the topology file, a group's `read_only` list: `policy`).
        """
        return confine(self.workspace, path, write=write, policy=self.policy)


def confine(workspace: Path, path: str | os.PathLike[str], *, write: bool = True,
            policy: SandboxPolicy = DEFAULT_POLICY) -> Path:
    """Resolve `path` against `workspace` (symlinks included) and refuse escapes.

    Also refuses anything inside an agent-bus state directory, whatever the workspace: a model
    that could write there could rewrite the running configuration or the event log. With
    `write`, also the protected paths of `tools.sandbox` under `policy` (files there run as code
    outside the tools' reach: a `.pth` in the venv, a git hook), in every case, sandbox or not.
    """
    root = workspace.resolve()
    raw = os.fspath(path)
    if "\0" in raw:
        raise WorkspaceError(f"Path `{raw!r}` contains a NUL byte")
    candidate = Path(raw)
    resolved = (candidate if candidate.is_absolute() else root / candidate).resolve()
    if resolved != root and not resolved.is_relative_to(root):
        raise WorkspaceError(
            f"Path `{raw}` resolves to `{resolved}`, outside the workspace `{root}`; "
            f"use a path inside the workspace (relative paths are resolved against it)"
        )
    state = inside_state_dir(resolved)
    if state is not None:
        raise WorkspaceError(f"Path `{raw}` is inside the bus's state directory `{state}`, "
                             "which tools may not read or write")
    if write:
        refusal = check_writable(root, resolved, raw, policy)
        if refusal:
            raise WorkspaceError(refusal)
    return resolved
