"""Issue 8 §1: SIGKILL of any process of a `busctl up` topology mid-run (parallel tool calls of
~1 s, a slowly streaming model). No client hangs past its deadline, the affected run ends (with a
clear error where it could not go on), `busctl up` restarts the process, the topology is whole
again, the next run succeeds, and the agent's conversation is intact."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent_bus.agents.gateway.fakellm import FakeLLMServer
from tests.cli.conftest import Topology, pid_alive, start_up
from tests.fault.conftest import FAULT_TOOLS
from tests.support import Proc, busctl, wait_for

SCRIPT = {
    "rules": [
        {"contains": ["work"], "tool_result": False,
         "reply": {"text": "Working on it, in parallel.", "chunk_size": 2, "chunk_delay": 0.05,
                   "tool_calls": [
                       {"name": "nap", "arguments": {"tag": "a", "seconds": 1.0}},
                       {"name": "nap", "arguments": {"tag": "b", "seconds": 1.0}},
                       {"name": "nap_again", "arguments": {"tag": "c", "seconds": 1.0}}]}},
        {"contains": [], "tool_result": True,
         "reply": {"text": "Finished: {tool_results}", "chunk_size": 2, "chunk_delay": 0.02}},
    ],
    "echo": True,
}

RUN_BOUND = 45.0  # `busctl run` must return within this, whatever was killed

# What `busctl run` does when each process dies mid-run (docs/reliability.md, "What survives
# which crash"): (exit code, the agent_end stop reason it prints, or None when it prints none).
OUTCOME = {
    "tools-1": (0, "stop"),  # the lost calls come back (re-dispatched or as tool errors); run ends
    "gateway-1": (1, "error"),  # the streaming `llm` request fails peer_lost: the run ends in error
    "coordinator-1": (0, "stop"),  # the run is journaled: the restarted coordinator resumes it
    "hub": (1, None),  # the requester's pending call fails hub_lost; the run goes on elsewhere
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
tools = ["{FAULT_TOOLS}"]
concurrency = 8

[[agents]]
name = "assistant"
model = "fake"
"""


def cli(endpoint: str, *args: str, timeout: float = RUN_BOUND) -> subprocess.CompletedProcess[str]:
    return subprocess.run(busctl(*args[:1], "--hub", endpoint, *args[1:]), capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def services(endpoint: str) -> dict[str, Any]:
    out = cli(endpoint, "status", "--json", timeout=10)
    if out.returncode != 0:
        return {}
    status = json.loads(out.stdout)
    return {"services": {s["name"] for s in status["services"]},
            "peers": {p["name"] for p in status["peers"]},
            "busy": {name for name, a in status.get("agents", {}).items() if a.get("is_running")}}


WHOLE = {"llm", "tool.nap", "tool.nap_again", "agent.assistant"}


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[Topology, FakeLLMServer]]:
    with FakeLLMServer(SCRIPT) as srv:
        config = tmp_path / "crash.toml"
        config.write_text(topology(srv.base_url))
        proc, ready = start_up(tmp_path, "-c", str(config))
        topo = Topology(proc, tmp_path, ready)
        pids = topo.child_pids()
        try:
            yield topo, srv
        finally:
            proc.stop(timeout=8)
            for pid in pids.values():
                if pid_alive(pid):
                    os.kill(pid, signal.SIGKILL)


def user_texts(body: dict[str, Any]) -> list[str]:
    out = []
    for m in body.get("messages", []):
        content = m.get("content")
        if m.get("role") == "user" and content:
            out.append(content if isinstance(content, str) else content[0].get("text", ""))
    return out


@pytest.mark.parametrize("victim", ["tools-1", "gateway-1", "coordinator-1", "hub"])
def test_sigkill_mid_run_recovers(stack: tuple[Topology, FakeLLMServer], victim: str) -> None:
    topo, srv = stack
    endpoint = topo.endpoint
    assert WHOLE <= services(endpoint)["services"]
    first = cli(endpoint, "run", "remember the word banana")
    assert first.returncode == 0, first.stdout + first.stderr
    # every `busctl run` starts a fresh session unless continued: the next ones continue this one
    session = re.search(r"^session (\S+)", first.stderr, re.MULTILINE).group(1)  # type: ignore[union-attr]
    pid = topo.child_pids()[victim]

    run = Proc(busctl("run", "--hub", endpoint, "--json", "-c", session, "now do the work"))
    try:
        # the kill lands mid-run: model streaming (gateway) or tools in flight (the rest)
        marker = '"message_update"' if victim == "gateway-1" else '"tool_execution_start"'
        run.wait_line(lambda s: marker in s, 30)
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        try:
            code = run.popen.wait(RUN_BOUND)
        except subprocess.TimeoutExpired:
            pytest.fail(f"`busctl run` hung after {victim} was killed:\n{run.output()[-3000:]}")
        took = time.monotonic() - killed
    finally:
        run.stop()
    output = run.output()
    assert took < RUN_BOUND
    expected_code, expected_end = OUTCOME[victim]
    assert code == expected_code, output[-3000:]
    ends = [json.loads(s).get("stop_reason", "stop") for s in output.splitlines()
            if '"agent_end"' in s]
    assert ends == ([expected_end] if expected_end else []), output[-3000:]
    if code != 0:  # the run could not go on: one clear error, no traceback
        assert "Traceback" not in output, output[-3000:]
        assert any(line.startswith("Error") or '"error"' in line for line in output.splitlines())

    # `busctl up` restarts it and the topology is whole again
    topo.proc.wait_line(lambda s: victim in s and "restarting" in s, 15)
    wait_for(lambda: WHOLE <= services(endpoint).get("services", set()), 30,
             f"the services to be back after {victim} restarted")
    assert topo.child_pids()[victim] != pid or not pid_alive(pid)
    # A run whose requester lost the hub (hub restart) goes on to its end in the coordinator:
    # wait for the agent to be idle again (a prompt meanwhile is refused as "already processing").
    wait_for(lambda: not services(endpoint).get("busy", {"?"}), RUN_BOUND, "the agent to be idle")

    srv_requests_before = len(srv.requests)
    after = cli(endpoint, "run", "-c", session, "now do the work again")
    assert after.returncode == 0, after.stdout + after.stderr
    assert "Finished:" in after.stdout and "nap:a" in after.stdout, after.stdout
    # the conversation survived: the next model request carries what was acknowledged before
    asked = srv.requests[srv_requests_before].body
    texts = user_texts(asked)
    assert "remember the word banana" in texts, texts
    assert texts[-1] == "now do the work again"
