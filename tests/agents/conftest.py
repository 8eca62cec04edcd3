"""In-memory fakes for the agent loop: a scripted LlmClient, a dict-backed ToolExecutor, a recorder."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from agent_bus.agents.loop.abort import Abort
from agent_bus.agents.loop.hooks import call_hook
from agent_bus.bus.events import Event, event_type
from agent_bus.bus.messages import (
    AssistantDelta,
    AssistantMessage,
    LlmRequest,
    TextPart,
    ToolCall,
    ToolCallRequest,
    ToolInfo,
    ToolResult,
    Usage,
    error_result,
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def call(call_id: str, name: str, raw: str | None = None, **args: Any) -> ToolCall:
    """A tool call; `raw` gives the argument text verbatim (e.g. broken JSON)."""
    return ToolCall(id=call_id, name=name, arguments=raw if raw is not None else json.dumps(args))


def reply(text: str = "", *calls: ToolCall, stop: str | None = None, total: int = 0) -> AssistantMessage:
    content: list[Any] = [TextPart(text)] if text else []
    content += list(calls)
    stop_reason = stop or ("tool_use" if calls else "stop")
    return AssistantMessage(
        content=content, stop_reason=stop_reason, usage=Usage(total=total), model="m"  # type: ignore[arg-type]
    )


Script = AssistantMessage | BaseException | Callable[[LlmRequest], Any]


class ScriptedLlm:
    """Answers from a script; streams each text part as one delta. Entries may be replies,
    exceptions to raise, or callables (sync/async) taking the request."""

    def __init__(self, *script: Script) -> None:
        self.script = list(script)
        self.requests: list[LlmRequest] = []

    async def complete(self, request: LlmRequest, on_delta: Any = None, *,
                       abort: Abort | None = None) -> AssistantMessage:
        self.requests.append(request)
        assert self.script, "scripted LLM called more times than scripted"
        entry = self.script.pop(0)
        if isinstance(entry, BaseException):
            raise entry
        message = entry if isinstance(entry, AssistantMessage) else await call_hook(entry, request)
        if on_delta is not None:
            for part in message.content:
                if isinstance(part, TextPart):
                    await on_delta(AssistantDelta(kind="text", delta=part.text))
        return message


Handler = Callable[..., Any]


class FakeTools:
    """Tools by name: handler(args, on_update) -> str | ToolResult (sync or async); raising
    becomes "Error: <message>" like a real executor."""

    def __init__(self, handlers: dict[str, Handler] | None = None, sequential: tuple[str, ...] = ()) -> None:
        self.handlers = handlers or {}
        self.sequential = set(sequential)
        self.executed: list[str] = []

    async def catalog(self) -> list[ToolInfo]:
        return [ToolInfo(name=n, sequential=n in self.sequential) for n in self.handlers]

    async def execute(self, request: ToolCallRequest, on_update: Any = None) -> ToolResult:
        handler = self.handlers.get(request.name)
        if handler is None:
            return error_result(f"Error: Unknown tool '{request.name}'")
        self.executed.append(request.call_id)
        try:
            out = await call_hook(handler, json.loads(request.arguments), on_update)
        except Exception as exc:
            return error_result(f"Error: {exc}")
        return ToolResult(content=[TextPart(out)]) if isinstance(out, str) else out


class Recorder:
    """The emit sink: keeps every event in order."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    async def __call__(self, event: Event) -> None:
        self.events.append(event)

    def types(self) -> list[str]:
        return [event_type(e) for e in self.events]

    def of(self, type_: str) -> list[Any]:
        return [e for e in self.events if event_type(e) == type_]

    def compact(self) -> list[str]:
        """Types with the message role / tool call id appended, for exact-order asserts."""
        out = []
        for e in self.events:
            t = event_type(e)
            msg = getattr(e, "message", None)
            if t in ("message_start", "message_end") and msg is not None:
                t += f":{type(msg).__struct_config__.tag}"
            elif t.startswith("tool_execution"):
                t += f":{e.tool_call_id}"
            out.append(t)
        return out
