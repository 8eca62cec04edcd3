"""Issue 18, the fork options beside `--live-from TURN --model ALIAS`: `--live-from-seq SEQ` (fork
at a point of the event log), `--system-prompt-file F` and `--set AGENT.KEY=VALUE` (change the
live part), on real processes: hub, gateway, tool worker, coordinator and two scripted model
servers whose request logs show what each live call carried. The recorded experiment (2 runs of
3 turns on model x) is made once; every test forks it under a new name."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from agent_bus.agents.client.remote import connect
from agent_bus.agents.gateway.fakellm import FakeLLMServer
from agent_bus.agents.launch.topology import TopologyError, parse_topology
from agent_bus.agents.replay import Fork, ForkError, ForkPlan, _plan_agent
from tests.coordinator.conftest import Stack, start_stack
from tests.durable.test_fork import SCRIPT_X, SCRIPT_Y
from tests.support import busctl

pytestmark = pytest.mark.anyio

RECORDED_SYSTEM = "You are SOLO, step by step."
AGENTS = """
[[agents]]
name = "solo"
model = "x"
system_prompt = "{system}"
tools = ["echo"]
"""


class Recorded:
    def __init__(self, stack: Stack, other: FakeLLMServer, turn_starts: list[dict[str, Any]]):
        self.stack, self.other, self.turn_starts = stack, other, turn_starts

    def turn_seq(self, run: int, turn: int) -> int:
        """The seq of run `run`'s (1-based, start order) `turn_start` of `turn`."""
        runs = list(dict.fromkeys(e["run_id"] for e in self.turn_starts))
        return next(e["seq"] for e in self.turn_starts
                    if e["run_id"] == runs[run - 1] and e["turn"] == turn)


def cli(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(busctl(args[0], "--hub", stack.endpoint, *args[1:]),
                          capture_output=True, text=True, timeout=60, check=False)


async def record(s: Stack) -> list[dict[str, Any]]:
    s.srv.set_script(SCRIPT_X)
    async with connect(s.endpoint, name="test-fork-options") as bus:
        for i in range(2):
            result = await bus.run("solo", f"task {i}", experiment="base")
            assert result.final_text == "Final from x.", result
    assert len(s.srv.requests) == 6
    out = await anyio.to_thread.run_sync(cli, s, "watch", "--experiment", "base", "--no-follow",
                                         "--json", "--type", "turn_start")
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Recorded]:
    with FakeLLMServer(SCRIPT_Y) as other:
        models = f"""
[models.y]
provider = "openai"
base_url = "{other.base_url}"
model = "m"
timeout = 10.0
"""
        s = start_stack(tmp_path_factory.mktemp("fork"), coordinator=("solo",),
                        agents=models + AGENTS.format(system=RECORDED_SYSTEM))
        try:
            starts = anyio.run(record, s, backend="asyncio")
            assert len(starts) == 6, starts
            yield Recorded(s, other, starts)
        finally:
            s.close()


@pytest.fixture
def fresh(recorded: Recorded) -> Recorded:
    """The recorded stack with empty request logs for this test (the servers' scripts from
    their first step)."""
    recorded.stack.srv.set_script(SCRIPT_X, clear_requests=True)
    recorded.other.set_script(SCRIPT_Y, clear_requests=True)
    return recorded


async def fork(r: Recorded, target: str, *options: str) -> tuple[str, dict[str, Any]]:
    """`busctl replay --experiment base --as TARGET OPTIONS...` (it must diverge); returns the
    divergence it reported and `busctl diff base TARGET --json`."""
    out = await anyio.to_thread.run_sync(cli, r.stack, "replay", "--experiment", "base",
                                         "--as", target, *options)
    assert out.returncode == 1, out.stdout + out.stderr
    divergence = out.stderr.partition(f"replayed as {target}: ")[2].strip()
    assert divergence.startswith("diverged at run"), out.stderr
    diffed = await anyio.to_thread.run_sync(cli, r.stack, "diff", "base", target, "--json")
    assert diffed.returncode == 0, diffed.stderr
    return divergence, json.loads(diffed.stdout)


