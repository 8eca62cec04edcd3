"""Issue 18, fork (acceptance 3): `busctl replay --live-from 2 --model y` replays each run's
first two turns from the log and sends the third to another scripted model: the report names the
divergence at turn 3, and `busctl diff` shows the changed final texts and token counts."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from agent_bus.agents.client.remote import connect
from agent_bus.agents.gateway.fakellm import FakeLLMServer
from tests.coordinator.conftest import Stack, start_stack
from tests.support import busctl

pytestmark = pytest.mark.anyio


def echo(text: str) -> dict[str, object]:
    return {"text": f"Step {text}.", "tool_calls": [{"name": "echo", "arguments": {"text": text}}]}


SCRIPT_X = {"rules": [
    {"tool_result": False, "reply": echo("step-a")},
    {"tool_result": True, "results_contain": ["step-a"], "reply": echo("step-b")},
    {"tool_result": True, "results_contain": ["step-b"], "reply": {"text": "Final from x."}},
]}
SCRIPT_Y = {"rules": [{"tool_result": None, "reply": {"text": "A much longer final answer from model y, which "
                                          "differs from the recorded one in its tokens too."}}]}


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[Stack, FakeLLMServer]]:
    with FakeLLMServer(SCRIPT_Y) as other:
        agents = f"""
[models.y]
provider = "openai"
base_url = "{other.base_url}"
model = "m"
timeout = 10.0

[[agents]]
name = "solo"
model = "x"
tools = ["echo"]
"""
        s = start_stack(tmp_path, coordinator=("solo",), agents=agents)
        try:
            yield s, other
        finally:
            s.close()


def cli(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(busctl(args[0], "--hub", stack.endpoint, *args[1:]),
                          capture_output=True, text=True, timeout=60, check=False)


async def test_live_from_forks_at_the_turn(stack: tuple[Stack, FakeLLMServer]) -> None:
    s, other = stack
    s.srv.set_script(SCRIPT_X)
    async with connect(s.endpoint, name="test-fork") as bus:
        for i in range(2):
            result = await bus.run("solo", f"task {i}", experiment="base")
            assert result.final_text == "Final from x.", result
    recorded = len(s.srv.requests)
    assert recorded == 6

    out = await anyio.to_thread.run_sync(cli, s, "replay", "--experiment", "base", "--as",
                                         "forked", "--live-from", "2", "--model", "y")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "diverged at run 1 (agent `solo`), turn 3" in out.stderr, out.stderr
    assert "message_start" in out.stderr or "message_end" in out.stderr, out.stderr
    assert len(s.srv.requests) == recorded  # turns 1-2 from the log
    assert len(other.requests) == 2  # turn 3 of each run, live on model y

    diffed = await anyio.to_thread.run_sync(cli, s, "diff", "base", "forked", "--json")
    report = json.loads(diffed.stdout)
    assert report["identical"] is False
    for run in report["runs"]:
        assert run["differs"] == ["final_text", "tokens"], run
        assert run["a"]["final_text"] == "Final from x."
        assert run["b"]["final_text"].startswith("A much longer final answer")
        assert run["b"]["tokens"]["output"] > run["a"]["tokens"]["output"]
        assert run["a"]["turns"] == run["b"]["turns"] == 3
    human = await anyio.to_thread.run_sync(cli, s, "diff", "base", "forked")
    assert "-Final from x." in human.stdout and "+A much longer" in human.stdout, human.stdout

    bad = await anyio.to_thread.run_sync(cli, s, "replay", "--experiment", "base", "--model", "y")
    assert bad.returncode == 2 and "--live-from" in bad.stderr
