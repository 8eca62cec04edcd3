"""run_shell: a shell command in the workspace, only where the worker enabled shell access.

The command runs as `/bin/sh -c` with stdin closed and stderr merged into stdout, in a nested
bubblewrap sandbox of its own where one can be set up (the worker's policy,
`ToolContext.policy.shell_prefix`): a new PID namespace, so when the shell exits, times out or the
call is cancelled everything it started dies with it (`setsid`, double fork and `nohup`
included), and no network unless the worker group sets `network = true`. Without bwrap, the
shell runs in its own session and its process group gets SIGKILL (a `setsid` child escapes
that). Environment variables whose names look like secrets are not passed on.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from typing import Annotated

import anyio
import anyio.abc
import msgspec

from agent_bus.bus.messages import TextPart, ToolResult
from agent_bus.tools._context import ToolContext
from agent_bus.tools._exceptions import ToolError
from agent_bus.tools._tool import tool
from agent_bus.tools.workspaces import RUNS_DIR

MAX_OUTPUT_BYTES = 100 * 1024
#: After the shell exits and its group is killed, how long to wait for the pipe to drain.
DRAIN_GRACE = 1.0
#: How long a killed process group gets to be reaped before we stop waiting.
REAP_GRACE = 2.0
_SECRET_NAME_RE = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)


class _Output:
    """Collected output, capped at `limit` bytes (the rest is counted, not kept)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.chunks: list[bytes] = []
        self.kept = 0
        self.dropped = 0
        self.eof = anyio.Event()

    def add(self, chunk: bytes) -> bytes:
        room = max(self.limit - self.kept, 0)
        kept = chunk[:room]
        self.chunks.append(kept)
        self.kept += len(kept)
        self.dropped += len(chunk) - len(kept)
        return kept

    def text(self) -> str:
        text = b"".join(self.chunks).decode("utf-8", errors="replace")
        if self.dropped:
            text += f"\n[output truncated: {self.dropped} more bytes not shown]"
        return text


@tool
async def run_shell(
    command: Annotated[
        str, msgspec.Meta(min_length=1, description="Shell command line, run by `/bin/sh -c`.")
    ],
    ctx: ToolContext,
    timeout: Annotated[
        float, msgspec.Meta(gt=0, le=600, description="Seconds before the command is killed.")
    ] = 60,
) -> ToolResult:
    """Run a shell command in the workspace directory and return its combined stdout and stderr.
    Output is capped at 100 KiB; the last line gives the exit code, and a non-zero exit code
    marks the result as an error. stdin is closed, so commands must not wait for input. Commands
    are killed, with everything they started, after `timeout` seconds. Only available on workers
    started with shell access enabled.
    """
    if not ctx.allow_shell:
        raise ToolError(
            "Shell commands are disabled on this worker: `run_shell` needs a worker started "
            "with `busctl worker --shell` (`shell = true` in the topology's [[workers]] group)"
        )
    output = _Output(MAX_OUTPUT_BYTES)
    # Shielded: the shell runs (and may start children) before `open_process` returns; a
    # cancellation landing inside it would make asyncio kill the shell alone, leaving its
    # children running. Delivered at the next checkpoint instead, the `finally` kills the group.
    with anyio.CancelScope(shield=True):
        process = await anyio.open_process(
            [*ctx.policy.shell_prefix, *_chdir(ctx), "/bin/sh", "-c", command],
            cwd=ctx.workspace,
            env=_scrubbed_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        timed_out = await _supervise(process, output, ctx, timeout)
    finally:
        _kill_group(process)
        with anyio.move_on_after(REAP_GRACE, shield=True):
            await process.aclose()
    return _result(output, process.returncode, timed_out, timeout)


async def _supervise(
    process: anyio.abc.Process, output: _Output, ctx: ToolContext, timeout: float
) -> bool:
    """Wait for the shell (or the timeout) while pumping output; True if it timed out."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(_pump, process, output, ctx)
        with anyio.move_on_after(timeout) as deadline:
            await process.wait()
        _kill_group(process)  # background children would keep the pipe open
        with anyio.move_on_after(DRAIN_GRACE):
            await output.eof.wait()
        tg.cancel_scope.cancel()
    return deadline.cancelled_caught


async def _pump(process: anyio.abc.Process, output: _Output, ctx: ToolContext) -> None:
    assert process.stdout is not None  # opened with stdout=PIPE
    try:
        async for chunk in process.stdout:
            kept = output.add(chunk)
            if kept:
                await ctx.progress(kept.decode("utf-8", errors="replace"))
    except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
        pass
    finally:
        output.eof.set()


def _kill_group(process: anyio.abc.Process) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group is gone (or the pid was reused)
        pass


def _result(output: _Output, code: int | None, timed_out: bool, timeout: float) -> ToolResult:
    text = output.text() or "(no output)"
    text += "" if text.endswith("\n") else "\n"
    if timed_out:
        text += f"[Command timed out after {timeout:g}s and was killed]"
    else:
        text += f"[exit code {code}]"
    return ToolResult(
        content=[TextPart(text)],
        is_error=timed_out or code != 0,
        details={"exit_code": code, "timed_out": timed_out, "truncated": output.dropped > 0},
    )


def _chdir(ctx: ToolContext) -> list[str]:
    """bwrap's own `--chdir` (it would otherwise keep the cwd only if it exists inside); in a
    run's own workspace (tools.workspaces), also what the call sees of the worker's: the rest
    of it read-only, no other run's folder."""
    if not ctx.policy.shell_prefix:
        return []
    return [*_run_view(ctx), "--chdir", str(ctx.workspace)]


def _run_view(ctx: ToolContext) -> list[str]:
    if not ctx.run_workspace:
        return []
    folder = ctx.workspace
    runs = folder.parents[len(ctx.run_workspace.split("/")) - 1]
    if runs.name != RUNS_DIR:  # not laid out as tools.workspaces makes it: leave the view
        return []
    shared = str(runs.parent)
    return ["--ro-bind", shared, shared, "--tmpfs", str(runs), "--bind", str(folder),
            str(folder)]


def _scrubbed_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not _SECRET_NAME_RE.search(k)}
