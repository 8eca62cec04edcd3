"""`busctl up` and friends, driven as a user would: real CLI subprocesses, real topology."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from agent_bus.agents.gateway.fakellm import FakeLLMServer
from agent_bus.bus.client import CONNECT_TIMEOUT
from agent_bus.bus.paths import default_state_dir
from tests.cli.conftest import FIXTURES, Topology, json_lines, pid_alive, start_up
from tests.support import busctl, running, wait_for


def cli(*args: str, cwd: Path | None = None, timeout: float = 30,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run(busctl(*args), capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, **(env or {})})


def test_up_attach_worker_run_watch_and_ctrl_c(up_default: Topology) -> None:
    topo = up_default
    pids = topo.child_pids()
    assert {"hub", "gateway-1", "tools-1", "coordinator-1"} <= set(pids)
    tools = str(FIXTURES / "my_tools.py")
    with running(busctl("worker", "--hub", topo.endpoint, "--tools", tools, "--name", "mine")) as w:
        w.wait_ready()
        result = cli("run", "--hub", topo.endpoint, "please count these words")
        assert result.returncode == 0, result.stdout + result.stderr
        assert "Result: - 4" in result.stdout
        watch = cli("watch", "--hub", topo.endpoint, "--json", "--no-follow", "--since", "0",
                    "--agent", "assistant")
    events = json_lines(watch.stdout)
    run_ids = {e["run_id"] for e in events}
    assert len(run_ids) == 1
    types = [e["type"] for e in events if e["type"] != "message_update"]
    assert types == [
        "agent_start", "turn_start", "message_start", "message_end",  # the prompt
        "message_start", "message_end",  # the assistant's tool call
        "tool_execution_start", "tool_execution_end", "message_start", "message_end", "turn_end",
        "turn_start", "message_start", "message_end", "turn_end", "agent_end",
    ]
    start = next(e for e in events if e["type"] == "tool_execution_start")
    assert start["tool_name"] == "word_count"
    assert [e["seq"] for e in events] == sorted(e["seq"] for e in events)

    topo.proc.signal(signal.SIGINT)
    assert topo.proc.popen.wait(10) == 0
    topo.proc.wait_line(lambda s: "stopped." in s, 2)
    for name, pid in pids.items():
        assert not pid_alive(pid), f"{name} ({pid}) outlived `busctl up`"


def test_a_killed_worker_is_restarted_and_calls_keep_working(up_default: Topology) -> None:
    topo = up_default
    pids = topo.child_pids()
    import os

    os.kill(pids["tools-1"], signal.SIGKILL)
    topo.proc.wait_line(lambda s: "tools-1" in s and "restarting" in s, 10)

    def restarted() -> bool:
        out = cli("watch", "--hub", topo.endpoint, "--json", "--no-follow", "--since", "0",
                  "--type", "process_restarted").stdout
        return any(e.get("process") == "tools-1" for e in json_lines(out))

    wait_for(restarted, 20, "a process_restarted event for tools-1")
    (topo.cwd / "seen-by-the-restarted-worker.txt").write_text("x")
    result = cli("run", "--hub", topo.endpoint, "explore the files")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "seen-by-the-restarted-worker.txt" in result.stdout  # list_dir ran on the new worker


def test_topology_with_two_gateways_three_worker_groups_three_agents(
        tmp_path: Path, fake_llm: FakeLLMServer) -> None:
    config = tmp_path / "team.toml"
    config.write_text(f"""
[models.fake]
provider = "openai"
model = "m"
base_url = "{fake_llm.base_url}"

[gateways]
count = 2

[[workers]]
name = "files"
tools = ["agent_bus.tools.builtin"]

[[workers]]
name = "mine"
tools = ["{FIXTURES / 'my_tools.py'}"]
count = 2
concurrency = 2

[[workers]]
name = "more"
tools = ["{FIXTURES / 'my_tools.py'}"]

[[agents]]
name = "researcher"
model = "fake"

[[agents]]
name = "writer"
model = "fake"
tools = ["word_count"]

