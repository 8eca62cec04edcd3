"""Experiments from Python (issue 7, acceptance 6 and 7): a real `busctl up` topology with two
agents on one scripted model, driven with `agents.connect`; then `busctl export` / `busctl watch`
checked against what the runs did."""

from __future__ import annotations

import json
import subprocess
import threading
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from agent_bus.agents import connect, connect_blocking
from agent_bus.agents.gateway.fakellm import FakeLLMServer
from agent_bus.bus import events as ev
from tests.cli.conftest import start_up
from tests.examples.helpers import stop_up
from tests.support import Proc, busctl

EXPERIMENT = "exp-twenty"

# One scripted model drives both agents: rules are keyed on each agent's system prompt.
SCRIPT = {
    "rules": [
        {"system": ["agent alpha"], "contains": ["look"],
         "reply": {"text": "Looking.", "tool_calls": [{"name": "list_dir", "arguments": {"path": "."}}]}},
        {"system": ["agent alpha"], "tool_result": True, "reply": {"text": "alpha saw {tool_results}"}},
        {"system": ["agent alpha"], "reply": {"text": "alpha: {last_user}"}},
        {"system": ["agent beta"], "reply": {"text": "beta: {last_user}",
                                             "usage": {"input": 11, "output": 5}}},
    ],
    "echo": True,
}

TOPOLOGY = """
[hub]
heartbeat_interval = 0.2

[models.fake]
provider = "openai"
model = "fake-model"
base_url = "{base_url}"

[[workers]]
name = "tools"
tools = ["agent_bus.tools.builtin"]
workspace = "data"

[[agents]]
name = "alpha"
system_prompt = "You are agent alpha."
tools = ["list_dir"]

[[agents]]
name = "beta"
system_prompt = "You are agent beta."
tools = []
"""


