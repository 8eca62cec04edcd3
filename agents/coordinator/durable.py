"""Durable runs: what a run that was live when its coordinator died needs to go on.

The coordinator journals each run (`agents.coordinator.persistence`: the run, its last turn, every tool call
begun and its result once ended) before publishing the matching event; the model replies it
completed are the session's stored messages. After a restart, `recover` looks at the stored
history: the tool calls of the last assistant reply that have no result message yet get

- their journaled result, when the call ended (it is not run again);
- a new execution, when it never began, or began and its tool is idempotent;
- an error result saying it may have run, when it began, did not end and is not idempotent
  (a second execution could repeat a side effect: never done silently).

The run then goes on from the history plus those results (`Agent.resume`), so the model call that
was in flight is issued again and completed ones are not. A history that ends with a final reply
(no tool calls) only lacked its `agent_end`: `final_end` gives it.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent_bus.agents.coordinator.persistence import JournaledCall
from agent_bus.bus import events as ev
from agent_bus.bus.messages import (
    AssistantMessage,
    Message,
    TextPart,
    ToolCall,
    ToolCallRequest,
    ToolInfo,
    ToolResult,
    ToolResultMessage,
)

MAY_HAVE_RUN = ("Error: tool `{name}` (call {call_id}) was in progress when the agent's "
                "coordinator stopped and may have run; it is not idempotent, so it was not run "
                "again. Check its effect before calling it again.")

Execute = Callable[[ToolCallRequest], Awaitable[ToolResult]]  # never raises (executor contract)
Emit = Callable[[ev.Event], Awaitable[None]]


@dataclass
class Plan:
    """What recovery does with each unanswered call (decided before anything runs, so the
    `run_resumed` event can say it)."""

    done: dict[str, ToolResultMessage] = field(default_factory=dict)  # journaled results
    rerun: list[str] = field(default_factory=list)  # call ids run (again)
    failed: list[str] = field(default_factory=list)  # call ids given MAY_HAVE_RUN


def unanswered(messages: Sequence[Message]) -> list[ToolCall]:
    """The tool calls of the last assistant reply with no result message after it (empty when
    anything but tool results follows that reply)."""
    answered: set[str] = set()
    for message in reversed(messages):
        if isinstance(message, ToolResultMessage):
            answered.add(message.tool_call_id)
            continue
        if isinstance(message, AssistantMessage):
            return [c for c in message.tool_calls if c.id not in answered]
        return []
    return []


def final_end(messages: Sequence[Message]) -> ev.AgentEnd | None:
    """The `agent_end` of a run whose last reply was final (only its end was lost); None when
    the history can go on."""
    last = messages[-1] if messages else None
    if not isinstance(last, AssistantMessage) or last.tool_calls:
        return None
    failed = last.stop_reason in ("error", "aborted")
    return ev.AgentEnd(final_text=last.text.strip(), stop_reason=last.stop_reason if failed
                       else "stop", error=last.error)


def plan(calls: Sequence[ToolCall], journal: dict[str, JournaledCall],
         catalog: Sequence[ToolInfo]) -> Plan:
    idempotent = {t.name for t in catalog if t.idempotent}
    out = Plan()
    for call in calls:
        entry = journal.get(call.id)
        if entry is not None and entry.result is not None:
            out.done[call.id] = entry.result  # ended before the crash: never run twice
        elif entry is not None and call.name not in idempotent:
            out.failed.append(call.id)
        else:  # never began, or idempotent
            out.rerun.append(call.id)
    return out


async def recover(calls: Sequence[ToolCall], todo: Plan, agent: str, run_id: str,
                  execute: Execute, emit: Emit) -> list[ToolResultMessage]:
    """The result messages of the unanswered `calls`, in call order, per `todo`; emits
    tool_execution_start / end for the calls run or failed, so they are journaled and
    published like any other."""
    results: list[ToolResultMessage] = []
    for call in calls:
        done = todo.done.get(call.id)
        if done is not None:
            results.append(done)
            continue
        if call.id in todo.failed:
            text = MAY_HAVE_RUN.format(name=call.name, call_id=call.id)
            result = ToolResult(content=[TextPart(text)], is_error=True)
        else:
            await emit(ev.ToolExecutionStart(tool_call_id=call.id, tool_name=call.name,
                                             args=_args(call.arguments)))
            result = await execute(ToolCallRequest(call_id=call.id, name=call.name,
                                                   arguments=call.arguments or "{}",
                                                   agent=agent, run_id=run_id))
        message = _message(call, result)
        await emit(ev.ToolExecutionEnd(tool_call_id=call.id, tool_name=call.name,
                                       result=message, is_error=message.is_error))
        results.append(message)
    return results


def _args(raw: str) -> Any:
    try:
        return json.loads(raw or "{}")
    except json.JSONDecodeError:
        return raw


def _message(call: ToolCall, result: ToolResult) -> ToolResultMessage:
    return ToolResultMessage(tool_call_id=call.id, tool_name=call.name,
                             content=list(result.content), is_error=result.is_error,
                             details=result.details)


__all__ = ["MAY_HAVE_RUN", "Plan", "final_end", "plan", "recover", "unanswered"]
