"""`agents.coordinator.durable`: what a resumed run does with the calls of its last reply (pure functions;
the real-process acceptance tests are in test_resume.py)."""

from __future__ import annotations

import anyio
import pytest

from agent_bus.agents.coordinator.durable import MAY_HAVE_RUN, final_end, plan, recover, unanswered
from agent_bus.agents.coordinator.persistence import JournaledCall
from agent_bus.bus import events as ev
from agent_bus.bus.messages import (
    AssistantMessage,
    TextPart,
    ToolCall,
    ToolCallRequest,
    ToolInfo,
    ToolResult,
    ToolResultMessage,
    user_text,
)

CALLS = [ToolCall("c1", "once", '{"tag": "a"}'), ToolCall("c2", "again", "{}"),
         ToolCall("c3", "once", "{}"), ToolCall("c4", "once", "{}")]
REPLY = AssistantMessage(content=[TextPart("working"), *CALLS], stop_reason="tool_use")
CATALOG = [ToolInfo("once"), ToolInfo("again", idempotent=True)]


def result(call_id: str, text: str) -> ToolResultMessage:
    return ToolResultMessage(tool_call_id=call_id, tool_name="once", content=[TextPart(text)])


def test_unanswered_are_the_last_replys_calls_without_a_result() -> None:
    history = [user_text("go"), REPLY, result("c1", "done")]
    assert [c.id for c in unanswered(history)] == ["c2", "c3", "c4"]
    assert unanswered([user_text("go")]) == []
    assert unanswered([REPLY, user_text("steer")]) == []  # the reply was answered by the user


def test_final_end_only_for_a_final_reply() -> None:
    final = AssistantMessage(content=[TextPart(" the answer ")])
    end = final_end([user_text("go"), final])
    assert end == ev.AgentEnd(final_text="the answer", stop_reason="stop")
    failed = AssistantMessage(stop_reason="error", error="boom")
    assert final_end([failed]) == ev.AgentEnd(stop_reason="error", error="boom")
    assert final_end([REPLY]) is None and final_end([user_text("go")]) is None


def test_plan_and_recover() -> None:
    journal = {"c1": JournaledCall("c1", "once", result("c1", "journaled")),
               "c2": JournaledCall("c2", "again"),  # began, idempotent: runs again
               "c3": JournaledCall("c3", "once")}  # began, not idempotent: may have run
    todo = plan(CALLS, journal, CATALOG)  # c4 never began: runs
    assert (list(todo.done), todo.rerun, todo.failed) == (["c1"], ["c2", "c4"], ["c3"])
    executed: list[str] = []
    emitted: list[ev.Event] = []

    async def execute(request: ToolCallRequest) -> ToolResult:
        executed.append(request.call_id)
        assert (request.agent, request.run_id) == ("a", "r1")
        return ToolResult(content=[TextPart(f"ran {request.call_id}")])

    async def emit(event: ev.Event) -> None:
        emitted.append(event)

    results = anyio.run(recover, CALLS, todo, "a", "r1", execute, emit)
    assert executed == ["c2", "c4"]
    assert [r.tool_call_id for r in results] == ["c1", "c2", "c3", "c4"]
    assert results[0].text == "journaled"
    assert results[2].is_error and results[2].text == MAY_HAVE_RUN.format(name="once",
                                                                         call_id="c3")
    assert [(ev.event_type(e), getattr(e, "tool_call_id", "")) for e in emitted] == [
        ("tool_execution_start", "c2"), ("tool_execution_end", "c2"),
        ("tool_execution_end", "c3"),
        ("tool_execution_start", "c4"), ("tool_execution_end", "c4")]


@pytest.mark.parametrize("name", ["once", "again"])
def test_a_call_that_never_began_runs_whatever_its_tool(name: str) -> None:
    todo = plan([ToolCall("c9", name, "{}")], {}, CATALOG)
    assert todo.rerun == ["c9"] and not todo.failed
