"""(d) The coordinator's `run` (a prompt, an experiment cell's) with a repeated idempotency key
attaches to the run the coordinator already has: one run, its one result to both requests.
Real processes: a hub, a gateway on the fake model, a tool worker and a coordinator."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent_bus.agents.client.remote import connect
from tests.coordinator.conftest import Stack, calls, start_stack, text

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
