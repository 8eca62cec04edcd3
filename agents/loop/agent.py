"""`Agent`: the stateful wrapper around `run_loop` — transcript, queues, listeners and run lifecycle.

The loop is a pure function; the Agent only adds what must outlive one run: the message history,
the steering and follow-up queues, usage totals, the tool-output store and the subscribers.

Concurrency model: `await agent.prompt(...)` runs one run to completion in the caller's task (so
the run belongs to whatever task group the caller owns). `steer()`, `follow_up()` and `abort()`
are plain methods that other tasks call while it runs; `wait_for_idle()` waits for the end.
`run_stream()` owns a small task group of its own to hand events to the consumer.
"""

from __future__ import annotations

import math
import uuid
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import anyio
import msgspec

from agent_bus.agents.loop.abort import AbortSignal
from agent_bus.agents.loop.context import ToolOutputCache, ToolOutputStore, UsageTracker
from agent_bus.agents.loop.hooks import call_hook
from agent_bus.agents.loop.run import (
    LlmClient,
    LoopConfig,
    LoopResult,
    QueueMode,
    ToolExecutor,
    UpdateSink,
    run_loop,
)
from agent_bus.bus.errors import AgentBusError
from agent_bus.bus.events import AgentEnd, Event, MessageEnd, ToolExecutionEnd, ToolExecutionStart
from agent_bus.bus.messages import (
    AssistantMessage,
    Message,
    ToolCallRequest,
    ToolInfo,
    ToolResult,
    Usage,
    user_text,
)

PROMPT_BUSY = (
    "Agent is already processing a prompt. Use steer() or follow_up() to queue messages, "
    "or wait for completion."
)
CONTINUE_BUSY = "Agent is already processing. Wait for completion before continuing."
RESET_BUSY = "Agent is already processing. Wait for completion before resetting."
NO_MESSAGES = "No messages to continue from"
CONTINUE_FROM_ASSISTANT = "Cannot continue from message role: assistant"

Listener = Callable[[Event], "Awaitable[None] | None"]
OnMessageEnd = Callable[[Message], "Awaitable[None] | None"]
PromptInput = str | Message | Sequence[Message]


class AgentError(AgentBusError, RuntimeError):
    """A caller used the Agent wrongly (prompt while running, continue with nothing to continue)."""


class MessageQueue:
    """Messages waiting to be injected; `drain()` takes one ("one-at-a-time") or all ("all")."""

    def __init__(self, mode: QueueMode = "one-at-a-time") -> None:
        self.mode: QueueMode = mode
        self._items: deque[Message] = deque()

    def push(self, message: Message) -> None:
        self._items.append(message)

    def drain(self) -> list[Message]:
        if not self._items:
            return []
        if self.mode == "all":
            items = list(self._items)
            self._items.clear()
            return items
        return [self._items.popleft()]

    def clear(self) -> None:
        self._items.clear()

    def __len__(self) -> int:
        return len(self._items)


@dataclass
class AgentState:
    """What an observer may read at any time; mutated only by the Agent and its loop."""

    system_prompt: str
    model: str
    messages: list[Message] = field(default_factory=list)
    tools: list[ToolInfo] = field(default_factory=list)
    is_running: bool = False
    pending_tool_calls: set[str] = field(default_factory=set)
    error: str | None = None
    usage: dict[str, Usage] = field(default_factory=dict)
    run_id: str = ""


class _CatalogTracker:
    """Passes calls through and remembers the last catalog in `state.tools`."""

    def __init__(self, inner: ToolExecutor, state: AgentState) -> None:
        self._inner = inner
        self._state = state

    async def catalog(self) -> list[ToolInfo]:
        tools = await self._inner.catalog()
        self._state.tools = list(tools)
        return tools

    async def execute(self, request: ToolCallRequest, on_update: UpdateSink | None = None) -> ToolResult:
        return await self._inner.execute(request, on_update)


def _to_messages(value: PromptInput) -> list[Message]:
    if isinstance(value, str):
        return [user_text(value)]
    if isinstance(value, msgspec.Struct):
        return [value]
    return list(value)


def _to_message(value: str | Message) -> Message:
    return user_text(value) if isinstance(value, str) else value


