"""Acceptance 1 end to end: a topology's worker group with an `mcp` list (`busctl up`), and a
scripted run whose model calls the time server's `get_current_time` through the bus."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from agent_bus.agents.gateway.fakellm import FakeLLMServer
from tests.cli.conftest import start_up
from tests.support import busctl

SECRET = "s3cr3t-token-value"
SCRIPT = {"rules": [
    {"contains": ["time"], "tool_result": False,
     "reply": {"text": "Asking.", "tool_calls": [
         {"name": "clock_get_current_time", "arguments": {"timezone": "UTC"}}]}},
    {"contains": [], "tool_result": True, "reply": {"text": "Result: {tool_results}"}},
], "echo": True}

TOPOLOGY = f"""
[gateways]
count = 1

[[workers]]
name = "mcp"
tools = []

[[workers.mcp]]
name = "time"
command = "{sys.executable}"
args = ["-m", "mcp_server_time", "--local-timezone", "UTC"]
env = {{ CLOCK_TOKEN = "{SECRET}" }}
prefix = "clock_"
deny = ["convert_time"]

[[agents]]
name = "assistant"
"""


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(busctl(*args), capture_output=True, text=True, timeout=60,
                          env={**os.environ, "NO_COLOR": "1"}, check=False)


def test_topology_mcp_server_answers_a_scripted_run(tmp_path: Path) -> None:
    (tmp_path / "team.toml").write_text(TOPOLOGY)
    with FakeLLMServer(SCRIPT) as llm:
        proc, ready = start_up(tmp_path, "-c", "team.toml",
                               env={"OPENAI_BASE_URL": llm.base_url, "OPENAI_API_KEY": ""})
        try:
            hub = ready["endpoint"]
            status = cli("status", "--json", "--hub", hub)
            services = {s["name"] for s in json.loads(status.stdout)["services"]}
            assert "tool.clock_get_current_time" in services, services
            assert "tool.clock_convert_time" not in services  # denied
            result = cli("run", "-q", "--hub", hub, "what time is it?")
            assert result.returncode == 0, result
            assert result.stdout.startswith("Result: "), result.stdout
            assert '"timezone": "UTC"' in result.stdout or '"timezone":"UTC"' in result.stdout
            assert SECRET not in status.stdout and SECRET not in proc.output()
        finally:
            proc.stop(timeout=8)
