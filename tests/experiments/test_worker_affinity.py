"""Per-run worker affinity over real processes: two tool workers serving the same built-in
tools from **different** workspaces, and runs with a workspace each whose first turn writes two
files (two calls at once) and whose second reads them back (two calls at once) and lists its
folder. The hub alone would spread each turn's calls over both workers (ties rotate), so a read
would miss a file the other worker wrote; the coordinator's tool executor prefers the worker that
served the workspace's first call (header `prefer`, docs/protocol.md section 5), so every run
reads its own files and its folder is whole on one worker."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from agent_bus.agents import connect
from agent_bus.agents.gateway.fakellm import load_script
from agent_bus.bus.messages import RunWorkspace
from tests.coordinator.conftest import start_stack
from tests.support import busctl

RUNS = 4

AGENT = """
[[agents]]
name = "w"
model = "x"
tools = ["write_file", "read_file", "list_dir"]
"""

RULES = {"rules": [
    # turn 1: two files at once; turn 2 (after the writes): both read back at once, and a list
    {"tool_result": False, "reply": {"text": "Writing.", "tool_calls": [
        {"name": "write_file", "arguments": {"path": "mine.txt", "content": "{last_user}"}},
        {"name": "write_file", "arguments": {"path": "also.txt", "content": "{last_user}"}}]}},
    {"tool_result": True, "results_contain": ["Wrote "], "reply": {"text": "Reading.",
     "tool_calls": [{"name": "read_file", "arguments": {"path": "mine.txt"}},
                    {"name": "read_file", "arguments": {"path": "also.txt"}},
                    {"name": "list_dir", "arguments": {"path": "."}}]}},
    {"tool_result": True, "reply": {"text": "Saw: {tool_results_full}"}},
]}


@pytest.mark.anyio
async def test_each_runs_calls_stay_on_the_worker_of_its_first_call(tmp_path: Path) -> None:
    stack = start_stack(tmp_path, worker=False, coordinator=None, agents=AGENT)
    try:
        for name in ("wa", "wb"):
            (tmp_path / name).mkdir()
            stack.start(name, busctl("worker", "--hub", stack.endpoint, "--tools",
                                     "agent_bus.tools.builtin", "--workspace",
                                     str(tmp_path / name), "--concurrency", "4", "--name", name))
        stack.coordinator("w", name="coord-w")
        stack.srv.set_script(load_script(RULES), clear_requests=True)
        answers: dict[int, str] = {}
        async with connect(stack.endpoint, name="test-affinity") as bus:

            async def one(i: int) -> None:
                run = await bus.prompt("w", f"token-{i}",
                                       workspace=RunWorkspace(id=f"aff/r{i}"))
                answers[i] = (await run.result()).final_text

            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    for i in range(RUNS):
                        tg.start_soon(one, i)
        for i, answer in answers.items():
            assert answer.count(f"token-{i}") == 2 and "Error" not in answer, answer
            assert "also.txt" in answer and "mine.txt" in answer, answer
        # each run's folder is whole on one worker, and absent on the other
        homes = {i: [w for w in ("wa", "wb") if (tmp_path / w / ".runs" / "aff" / f"r{i}")
                     .exists()] for i in range(RUNS)}
        for i, home in homes.items():
            assert len(home) == 1, (i, home)
            folder = tmp_path / home[0] / ".runs" / "aff" / f"r{i}"
            assert sorted(p.name for p in folder.iterdir()) == ["also.txt", "mine.txt"]
        assert len(answers) == RUNS
    finally:
        stack.close()