class Agent:
    """A conversation with one model and one tool set, run turn by turn by `run_loop`."""

    def __init__(
        self,
        llm: LlmClient,
        tools: ToolExecutor,
        config: LoopConfig | None = None,
        *,
        on_message_end: OnMessageEnd | None = None,
        messages: Sequence[Message] = (),
        output_store: ToolOutputStore | None = None,
    ) -> None:
        self.config = config or LoopConfig()
        self.state = AgentState(
            system_prompt=self.config.system_prompt, model=self.config.model, messages=list(messages)
        )
        self.steering = MessageQueue(self.config.steering_mode)
        self.follow_ups = MessageQueue(self.config.follow_up_mode)
        # `is None`, not `or`: a store is falsy while empty (`__len__`), and the coordinator's
        # (persisted, serving `tool_output`) starts empty.
        self.output_store = output_store if output_store is not None else ToolOutputStore()

        self._llm = llm
        self._tools = _CatalogTracker(tools, self.state)
        self._on_message_end = on_message_end
        self._usage = UsageTracker()
        self.state.usage = self._usage.by_model
        self._cache = self._new_cache()
        self._listeners: list[Listener] = []
        self._signal: AbortSignal | None = None
        self._idle = anyio.Event()
        self._idle.set()

    def _new_cache(self) -> ToolOutputCache | None:
        cfg = self.config.tool_output
        if cfg is None:
            return None
        return ToolOutputCache(self.output_store, cfg, self.config.context_window)

    # --- observation ----------------------------------------------------------------------

    @property
    def run_id(self) -> str:
        """Id of the current (or last) run: a uuid4 hex, new for every run."""
        return self.state.run_id

    @property
    def is_running(self) -> bool:
        return self.state.is_running

    def context_left_percent(self) -> int | None:
        """Percent of the context window the last reply left free; None before any reply."""
        return self._usage.context_left_percent(self.config.context_window)

    def has_queued_messages(self) -> bool:
        return bool(self.steering) or bool(self.follow_ups)

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call `listener` (sync or async, awaited in subscription order) for every event.

        A listener that raises fails the run's event delivery: the run then ends with
        stop_reason "error" where possible. Returns an unsubscribe function.
        """
        self._listeners.append(listener)

        def unsubscribe() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return unsubscribe

    # --- queues and control ---------------------------------------------------------------

    def steer(self, message: str | Message) -> None:
        """Queue a message for the next turn of the current run (nothing in flight is skipped)."""
        self.steering.push(_to_message(message))

    def follow_up(self, message: str | Message) -> None:
        """Queue a message to run when the agent would otherwise stop."""
        self.follow_ups.push(_to_message(message))

    def abort(self) -> None:
        """Cancel the in-flight model call, tools and hooks; the run ends with stop_reason aborted.

        Safe from any task; does nothing when idle. Queued messages stay queued.
        """
        if self._signal is not None:
            self._signal.abort()

    async def wait_for_idle(self) -> None:
        await self._idle.wait()

    def reset(self) -> None:
        """Forget the conversation, queues, error and usage; refused while a run is active."""
        if self.state.is_running:
            raise AgentError(RESET_BUSY)
        self.state.messages.clear()
        self.state.pending_tool_calls.clear()
        self.state.error = None
        self.state.run_id = ""
        self.steering.clear()
        self.follow_ups.clear()
        self._usage.by_model.clear()
        self._usage.last = None
        self._cache = self._new_cache()

    # --- entry points ---------------------------------------------------------------------

    async def prompt(self, value: PromptInput, *, max_turns: int | None = None) -> LoopResult:
        """Add the prompt message(s) and run until the agent stops.

        `max_turns` bounds this run only (instead of `config.max_iterations`); the run then ends
        with stop reason "max_iterations"."""
        messages = _to_messages(value)
        signal = self._begin(PROMPT_BUSY)
        return await self._execute(signal, messages, skip_initial_steering=False,
                                   max_turns=max_turns)

    async def continue_(self) -> LoopResult:
        """Run again from the history as it is (e.g. after a tool result or a failed run).

        From an assistant tail only queued messages can continue: steering first (taken per its
        mode), else follow-ups.
        """
        if self.state.is_running:
            raise AgentError(CONTINUE_BUSY)
        if not self.state.messages:
            raise AgentError(NO_MESSAGES)
        if not isinstance(self.state.messages[-1], AssistantMessage):
            return await self._execute(self._begin(CONTINUE_BUSY), [], skip_initial_steering=False)
        steering = self.steering.drain()
        if steering:
            return await self._execute(self._begin(CONTINUE_BUSY), steering, skip_initial_steering=True)
        follow_ups = self.follow_ups.drain()
        if follow_ups:
            return await self._execute(self._begin(CONTINUE_BUSY), follow_ups, skip_initial_steering=False)
        raise AgentError(CONTINUE_FROM_ASSISTANT)

    async def resume(self, run_id: str, pending: Sequence[Message], *, start_turn: int = 0,
                     max_turns: int | None = None) -> LoopResult:
        """Go on with run `run_id` after a restart (durable runs, `agents.coordinator.process`): the
        history is as persisted, `pending` (e.g. tool results recovered from the journal) is
        added first, turns are numbered on from `start_turn`. The caller checks that the history
        can continue (it does not end with a final assistant reply)."""
        signal = self._begin(CONTINUE_BUSY)
        self.state.run_id = run_id
        return await self._execute(signal, list(pending), skip_initial_steering=True,
                                   max_turns=max_turns, start_turn=start_turn)

    async def run(self, value: PromptInput) -> str:
        """Prompt and return the final text (check `state.error` for failures)."""
        return (await self.prompt(value)).final_text

    async def run_stream(self, value: PromptInput) -> AsyncGenerator[Event, None]:
        """Prompt and yield every event of the run, ending after agent_end.

        Breaking out early aborts the run; wrap in `contextlib.aclosing` when you may break, so
        the run is closed in your task rather than by the garbage collector.
        """
        messages = _to_messages(value)
        signal = self._begin(PROMPT_BUSY)
        send, receive = anyio.create_memory_object_stream[Event](math.inf)
        unsubscribe = self.subscribe(send.send)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._execute_then_close, signal, messages, send)
                try:
                    async with receive:
                        async for event in receive:
                            yield event
                finally:
                    signal.abort()  # no-op when the run already ended
        finally:
            unsubscribe()

    # --- run lifecycle --------------------------------------------------------------------

    def _begin(self, busy_text: str) -> AbortSignal:
        """Mark a run active (synchronously, so two callers cannot both start one)."""
        if self.state.is_running:
            raise AgentError(busy_text)
        self.state.is_running = True
        self.state.error = None
        self.state.pending_tool_calls.clear()
        self.state.run_id = uuid.uuid4().hex
        self._signal = AbortSignal()
        self._idle = anyio.Event()
        return self._signal

    async def _execute(
        self, signal: AbortSignal, messages: list[Message], *, skip_initial_steering: bool,
        max_turns: int | None = None, start_turn: int = 0,
    ) -> LoopResult:
        config = replace(
            self.config,
            max_iterations=max_turns or self.config.max_iterations,
            model=self.state.model,
            system_prompt=self.state.system_prompt,
            get_steering_messages=self.steering.drain,
            get_follow_up_messages=self.follow_ups.drain,
        )
        try:
            return await run_loop(
                messages,
                self.state.messages,
                config,
                self._llm,
                self._tools,
                self._handle_event,
                signal=signal,
                output_cache=self._cache,
                run_id=self.state.run_id,
                skip_initial_steering=skip_initial_steering,
                start_turn=start_turn,
            )
        finally:
            self.state.is_running = False
            self.state.pending_tool_calls.clear()
            self._signal = None
            self._idle.set()

    async def _execute_then_close(
        self, signal: AbortSignal, messages: list[Message], send: Any
    ) -> None:
        async with send:
            await self._execute(signal, messages, skip_initial_steering=False)

    async def _handle_event(self, event: Event) -> None:
        """Keep state in step with the run, persist ended messages, then notify listeners."""
        if isinstance(event, MessageEnd):
            await self._on_message(event.message)
        elif isinstance(event, ToolExecutionStart):
            self.state.pending_tool_calls.add(event.tool_call_id)
        elif isinstance(event, ToolExecutionEnd):
            self.state.pending_tool_calls.discard(event.tool_call_id)
        elif isinstance(event, AgentEnd):
            self._usage.merge(event.usage)
            if event.error:
                self.state.error = event.error
        for listener in list(self._listeners):
            await call_hook(listener, event)

    async def _on_message(self, message: Message) -> None:
        if isinstance(message, AssistantMessage):
            self._usage.last = message.usage
            if message.error:
                self.state.error = message.error
        if self._on_message_end is not None:
            await call_hook(self._on_message_end, message)


__all__ = [
    "CONTINUE_BUSY",
    "CONTINUE_FROM_ASSISTANT",
    "NO_MESSAGES",
    "PROMPT_BUSY",
    "RESET_BUSY",
    "Agent",
    "AgentError",
    "AgentState",
    "Listener",
    "MessageQueue",
    "OnMessageEnd",
    "PromptInput",
]