[[agents]]
name = "judge"
model = "fake"
tool_execution = "sequential"
""")
    proc, ready = start_up(tmp_path, "-c", str(config))
    try:
        status = json.loads(cli("status", "--hub", ready["endpoint"], "--json").stdout)
        names = {p["name"] for p in status["peers"]}
        assert {"gateway-1", "gateway-2", "files-1", "mine-1", "mine-2", "more-1"} <= names
        services = {s["name"]: s for s in status["services"]}
        assert services["llm"]["peers"] == 2
        assert services["tool.word_count"]["peers"] == 3
        assert set(status["agents"]) == {"researcher", "writer", "judge"}
        assert all(not a["is_running"] for a in status["agents"].values())
        result = cli("run", "--hub", ready["endpoint"], "--agent", "writer", "count this")
        assert result.returncode == 0 and "Result: - 4" in result.stdout, result.stdout
    finally:
        proc.stop(timeout=8)


@pytest.mark.parametrize("body, key", [
    ("[hub]\nendpont = 'x'\n", "hub.endpont"),
    ("[hub]\nliveness = 'three'\n", "hub.liveness"),
    ("[[agents]]\nname = 'a'\nmodel = 'missing'\n", "agents[0].model"),
    ("[[workers]]\ntools = ['no_such_module_xyz']\n", "workers[0].tools[0]"),
])
def test_invalid_topology_files_name_the_key_and_start_nothing(
        tmp_path: Path, body: str, key: str) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(body)
    result = cli("up", "-c", str(config), cwd=tmp_path)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and key in lines[0] and "bad.toml" in lines[0], result.stderr
    assert not default_state_dir(tmp_path).exists()
    check = cli("config", "check", str(config))
    assert check.returncode != 0 and key in check.stderr


def test_run_against_a_dead_hub_fails_fast_naming_the_address() -> None:
    started = time.monotonic()  # baseline: busctl's start, on this (maybe busy) machine
    assert cli("run", "--help").returncode == 0
    baseline = time.monotonic() - started
    started = time.monotonic()
    result = cli("run", "--hub", "tcp://127.0.0.1:9", "hello")
    took = time.monotonic() - started
    assert took < baseline + CONNECT_TIMEOUT + 2.0, (took, baseline)
    assert result.returncode == 2
    assert "tcp://127.0.0.1:9" in result.stderr


def test_up_detached_then_down_leaves_nothing(tmp_path: Path, fake_llm: FakeLLMServer) -> None:
    env = {"OPENAI_BASE_URL": fake_llm.base_url}
    result = cli("up", "-d", "--hub", "tcp://127.0.0.1:0", cwd=tmp_path, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    state = default_state_dir(tmp_path)
    pid = int((state / "up.pid").read_text())
    log = (state / "logs" / "up.log").read_text()
    line = next(s for s in log.splitlines() if s.startswith("processes"))
    import re

    children = [int(m) for m in re.findall(r"\[(\d+)\]", line)]
    assert len(children) >= 4 and pid_alive(pid)
    down = cli("down", cwd=tmp_path)
    assert down.returncode == 0, down.stderr
    assert not pid_alive(pid)
    for child in children:
        assert not pid_alive(child)
    assert not (state / "up.pid").exists()


def test_run_ctrl_c_aborts_the_run_and_exits_130(up_default: Topology) -> None:
    topo = up_default
    tools = str(FIXTURES / "my_tools.py")
    with running(busctl("worker", "--hub", topo.endpoint, "--tools", tools)) as w:
        w.wait_ready()
        with running(busctl("run", "--hub", topo.endpoint, "--json", "be slow")) as run:
            run.wait_line(lambda s: '"tool_execution_start"' in s, 20)
            run.popen.send_signal(signal.SIGINT)
            assert run.popen.wait(15) == 130
            end = json.loads(run.wait_line(lambda s: '"agent_end"' in s, 2))
            assert end["stop_reason"] == "aborted"
        again = cli("run", "--hub", topo.endpoint, "hello again")
        assert again.returncode == 0 and "echo: hello again" in again.stdout


def test_up_without_a_model_is_healthy_and_run_says_how_to_configure(tmp_path: Path) -> None:
    no_keys = {"OPENAI_API_KEY": "", "OPENAI_BASE_URL": "", "ANTHROPIC_API_KEY": "",
               "ANTHROPIC_BASE_URL": ""}
    proc, ready = start_up(tmp_path, env=no_keys)
    try:
        proc.wait_line(lambda s: "no model is configured" in s, 5)
        started = time.monotonic()  # baseline: busctl's start, connection and a round trip
        assert cli("status", "--hub", ready["endpoint"]).returncode == 0
        baseline = time.monotonic() - started
        started = time.monotonic()
        result = cli("run", "--hub", ready["endpoint"], "hello")
        took = time.monotonic() - started
        assert took < baseline + 3, (took, baseline)
        assert result.returncode == 1
        assert "OPENAI_API_KEY" in result.stdout + result.stderr
    finally:
        proc.stop(timeout=8)