async def test_live_from_seq_forks_where_the_log_says(fresh: Recorded) -> None:
    r = fresh
    by_turn, _ = await fork(r, "by-turn", "--live-from", "2", "--model", "y")
    assert "diverged at run 1 (agent `solo`), turn 3" in by_turn
    assert (len(r.stack.srv.requests), len(r.other.requests)) == (0, 2)  # turn 3 of each run

    # at the seq of run 1's turn 3: run 1 replays turns 1-2, as --live-from 2; run 2 began
    # after that point, so all of it is live
    r.other.set_script(SCRIPT_Y, clear_requests=True)
    at_run1, report = await fork(r, "by-seq-1", "--live-from-seq", str(r.turn_seq(1, 3)),
                                 "--model", "y")
    assert at_run1 == by_turn
    assert (len(r.stack.srv.requests), len(r.other.requests)) == (0, 2)
    first, second = report["runs"]
    assert first["differs"] == ["final_text", "tokens"] and first["b"]["turns"] == 3, first
    assert second["b"]["turns"] == 1 and "turns" in second["differs"], second

    # at the seq of run 2's turn 3: run 1 is replayed whole, run 2 goes live at its turn 3
    r.other.set_script(SCRIPT_Y, clear_requests=True)
    at_run2, report = await fork(r, "by-seq-2", "--live-from-seq", str(r.turn_seq(2, 3)),
                                 "--model", "y")
    assert "diverged at run 2 (agent `solo`), turn 3" in at_run2
    assert at_run2.partition(": ")[2] == by_turn.partition(": ")[2]  # the same difference
    assert (len(r.stack.srv.requests), len(r.other.requests)) == (0, 1)
    assert [run["differs"] for run in report["runs"]] == [[], ["final_text", "tokens"]]


async def test_system_prompt_file_and_set_change_only_the_live_calls(fresh: Recorded,
                                                                      tmp_path: Path) -> None:
    r = fresh
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("You are SOLO, now terse.\n")
    _, report = await fork(r, "changed", "--live-from", "2", "--model", "y",
                           "--system-prompt-file", str(prompt), "--set", "solo.temperature=0.2",
                           "--set", "solo.max_tokens=77", "--set", "solo.stop=END")
    assert len(r.stack.srv.requests) == 0  # turns 1-2 from the log
    live = r.other.bodies
    assert len(live) == 2, live
    for body in live:
        assert body["messages"][0] == {"role": "system", "content": "You are SOLO, now terse.\n"}
        assert (body["temperature"], body["max_tokens"], body["stop"]) == (0.2, 77, ["END"])
    assert report["runs"][0]["b"]["final_text"].startswith("A much longer final answer")

    # the recorded calls had neither: the change is the fork's, not the agent's
    r.stack.srv.set_script(SCRIPT_X, clear_requests=True)
    async with connect(r.stack.endpoint, name="test-fork-options") as bus:
        assert (await bus.run("solo", "task 9", experiment="plain")).final_text == "Final from x."
    for body in r.stack.srv.bodies:
        assert body["messages"][0]["content"] == RECORDED_SYSTEM
        assert "temperature" not in body and "stop" not in body


async def test_set_turn_bound_and_model_per_agent(fresh: Recorded) -> None:
    """`--set solo.max_turns=2 --set solo.model=x`: turn 1 from the log, turn 2 live on x (the
    agent's own model, named per agent), then the bound ends the run (its summary call is
    live too)."""
    r = fresh
    _, report = await fork(r, "bounded", "--live-from", "1", "--set", "solo.max_turns=2",
                           "--set", "solo.model=x")
    assert len(r.other.requests) == 0
    assert len(r.stack.srv.requests) == 4  # per run: turn 2, the max-turns summary
    for run in report["runs"]:
        assert (run["b"]["turns"], run["b"]["stop_reason"]) == (2, "max_iterations"), run


