"""Whole runs a weak model makes, through `busctl up` and `busctl run` against `busctl fake-llm`
playing llama.cpp (one model, a 4,096-token window, HTTP 400 past it): the repeat guard,
`--max-turns`, and a conversation that outgrows the window."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator

import pytest

from agents.gateway.fakellm import FakeLLMServer
from tests.cli.conftest import Topology, json_lines, pid_alive, start_up
from tests.support import busctl

SCRIPT = {
    "models": ["qwen-local"],
    "context_window": 4096,
    "close_after_stream": True,
    "rules": [
        # the weak model's habit: the same call, again and again
        {"contains": ["loop"], "tool_result": None,
         "reply": {"text": "Looking.", "tool_calls": [{"name": "list_dir", "arguments": {"path": "."}}]}},
        # a long-winded answer: a few of these fill the 4,096-token window
        {"contains": ["essay"], "reply": {"text": "essay " + "blah " * 600}},
        {"contains": ["summarizing the conversation"], "reply": {"text": "<summary>essays were written</summary>"}},
    ],
    "echo": True,
}


@pytest.fixture(scope="module")
def llama_like() -> Iterator[FakeLLMServer]:
    with FakeLLMServer(SCRIPT) as srv:
        yield srv


@pytest.fixture(scope="module")
def topo(tmp_path_factory: pytest.TempPathFactory, llama_like: FakeLLMServer) -> Iterator[Topology]:
    cwd = tmp_path_factory.mktemp("weak")
    env = {"OPENAI_BASE_URL": llama_like.base_url, "OPENAI_API_KEY": ""}
    proc, ready = start_up(cwd, env=env)
    topology = Topology(proc, cwd, ready)
    pids = topology.child_pids()
    try:
        yield topology
    finally:
        proc.stop(timeout=8)
        for pid in pids.values():
            if pid_alive(pid):
                os.kill(pid, 9)


def run(topo: Topology, *args: str, timeout: float = 60) -> tuple[int, list[dict]]:
    done = subprocess.run(busctl("run", "--hub", topo.endpoint, "--json", *args), capture_output=True,
                          text=True, timeout=timeout, cwd=topo.cwd, env=dict(os.environ))
    return done.returncode, json_lines(done.stdout)


def end_of(events: list[dict]) -> dict:
    return next(e for e in events if e["type"] == "agent_end")


def tool_texts(events: list[dict]) -> list[str]:
    return [json.dumps(e["result"]) for e in events if e["type"] == "tool_execution_end"]


def test_max_turns_bounds_the_run(topo: Topology) -> None:
    code, events = run(topo, "--new-session", "--max-turns", "2", "loop over the files")
    assert code == 3 and end_of(events)["stop_reason"] == "max_iterations"  # busctl run: exit 3
    assert sum(e["type"] == "turn_start" for e in events) == 2


def test_the_repeat_guard_tells_the_model_then_stops_the_run(topo: Topology) -> None:
    code, events = run(topo, "--new-session", "loop over the files")
    texts = tool_texts(events)
    end = end_of(events)
    assert code == 1 and end["stop_reason"] == "error"
    assert "Stopped: the model called `list_dir` with the same arguments 6 times" in end["error"]
    assert len(texts) == 6 and "in a row" not in texts[1] and "call 3 in a row" in texts[2]


def test_max_turns_is_checked_at_the_cli(topo: Topology) -> None:
    code, _ = run(topo, "--max-turns", "0", "hi")
    assert code == 2


def test_a_conversation_that_outgrows_the_window_is_compacted_under_half_and_never_refused(
        topo: Topology, llama_like: FakeLLMServer) -> None:
    compactions: list[dict] = []
    for i in range(8):
        args = [] if i == 0 else ["--continue"]  # one conversation: each run continues the last
        code, events = run(topo, *args, f"write essay {i}")
        assert code == 0 and end_of(events).get("stop_reason", "stop") == "stop", events[-1]
        compactions += [e for e in events if e["type"] == "compaction_complete"]
        # the answer is never held back by compaction: it comes at the start of a run, not its end
        types = [e["type"] for e in events]
        assert "compaction_start" not in types[types.index("turn_end"):]
    assert compactions and all(c["compacted"] for c in compactions)
    assert all(0 < c["tokens_after"] < 2048 for c in compactions), compactions
    assert llama_like.context_refusals == 0
