"""The agent loop is pure logic: importing it loads no transport (no pyzmq, no bus client)."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_loop_loads_no_transport() -> None:
    probe = ("import sys, agent_bus.agents.loop.run, agent_bus.agents.loop.agent\n"
             "print(sorted(m for m in ('zmq', 'agent_bus.bus.client', 'agent_bus.tools.worker', 'httpx')"
             " if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]", f"the loop pulled in {out}"


def test_the_client_api_is_still_importable_from_agents() -> None:
    probe = "from agent_bus.agents import connect, connect_blocking, AgentBus; print(connect.__module__)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "agent_bus.agents.client.remote"


def test_scripts_import_the_client_from_the_top() -> None:
    probe = "from agent_bus import connect, tool; print(connect.__module__, tool.__module__)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "agent_bus.agents.client.remote agent_bus.tools._tool"


def test_importing_the_top_package_loads_no_transport() -> None:
    probe = "import sys, agent_bus\nprint(sorted(m for m in ('zmq', 'httpx', 'agent_bus.agents') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]", f"`import agent_bus` pulled in {out}"
