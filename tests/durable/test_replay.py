"""Issue 18, replay and compare (acceptance 2): a 5-run, 2-agent experiment (the lead asks the
helper through `ask_helper`) is replayed with `busctl replay`: no request reaches the model
server, no tool runs (the tool worker is stopped: results come from the log), the report says
identical and `busctl diff` finds no difference; with `--live-tools` the missing worker makes it
diverge; an experiment run with another script differs, and `busctl diff` names how."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from agent_bus.agents.client.remote import connect
from tests.coordinator.conftest import Stack, start_stack
from tests.store_cluster import STORES
from tests.support import busctl

pytestmark = pytest.mark.anyio

AGENTS = """
[[agents]]
name = "lead"
model = "x"
system_prompt = "You are LEAD."
agents = ["helper"]
tools = []

[[agents]]
name = "helper"
model = "x"
system_prompt = "You are HELPER."
tools = ["echo"]
"""


def script(final: str) -> dict[str, Any]:
    return {"rules": [
        {"system": ["LEAD"], "tool_result": False,
         "reply": {"text": "Asking.", "tool_calls": [
             {"name": "ask_helper", "arguments": {"prompt": "help with {last_user}"}}]}},
        {"system": ["LEAD"], "tool_result": True,
         "reply": {"text": final + " {tool_results}"}},
        {"system": ["HELPER"], "tool_result": False,
         "reply": {"text": "Echoing.", "tool_calls": [
             {"name": "echo", "arguments": {"text": "{last_user}"}}]}},
        {"system": ["HELPER"], "tool_result": True,
         "reply": {"text": "Helper echoed: {tool_results}"}},
    ], "echo": True}


@pytest.fixture(params=STORES)
def stack(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Stack]:
    # each test on the SQLite log and on a JetStream stream: replay reads the same either way
    store = "" if request.param == "sqlite" else request.getfixturevalue("jetstream").stream_url()
    s = start_stack(tmp_path, coordinator=("lead", "helper"), agents=AGENTS, store=store)
    try:
        yield s
    finally:
        s.close()


def cli(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(busctl(args[0], "--hub", stack.endpoint, *args[1:]),
                          capture_output=True, text=True, timeout=60, check=False)


async def run_experiment(stack: Stack, experiment: str, final: str) -> None:
    stack.srv.set_script(script(final))
    async with connect(stack.endpoint, name="test-replay") as bus:
        for i in range(5):
            result = await bus.run("lead", f"question {i}", experiment=experiment)
            assert result.final_text.startswith(final), result


async def test_replay_serves_the_log_and_is_identical(stack: Stack) -> None:
    await run_experiment(stack, "exp", "Lead says:")
    asked = len(stack.srv.requests)
    assert asked == 20  # 5 runs x (2 lead + 2 helper) model calls
    stack.stop("worker")  # the tools cannot run again: their results must come from the log

    out = await anyio.to_thread.run_sync(cli, stack, "replay", "--experiment", "exp",
                                         "--as", "exp2")
    if out.returncode != 0:
        log = await anyio.to_thread.run_sync(cli, stack, "export", "--experiment", "exp2")
        ends = [line for line in log.stdout.splitlines() if "tool_execution_end" in line]
        pytest.fail(out.stderr + "\n".join(ends)[-3000:])
    assert "exp replayed as exp2: identical" in out.stdout
    assert len(stack.srv.requests) == asked  # every reply came from the log

    same = await anyio.to_thread.run_sync(cli, stack, "diff", "exp", "exp2", "--json")
    assert same.returncode == 0, same.stderr
    report = json.loads(same.stdout)
    assert report["identical"] is True
    assert len(report["runs"]) == 10  # 5 lead runs and the 5 helper runs they asked for
    assert report["totals"]["a"]["tokens"] == report["totals"]["b"]["tokens"] > 0
    assert {r["a"]["run_id"] for r in report["runs"]}.isdisjoint(
        {r["b"]["run_id"] for r in report["runs"]})

    again = await anyio.to_thread.run_sync(cli, stack, "replay", "--experiment", "exp",
                                           "--as", "exp2")
    assert again.returncode == 2 and "already has runs" in again.stderr, again.stderr

    live = await anyio.to_thread.run_sync(cli, stack, "replay", "--experiment", "exp",
                                          "--as", "exp3", "--live-tools")
    assert live.returncode == 1, live.stdout + live.stderr
    assert "diverged at run 1 (agent `lead`)" in live.stderr, live.stderr
    assert "(tool_execution_end): $.is_error: null != true" in live.stderr, live.stderr
    assert len(stack.srv.requests) == asked  # the divergent replies are replay errors, not calls


async def test_diff_names_what_differs(stack: Stack) -> None:
    await run_experiment(stack, "first", "Lead says:")
    await run_experiment(stack, "second", "Lead concludes:")
    out = await anyio.to_thread.run_sync(cli, stack, "diff", "first", "second")
    assert out.returncode == 0, out.stderr
    assert "run 1 (lead): differs in final_text" in out.stdout, out.stdout
    assert "-Lead says:" in out.stdout and "+Lead concludes:" in out.stdout, out.stdout
    assert "run 2 (helper): same" in out.stdout, out.stdout
    assert out.stdout.rstrip().endswith("different")
    missing = await anyio.to_thread.run_sync(cli, stack, "diff", "first", "nope")
    assert missing.returncode == 2 and "`nope` has no runs" in missing.stderr


async def test_a_script_runs_against_a_recorded_experiment(stack: Stack) -> None:
    await run_experiment(stack, "recorded", "Lead says:")
    asked = len(stack.srv.requests)
    async with connect(stack.endpoint, name="test-replay-lib", replay_from="recorded") as bus:
        with pytest.raises(ValueError, match="give each prompt an `experiment=`"):
            await bus.run("lead", "question 1")
        result = await bus.run("lead", "question 1", experiment="scripted")
    assert result.final_text == "Lead says: - Helper echoed: - help with question 1"
    assert len(stack.srv.requests) == asked  # answered from the log
