"""Issue 49 item 11: `busctl experiment run` (run.workspace = "sample") refuses only when a
variant's agents can call a tool that cannot honour a run workspace.

A live foreign tool registered without `meta.workspaces` (here a stateless one, served by a
peer of the test) used to make every experiment refuse to start. Now: a variant whose agent
cannot call it runs; one whose agent (or an agent it asks) can is refused, the error naming the
variant, the agent, the tool and its workers, and what to do. Real hub, gateway, worker,
coordinator and `busctl experiment run` processes."""

from __future__ import annotations

import functools
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import anyio.to_thread
import msgspec
import pytest

from agent_bus.bus.client import IncomingRequest, Peer, connect
from agent_bus.bus.messages import TextPart, ToolResult
from tests.coordinator.conftest import Stack, start_stack
from tests.support import busctl

pytestmark = pytest.mark.anyio

AGENTS = """
[[agents]]
name = "calc"
model = "x"
tools = ["echo"]

[[agents]]
name = "star"
model = "x"
tools = ["*"]

[[agents]]
name = "lead"
model = "x"
tools = []
agents = ["star"]
"""

SPEC = """
name = "{variant}-exp"
[dataset]
path = "samples.jsonl"
[[variants]]
name = "{variant}"
agent = "{variant}"
"""


@pytest.fixture
async def stack_with_foreign_tool(tmp_path: Path) -> AsyncIterator[tuple[Stack, Peer]]:
    stack = start_stack(tmp_path, coordinator=("calc", "star", "lead"), agents=AGENTS)
    try:
        async with connect(stack.endpoint, name="foreign-clock") as foreign:
            async def now(req: IncomingRequest) -> bytes:
                return msgspec.msgpack.encode(ToolResult(content=[TextPart(text="12:00")]))

            # stateless: it touches no file, and names no `workspaces` in its meta
            await foreign.serve("tool.clock_now", now, meta={"description": "The time."})
            yield stack, foreign
    finally:
        stack.close()


async def run_experiment(stack: Stack, variant: str) -> subprocess.CompletedProcess[str]:
    folder = stack.dir / variant
    folder.mkdir()
    (folder / "samples.jsonl").write_text('{"id": 1, "input": "hi", "target": "hi"}\n')
    (folder / "spec.toml").write_text(SPEC.format(variant=variant))
    command = busctl("experiment", "run", str(folder / "spec.toml"), "--hub", stack.endpoint)
    # in a thread: the test's own peer (the foreign tool) keeps heartbeating meanwhile
    return await anyio.to_thread.run_sync(functools.partial(
        subprocess.run, command, capture_output=True, text=True, timeout=120, cwd=folder))


async def test_a_variant_whose_agents_cannot_call_the_tool_runs(
        stack_with_foreign_tool: tuple[Stack, Peer]) -> None:
    stack, _ = stack_with_foreign_tool
    done = await run_experiment(stack, "calc")
    assert done.returncode == 0, done.stderr
    assert "cannot honour a run workspace" not in done.stderr


@pytest.mark.parametrize(("variant", "named"), [
    ("star", "agent `star` can call tool `clock_now`"),
    ("lead", "agent `star` (asked by `lead`) can call tool `clock_now`"),
])
async def test_a_variant_whose_agents_can_call_it_is_refused_saying_why(
        stack_with_foreign_tool: tuple[Stack, Peer], variant: str, named: str) -> None:
    stack, _ = stack_with_foreign_tool
    refused = await run_experiment(stack, variant)
    assert refused.returncode == 2, (refused.returncode, refused.stderr)
    assert f"variants[0] (`{variant}`): {named}" in refused.stderr, refused.stderr
    assert "which cannot honour a run workspace" in refused.stderr
    assert "foreign-clock" in refused.stderr  # its worker, by name
    assert "run.workspace = \"shared\"" in refused.stderr
