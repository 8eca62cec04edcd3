"""Issue 28 item 4: one oversized model reply must not take the gateway off the bus.

A 20 MB tool argument made the gateway's reply (and its streamed events) exceed the hub's 16 MiB
`max_message_bytes`; the hub dropped the gateway's connection and an unrelated run on the same
gateway failed. Now that one model call fails with an error naming the size and the limit, and a
run in flight on the same gateway at the same time finishes, over the same connection.
"""

from __future__ import annotations

from collections.abc import Iterator

import anyio
import pytest

from agent_bus.agents.client.remote import connect
from tests.coordinator.conftest import Stack, start_stack
from tests.support import until

pytestmark = pytest.mark.anyio

HUGE = 20 * 1024 * 1024
LIMIT = 16 * 1024 * 1024  # the hub's default `max_message_bytes`


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(tmp_path_factory.mktemp("oversize"), worker=True, coordinator=("a", "p"))
    try:
        yield s
    finally:
        s.close()


async def test_a_20_mb_tool_argument_fails_its_call_and_nothing_else(stack: Stack) -> None:
    stack.srv.set_script({"rules": [
        {"contains": ["huge"], "reply": {
            "text": "Writing.", "chunk_size": 1 << 20,
            "tool_calls": [{"name": "echo", "arguments": {"text": "x" * HUGE}, "id": "c1"}]}},
        {"contains": ["slow"], "delay": 2.0, "reply": {"text": "slow done"}},
    ]}, clear_requests=True)
    async with connect(stack.endpoint, name="test-oversize") as bus:
        before = await bus.peer.status()
        gateway = next(p for p in before.peers if p.name == "gateway")
        slow = await bus.prompt("p", "slow please", new_session=True)
        await until(lambda: len(stack.srv.requests) == 1, 10, "the slow call to be in flight")
        huge = await bus.prompt("a", "huge please", new_session=True)
        with anyio.fail_after(30):
            huge_result = await huge.result()
            slow_result = await slow.result()
        after = await bus.peer.status()
    assert huge_result.stop_reason == "error", huge_result
    error = huge_result.error or ""
    assert f"over the hub's message limit of {LIMIT} bytes" in error, error
    assert "max_message_bytes" in error, error
    assert slow_result.stop_reason == "stop" and slow_result.final_text == "slow done"
    # the gateway's connection is the same one, and the hub never had to drop anything
    same = next(p for p in after.peers if p.name == "gateway")
    assert (same.peer, same.session, same.since) == (gateway.peer, gateway.session, gateway.since)
    assert after.counters.get("oversize", 0) == before.counters.get("oversize", 0)
    assert after.counters.get("oversize_events", 0) == before.counters.get("oversize_events", 0)
    assert "may be missing" not in stack.procs["gateway"].output()
