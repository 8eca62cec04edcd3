"""Issue 18, durable runs (acceptance 1 and 4): SIGKILL the coordinator of a `busctl up`
topology during turn 2's tool batch of a 3-turn run; the supervisor restarts it and the run
resumes. Completed model and tool calls are not repeated, the idempotent call in flight runs
again, the non-idempotent one gets an error result instead of a second execution, and the
`busctl run` that was following exits 0 with the final text."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent_bus.agents.coordinator.durable import MAY_HAVE_RUN
from agent_bus.agents.gateway.fakellm import FakeLLMServer
from tests.cli.conftest import Topology, pid_alive, start_up
from tests.store_cluster import STORES
from tests.support import Proc, busctl

TOOLS = str(Path(__file__).parent / "fixtures" / "durable_tools.py")
RUN_BOUND = 60.0


def calls(*specs: tuple[str, str, float]) -> list[dict[str, Any]]:
    return [{"name": name, "arguments": {"tag": tag, "seconds": s}} for name, tag, s in specs]


SCRIPT = {
    "rules": [
        {"contains": ["research"], "tool_result": False,
         "reply": {"text": "Turn one.", "tool_calls": calls(("once", "t1", 0.1))}},
        {"tool_result": True, "results_contain": ["once:t1"],
         "reply": {"text": "Turn two.", "tool_calls": calls(
             ("once", "t2done", 0.1), ("again", "t2slow", 3.0), ("once", "t2lost", 3.0))}},
        {"tool_result": True, "results_contain": ["t2slow"],
         "reply": {"text": "Turn three.", "tool_calls": calls(("once", "t3", 0.1))}},
        {"tool_result": True, "results_contain": ["once:t3"],
         "reply": {"text": "All done: {tool_results}"}},
    ],
    "echo": True,
}


def topology(base_url: str) -> str:
    return f"""
[hub]
heartbeat_interval = 0.2

[models.fake]
provider = "openai"
model = "m"
base_url = "{base_url}"
timeout = 10.0

[[workers]]
name = "tools"
tools = ["{TOOLS}"]
concurrency = 8

[[agents]]
name = "assistant"
model = "fake"
"""


@pytest.fixture(params=STORES)
def stack(tmp_path: Path, request: pytest.FixtureRequest
          ) -> Iterator[tuple[Topology, FakeLLMServer, Path]]:
    """The topology on each store: its `[hub] store` is a fresh JetStream stream for the second."""
    counts = tmp_path / "counts"
    store = "" if request.param == "sqlite" else request.getfixturevalue("jetstream").stream_url()
    with FakeLLMServer(SCRIPT) as srv:
        config = tmp_path / "durable.toml"
        text = topology(srv.base_url)
        if store:
            text = text.replace("[hub]\n", f"[hub]\nstore = \"{store}\"\n", 1)
        config.write_text(text)
        proc, ready = start_up(tmp_path, "-c", str(config))
        topo = Topology(proc, tmp_path, ready)
        pids = topo.child_pids()
        try:
            yield topo, srv, counts
        finally:
            proc.stop(timeout=8)
            for pid in pids.values():
                if pid_alive(pid):
                    os.kill(pid, signal.SIGKILL)


def runs_of(counts: Path) -> dict[str, int]:
    return {f.name: len(f.read_text().splitlines()) for f in counts.iterdir()}


def events(output: str) -> list[dict[str, Any]]:
    out = []
    for line in output.splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def test_sigkilled_coordinator_resumes_the_run(
        stack: tuple[Topology, FakeLLMServer, Path]) -> None:
    topo, srv, counts = stack
    pid = topo.child_pids()["coordinator-1"]
    run = Proc(busctl("run", "--hub", topo.endpoint, "--json", "research this"))
    try:
        # turn 2's batch: t2done has ended (journaled), t2slow and t2lost are in flight
        run.wait_line(lambda s: '"tool_execution_end"' in s and "once:t2done" in s, 30)
        os.kill(pid, signal.SIGKILL)
        try:
            code = run.popen.wait(RUN_BOUND)
        except subprocess.TimeoutExpired:
            pytest.fail(f"`busctl run` hung after the coordinator was killed:\n"
                        f"{run.output()[-3000:]}")
    finally:
        run.stop()
    output = run.output()
    assert code == 0, output[-3000:]
    seen = events(output)
    types = [e["type"] for e in seen]
    assert types.count("agent_end") == 1 and types.count("run_resumed") == 1, types
    assert types.index("run_resumed") < types.index("agent_end")
    end = seen[types.index("agent_end")]
    assert end.get("stop_reason", "stop") == "stop" and end["final_text"].startswith("All done:"), end
    assert "once:t3" in end["final_text"]
    resumed = seen[types.index("run_resumed")]
    assert resumed["turn"] == 2 and resumed["model"] is True, resumed

    # no event published twice: each tool call ended once, each turn began once
    ended = Counter(e["tool_call_id"] for e in seen if e["type"] == "tool_execution_end")
    assert all(n == 1 for n in ended.values()), ended
    turns = [e["turn"] for e in seen if e["type"] == "turn_start"]
    assert turns == sorted(set(turns)), turns

    # the in-flight non-idempotent call got an error result naming it, not a second run
    lost = [e for e in seen if e["type"] == "tool_execution_end"
            and e["tool_name"] == "once" and e.get("is_error")]
    assert len(lost) == 1, lost
    assert MAY_HAVE_RUN.format(name="once", call_id=lost[0]["tool_call_id"]) in \
        lost[0]["result"]["content"][0]["text"], lost[0]
    assert resumed["failed"] == [lost[0]["tool_call_id"]]

    ran = runs_of(counts)
    assert ran["t1"] == 1 and ran["t2done"] == 1 and ran["t3"] == 1, ran  # completed: once
    assert ran["t2lost"] == 1, ran  # in flight, not idempotent: never a second execution
    assert ran["t2slow"] == 2, ran  # in flight, idempotent: issued again

    # the model call of turn 1 (and turn 2) was not repeated
    bodies = [r.body for r in srv.requests]
    first_turn = [b for b in bodies if b["messages"][-1]["role"] == "user"]
    assert len(first_turn) == 1, len(first_turn)
    assert len(bodies) == 4, [b["messages"][-1] for b in bodies]
