"""Hook contracts of the agent loop: the decision types hooks return and the contexts they receive.

Every hook is optional and may be a plain function or a coroutine function; the loop awaits the
result when it is awaitable (see `call_hook`). A hook that raises is a bug in the hook, not in the
tool or the model, so each hook's docstring below says what the loop does with an exception.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from agent_bus.bus.messages import (
    AssistantMessage,
    LlmMessage,
    Message,
    ToolCall,
    ToolResult,
    ToolResultMessage,
    UserContent,
)


class _Keep:
    """Sentinel type: "leave this field as it is" where None is itself a meaningful value."""

    _instance: _Keep | None = None

    def __new__(cls) -> _Keep:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "KEEP"


KEEP = _Keep()


# --- before_tool_call ---------------------------------------------------------------------


@dataclass(frozen=True)
class Allow:
    """Run the tool call as the model wrote it."""


@dataclass(frozen=True)
class Block:
    """Do not run the call; the model gets an error result with `reason` (or `Tool execution was blocked`)."""

    reason: str | None = None


@dataclass(frozen=True)
class BlockAndStop:
    """Do not run the call and end the run after this turn (a denied permission request).

    The blocked call gets an error result with `reason` (or `Tool execution was blocked`); later calls
    of the batch are not started (in parallel mode, calls already approved before it still run);
    after turn_end the run ends with the fixed "Permission request was denied" text and
    stop_reason "denied".
    """

    reason: str | None = None


ToolDecision: TypeAlias = "Allow | Block | BlockAndStop | None"


@dataclass(frozen=True)
class ToolCallContext:
    """What `before_tool_call` sees: the call, its parsed arguments and the conversation so far."""

    call: ToolCall
    args: Any
    assistant: AssistantMessage
    messages: Sequence[Message]


BeforeToolCall: TypeAlias = Callable[[ToolCallContext], "ToolDecision | Awaitable[ToolDecision]"]
"""before_tool_call(ctx) -> Allow | Block | BlockAndStop | None.

Called once per known tool call with valid JSON arguments, after tool_execution_start and before
the tool runs (never for unknown tools, bad JSON or length-truncated calls). None means Allow. It
may wait (e.g. for a human); abort() cancels it. If it raises, the call is not run and gets the
error result `Permission check failed: <message>`; the loop continues.
"""


# --- after_tool_call ----------------------------------------------------------------------


@dataclass(frozen=True)
class AfterToolResult:
    """Field-wise override of a finished tool result. Unset fields keep the tool's value.

    `content` replaces the whole content (a str becomes one text part); `details` replaces the
    details (KEEP leaves them); `is_error` replaces the flag (None leaves it). No deep merge.
    """

    content: list[UserContent] | str | None = None
    details: Any = KEEP
    is_error: bool | None = None


@dataclass(frozen=True)
class ToolResultContext:
    """What `after_tool_call` sees: the call, its parsed arguments, the tool's result and history."""

    call: ToolCall
    args: Any
    result: ToolResult
    assistant: AssistantMessage
    messages: Sequence[Message]


AfterToolCall: TypeAlias = Callable[
    [ToolResultContext], "AfterToolResult | None | Awaitable[AfterToolResult | None]"
]
"""after_tool_call(ctx) -> AfterToolResult | None.

Called after a tool that actually ran returns (not for blocked, unknown or invalid calls), before
tool_execution_end. None keeps the result. If it raises, the result becomes the error result
`Error: <message>`; the loop continues.
"""


# --- context hooks ------------------------------------------------------------------------

TransformContext: TypeAlias = Callable[
    [list[Message]], "Sequence[Message] | Awaitable[Sequence[Message]]"
]
"""transform_context(messages) -> messages.

Called before every model call with a copy of the history; returns the messages to send (prune,
inject, reorder). History itself is untouched. Must not raise: an exception ends the run with
stop_reason "error".
"""

ConvertToLlm: TypeAlias = Callable[
    [list[Message]], "Sequence[LlmMessage] | Awaitable[Sequence[LlmMessage]]"
]
"""convert_to_llm(messages) -> LLM messages.

Maps agent messages (including compaction summaries, branch summaries and custom messages) to
the user/assistant/tool_result messages a model understands. The default turns the custom kinds
into user messages (see `agents.loop.context.default_convert_to_llm`). An exception ends the run with
stop_reason "error".
"""


@dataclass(frozen=True)
class TurnInfo:
    """A finished turn: its assistant message, its tool results, and the whole history after it."""

    turn: int
    message: AssistantMessage
    tool_results: list[ToolResultMessage]
    messages: Sequence[Message]
    new_messages: Sequence[Message]


@dataclass(frozen=True)
class NextTurn:
    """Changes for the turns that follow. None/KEEP leaves a field alone.

    `messages` replaces the history (in place, so the Agent's transcript follows); `model` switches
    the model alias; `reasoning` sets the reasoning level ("off" or None clears it).
    """

    messages: list[Message] | None = None
    model: str | None = None
    reasoning: str | None | _Keep = KEEP


PrepareNextTurn: TypeAlias = Callable[[TurnInfo], "NextTurn | None | Awaitable[NextTurn | None]"]
"""prepare_next_turn(turn) -> NextTurn | None.

Called after every turn_end (and after compaction) of a turn that did not end the run, before
should_stop_after_turn and before the steering poll. An exception ends the run with stop_reason
"error".
"""

ShouldStopAfterTurn: TypeAlias = Callable[[TurnInfo], "bool | Awaitable[bool]"]
"""should_stop_after_turn(turn) -> bool.

Called after prepare_next_turn. True ends the run at once: no steering or follow-up poll, no
further model call (stop_reason "stop"). An exception ends the run with stop_reason "error".
"""

GetIncompleteWorkPrompt: TypeAlias = Callable[[Sequence[Message]], "str | None | Awaitable[str | None]"]
"""get_incomplete_work_prompt(messages) -> prompt | None.

Called each time the run would stop (no tool calls, no steering, no follow-up). A non-empty
string is injected as a hidden user message (UserMessage(hidden=True)) and the loop runs another
turn; None or "" lets the run stop. It must return None once the work is done: only
max_iterations bounds a hook that never does. An exception ends the run with stop_reason "error".
"""

MessageSource: TypeAlias = Callable[[], "list[Message] | Awaitable[list[Message]]"]
"""get_steering_messages() / get_follow_up_messages() -> messages to inject ([] when empty).

Must not raise; each call removes what it returns from its queue.
"""


async def call_hook(hook: Callable[..., Any], *args: Any) -> Any:
    """Call a sync or async hook and return its (awaited) result."""
    result = hook(*args)
    if result is None:  # a plain function hook with nothing to return (e.g. on_message_end)
        return None
    if type(result) is types.CoroutineType:  # an `async def` hook (every event listener): the
        return await result  # general check below costs more than the call itself
    if inspect.isawaitable(result):
        result = await result
    return result
