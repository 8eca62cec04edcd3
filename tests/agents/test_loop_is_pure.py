"""The agent loop is pure logic: importing it loads no transport (no pyzmq, no bus client)."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_loop_loads_no_transport() -> None:
    probe = ("import sys, agents.loop.run, agents.loop.agent\n"
             "print(sorted(m for m in ('zmq', 'bus.client', 'tools.worker', 'httpx')"
             " if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]", f"the loop pulled in {out}"


def test_the_client_api_is_still_importable_from_agents() -> None:
    probe = "from agents import connect, connect_blocking, AgentBus; print(connect.__module__)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "agents.client.remote"
