"""Idle sessions leave the coordinator's memory once `IDLE_SESSIONS_KEPT` more recent ones are
idle, and come back from the store when continued; with concurrent runs too (a run's end
looks only at the eviction candidates, not every session). Real processes: hub, gateway ->
FakeLLMServer, worker, coordinator."""

from __future__ import annotations

from typing import Any

import pytest

from agent_bus.agents.client.remote import connect
from agent_bus.agents.coordinator.process import IDLE_SESSIONS_KEPT
from agent_bus.agents.gateway.fakellm import load_script
from tests.coordinator.conftest import Stack

pytestmark = pytest.mark.anyio


def user_texts(body: dict[str, Any]) -> list[str]:
    return [m["content"] if isinstance(m["content"], str) else m["content"][0]["text"]
            for m in body["messages"] if m["role"] == "user"]


async def test_idle_sessions_beyond_the_kept_ones_leave_memory_and_load_again(
        stack: Stack) -> None:
    stack.srv.set_script(load_script({"rules": [
        {"contains": [], "tool_result": False, "reply": {"text": "answer to {last_user}"}}]}),
        clear_requests=True)
    async with connect(stack.endpoint, name="t-idle") as bus:
        early = await bus.run_many([("a", f"early-{i}") for i in range(IDLE_SESSIONS_KEPT + 8)],
                                   concurrency=8)
        state = await bus.state("a")
        assert (state.live, state.idle, len(state.sessions)) == (0, IDLE_SESSIONS_KEPT,
                                                                 IDLE_SESSIONS_KEPT)
        assert state.stored >= IDLE_SESSIONS_KEPT + 8
        for i in range(IDLE_SESSIONS_KEPT):  # more recent ones: every early session leaves
            await bus.run("a", f"late-{i}")
        state = await bus.state("a")
        held = {info.session for info in state.sessions}
        assert state.idle == len(held) == IDLE_SESSIONS_KEPT
        assert not held & {r.session for r in early}
        again = await bus.run("a", "more", session=early[0].session)
    assert (again.final_text, again.session) == ("answer to more", early[0].session)
    assert user_texts(stack.srv.requests[-1].body) == ["early-0", "more"]
