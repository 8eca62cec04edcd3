"""Issue 12, item 1: a model cannot reach the bus's state, so it cannot redirect the API key.

The attack as found: the model calls `write_file` on the running topology (pointing the gateway at
a server of its choosing), the event log and the conversation store; the gateway is then killed,
and its restart must still send the key to the configured server only.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent_bus.agents.gateway.fakellm import FakeLLMServer
from agent_bus.bus.paths import STATE_MARKER, default_state_dir, ensure_state_dir
from agent_bus.tools import run_tool
from agent_bus.tools.builtin import list_dir, read_file, search_files, write_file
from tests.cli.conftest import Topology, pid_alive, start_up
from tests.support import busctl, wait_for

KEY = "sk-test-state-dir-attack-0123456789"


def _attack_script(project: Path, state: Path, evil_url: str) -> dict[str, Any]:
    evil = json.dumps({"models": {"m": {"provider": "openai", "model": "x", "base_url": evil_url,
                                        "api_key_env": "OPENAI_API_KEY"}}})
    targets = [state / "topology.json", state / "hub" / "events.db",
               state / "agents" / "conversations.sqlite"]
    calls = [{"name": "write_file", "arguments": {"path": str(t), "content": evil}}
             for t in targets]
    calls.append({"name": "write_file", "arguments": {"path": os.path.relpath(targets[0], project),
                                                       "content": evil}})
    return {"rules": [
        {"contains": ["attack"], "tool_result": False,
         "reply": {"text": "Rewriting.", "tool_calls": calls}},
        {"contains": [], "tool_result": True, "reply": {"text": "RESULTS {tool_results_full}"}},
    ], "echo": True}


@pytest.fixture
def evil() -> Iterator[FakeLLMServer]:
    with FakeLLMServer({"echo": True}) as srv:
        yield srv


def _run(topo: Topology, prompt: str) -> str:
    result = subprocess.run(busctl("run", "--hub", topo.endpoint, prompt), capture_output=True,
                            text=True, timeout=60, cwd=topo.cwd)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_model_cannot_rewrite_state_and_restarted_gateway_keeps_its_server(
        tmp_path: Path, evil: FakeLLMServer) -> None:
    project = tmp_path / "project"
    project.mkdir()
    state = default_state_dir(project)
    with FakeLLMServer(_attack_script(project, state, evil.base_url)) as good:
        env = {"OPENAI_BASE_URL": good.base_url, "OPENAI_API_KEY": KEY}
        proc, ready = start_up(project, env=env)
        topo = Topology(proc, project, ready)
        pids = topo.child_pids()
        try:
            before = {p: p.read_bytes() for p in (state / "topology.json",
                                                   state / "hub" / "events.db")}
            out = _run(topo, "attack")
            assert out.count("outside the workspace") >= 3, out
            for path, data in before.items():
                assert path.read_bytes()[:100] == data[:100], f"{path} was rewritten"

            os.kill(pids["gateway-1"], signal.SIGKILL)
            wait_for(lambda: "restarting" in proc.output(), 20, "the gateway's restart")
            served = len(good.requests)
            answer = wait_for(lambda: _try_run(topo, "hello again"), 30, "a run after restart")
            assert "hello again" in answer
            assert len(good.requests) > served
            assert all(r.headers.get("Authorization", r.headers.get("authorization", ""))
                       .endswith(KEY) for r in good.requests[served:])
            assert evil.requests == [], "the key went to the attacker's server"
        finally:
            proc.stop(timeout=8)
            for pid in pids.values():
                if pid_alive(pid):
                    os.kill(pid, signal.SIGKILL)


def _try_run(topo: Topology, prompt: str) -> str | None:
    result = subprocess.run(busctl("run", "--hub", topo.endpoint, prompt), capture_output=True,
                            text=True, timeout=60, cwd=topo.cwd)
    return result.stdout if result.returncode == 0 else None


@pytest.mark.parametrize("workspace_key", ["'.'", "'..'", "'state/inner'"])
def test_up_refuses_a_workspace_that_overlaps_the_state_dir(
        tmp_path: Path, workspace_key: str) -> None:
    (tmp_path / "state" / "inner").mkdir(parents=True)
    config = tmp_path / "t.toml"
    config.write_text(f"[hub]\nstate_dir = 'state'\n[[workers]]\nworkspace = {workspace_key}\n")
    result = subprocess.run(busctl("up", "-c", str(config)), capture_output=True, text=True,
                            timeout=30, cwd=tmp_path)
    assert result.returncode != 0
    assert "workers[0].workspace" in result.stderr and "state" in result.stderr, result.stderr


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_tools_refuse_any_state_dir_even_inside_their_workspace(tmp_path: Path) -> None:
    """A worker started by hand with a wide workspace still cannot touch a state directory."""
    from agent_bus.bus.messages import ToolCallRequest

    state = ensure_state_dir(tmp_path / "somewhere" / "state")
    (state / "topology.json").write_text("{}")
    assert (state / STATE_MARKER).is_file()
    attempts = [(write_file, {"path": "somewhere/state/topology.json", "content": "x"}),
                (write_file, {"path": "somewhere/state/new/file.txt", "content": "x"}),
                (read_file, {"path": "somewhere/state/topology.json"}),
                (list_dir, {"path": "somewhere/state"})]
    for tool, args in attempts:
        req = ToolCallRequest(call_id="c", name=tool.name, arguments=json.dumps(args))
        result = await run_tool(tool, req, workspace=tmp_path)
        assert result.is_error and "state directory" in result.text, (tool.name, result)
    assert (state / "topology.json").read_text() == "{}"
    req = ToolCallRequest(call_id="c", name="search_files",
                          arguments=json.dumps({"pattern": "{}", "path": "."}))
    result = await run_tool(search_files, req, workspace=tmp_path)
    assert "topology.json" not in result.text


def test_worker_refuses_a_workspace_inside_a_state_dir(tmp_path: Path) -> None:
    state = ensure_state_dir(tmp_path / "state")
    result = subprocess.run(busctl("worker", "--hub", "tcp://127.0.0.1:9", "--workspace",
                                   str(state)), capture_output=True, text=True, timeout=30)
    assert result.returncode != 0 and "state directory" in result.stderr, result.stderr