async def test_the_client_takes_the_same_fork(fresh: Recorded) -> None:
    r = fresh
    fork_y = Fork(live_from=2, model="y", settings={"solo.temperature": 0.2})
    async with connect(r.stack.endpoint, name="test-fork-client", replay_from="base",
                       fork=fork_y) as bus:
        result = await bus.run("solo", "task 0", experiment="client-fork")
    assert result.final_text.startswith("A much longer final answer"), result
    assert len(r.stack.srv.requests) == 0
    assert [b["temperature"] for b in r.other.bodies] == [0.2]

    async with connect(r.stack.endpoint, name="test-fork-client", replay_from="base",
                       fork=Fork(live_from=2, settings={"solo.top_p": 3})) as bus:
        with pytest.raises(ForkError, match=r"--set solo.top_p=3: expected a finite number <= 1"):
            await bus.run("solo", "task 0", experiment="client-fork-bad")
    with pytest.raises(ForkError, match="give replay_from= too"):
        async with connect(r.stack.endpoint, fork=fork_y):
            pass
    assert (len(r.stack.srv.requests), len(r.other.requests)) == (0, 1)


BAD = [
    (["--live-from", "2", "--set", "solo.temperature=hot"],
     "--set solo.temperature=hot: expected a number; e.g. --set solo.temperature=0.2"),
    (["--live-from", "2", "--set", "solo.max_tokens=-5"],
     "--set solo.max_tokens=-5: expected a whole number >= 1"),
    (["--live-from", "2", "--set", "solo.max_turns=0"], "--set solo.max_turns=0: expected a whole"),
    (["--live-from", "2", "--set", "nobody.temperature=0.2"],
     "--set nobody.temperature=0.2: experiment `base` has no runs of agent `nobody`"),
    (["--live-from", "2", "--set", "solo.tools=[]"], "`tools` cannot change in a fork"),
    (["--live-from", "2", "--set", "solo.temprature=0.2"], "`temprature` is not an [[agents]] key"),
    (["--live-from", "2", "--set", "solo=0.2"], "--set solo=0.2: expected AGENT.KEY=VALUE"),
    (["--live-from", "2", "--model", "nosuch"],
     "--model / --set AGENT.model: model alias nosuch is not one of this gateway's"),
    (["--live-from-seq", "999999999"], "--live-from-seq 999999999: experiment `base`'s events"),
    (["--live-from", "2", "--live-from-seq", "5"], "--live-from and --live-from-seq"),
    (["--set", "solo.temperature=0.2"], "give --live-from TURN or --live-from-seq SEQ too"),
    (["--live-from", "2", "--system-prompt-file", "/nonexistent/prompt.txt"],
     "'--system-prompt-file': File '/nonexistent/prompt.txt' does not exist"),
    # issue 35 item 5: the topology file's ranges, nothing that overflows or is not finite
    (["--live-from", "2", "--set", f"solo.max_tokens={10**40}"],
     f"--set solo.max_tokens={10**40}: expected a whole number <= 2147483647"),
    (["--live-from", "2", "--set", f"solo.max_turns={10**40}"],
     f"--set solo.max_turns={10**40}: expected a whole number of turns from 1 to 2147483647"),
    (["--live-from", "2", "--set", "solo.temperature=inf"],
     "--set solo.temperature=inf: expected a finite number <= 2.0"),
    (["--live-from", "2", "--system-prompt-file", "/dev/zero"],
     "--system-prompt-file /dev/zero: larger than 1 MiB"),
]


@pytest.mark.parametrize(("options", "message"), BAD, ids=[" ".join(o) for o, _ in BAD])
async def test_bad_fork_options_exit_2_before_anything_runs(fresh: Recorded, options: list[str],
                                                            message: str) -> None:
    r = fresh
    target = "never"
    out = await anyio.to_thread.run_sync(cli, r.stack, "replay", "--experiment", "base", "--as",
                                         target, *options)
    assert out.returncode == 2, out.stdout + out.stderr
    assert message in " ".join(out.stderr.split()), out.stderr
    assert (len(r.stack.srv.requests), len(r.other.requests)) == (0, 0)
    diffed = await anyio.to_thread.run_sync(cli, r.stack, "diff", "base", target)
    assert "experiment `never` has no runs" in diffed.stderr, diffed.stdout + diffed.stderr


@pytest.mark.parametrize(("key", "value"), [
    ("temperature", "inf"), ("temperature", "nan"), ("top_p", "0"), ("max_tokens", str(10**40)),
    ("seed", str(2**63)), ("max_iterations", "0")])
