"""Every process imports only what it runs (docs/architecture.md): busctl is the entry of every
process `busctl up` starts, so a heavy import there is paid at every start."""

from __future__ import annotations

import subprocess
import sys

import pytest

# What each process's own modules must not pull in, and why it would be a waste there.
CASES = {
    # busctl itself: the hub's modules and the fake model server load only for their commands
    "agent_bus.cli": ("agent_bus.bus.hub", "sqlite3", "agent_bus.agents.gateway.fakellm", "http.server", "httpx"),
    # the coordinator and `busctl up` read the gateway's types, not its HTTP stack
    "agent_bus.cli, agent_bus.agents.coordinator.process": ("httpx", "agent_bus.agents.gateway.engine", "agent_bus.bus.hub"),
    "agent_bus.cli, agent_bus.agents.launch.up": ("httpx", "agent_bus.agents.gateway.engine", "agent_bus.bus.hub"),
    "agent_bus.cli, agent_bus.tools.worker": ("agent_bus.bus.hub", "agent_bus.agents.gateway.engine"),
}


@pytest.mark.parametrize("modules", list(CASES))
def test_a_process_does_not_import_what_it_does_not_run(modules: str) -> None:
    banned = CASES[modules]
    probe = f"import sys, {modules}\nprint(sorted(m for m in {banned!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]", f"importing {modules} pulled in {out}"


def test_lazy_commands_are_listed_and_run() -> None:
    """`hub` and `fake-llm` are built when used: --help lists them and their own help works."""
    listing = subprocess.run([sys.executable, "-m", "agent_bus.cli", "--help"], capture_output=True,
                             text=True, check=True).stdout
    assert "  hub " in listing and "  fake-llm " in listing, listing
    hub_help = subprocess.run([sys.executable, "-m", "agent_bus.cli", "hub", "--help"], capture_output=True,
                              text=True, check=True).stdout
    assert "--request-bytes" in hub_help and "--retain-days" in hub_help, hub_help
