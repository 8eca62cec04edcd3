"""A second worker serving another function under a live tool's name (issue 49, item 6): the hub
refuses its registration, naming the peer that serves the tool, and the worker says so and
exits; calls keep going to the first worker only. The same function again joins the pool."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from agent_bus.bus.client import connect
from tests.support import Proc, busctl

pytestmark = pytest.mark.anyio

CITY = '''
from agent_bus import tool

@tool
def lookup(city: str) -> str:
    """Look a city up."""
    return city
'''
ORDER = '''
from agent_bus import tool

@tool
def lookup(order_id: int) -> str:
    """Look an order up."""
    return str(order_id)
'''


def worker(hub: str, module: Path, name: str) -> list[str]:
    return busctl("worker", "--hub", hub, "--tools", str(module), "--name", name,
                  "--sandbox", "off")


async def test_another_schema_under_a_live_tool_name_is_refused(tmp_path: Path) -> None:
    (tmp_path / "city.py").write_text(CITY)
    (tmp_path / "order.py").write_text(ORDER)
    hub = Proc(busctl("hub", "--hub", "tcp://127.0.0.1:0", "--state-dir", str(tmp_path / "hub")))
    first = same = None
    try:
        endpoint = hub.wait_ready()["endpoint"]
        first = Proc(worker(endpoint, tmp_path / "city.py", "cities"))
        first.wait_ready(30)
        clash = subprocess.run(worker(endpoint, tmp_path / "order.py", "orders"),
                               capture_output=True, text=True, timeout=60)
        assert clash.returncode != 0, clash.stdout + clash.stderr
        said = clash.stdout + clash.stderr
        assert "tool.lookup" in said and "`cities`" in said and "other parameters" in said, said
        assert "Traceback" not in said, said
        same = Proc(worker(endpoint, tmp_path / "city.py", "cities-2"))  # the same schema: joins
        same.wait_ready(30)
        async with connect(endpoint, name="t-clash") as peer:
            status = await peer.status()
        servers = sorted(x.name for x in status.peers
                         if any(s.name == "tool.lookup" for s in x.services))
        assert servers == ["cities", "cities-2"], servers
        service = next(s for s in status.services if s.name == "tool.lookup")
        assert "city" in str(service.meta.get("parameters")), service.meta
    finally:
        for proc in (same, first, hub):
            if proc is not None:
                proc.stop()
