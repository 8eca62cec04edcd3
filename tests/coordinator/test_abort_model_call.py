"""Aborting a run mid-answer: the coordinator's model client leaves the stream as soon as the
loop's abort is set (no watcher task: `agents.loop.abort.Abort.cancels`) and returns what
streamed so far, so the aborted reply keeps its text. Real processes: hub, gateway ->
FakeLLMServer (a slow stream), worker, coordinator."""

from __future__ import annotations

import anyio
import pytest

from agent_bus.agents.client.remote import connect
from tests.coordinator.conftest import Stack

pytestmark = pytest.mark.anyio

LONG = "word " * 400


async def test_abort_mid_answer_keeps_the_text_streamed_so_far(stack: Stack) -> None:
    # 400 chunks 20 ms apart: the stream runs ~8 s, far past the abort and its 2 s grace
    stack.script([{"reply": {"text": LONG, "chunk_size": 5, "chunk_delay": 0.02}}])
    async with connect(stack.endpoint, name="t-abort-llm") as bus:
        run = await bus.prompt("a", "tell me a long one", new_session=True)
        with anyio.fail_after(10):
            async for envelope in run.events():
                if envelope.header.type == "message_update":
                    break
            await bus.abort("a", run=run.run_id)
            result = await run.result()
    assert result.stop_reason == "aborted"
    ends = [e for e in await stack.watch(run.run_id) if e["type"] == "message_end"]
    message = ends[-1]["message"]
    text = "".join(part.get("text", "") for part in message["content"])
    # Cancelled only after the grace, the client would have returned nothing (the loop's own
    # partial text comes from deltas, which the gateway publishes instead).
    assert message["stop_reason"] == "aborted" and text.startswith("word ")
    assert len(text) < len(LONG)