class Up:
    def __init__(self, proc: Proc, endpoint: str, cwd: Path, srv: FakeLLMServer) -> None:
        self.proc, self.endpoint, self.cwd, self.srv = proc, endpoint, cwd, srv

    def cli(self, *args: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(busctl(*args[:1], "--hub", self.endpoint, *args[1:]),
                              capture_output=True, timeout=30, cwd=self.cwd)

    def watch(self, *args: str) -> list[dict[str, Any]]:
        out = self.cli("watch", "--json", "--no-follow", "--since", "0", *args)
        assert out.returncode == 0, out.stderr
        return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    cwd = tmp_path_factory.mktemp("experiments")
    (cwd / "data").mkdir()
    (cwd / "data" / "notes.txt").write_text("hello\n")
    with FakeLLMServer(SCRIPT) as srv:
        config = cwd / "topology.toml"
        config.write_text(TOPOLOGY.replace("{base_url}", srv.base_url))
        proc, ready = start_up(cwd, "-c", str(config))
        try:
            yield Up(proc, ready["endpoint"], cwd, srv)
        finally:
            stop_up(proc)


def prompts() -> list[tuple[str, str]]:
    out = []
    for i in range(20):
        agent = "alpha" if i % 2 == 0 else "beta"
        out.append((agent, f"task {i}" + (" look around" if i % 4 == 0 else "")))
    return out


def expected_text(agent: str, text: str) -> str:
    if agent == "alpha" and "look" in text:
        return "alpha saw - notes.txt  (6 bytes)"
    return f"{agent}: {text}"


@pytest.fixture(scope="module")
def twenty(up: Up) -> list[Any]:
    """The acceptance-7 script: 20 prompts, 2 agents, at most 4 at once, one experiment id."""

    async def main() -> list[Any]:
        async with connect(up.endpoint) as bus:
            return await bus.run_many(prompts(), concurrency=4, experiment=EXPERIMENT)

    results = anyio.run(main)
    # Another experiment's run in the same log, which the filters must leave out.
    other = up.cli("run", "--agent", "beta", "--experiment", "other-exp", "not part of it")
    assert other.returncode == 0, other.stdout + other.stderr
    return results


def test_run_many_20_prompts_2_agents_every_final_text_and_export_lists_exactly_those_runs(
        up: Up, twenty: list[Any]) -> None:
    assert len(twenty) == 20
    for (agent, text), result in zip(prompts(), twenty, strict=True):
        assert result.agent == agent and result.error is None
        assert result.final_text == expected_text(agent, text)
        assert result.usage  # per-model usage of the run
    run_ids = {r.run_id for r in twenty}
    assert len(run_ids) == 20
    assert up.srv.max_in_flight <= 4

    out = up.cli("export", "--experiment", EXPERIMENT)
    assert out.returncode == 0, out.stderr
    events = [json.loads(line) for line in out.stdout.splitlines()]
    totals = json.loads(out.stderr.decode().strip().splitlines()[-1])
    assert set(totals["runs"]) == run_ids and len(totals["runs"]) == 20
    assert {e["run_id"] for e in events} == run_ids
    # Every run's events, in order: seq increasing, agent_start first, agent_end last.
    per_run: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for event in events:
        per_run[event["run_id"]].append(event)
    by_id = {r.run_id: r for r in twenty}
    for run_id, run_events in per_run.items():
        seqs = [e["seq"] for e in run_events]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        assert run_events[0]["type"] == "agent_start" and run_events[-1]["type"] == "agent_end"
        assert all(e["agent"] == by_id[run_id].agent for e in run_events)
        last_reply = [e for e in run_events if e["type"] == "message_end"
                      and e["message"]["role"] == "assistant"][-1]
        text = "".join(c.get("text", "") for c in last_reply["message"]["content"])
        assert text == by_id[run_id].final_text


def _usage_sum(events: list[dict[str, Any]], key: str) -> int:
    return sum(e["message"].get("usage", {}).get(key, 0) for e in events
               if e["type"] == "message_end" and e["message"]["role"] == "assistant")


def test_export_has_every_event_of_the_experiment_and_totals_match_per_call_usage(
        up: Up, twenty: list[Any]) -> None:
    logged = up.watch("--experiment", EXPERIMENT)
    everything = up.watch()
    assert logged and all(e.get("experiment") == EXPERIMENT for e in logged)
    assert len(logged) == sum(1 for e in everything if e.get("experiment") == EXPERIMENT)
    assert any(e.get("experiment") == "other-exp" for e in everything)

    out = up.cli("export", "--experiment", EXPERIMENT)
    exported = [json.loads(line) for line in out.stdout.splitlines()]
    totals = json.loads(out.stderr.decode().strip().splitlines()[-1])
    assert exported == logged
    assert totals["events"] == len(logged)
    for key in ("input", "output"):
        expected = _usage_sum(logged, key)
        assert expected > 0
        assert totals["total"].get(key, 0) == expected
        assert sum(u.get(key, 0) for u in totals["by_agent"].values()) == expected
        assert sum(u.get(key, 0) for u in totals["by_model"].values()) == expected
    beta_calls = sum(1 for e in logged if e["type"] == "message_end" and e["agent"] == "beta"
                     and e["message"]["role"] == "assistant")
    assert totals["by_agent"]["beta"]["input"] == 11 * beta_calls  # the scripted usage

    target = up.cwd / "exp.msgpack"
    packed = up.cli("export", "--experiment", EXPERIMENT, "--format", "msgpack", "-o", str(target))
    assert packed.returncode == 0, packed.stderr
    data = target.read_bytes()
    # The file is a stream of maps: as the body of an array of len(logged) it decodes exactly.
    decoded = msgspec.msgpack.decode(b"\xdd" + len(logged).to_bytes(4, "big") + data)
    assert decoded == logged


def test_run_events_stream_in_order_for_concurrent_runs(up: Up) -> None:
    async def one(bus: Any, agent: str, text: str, out: dict[str, Any]) -> None:
        run = await bus.prompt(agent, text, experiment="exp-events")
        out[agent] = ([e async for e in run.events()], await run.result())

    async def main() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with connect(up.endpoint) as bus, anyio.create_task_group() as tg:
            tg.start_soon(one, bus, "alpha", "look here", out)
            tg.start_soon(one, bus, "beta", "hello", out)
        return out

    out = anyio.run(main)
    for agent, (envelopes, result) in out.items():
        seqs = [e.header.seq for e in envelopes]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        assert isinstance(envelopes[0].event, ev.AgentStart)
        assert isinstance(envelopes[-1].event, ev.AgentEnd)
        assert all(e.header.run == result.run_id and e.header.agent == agent for e in envelopes)
        assert all(e.header.experiment == "exp-events" for e in envelopes)
    assert out["alpha"][1].final_text == "alpha saw - notes.txt  (6 bytes)"
    assert any(isinstance(e.event, ev.ToolExecutionEnd) for e in out["alpha"][0])
    assert out["beta"][1].final_text == "beta: hello"


def test_connect_blocking_works_from_a_plain_thread(up: Up) -> None:
    box: dict[str, Any] = {}

    def script() -> None:
        try:
            with connect_blocking(up.endpoint) as bus:
                box["agents"] = bus.agents()
                box["one"] = bus.run("beta", "from a thread", experiment="exp-thread")
                box["many"] = bus.run_many([("alpha", "t1"), ("beta", "t2")], concurrency=2,
                                           experiment="exp-thread")
                box["state"] = bus.state("beta")
        except BaseException as exc:  # re-raised in the test thread
            box["error"] = exc

    thread = threading.Thread(target=script)
    thread.start()
    thread.join(30)
    assert not thread.is_alive()
    if "error" in box:
        raise box["error"]
    assert box["agents"] == ["alpha", "beta"]
    assert box["one"].final_text == "beta: from a thread"
    assert [r.final_text for r in box["many"]] == ["alpha: t1", "beta: t2"]
    assert box["state"].name == "beta" and not box["state"].is_running
    logged = up.watch("--experiment", "exp-thread", "--type", "agent_end")
    assert len(logged) == 3
