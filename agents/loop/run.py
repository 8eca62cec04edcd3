"""The agent loop: a pure, in-process function with the model, the tools and the event sink injected.

`run_loop` drives turns (inject pending messages -> one model call -> the tool batch -> turn_end)
until the model stops asking for tools and no steering, follow-up or incomplete-work prompt
remains. It opens no sockets: the coordinator implements `LlmClient`/`ToolExecutor` over the bus
and tests implement them in memory, so every behaviour below is testable by collecting events.

Event order of one run (see docs in the tests, tests/agents/test_loop.py):

    agent_start
    turn_start, [compaction_start, compaction_complete] (before the turn's messages go in),
    (message_start, message_end)* for injected messages,
    message_start(assistant) -- emitted *before* the model call, with an empty placeholder, so
        updates a remote client publishes elsewhere never precede it --
    message_update*, message_end(assistant),
    [tool_execution_start, tool_execution_update*, tool_execution_end, message_start/end]*,
    turn_end, ...next turn...
    agent_end

Run stop reasons (AgentEnd.stop_reason): "stop" (model finished, or should_stop_after_turn),
"length" (the model's final answer was cut at its output token limit, `max_tokens`),
"done" (a tool returned done), "denied" (BlockAndStop), "max_iterations", "error" (also: the
repeat guard saw the same call 2 * repeat_limit times in a row), "aborted".
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import anyio
import msgspec

from agent_bus.agents.loop.abort import Abort, AbortSignal
from agent_bus.agents.loop.context import (
    DEFAULT_CONTEXT_WINDOW,
    PROMPT_CEILING,
    CompactionConfig,
    LlmView,
    SizeMemo,
    TokenRate,
    ToolOutputCache,
    ToolOutputConfig,
    ToolOutputStore,
    UsageTracker,
    common_prefix,
    compacted_history,
    compaction_prompt,
    default_convert_to_llm,
    estimate_tokens,
    estimate_usage,
    exceeded_window,
    first_prompt,
    fixed_tokens,
    history_rate,
    history_tokens,
    is_context_exceeded,
    messages_for_summary,
    parse_compaction,
    prompt_tokens,
    refused_prompt,
    retained_start,
    should_compact,
    summarisable,
    summary_budget,
    summary_chunks,
)
from agent_bus.agents.loop.hooks import (
    KEEP,
    AfterToolCall,
    AfterToolResult,
    BeforeToolCall,
    Block,
    BlockAndStop,
    ConvertToLlm,
    GetIncompleteWorkPrompt,
    MessageSource,
    NextTurn,
    PrepareNextTurn,
    ShouldStopAfterTurn,
    ToolCallContext,
    ToolResultContext,
    TransformContext,
    TurnInfo,
    call_hook,
)
from agent_bus.bus.events import (
    AgentEnd,
    AgentStart,
    CompactionComplete,
    CompactionStart,
    Event,
    MessageEnd,
    MessageStart,
    MessageUpdate,
    ToolExecutionEnd,
    ToolExecutionStart,
    ToolExecutionUpdate,
    TurnEnd,
    TurnStart,
)
from agent_bus.bus.messages import (
    AssistantDelta,
    AssistantMessage,
    CompactionSummaryMessage,
    LlmMessage,
    LlmRequest,
    LlmTrace,
    Message,
    RetryPolicy,
    TextPart,
    ToolCall,
    ToolCallRequest,
    ToolChoice,
    ToolInfo,
    ToolResult,
    ToolResultMessage,
    ToolSpec,
    Usage,
    UserContent,
    UserMessage,
    error_result,
    user_text,
)

# --- exact strings ------------------------------------------------------------------------

ABORTED_TEXT = "Operation aborted"
BLOCKED_TEXT = "Tool execution was blocked"
DENIED_TEXT = "Permission request was denied. Turn stopped. Please send your next input to continue."
TASK_COMPLETE_TEXT = "Task complete"
TRUNCATED_CALL_TEXT = (
    'Tool call "{name}" was not executed: the response hit the output token limit, so its '
    "arguments may be truncated. Re-issue the tool call with complete arguments."
)
REPEAT_NOTE = (
    "\n\n[Note: this is call {count} in a row of `{name}` with the same arguments; the result will "
    "not change. Do something different, or answer with what you have. The run is stopped at "
    "{stop} identical calls.]"
)
REPEAT_STOP_TEXT = (
    "Stopped: the model called `{name}` with the same arguments {count} times in a row (the "
    "repeat limit is {limit}: a note at {limit}, a stop at twice that). Set the agent's "
    "`repeat_limit` higher, or 0 to turn the guard off."
)
CONTEXT_TOO_SMALL_TEXT = (
    "The request does not fit the model's context window ({window} tokens) even with older turns "
    "compacted: the question and the newest tool results alone need about {needed} tokens "
    "(estimated; the system prompt and the tool schemas come on top). Use a bigger window (the "
    "server's context size, e.g. llama.cpp's --ctx-size, and the model's `context_window`), a "
    "lower `max_tokens`, or ask for a smaller tool result. The server said: {error}"
)
MAX_ITERATIONS_PREFIX = "[Max Iterations Reached]\n\n"
MAX_ITERATIONS_FALLBACK = "Summary unavailable due to an internal error."
MAX_ITERATIONS_SUMMARY_PROMPT = (
    "You are generating the final response for the user after the agent reached max iterations. "
    "Summarize what was completed, what is pending, and any blockers. Be concise, user-facing, "
    "and do not mention internal agent mechanics. If there is a clear next step, suggest it as a "
    "short list."
)

# --- injected interfaces ------------------------------------------------------------------

Emit = Callable[[Event], Awaitable[None]]
DeltaSink = Callable[[AssistantDelta], Awaitable[None]]
UpdateSink = Callable[[Any], Awaitable[None]]
ToolExecutionMode = Literal["parallel", "sequential"]
QueueMode = Literal["one-at-a-time", "all"]


class LlmClient(Protocol):
    async def complete(
        self, request: LlmRequest, on_delta: DeltaSink | None = None, *, abort: Abort | None = None
    ) -> AssistantMessage:
        """One model call.

        Never raises for provider failures: returns an AssistantMessage with stop_reason "error"
        and `error` set (the loop still turns an unexpected exception into such a message).
        Cancellation is anyio cancellation. A client that streams calls on_delta per delta (the
        loop then emits message_update); a remote client whose deltas are published elsewhere
        simply never calls it. Retrying is the gateway's job (request.retry says how).

        `abort` (the loop always passes one): a client that runs its call under
        `abort.cancels()` is stopped when the run is aborted and returns what it has, with
        stop_reason "aborted"; one that ignores it is cancelled (see `agents.loop.abort`).
        """
        ...


class ToolExecutor(Protocol):
    async def catalog(self) -> list[ToolInfo]:
        """The live tools (name, description, parameters, sequential, idempotent, timeout)."""
        ...

    async def execute(
        self, request: ToolCallRequest, on_update: UpdateSink | None = None
    ) -> ToolResult:
        """Run one call (`arguments` is the model's JSON text).

        Never raises for tool failures: returns an is_error ToolResult (unknown tool ->
        "Error: Unknown tool '<name>'"; schema violations name the field; an exception in the
        tool -> "Error: <message>"; TaskComplete/Done -> done=True). Partial output goes to
        on_update. Cancellation is anyio cancellation.
        """
        ...


# --- configuration ------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class LoopConfig:
    """Everything a run needs besides the injected model, tools and sink. Hooks: see agents.loop.hooks."""

    model: str = ""
    system_prompt: str = ""
    agent: str = ""
    tool_execution: ToolExecutionMode = "parallel"
    max_iterations: int = 200
    #: A weak model loops: the same tool with the same arguments this many times in a row gets a
    #: note in its result; twice as many ends the run with stop reason "error". 0 = no guard.
    repeat_limit: int = 3
    require_done_tool: bool = False
    tool_choice: ToolChoice = "auto"
    reasoning: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()  # None/empty: the model's `[models.x]` defaults, then the server's
    llm_max_retries: int = 5
    llm_retry_base_delay: float = 1.0
    llm_retry_max_delay: float = 60.0
    llm_retryable_statuses: tuple[int, ...] = (429, 500, 502, 503, 504)
    context_window: int = DEFAULT_CONTEXT_WINDOW
    compaction: CompactionConfig | None = field(default_factory=CompactionConfig)
    tool_output: ToolOutputConfig | None = field(default_factory=ToolOutputConfig)
    steering_mode: QueueMode = "one-at-a-time"
    follow_up_mode: QueueMode = "one-at-a-time"
    get_steering_messages: MessageSource | None = None
    get_follow_up_messages: MessageSource | None = None
    before_tool_call: BeforeToolCall | None = None
    after_tool_call: AfterToolCall | None = None
    transform_context: TransformContext | None = None
    convert_to_llm: ConvertToLlm | None = None
    prepare_next_turn: PrepareNextTurn | None = None
    should_stop_after_turn: ShouldStopAfterTurn | None = None
    get_incomplete_work_prompt: GetIncompleteWorkPrompt | None = None

    def retry_policy(self) -> RetryPolicy:
        return RetryPolicy(
            max_attempts=self.llm_max_retries,
            base_delay=self.llm_retry_base_delay,
            max_delay=self.llm_retry_max_delay,
            retry_statuses=list(self.llm_retryable_statuses),
        )


@dataclass
class LoopResult:
    """What a run produced; the same facts AgentEnd carries, plus the messages it added."""

    final_text: str
    stop_reason: str
    error: str | None = None
    usage: dict[str, Usage] = field(default_factory=dict)
    messages: list[Message] = field(default_factory=list)


# --- run state ----------------------------------------------------------------------------


@dataclass
class _End:
    final_text: str
    stop_reason: str
    error: str | None = None


def _aborted_end() -> _End:
    return _End("", "aborted", ABORTED_TEXT)


def _answer_end(run: _Run) -> _End:
    """The model answered: "length" when that answer was cut at the output token limit."""
    last = next((m for m in reversed(run.messages) if isinstance(m, AssistantMessage)), None)
    cut = last is not None and last.stop_reason == "length" and not last.tool_calls
    return _End(run.last_text, "length" if cut else "stop")


@dataclass
class _Run:
    config: LoopConfig
    llm: LlmClient
    tools: ToolExecutor
    emit: Emit
    messages: list[Message]
    signal: AbortSignal
    cache: ToolOutputCache | None
    run_id: str
    model: str
    reasoning: str | None
    usage: UsageTracker = field(default_factory=UsageTracker)
    new_messages: list[Message] = field(default_factory=list)
    iterations: int = 0
    turn: int = 0
    last_call: tuple[str, str] | None = None  # (tool, canonical arguments) of the previous call
    repeats: int = 0  # how many calls in a row were `last_call`
    #: Model calls begun (assistant message_starts): the next one's index, which names its `chat`
    #: span in `busctl otel`'s trace (LlmTrace.call). One per turn, so a resumed run starts at
    #: its turn count.
    calls: int = 0
    #: The history's converted view and estimated size, kept from turn to turn so a turn
    #: converts and measures only what changed (see `LlmView`, `SizeMemo`).
    view: LlmView = field(default_factory=LlmView)
    sizes: SizeMemo = field(default_factory=lambda: SizeMemo(estimate_tokens))
    #: The user's messages of this run (its prompt, follow-ups, steering): compaction keeps them.
    pinned: list[Message] = field(default_factory=list)
    #: The window a context-exceeded error reported: it applies at once (0: none).
    window_hint: int = 0
    #: Real tokens per estimated one, from the last real usage of this history (read from the
    #: history at the run's start, then measured on each reply).
    rate: TokenRate = field(default_factory=TokenRate)

    @property
    def last_text(self) -> str:
        for message in reversed(self.messages):
            if isinstance(message, AssistantMessage):
                return message.text.strip()
        return ""


# --- entry point --------------------------------------------------------------------------


async def run_loop(
    prompts: Sequence[Message],
    messages: list[Message],
    config: LoopConfig,
    llm: LlmClient,
    tools: ToolExecutor,
    emit: Emit,
    *,
    signal: AbortSignal | None = None,
    output_cache: ToolOutputCache | None = None,
    run_id: str = "",
    skip_initial_steering: bool = False,
    start_turn: int = 0,
) -> LoopResult:
    """Run the agent until it stops; `messages` is the history, extended (and compacted) in place.

    `prompts` are injected in the first turn (none: continue from the history as it is). Never
    raises for model, tool or hook failures: those end the run with stop_reason "error" and the
    full closing events. Only cancellation of the caller's own scope propagates; use `signal`
    to abort with closing events. `start_turn`: turns this run already had (a run resumed after
    a crash numbers its turns on, and `max_iterations` counts them).
    """
    run = _Run(
        config=config,
        llm=llm,
        tools=tools,
        emit=emit,
        messages=messages,
        signal=signal or AbortSignal(),
        cache=output_cache if output_cache is not None else _default_cache(config),
        run_id=run_id,
        model=config.model,
        reasoning=config.reasoning,
        iterations=start_turn,
        turn=start_turn,
        calls=start_turn,
    )
    await emit(AgentStart())
    try:
        end = await _run_turns(run, list(prompts), skip_initial_steering)
    except Exception as exc:  # a hook or the executor broke its contract: end the run cleanly
        end = await _fail_run(run, exc)
    finally:
        _forget_run_caches(run)
    usage = dict(run.usage.by_model)
    await emit(
        AgentEnd(
            final_text=end.final_text,
            stop_reason=end.stop_reason,
            usage=usage,
            error=end.error,
            message_count=len(run.new_messages),
        )
    )
    return LoopResult(end.final_text, end.stop_reason, end.error, usage, list(run.new_messages))


def _forget_run_caches(run: _Run) -> None:
    """Drop what only speeds up the turns of this run (the converted view, the size memos):
    the output cache outlives the run in its Agent, and a session then sits idle in memory."""
    run.view, run.sizes = LlmView(), SizeMemo(estimate_tokens)
    if run.cache is not None:
        run.cache.end_run()


def _default_cache(config: LoopConfig) -> ToolOutputCache | None:
    if config.tool_output is None:
        return None
    return ToolOutputCache(ToolOutputStore(), config.tool_output, config.context_window)


async def _run_turns(run: _Run, prompts: list[Message], skip_initial_steering: bool) -> _End:
    """Outer loop: run turns; when the agent would stop, try follow-ups, then incomplete work."""
    steering = [] if skip_initial_steering else await _poll(run.config.get_steering_messages)
    pending = prompts + steering
    while True:
        end = await _run_until_idle(run, pending)
        if end is not None:
            return end
        pending = await _poll(run.config.get_follow_up_messages)
        if pending:
            continue
        prompt = await _incomplete_work_prompt(run)
        if prompt:
            pending = [user_text(prompt, hidden=True)]
        elif not run.config.require_done_tool:
            return _answer_end(run)


async def _run_until_idle(run: _Run, pending: list[Message]) -> _End | None:
    """Inner loop: turns while the model calls tools or steering is pending; None = would stop."""
    has_tool_calls = True
    while has_tool_calls or pending:
        if run.iterations >= run.config.max_iterations:
            return await _max_iterations_end(run)
        info, end = await _run_turn(run, pending)
        if end is not None:
            return end
        assert info is not None
        has_tool_calls = bool(info.message.tool_calls)
        end = await _between_turns(run, info)
        if end is not None:
            return end
        pending = await _poll(run.config.get_steering_messages)
    return None


async def _poll(source: MessageSource | None) -> list[Message]:
    if source is None:
        return []
    return list(await call_hook(source))


async def _incomplete_work_prompt(run: _Run) -> str | None:
    hook = run.config.get_incomplete_work_prompt
    if hook is None:
        return None
    prompt: str | None = await call_hook(hook, run.messages)
    return prompt or None


# --- one turn -----------------------------------------------------------------------------


async def _run_turn(run: _Run, pending: list[Message]) -> tuple[TurnInfo | None, _End | None]:
    """turn_start, injected messages, the model call, the tool batch, turn_end."""
    run.turn += 1
    run.iterations += 1
    await run.emit(TurnStart(turn=run.turn))
    if not await _compact_before_call(run):
        return None, _aborted_end()
    for message in pending:
        if isinstance(message, UserMessage) and not message.hidden:
            run.pinned.append(message)
        await _add_message(run, message)
    assistant, catalog = await _assistant_response(run)
    if assistant.stop_reason in ("error", "aborted"):
        await run.emit(TurnEnd(message=assistant, turn=run.turn))
        return None, _failed_reply_end(assistant)
    batch = await _run_tool_batch(run, assistant, catalog)
    await run.emit(TurnEnd(message=assistant, tool_results=batch.results, turn=run.turn))
    info = TurnInfo(run.turn, assistant, batch.results, run.messages, run.new_messages)
    return info, batch.end(assistant)


def _failed_reply_end(assistant: AssistantMessage) -> _End:
    if assistant.stop_reason == "aborted":
        return _End(assistant.text.strip(), "aborted", assistant.error or ABORTED_TEXT)
    return _End(assistant.text.strip(), "error", assistant.error or "Unknown error")


async def _add_message(run: _Run, message: Message) -> None:
    await run.emit(MessageStart(message=message))
    await _end_message(run, message)


async def _end_message(run: _Run, message: Message) -> None:
    run.messages.append(message)
    run.new_messages.append(message)
    await run.emit(MessageEnd(message=message))


async def _between_turns(run: _Run, info: TurnInfo) -> _End | None:
    """prepare_next_turn, should_stop_after_turn; abort cancels both."""
    stop = False
    with run.signal.scope():
        if not run.signal.aborted:
            await _prepare_next_turn(run, info)
            stop = await _should_stop(run, info)
    if run.signal.aborted:
        return _aborted_end()
    return _End(run.last_text, "stop") if stop else None


async def _prepare_next_turn(run: _Run, info: TurnInfo) -> None:
    hook = run.config.prepare_next_turn
    if hook is None:
        return
    change: NextTurn | None = await call_hook(hook, info)
    if change is None:
        return
    if change.messages is not None:
        run.messages[:] = change.messages
    if change.model is not None:
        run.model = change.model
    if change.reasoning is not KEEP:
        run.reasoning = None if change.reasoning in (None, "off") else change.reasoning  # type: ignore[assignment]


async def _should_stop(run: _Run, info: TurnInfo) -> bool:
    hook = run.config.should_stop_after_turn
    return bool(await call_hook(hook, info)) if hook is not None else False


# --- the model call -----------------------------------------------------------------------


async def _assistant_response(run: _Run) -> tuple[AssistantMessage, list[ToolInfo]]:
    """Build the request from history, call the model, record usage, add the reply to history."""
    catalog = await run.tools.catalog()
    specs = [t.spec() for t in catalog]
    fixed = fixed_tokens(run.config.system_prompt, specs)
    await _within_ceiling(run, fixed)
    view = list(run.messages)
    if run.config.transform_context is not None:
        view = list(await call_hook(run.config.transform_context, view))
    llm_messages = await _convert_history(run, view)
    call, run.calls = run.calls, run.calls + 1
    request = _request(run, llm_messages, specs, run.config.tool_choice, call=call)
    estimated = run.sizes.total(run.messages) + fixed
    await run.emit(MessageStart(message=AssistantMessage(model=run.model)))
    reply = await _complete(run, request, _emit_delta(run))
    if is_context_exceeded(reply):
        if refused_prompt(reply):  # the server counted the prompt: a real size to calibrate on
            run.rate = TokenRate.of(refused_prompt(reply), estimated)
        reply = await _refit_and_retry(run, request, reply, call)
        estimated = run.sizes.total(run.messages) + fixed
    _calibrate(run, reply, estimated)
    run.usage.add(reply)
    await _end_message(run, reply)
    return reply, catalog


async def _within_ceiling(run: _Run, fixed: int) -> None:
    """Fit the tool outputs, and compact first when the request would go out above
    PROMPT_CEILING of the window (the rest is the reply's room): the turn's new messages and
    tool results are counted here, not at the turn's start, with the rate this history showed."""
    if not run.rate.whole:  # the tools are known now: the whole prompt of the newest reply
        whole = history_rate(run.messages, fixed)
        run.rate = whole if whole.measured else run.rate
    _fit_tool_outputs(run)
    window = _context_window(run)
    if run.rate.tokens(run.sizes.total(run.messages) + fixed) > window * PROMPT_CEILING:
        await _maybe_compact(run, force=True)


def _calibrate(run: _Run, reply: AssistantMessage, estimated: int) -> None:
    """Measure the rate on the reply's real usage (the prompt it reports for what was sent)."""
    prompt = prompt_tokens(reply.usage) if reply.stop_reason not in ("error", "aborted") else 0
    if prompt:
        run.rate = TokenRate.of(prompt, estimated)


async def _refit_and_retry(run: _Run, request: LlmRequest, reply: AssistantMessage,
                           call: int) -> AssistantMessage:
    """The server refused the prompt as too long: adopt the window its error reported, cut the
    tool outputs to it, compact older turns, and retry the call once. When the prompt still
    does not fit, the reply's error says why and what to change."""
    run.window_hint = exceeded_window(reply) or run.window_hint
    before = list(run.messages)
    _fit_tool_outputs(run)
    await _maybe_compact(run, force=True)
    retried = reply
    if common_prefix(run.messages, before) != len(before) or len(run.messages) != len(before):
        run.usage.add(reply)  # the refused attempt (a server may bill it); the retry is the reply
        llm_messages = await _convert_history(run, list(run.messages))
        request = _request(run, llm_messages, request.tools, request.tool_choice, call=call)
        retried = await _complete(run, request, _emit_delta(run))
        if not is_context_exceeded(retried):
            return retried
    window = exceeded_window(retried) or _context_window(run)
    retried.error = CONTEXT_TOO_SMALL_TEXT.format(
        window=window, needed=run.rate.tokens(history_tokens(run.messages)), error=retried.error)
    return retried


def _fit_tool_outputs(run: _Run) -> None:
    """Cut and trim the tool outputs in history to the window as now known."""
    if run.cache is not None:
        # the window in estimated tokens: the cache counts 4 bytes a token, and the rate says
        # how many real tokens those are
        run.cache.context_window = run.rate.budget(_context_window(run))
        run.cache.trim(run.messages)


def _context_window(run: _Run) -> int:
    """The window a context-exceeded error of this run reported, else the one the model client
    reports (the gateway learns it from the server), else the configured one."""
    if run.window_hint:
        return run.window_hint
    known = getattr(run.llm, "context_window", None)
    window = known(run.model) if callable(known) else 0
    return window or run.config.context_window or DEFAULT_CONTEXT_WINDOW


def _emit_delta(run: _Run) -> DeltaSink:
    async def on_delta(delta: AssistantDelta) -> None:
        await run.emit(MessageUpdate(delta=delta))

    return on_delta


async def _convert(run: _Run, messages: list[Message]) -> list[LlmMessage]:
    convert = run.config.convert_to_llm or default_convert_to_llm
    return list(await call_hook(convert, messages))


async def _convert_history(run: _Run, messages: list[Message]) -> list[LlmMessage]:
    """`_convert` for the history's view of each turn: by default only what changed since the
    last turn is converted (`LlmView`); a `convert_to_llm` hook gets the whole list each time."""
    if run.config.convert_to_llm is None:
        return run.view.convert(messages)
    return await _convert(run, messages)


def _request(
    run: _Run,
    messages: list[LlmMessage],
    tools: list[ToolSpec],
    tool_choice: ToolChoice,
    model: str | None = None,
    call: int | None = None,
) -> LlmRequest:
    """The model request; `call`: its index among the run's message_starts (None: a summary call,
    which has none). The coordinator's model client adds the trace's root run."""
    cfg = run.config
    return LlmRequest(
        messages=messages,
        model=model or run.model,
        system_prompt=cfg.system_prompt,
        tools=tools,
        tool_choice=tool_choice,
        reasoning=run.reasoning,
        max_tokens=cfg.max_tokens,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        seed=cfg.seed,
        stop=list(cfg.stop),
        retry=cfg.retry_policy(),
        agent=cfg.agent,
        run_id=run.run_id,
        trace=LlmTrace(call=call),
    )


async def _complete(run: _Run, request: LlmRequest, on_delta: DeltaSink | None) -> AssistantMessage:
    """Call the model under the abort signal; never raises except for outer cancellation."""
    partial: list[str] = []

    async def sink(delta: AssistantDelta) -> None:
        if delta.kind == "text":
            partial.append(delta.delta)
        if on_delta is not None:
            await on_delta(delta)

    reply: AssistantMessage | None = None
    if not run.signal.aborted:
        try:
            reply = await _call_llm(run, request, sink)
        except Exception as exc:  # the LlmClient contract says it never raises; be safe anyway
            return _error_reply(request.model, _error_text(exc))
    if reply is None:  # the abort cancelled the call: keep what streamed so far
        content: list[Any] = [TextPart("".join(partial))] if partial else []
        return AssistantMessage(
            content=content, stop_reason="aborted", error=ABORTED_TEXT, model=request.model,
            usage=estimate_usage(request, content),  # the server did bill what it streamed
        )
    if not reply.model:
        reply.model = request.model
    return reply


async def _call_llm(run: _Run, request: LlmRequest, sink: DeltaSink) -> AssistantMessage | None:
    """The reply; None when the abort cancelled the call. A client watching its `Abort` is told
    first and returns its partial message (it may know more than the text deltas)."""
    with run.signal.graceful() as abort:
        return await run.llm.complete(request, sink, abort=abort)
    return None


def _error_text(exc: BaseException) -> str:
    """The message of an exception; for task-group errors, that of the first underlying one."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return str(exc) or type(exc).__name__


def _error_reply(model: str, text: str) -> AssistantMessage:
    return AssistantMessage(content=[], stop_reason="error", error=text, model=model)


async def _fail_run(run: _Run, exc: Exception) -> _End:
    """Close a run broken by an unexpected exception with an error reply and full events."""
    message = _error_reply(run.model, _error_text(exc))
    await _add_message(run, message)
    await run.emit(TurnEnd(message=message, turn=run.turn))
    return _End("", "error", message.error)


# --- tool batch ---------------------------------------------------------------------------


@dataclass
class _Call:
    call: ToolCall
    args: Any = None
    args_error: str | None = None
    started_at: float | None = None
    result: ToolResult | None = None
    message: ToolResultMessage | None = None
    added: bool = False
    repeats: int = 1  # this call is the n-th identical call in a row (the repeat guard)


@dataclass
class _Batch:
    assistant: AssistantMessage
    known: dict[str, ToolInfo]
    calls: list[_Call]
    denied: bool = False
    aborted: bool = False
    looping: str = ""  # the repeat guard's stop message

    @property
    def results(self) -> list[ToolResultMessage]:
        return [c.message for c in self.calls if c.message is not None]

    def end(self, assistant: AssistantMessage) -> _End | None:
        if self.aborted:
            return _aborted_end()
        if self.denied:
            return _End(DENIED_TEXT, "denied")
        if self.looping:
            return _End(assistant.text.strip(), "error", self.looping)
        for c in self.calls:
            if c.result is not None and c.result.done:
                return _End(c.result.done_message or assistant.text.strip(), "done")
        return None


def _parse_args(raw: str) -> tuple[Any, str | None]:
    try:
        return json.loads(raw or "{}"), None
    except json.JSONDecodeError as exc:
        return None, str(exc)


async def _run_tool_batch(
    run: _Run, assistant: AssistantMessage, catalog: list[ToolInfo]
) -> _Batch:
    """Run (or fail) every tool call of one reply; result messages end up in call order."""
    calls = [_Call(c, *_parse_args(c.arguments)) for c in assistant.tool_calls]
    for c in calls:
        c.repeats = _count_repeat(run, c)
    batch = _Batch(assistant, {t.name: t for t in catalog}, calls)
    if not calls:
        return batch
    with run.signal.scope():
        if assistant.stop_reason == "length":
            await _fail_truncated(run, batch)
        elif _is_sequential(run, batch):
            await _run_sequential(run, batch)
        else:
            await _run_parallel(run, batch)
    if run.signal.aborted:
        batch.aborted = True
        await _close_unfinished(run, batch)
    for c in batch.calls:
        if c.message is not None and not c.added:
            await _add_message(run, c.message)
            c.added = True
    return batch


def _count_repeat(run: _Run, c: _Call) -> int:
    """How many calls in a row (this one included, across turns) had this tool and arguments."""
    args = c.call.arguments if c.args_error is not None else json.dumps(c.args, sort_keys=True)
    key = (c.call.name, args)
    run.repeats = run.repeats + 1 if key == run.last_call else 1
    run.last_call = key
    return run.repeats


def _repeat_guard(run: _Run, batch: _Batch, c: _Call) -> ToolResult | None:
    """At twice the limit the call is not run and the batch ends the run (see `_Batch.end`)."""
    limit = run.config.repeat_limit
    if limit <= 0 or c.repeats < 2 * limit:
        return None
    batch.looping = REPEAT_STOP_TEXT.format(name=c.call.name, count=c.repeats, limit=limit)
    return error_result(batch.looping)


def _with_repeat_note(run: _Run, c: _Call, result: ToolResult) -> ToolResult:
    """From the limit on, the result tells the model it is repeating itself (it may not know)."""
    limit = run.config.repeat_limit
    if limit <= 0 or c.repeats < limit:
        return result
    note = REPEAT_NOTE.format(count=c.repeats, name=c.call.name, stop=2 * limit)
    return msgspec.structs.replace(result, content=[*result.content, TextPart(note)])


def _is_sequential(run: _Run, batch: _Batch) -> bool:
    if run.config.tool_execution == "sequential":
        return True
    return any(batch.known[c.call.name].sequential for c in batch.calls if c.call.name in batch.known)


async def _fail_truncated(run: _Run, batch: _Batch) -> None:
    for c in batch.calls:
        await _start_call(run, c)
        await _finish_call(run, c, error_result(TRUNCATED_CALL_TEXT.format(name=c.call.name)), True)


async def _run_sequential(run: _Run, batch: _Batch) -> None:
    """Each call's start, end and result message before the next call begins."""
    for c in batch.calls:
        await _start_call(run, c)
        immediate, stop = await _preflight(run, batch, c)
        result = immediate if immediate is not None else await _execute(run, batch, c)
        await _finish_call(run, c, result, True)
        batch.denied = batch.denied or stop
        if stop or result.done:
            return  # later calls are not started


async def _run_parallel(run: _Run, batch: _Batch) -> None:
    """Starts and checks in call order, then concurrent execution; ends in completion order."""
    ready: list[_Call] = []
    for c in batch.calls:
        await _start_call(run, c)
        immediate, stop = await _preflight(run, batch, c)
        if immediate is not None:
            await _finish_call(run, c, immediate, False)
        else:
            ready.append(c)
        if stop:
            batch.denied = True
            break
    if not ready:
        return
    # The first call runs in this task, the others in tasks of their own (a task costs the
    # coordinator ~60 us to spawn and tear down; a reply with one call needs none). The first
    # goes first, so the requests still go out in call order.
    first, others = ready[0], ready[1:]
    if not others:
        await _execute_and_finish(run, batch, first)
        return
    async with anyio.create_task_group() as tg:
        for c in others:
            tg.start_soon(_execute_and_finish, run, batch, c)
        await _execute_and_finish(run, batch, first)


async def _execute_and_finish(run: _Run, batch: _Batch, c: _Call) -> None:
    result = await _execute(run, batch, c)
    await _finish_call(run, c, result, False)


async def _start_call(run: _Run, c: _Call) -> None:
    # time.monotonic, not anyio.current_time (the same clock under asyncio, 1 us dearer per
    # call through anyio's backend lookup): only a duration is taken from it
    c.started_at = time.monotonic()
    args = c.args if c.args_error is None else {"_raw": c.call.arguments}
    await run.emit(ToolExecutionStart(tool_call_id=c.call.id, tool_name=c.call.name, args=args))


async def _preflight(run: _Run, batch: _Batch, c: _Call) -> tuple[ToolResult | None, bool]:
    """Checks before running: (immediate result or None to run it, stop the run after the turn)."""
    name = c.call.name
    looping = _repeat_guard(run, batch, c)
    if looping is not None:
        return looping, False
    if name not in batch.known:
        return error_result(f"Error: Unknown tool '{name}'"), False
    if c.args_error is not None:
        return error_result(f"Error: Invalid tool arguments JSON for {name}: {c.args_error}"), False
    hook = run.config.before_tool_call
    if hook is None:
        return None, False
    context = ToolCallContext(c.call, c.args, batch.assistant, run.messages)
    try:
        decision = await call_hook(hook, context)
    except Exception as exc:
        return error_result(f"Permission check failed: {exc}"), False
    if isinstance(decision, (Block, BlockAndStop)):
        return error_result(decision.reason or BLOCKED_TEXT), isinstance(decision, BlockAndStop)
    return None, False


async def _execute(run: _Run, batch: _Batch, c: _Call) -> ToolResult:
    """Run one call through the executor and after_tool_call; failures become error results."""
    settled = False

    async def on_update(partial: Any) -> None:
        if not settled:  # late updates from a finished call are dropped
            await run.emit(
                ToolExecutionUpdate(tool_call_id=c.call.id, tool_name=c.call.name, partial=partial)
            )

    request = ToolCallRequest(
        call_id=c.call.id,
        name=c.call.name,
        arguments=c.call.arguments or "{}",
        agent=run.config.agent,
        run_id=run.run_id,
    )
    try:
        result = await run.tools.execute(request, on_update)
    except Exception as exc:  # the executor contract says it never raises; be safe anyway
        result = error_result(f"Error: {exc}")
    finally:
        settled = True
    return _with_repeat_note(run, c, await _after_tool_call(run, batch, c, result))


async def _after_tool_call(run: _Run, batch: _Batch, c: _Call, result: ToolResult) -> ToolResult:
    hook = run.config.after_tool_call
    if hook is None:
        return result
    context = ToolResultContext(c.call, c.args, result, batch.assistant, run.messages)
    try:
        override: AfterToolResult | None = await call_hook(hook, context)
    except Exception as exc:
        return error_result(f"Error: {exc}")
    return _apply_override(result, override) if override is not None else result


def _apply_override(result: ToolResult, override: AfterToolResult) -> ToolResult:
    changes: dict[str, Any] = {}
    if override.content is not None:
        content = override.content
        changes["content"] = [TextPart(content)] if isinstance(content, str) else list(content)
    if override.details is not KEEP:
        changes["details"] = override.details
    if override.is_error is not None:
        changes["is_error"] = override.is_error
    return msgspec.structs.replace(result, **changes)


def _result_message(call: ToolCall, result: ToolResult) -> ToolResultMessage:
    content: list[UserContent] = [TextPart(TASK_COMPLETE_TEXT)] if result.done else list(result.content)
    return ToolResultMessage(
        tool_call_id=call.id,
        tool_name=call.name,
        content=content,
        is_error=result.is_error,
        details=result.details,
    )


async def _finish_call(run: _Run, c: _Call, result: ToolResult, add_now: bool) -> None:
    """tool_execution_end (and, when `add_now`, the message pair); shielded so abort never tears it."""
    message = _result_message(c.call, result)
    if run.cache is not None:
        message = run.cache.process(message)
    c.result, c.message = result, message
    now = time.monotonic()
    duration = now - (c.started_at or now)
    with anyio.CancelScope(shield=True):
        await run.emit(
            ToolExecutionEnd(
                tool_call_id=c.call.id,
                tool_name=c.call.name,
                result=message,
                is_error=message.is_error,
                duration=duration,
            )
        )
        if add_now:
            await _add_message(run, message)
            c.added = True


async def _close_unfinished(run: _Run, batch: _Batch) -> None:
    """After an abort, give every call without a result an aborted error result (and a start)."""
    for c in batch.calls:
        if c.message is None:
            if c.started_at is None:
                await _start_call(run, c)
            await _finish_call(run, c, error_result(ABORTED_TEXT), False)


# --- compaction and max iterations ---------------------------------------------------------


async def _compact_before_call(run: _Run) -> bool:
    """Compaction, at the start of a turn before its messages are injected: a run's last answer
    is never held back by it (the next run's first turn compacts), and a new prompt is never
    folded into the summary. False when the run was aborted meanwhile."""
    if not run.rate.measured:  # a history continued: what its replies showed (the tools unknown yet)
        run.rate = history_rate(run.messages)
    with run.signal.scope():
        if not run.signal.aborted:
            await _maybe_compact(run)
    return not run.signal.aborted


async def _maybe_compact(run: _Run, *, force: bool = False) -> bool:
    """Fold history into a summary once the last reply used threshold * context_window tokens
    (`force`: now, the server refused the prompt as too long). True when history was compacted."""
    config = run.config.compaction
    last = next((m for m in reversed(run.messages) if isinstance(m, AssistantMessage)), None)
    if config is None or not config.enabled or (last is None and not force):
        return False
    window = _context_window(run)
    if not force and not _over_threshold(run, config, last, window):
        return False
    # What stays verbatim: the newest turns (under half the window, or the next call would
    # compact again at once; the unread tool results always) and this run's prompts. Only what
    # is older is summarised; with nothing older there is no summary call (it would invent one).
    rate = run.rate
    half = rate.budget(window // 2)
    start = retained_start(run.messages, config.retain_last_turns, half, run.pinned)
    older = run.messages[:start]
    if not summarisable(older, run.pinned):
        return False
    tokens = (last.usage.total if last is not None and last.usage.total
              else rate.tokens(history_tokens(run.messages)))
    await run.emit(CompactionStart(tokens=tokens))
    summary = await _summarise(run, config, window, older)
    after = 0
    if summary.text:
        # The first prompt (usually the task) rides verbatim beside the summary, up to an
        # eighth of the window: with the summary's own eighth and the tail's half, under 0.8.
        first = first_prompt(older, run.pinned, rate.budget(window // 8))
        run.messages[:] = compacted_history(run.messages, summary.text, config.retain_last_turns, tokens,
                                            budget=half, keep=run.pinned, first=first)
        after = rate.tokens(history_tokens(run.messages))
    await run.emit(CompactionComplete(compacted=bool(summary.text), tokens_before=tokens, tokens_after=after,
                                      usage=summary.usage, model=summary.model,
                                      summary_calls=summary.calls, left_out=summary.left_out))
    return bool(summary.text)


def _over_threshold(run: _Run, config: CompactionConfig, last: AssistantMessage | None,
                    window: int) -> bool:
    """The last reply's usage says so, or the history's estimate does: tool results added since
    that reply may already fill the window (the server would answer HTTP 400)."""
    if should_compact(config, last.usage if last else None, window):
        return True
    return run.rate.tokens(run.sizes.total(run.messages)) >= window * config.threshold



@dataclass
class _Summary:
    text: str = ""  # "" when a call failed: history stays as it is
    usage: Usage = field(default_factory=Usage)  # of every call, counted in the run's totals
    model: str = ""
    calls: int = 0
    left_out: int = 0  # older messages no call could take (see `summary_chunks`)


async def _summarise(run: _Run, config: CompactionConfig, window: int, older: list[Message]) -> _Summary:
    """The model's summary of `older` (the history before the kept tail), every message of it:
    in chunks when it does not fit one call, each call given the summary so far. The summary
    is capped at an eighth of the window (a long one would refill it), and each call's history
    part at what the window leaves beside that cap (`summary_budget`)."""
    cap = min(run.config.max_tokens or window, max(256, window // 8))
    prompt = compaction_prompt(config)
    fixed = estimate_tokens(user_text(run.config.system_prompt)) + estimate_tokens(user_text(prompt))
    rate = run.rate
    plan = summary_chunks(older, rate.budget(summary_budget(window, cap, rate.tokens(fixed))),
                          carry=rate.budget(cap))
    done = _Summary(left_out=plan.left_out)
    for chunk in plan.chunks:
        head: list[Message] = [CompactionSummaryMessage(summary=done.text)] if done.text else []
        reply = await _compaction_call(run, [*head, *chunk], prompt, cap, config.model)
        done.usage, done.model, done.calls = done.usage + reply.usage, reply.model, done.calls + 1
        done.text = "" if reply.stop_reason in ("error", "aborted") else parse_compaction(reply.text)
        if not done.text:
            break
    return done


async def _compaction_call(run: _Run, messages: list[Message], prompt: str, cap: int,
                           model: str | None) -> AssistantMessage:
    """One summary call over `messages`. The request says `purpose="compaction"`: the gateway
    does not stream it as the run's text."""
    view = messages_for_summary(messages, prompt)
    request = _request(run, await _convert(run, view), [], "none", model=model)
    request.max_tokens = cap
    request.purpose = "compaction"
    reply = await _complete(run, request, None)
    run.usage.add(reply)
    return reply


async def _max_iterations_end(run: _Run) -> _End:
    """One extra tool-less call over a copy of history with the summary prompt appended."""
    summary = await _max_iterations_summary(run)
    if run.signal.aborted:
        return _aborted_end()
    return _End(f"{MAX_ITERATIONS_PREFIX}{summary}", "max_iterations")


async def _max_iterations_summary(run: _Run) -> str:
    try:
        view = await _convert(run, [*run.messages, user_text(MAX_ITERATIONS_SUMMARY_PROMPT)])
    except Exception:
        return MAX_ITERATIONS_FALLBACK
    reply = await _complete(run, _request(run, view, [], "none"), None)
    run.usage.add(reply)
    text = reply.text.strip()
    if reply.stop_reason in ("error", "aborted") or not text:
        return MAX_ITERATIONS_FALLBACK
    return text

