"""(d) The coordinator's `run` (a prompt, an experiment cell's) with a repeated idempotency key
attaches to the run the coordinator already has: one run, its one result to both requests.
Real processes: a hub, a gateway on the fake model, a tool worker and a coordinator."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from agent_bus.agents.client.remote import connect
from agent_bus.agents.gateway.fakellm import FakeLLMServer
from tests.coordinator.conftest import Stack, calls, start_stack, text, topology_text
from tests.failover.conftest import hub_ports
from tests.support import Proc, until

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    s = start_stack(tmp_path, coordinator=("s",))
    try:
        yield s
    finally:
        s.close()


def agent_starts(events: list[dict[str, Any]]) -> int:
    return sum(1 for e in events if e["type"] == "agent_start")


async def test_a_repeated_cell_key_attaches_to_the_run(stack: Stack) -> None:
    stack.script([calls(("slow", {"label": "cell", "seconds": 1.0})), text("cell done.")])
    async with connect(stack.endpoint, name="runner-1") as one, \
            connect(stack.endpoint, name="runner-2") as two:
        first = await one.prompt("s", "run the cell", new_session=True, key="cell:exp/v/s1/0:a")
        second = await two.prompt("s", "run the cell", new_session=True, key="cell:exp/v/s1/0:a")
        assert second.run_id == first.run_id  # attached: no second run
        result_one, result_two = await first.result(), await second.result()
    assert result_one == result_two
    assert result_one.stop_reason != "error", result_one
    assert len(stack.srv.requests) == 2  # one run's two model calls, not four
    events = await stack.watch(first.run_id)
    assert agent_starts(events) == 1
    assert sum(1 for e in events if e["type"] == "agent_end") == 1
    # another key is another run
    async with connect(stack.endpoint, name="runner-3") as three:
        stack.script([text("again.")])
        third = await three.prompt("s", "run the cell", new_session=True, key="cell:exp/v/s1/0:b")
        assert third.run_id != first.run_id
        await third.result()


async def test_a_run_in_flight_survives_a_takeover(
        tmp_path: Path, start_hub: Callable[[int], Proc]) -> None:
    """A keyed prompt whose run is in a tool call when hub A is SIGKILLed: the gateway, the
    worker, the coordinator and the client all follow [A, B] to B (started on A's log); the run
    ends once, its model calls were made once each, and the client gets its one result."""
    port_a, port_b = hub_ports(2)
    hubs = f"tcp://127.0.0.1:{port_a},tcp://127.0.0.1:{port_b}"
    hub_a = start_hub(port_a)
    srv = FakeLLMServer().start()
    topology = tmp_path / "topology.toml"
    topology.write_text(topology_text(srv.base_url))
    stack = Stack(tmp_path, hubs, srv, topology, {})
    try:
        stack.gateway()
        stack.worker()
        stack.coordinator("s")
        stack.script([calls(("slow", {"label": "cell", "seconds": 5.0})), text("cell done.")])
        async with connect(hubs, name="runner") as bus:
            run = await bus.prompt("s", "run the cell", new_session=True, key="cell:takeover:a")
            await until(lambda: len(srv.requests) >= 1, 10, "the first model call")
            hub_a.signal(signal.SIGKILL)
            hub_a.popen.wait(5)
            killed = time.monotonic()
            start_hub(port_b)
            with anyio.fail_after(40):
                result = await run.result()
            print(f"the run's result came {time.monotonic() - killed:.1f}s after hub A was killed")
        assert result.stop_reason != "error", result
        assert result.final_text == "cell done." and result.error is None, result
        assert len(srv.requests) == 2  # each model call made once
        events = await stack.watch(run.run_id)  # through the list: B's log (A's continued)
        assert agent_starts(events) == 1
        assert sum(1 for e in events if e["type"] == "agent_end") == 1
    finally:
        stack.close()