async def test_the_topology_file_has_the_same_ranges(key: str, value: str) -> None:
    """One set of ranges (agents/launch/topology.py) for the file and for `--set`."""
    spec = f'[[agents]]\nname = "solo"\n{key} = {value}\n'
    with pytest.raises(TopologyError, match=key):
        parse_topology(spec.encode(), "t.toml", as_json=False)
    with pytest.raises(ForkError, match=f"--set solo.{key}={value}: expected"):
        _plan_agent(ForkPlan(), "solo", {key: value}, ["solo"])


async def test_empty_system_prompt_file_is_refused(fresh: Recorded, tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text(" \n")
    out = await anyio.to_thread.run_sync(cli, fresh.stack, "replay", "--experiment", "base",
                                         "--live-from", "2", "--system-prompt-file", str(empty))
    assert out.returncode == 2 and f"--system-prompt-file {empty} is empty" in out.stderr, \
        out.stderr
    huge = tmp_path / "huge.txt"  # issue 35 item 5: was "lost the hub" (over its message limit)
    with huge.open("w") as f:
        f.truncate(20 << 20)
    out = await anyio.to_thread.run_sync(cli, fresh.stack, "replay", "--experiment", "base",
                                         "--live-from", "2", "--system-prompt-file", str(huge))
    assert out.returncode == 2, out.stderr
    assert f"--system-prompt-file {huge}: larger than 1 MiB" in " ".join(out.stderr.split())
    assert (len(fresh.stack.srv.requests), len(fresh.other.requests)) == (0, 0)


# --- issue 45 §4: content first, usage apart; a fork point that forks nothing; all live ------


def cached(script: dict[str, Any], usage: dict[str, int]) -> dict[str, Any]:
    """`script` with every reply reporting `usage` (a server whose prompt cache split differs)."""
    return {"rules": [{**rule, "reply": {**rule["reply"], "usage": usage}} for rule in script["rules"]]}


async def test_live_from_0_sends_every_call_live_and_a_cache_split_is_not_a_divergence(
        fresh: Recorded) -> None:
    """The same answers from the live model, with another split of cached tokens: identical
    (the content is compared), and the token differences are reported apart."""
    r = fresh
    r.stack.srv.set_script(cached(SCRIPT_X, {"input": 20, "cached": 24, "output": 5}),
                           clear_requests=True)
    out = await anyio.to_thread.run_sync(cli, r.stack, "replay", "--experiment", "base", "--as",
                                         "all-live", "--live-from", "0", "--model", "x")
    assert out.returncode == 0, out.stdout + out.stderr
    assert len(r.stack.srv.requests) == 6  # every call of both runs went live
    assert "replayed as all-live: identical" in out.stdout, out.stdout
    assert "token usage differs" in out.stdout and "run 1 (solo): tokens" in out.stdout, out.stdout
    assert "cache_read 0 -> 72" in out.stdout, out.stdout  # three calls, 24 each


@pytest.mark.parametrize("options", [["--live-from", "3"], ["--live-from", "7", "--model", "y"]])
async def test_a_fork_point_past_every_run_says_no_call_would_go_live(fresh: Recorded,
                                                                       options: list[str]) -> None:
    r = fresh
    out = await anyio.to_thread.run_sync(cli, r.stack, "replay", "--experiment", "base", "--as",
                                         "nothing-live", *options)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "no model call would go live" in out.stderr and "at most 3 model calls" in out.stderr, \
        out.stderr
    assert (len(r.stack.srv.requests), len(r.other.requests)) == (0, 0)


def test_a_seq_after_the_last_reply_forks_nothing() -> None:
    from agent_bus.agents.replay import RecordedRun, plan_fork

    run = RecordedRun("r1", "solo", reply_seqs=[10, 20], first_seq=5, last_seq=25)
    with pytest.raises(ForkError, match="no model call would go live: the last model reply of `base` is seq 20"):
        plan_fork(Fork(live_from_seq=21), [run], "base")
    plan_fork(Fork(live_from_seq=20), [run], "base")  # the last reply goes live
    assert Fork(live_from=0).forks and Fork(live_from=0).live_seq([run]) == 5
