"""Issue 18, a fork of a 2-agent experiment: the caller's live turn asks its helper something the
log never saw. The helper's model request has no logged reply, so it goes to the live model (in
a fork; never an error reply), the run completes, and the report names the first divergence: the
caller's live turn. A pure replay (no fork) still answers such a request with an error reply.

Real processes: hub, gateway, tool worker, coordinator (`lead` asks `helper` through
`ask_helper`), the scripted model `x` that recorded the experiment and a second one, `y`, for the
live part."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

from agent_bus.agents.client.remote import connect
from agent_bus.agents.gateway.fakellm import FakeLLMServer
from tests.coordinator.conftest import Stack, start_stack
from tests.durable.test_replay import AGENTS, script
from tests.support import busctl

pytestmark = pytest.mark.anyio

NEW_ASK = "something new: which fruit is yellow?"
#: Model y: the lead's live turn asks the helper something new; the helper answers it; the lead
#: ends with the new answer. (The replayed helper's own live call, under `--live-from 1`, echoes.)
SCRIPT_Y: dict[str, Any] = {"rules": [
    {"system": ["HELPER"], "tool_result": False, "contains": ["something new"],
     "reply": {"text": "New help: bananas."}},
    {"system": ["HELPER"], "tool_result": True, "reply": {"text": "Helper echoed: {tool_results}"}},
    {"system": ["LEAD"], "tool_result": True, "results_contain": ["New help"],
     "reply": {"text": "Lead final: {tool_results}"}},
    {"system": ["LEAD"], "tool_result": True,
     "reply": {"text": "Asking again.", "tool_calls": [
         {"name": "ask_helper", "arguments": {"prompt": NEW_ASK}}]}},
]}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, FakeLLMServer]]:
    with FakeLLMServer(SCRIPT_Y) as other:
        models = f"""
[models.y]
provider = "openai"
base_url = "{other.base_url}"
model = "m"
timeout = 10.0
"""
        s = start_stack(tmp_path_factory.mktemp("fork-helper"), coordinator=("lead", "helper"),
                        agents=models + AGENTS)
        try:
            anyio.run(record, s, backend="asyncio")
            yield s, other
        finally:
            s.close()


async def record(s: Stack) -> None:
    s.srv.set_script(script("Lead says:"))
    async with connect(s.endpoint, name="test-fork-helper") as bus:
        result = await bus.run("lead", "question 0", experiment="base")
    assert result.final_text.startswith("Lead says:"), result
    assert len(s.srv.requests) == 4  # 2 lead + 2 helper calls


def cli(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(busctl(args[0], "--hub", stack.endpoint, *args[1:]),
                          capture_output=True, text=True, timeout=60, check=False)


def lead_turn_2_seq(s: Stack) -> int:
    out = cli(s, "watch", "--experiment", "base", "--no-follow", "--json", "--type", "turn_start")
    assert out.returncode == 0, out.stderr
    starts = [json.loads(line) for line in out.stdout.splitlines()]
    return next(e["seq"] for e in starts if e["agent"] == "lead" and e["turn"] == 2)


def helper_asked_anew(body: dict[str, Any]) -> bool:
    return "HELPER" in json.dumps(body["messages"][0]) and NEW_ASK in json.dumps(body)


@pytest.mark.parametrize("fork_at", ["--live-from", "--live-from-seq"])
async def test_a_live_turn_asking_the_helper_anew_goes_live(
        stack: tuple[Stack, FakeLLMServer], fork_at: str) -> None:
    s, other = stack
    s.srv.set_script(script("Lead says:"), clear_requests=True)
    other.set_script(SCRIPT_Y, clear_requests=True)
    point = "1" if fork_at == "--live-from" else str(lead_turn_2_seq(s))
    target = f"forked{fork_at}"
    out = await anyio.to_thread.run_sync(cli, s, "replay", "--experiment", "base", "--as",
                                         target, fork_at, point, "--model", "y")
    assert out.returncode == 1, out.stdout + out.stderr
    # the lead's turn 2 is the first thing that differs (its live reply asks anew)
    assert "diverged at run 1 (agent `lead`), turn 2" in out.stderr, out.stderr

    assert len(s.srv.requests) == 0  # the replayed part came from the log
    asked = [b for b in other.bodies if helper_asked_anew(b)]
    assert len(asked) == 1, other.bodies  # the helper's unmatched request reached model y
    # --live-from 1: also the replayed helper's 2nd call; --live-from-seq: only the new part
    assert len(other.requests) == (4 if fork_at == "--live-from" else 3), other.bodies

    diffed = await anyio.to_thread.run_sync(cli, s, "diff", "base", target, "--json")
    report = json.loads(diffed.stdout)
    runs = [r["b"] for r in report["runs"] if r["b"] is not None]
    assert [r["agent"] for r in runs] == ["lead", "helper", "helper"], runs
    assert all(r["stop_reason"] == "stop" for r in runs), runs  # no error replies
    assert runs[0]["final_text"] == "Lead final: - New help: bananas.", runs[0]
    assert runs[2]["final_text"] == "New help: bananas."


async def test_pure_replay_answers_an_unmatched_request_with_an_error(
        stack: tuple[Stack, FakeLLMServer]) -> None:
    s, other = stack
    s.srv.set_script(script("Lead says:"), clear_requests=True)
    other.set_script(SCRIPT_Y, clear_requests=True)
    async with connect(s.endpoint, name="test-fork-helper", replay_from="base") as bus:
        result = await bus.run("lead", "a question the log never saw", experiment="pure")
    assert result.stop_reason == "error", result
    assert "no recorded reply left for this request of agent `lead`" in (result.error or "")
    assert (len(s.srv.requests), len(other.requests)) == (0, 0)
