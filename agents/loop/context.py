"""Context management for the loop: usage tracking, the tool-output cache and compaction helpers.

These are pure, in-memory pieces; the loop (`agents.loop.run`) decides when to use them. They exist
so a long run keeps fitting the model's context window without losing anything for good: large
tool outputs are cut but stay retrievable by ref, and old history is folded into a summary.
"""

from __future__ import annotations

import json
import math
import operator
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from agent_bus.bus.messages import (
    AssistantContent,
    AssistantMessage,
    BranchSummaryMessage,
    CompactionSummaryMessage,
    CustomMessage,
    LlmMessage,
    LlmRequest,
    Message,
    TextPart,
    ThinkingPart,
    ToolCallRequest,
    ToolInfo,
    ToolResult,
    ToolResultMessage,
    Usage,
    UserMessage,
    error_result,
    user_text,
)

DEFAULT_CONTEXT_WINDOW = 128_000
#: Marker the gateway puts in the error of a reply the server refused because the prompt did not
#: fit the model's window (HTTP 400): the loop then compacts at once and retries the call once.
CONTEXT_EXCEEDED = "context_exceeded"


_EXCEEDED_WINDOW = re.compile(re.escape(CONTEXT_EXCEEDED) + r": [^:]*?\(window (\d+) tokens\)")


def is_context_exceeded(message: AssistantMessage) -> bool:
    return message.stop_reason == "error" and CONTEXT_EXCEEDED in (message.error or "")


def context_exceeded_text(window: int, text: str) -> str:
    """The gateway's error text for a prompt the server refused as too long (`window`: the
    server's window when its error said, else 0)."""
    size = f" (window {window} tokens)" if window > 0 else ""
    return (f"{CONTEXT_EXCEEDED}: the conversation does not fit the model's context "
            f"window{size}: {text}")


_REFUSED_PROMPT = re.compile(r"request \((\d+) tokens\) exceeds")


def refused_prompt(message: AssistantMessage) -> int:
    """The prompt tokens a context-exceeded error counted (llama.cpp's "request (4104 tokens)
    exceeds the available context size"; 0: it does not say): a real count to calibrate on."""
    match = _REFUSED_PROMPT.search(message.error or "") if is_context_exceeded(message) else None
    return int(match[1]) if match else 0


def exceeded_window(message: AssistantMessage) -> int:
    """The window a context-exceeded error reports (0: it does not say)."""
    match = _EXCEEDED_WINDOW.search(message.error or "") if is_context_exceeded(message) else None
    return int(match[1]) if match else 0

# --- usage --------------------------------------------------------------------------------


class UsageTracker:
    """Sums token usage by model and remembers the last response's usage (for context-left %)."""

    def __init__(self) -> None:
        self.by_model: dict[str, Usage] = {}
        self.last: Usage | None = None

    def add(self, message: AssistantMessage) -> None:
        """Record one model response; error responses count too (providers may bill them)."""
        self.last = message.usage
        key = message.model or "unknown"
        self.by_model[key] = self.by_model.get(key, Usage()) + message.usage

    def merge(self, by_model: dict[str, Usage]) -> None:
        """Fold another tracker's totals (e.g. one run's) into these."""
        for key, usage in by_model.items():
            self.by_model[key] = self.by_model.get(key, Usage()) + usage

    @property
    def total(self) -> Usage:
        total = Usage()
        for usage in self.by_model.values():
            total = total + usage
        return total

    def context_left_percent(self, context_window: int | None) -> int | None:
        """Percent of the window left after the last response; None when unknown."""
        if self.last is None or not context_window:
            return None
        if self.last.total <= 0:
            return 100
        left = round((1 - self.last.total / context_window) * 100)
        return max(0, min(100, left))


# --- tool output cache --------------------------------------------------------------------

TOOL_OUTPUT_TOOL = "tool_output"
BYTES_PER_TOKEN = 4


@dataclass(frozen=True)
class ToolOutputConfig:
    """Limits for tool outputs kept in history; both scale with the context window, so a small
    window (llama.cpp's 4,096 tokens) keeps the question and a cut of the newest result.

    `max_message_bytes` cuts any single result, and so does `result_ratio` of the window (one
    result is at most a quarter of it); `budget_tokens` bounds all tool outputs in history
    together (None: 25% of the context window, clamped to [20000, 60000] tokens, and never over
    half the window).
    """

    max_message_bytes: int = 51_200
    budget_tokens: int | None = None
    context_ratio: float = 0.25
    result_ratio: float = 0.25

    def message_bytes(self, context_window: int | None) -> int:
        """The most one result may hold in history, in bytes."""
        if not context_window:
            return self.max_message_bytes
        share = math.floor(context_window * self.result_ratio) * BYTES_PER_TOKEN
        return max(MIN_RESULT_BYTES, min(self.max_message_bytes, share))

    def budget(self, context_window: int | None) -> int:
        if self.budget_tokens is not None:
            return self.budget_tokens
        if not context_window:
            return 60_000
        floor = min(20_000, context_window // 2)
        return max(floor, min(60_000, math.floor(context_window * self.context_ratio)))


MIN_RESULT_BYTES = 256  # a result is never cut shorter than this: the model needs something


class ToolOutputStore:
    """Full texts of tool outputs by ref, so cut or trimmed outputs stay retrievable.

    The coordinator can offer it to models as the built-in `tool_output` tool via `tool_info()`
    and `handle()`.
    """

    def __init__(self) -> None:
        self._texts: dict[str, str] = {}

    def put(self, text: str) -> str:
        ref = uuid.uuid4().hex[:12]
        self._texts[ref] = text
        return ref

    def get(self, ref: str) -> str | None:
        return self._texts.get(ref)

    def __len__(self) -> int:
        return len(self._texts)

    @staticmethod
    def tool_info() -> ToolInfo:
        return ToolInfo(
            name=TOOL_OUTPUT_TOOL,
            description=(
                "Read the full text of a truncated or trimmed tool output by its `ref` "
                "(shown as `ref=<id>`). Use `offset`/`limit` (characters) to page."
            ),
            parameters={
                "type": "object",
                "properties": {
                    "ref": {"type": "string"},
                    "offset": {"type": "integer", "minimum": 0},
                    "limit": {"type": "integer", "minimum": 1},
                },
                "required": ["ref"],
                "additionalProperties": False,
            },
            idempotent=True,
        )

    async def handle(self, request: ToolCallRequest) -> ToolResult:
        """Serve one `tool_output` call; bad input becomes an error result, never an exception."""
        try:
            args = json.loads(request.arguments or "{}")
            ref, offset = str(args["ref"]), int(args.get("offset", 0))
            limit = args.get("limit")
        except (ValueError, KeyError, TypeError) as exc:
            return error_result(f"Error: `tool_output` expects {{ref, offset?, limit?}}: {exc}")
        text = self.get(ref)
        if text is None:
            return error_result(f"Error: no tool output with ref={ref}")
        end = None if limit is None else offset + int(limit)
        return ToolResult(content=[TextPart(text[offset:end])])


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8"))


def cut_to_bytes(text: str, max_bytes: int) -> str:
    """Longest prefix of whole lines within `max_bytes` (a single overlong line is cut mid-line)."""
    kept: list[str] = []
    used = 0
    for line in text.splitlines(keepends=True):
        size = _utf8_len(line)
        if used + size > max_bytes:
            if not kept:
                kept.append(line.encode("utf-8")[:max_bytes].decode("utf-8", "ignore"))
            break
        kept.append(line)
        used += size
    return "".join(kept)


def tail_to_bytes(text: str, max_bytes: int) -> str:
    """Longest suffix of whole lines within `max_bytes` ("" when even the last line is longer)."""
    kept: list[str] = []
    used = 0
    for line in reversed(text.splitlines(keepends=True)):
        used += _utf8_len(line)
        if used > max_bytes:
            break
        kept.append(line)
    return "".join(reversed(kept))


class ToolOutputCache:
    """Applies `ToolOutputConfig` to tool-result messages, storing full texts in a `ToolOutputStore`."""

    def __init__(
        self,
        store: ToolOutputStore,
        config: ToolOutputConfig | None = None,
        context_window: int | None = DEFAULT_CONTEXT_WINDOW,
    ) -> None:
        self.store = store
        self.config = config or ToolOutputConfig()
        self.context_window = context_window
        self._refs: dict[str, str] = {}  # tool_call_id -> ref
        self._trimmed: set[str] = set()
        self._cut_to: dict[str, int] = {}  # tool_call_id -> the bytes its result was cut to
        self._sizes = SizeMemo(_tokens)  # tool outputs' tokens, each history message measured once

    def process(self, message: ToolResultMessage) -> ToolResultMessage:
        """Cut the message to `max_message_bytes` (marker with the ref), storing the full text.

        A message that fits is not stored now: its text stays in the history, and `trim`
        stores it if it ever replaces it by a marker (a ref is stored before anyone sees it).
        Storing every output cost a store write per tool call (a row in the coordinator's
        database) and kept every text in memory for the agent's lifetime."""
        if not _has_text(message):
            return message
        return self._cut(message, self.config.message_bytes(self.context_window))

    def _cut(self, message: ToolResultMessage, limit: int) -> ToolResultMessage:
        """`message` within `limit` bytes: a prefix of its text and where the rest is."""
        if self._cut_to.get(message.tool_call_id, limit + 1) <= limit:
            return message  # cut already, as short or shorter (its note makes it look longer)
        text = message.text
        if _utf8_len(text) <= limit:
            return message
        self._cut_to[message.tool_call_id] = limit
        cut = cut_to_bytes(text, limit)
        if message.tool_name == TOOL_OUTPUT_TOOL:  # a page of a stored output: page on instead
            note = (f"[cut at {len(cut)} of {len(text)} characters: call `{TOOL_OUTPUT_TOOL}` "
                    "again with a larger `offset` and a smaller `limit` for the rest]")
            return _with_content(message, [TextPart(f"{cut}\n\n{note}")])
        ref = self._refs.get(message.tool_call_id) or self.store.put(text)
        self._refs[message.tool_call_id] = ref
        # The head and the tail: an output's end (the last line, an error, an exit code) matters
        # as often as its start, and a model asked about it must not read the cut note instead.
        head = cut_to_bytes(text, limit * 3 // 5)
        tail = tail_to_bytes(text[len(head):], limit - _utf8_len(head))
        omitted = len(text) - len(head) - len(tail)
        note = (f"[tool output truncated; ref={ref}: {omitted} of its {len(text)} characters are "
                f"cut here to fit the context window; `{TOOL_OUTPUT_TOOL}` with this ref reads them]")
        return _with_content(message, [TextPart(f"{head}\n{note}\n{tail}")])

    def trim(self, messages: list[Message]) -> int:
        """Replace the oldest tool outputs by a ref marker until all fit the budget; returns count.

        The newest results (those after the last assistant message: what the model is about to
        read) are never replaced: when they alone are over the budget, each is cut to its share
        of it instead, with its ref."""
        budget = self.config.budget(self.context_window)
        newest = next((i + 1 for i in range(len(messages) - 1, -1, -1)  # (no reply: none is)
                       if isinstance(messages[i], AssistantMessage)), len(messages))
        # The window may have shrunk since they were cut (the server reported a smaller one)
        trimmed = self._cut_newest(messages, newest, self.config.message_bytes(self.context_window))
        used = self._sizes.total(messages)
        if used <= budget:
            return trimmed
        indexes = [i for i, m in enumerate(messages[:newest]) if isinstance(m, ToolResultMessage)]
        trimmed += self._trim_older(messages, indexes, budget, used)
        used = self._sizes.total(messages)
        if used > budget:
            own = sum(_tokens(m) for m in messages[newest:] if isinstance(m, ToolResultMessage))
            results = sum(isinstance(m, ToolResultMessage) for m in messages[newest:])
            share = max(0, budget - (used - own)) // max(1, results) * BYTES_PER_TOKEN
            trimmed += self._cut_newest(messages, newest, share)
        return trimmed

    def _cut_newest(self, messages: list[Message], newest: int, limit: int) -> int:
        """Cut each result after index `newest` to `limit` bytes; how many were cut."""
        cut = 0
        for i in range(newest, len(messages)):
            message = messages[i]
            if not isinstance(message, ToolResultMessage):
                continue
            shorter = self._cut(message, max(MIN_RESULT_BYTES, limit))
            if shorter is not message:
                messages[i] = shorter
                cut += 1
        return cut

    def _trim_older(self, messages: list[Message], indexes: list[int], budget: int, used: int) -> int:
        trimmed = 0
        for i in indexes:
            if used <= budget:
                break
            message = messages[i]
            assert isinstance(message, ToolResultMessage)
            if message.tool_call_id in self._trimmed or message.tool_name == TOOL_OUTPUT_TOOL:
                continue
            ref = self._refs.get(message.tool_call_id) or self.store.put(message.text)
            marker = _with_content(message, [TextPart(f"[tool output trimmed; ref={ref}]")])
            used += _tokens(marker) - _tokens(message)
            messages[i] = marker
            self._trimmed.add(message.tool_call_id)
            trimmed += 1
        return trimmed

    def end_run(self) -> None:
        """Forget the size memo: it speeds up the turns of one run, but between runs it only
        held a reference to every history message (and to a compacted history's old ones) and
        a size per message, for as long as the session stays in memory, idle."""
        self._sizes.clear()


class SizeMemo:
    """The summed size of a history that mostly grows at its end, each message measured once.

    The loop asks for a history's size every turn; measuring all of it each time made a run's
    cost grow with the square of its length. The sizes of the messages still at the front (the
    same objects, in the same order: a C-level identity scan) are kept and only the rest is
    measured, so a replaced message (trimming, compaction, a hook's new history) is measured
    again. A message changed in place keeps its old size: sizes are estimates anyway."""

    def __init__(self, measure: Callable[[Message], int]) -> None:
        self.measure = measure
        self._messages: list[Message] = []
        self._sizes: list[int] = []
        self._total = 0

    def total(self, messages: Sequence[Message]) -> int:
        seen, sizes = self._messages, self._sizes
        keep = common_prefix(messages, seen)
        if keep < len(seen):
            self._total -= sum(sizes[keep:])
            del seen[keep:], sizes[keep:]
        if len(messages) > keep:
            tail = messages[keep:]
            new = list(map(self.measure, tail))
            seen.extend(tail)
            sizes.extend(new)
            self._total += sum(new)
        return self._total

    def clear(self) -> None:
        """Forget every message and size (the next `total` measures the whole history)."""
        self._messages, self._sizes, self._total = [], [], 0


def common_prefix(a: Sequence[object], b: Sequence[object]) -> int:
    """How many leading items `a` and `b` share by identity."""
    n = min(len(a), len(b))
    if all(map(operator.is_, a, b)):  # the usual case, at C speed (map stops at the shorter)
        return n
    return next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x is not y)



def _has_text(message: ToolResultMessage) -> bool:
    return any(isinstance(p, TextPart) for p in message.content)


def _tokens(message: ToolResultMessage | Message) -> int:
    text = message.text if isinstance(message, ToolResultMessage) else ""
    return math.ceil(_utf8_len(text) / BYTES_PER_TOKEN)


def _with_content(message: ToolResultMessage, content: list[Any]) -> ToolResultMessage:
    return ToolResultMessage(
        tool_call_id=message.tool_call_id,
        tool_name=message.tool_name,
        content=content,
        is_error=message.is_error,
        details=message.details,
        timestamp=message.timestamp,
    )


# --- compaction ---------------------------------------------------------------------------

DEFAULT_SUMMARY_PROMPT = (
    "Summarize the conversation so it can be continued later. Focus on decisions, results, "
    "constraints, and next steps. Keep it concise and factual."
)
DEFAULT_RETAIN_PROMPT = (
    "List concrete details that must be preserved verbatim. Include tool output refs, file paths, "
    "identifiers, commands, TODOs, and any critical decisions."
)


@dataclass(frozen=True)
class CompactionConfig:
    """When and how to fold history into a summary (set LoopConfig.compaction=None to disable)."""

    enabled: bool = True
    threshold: float = 0.8
    retain_last_turns: int = 1
    model: str | None = None
    summary_prompt: str = DEFAULT_SUMMARY_PROMPT
    retain_prompt: str | None = DEFAULT_RETAIN_PROMPT


def should_compact(
    config: CompactionConfig | None, usage: Usage | None, context_window: int | None
) -> bool:
    """True when the last response used at least threshold * context_window tokens."""
    if config is None or not config.enabled or usage is None or not context_window:
        return False
    return usage.total >= math.floor(context_window * config.threshold)


def compaction_prompt(config: CompactionConfig) -> str:
    lines = [
        "You are summarizing the conversation for context compaction.",
        "Respond only with the XML-like tags below and nothing else:",
    ]
    if config.retain_prompt is not None:
        lines.append("<retain>...</retain>")
    lines += ["<summary>...</summary>", ""]
    if config.retain_prompt is not None:
        lines += ["Retain instructions:", config.retain_prompt.strip(), ""]
    lines += ["Summary instructions:", config.summary_prompt.strip()]
    return "\n".join(lines).strip()


def _tag(text: str, tag: str) -> str:
    match = re.search(rf"<{tag}>([\s\S]*?)</{tag}>", text, re.IGNORECASE)
    return match.group(1).strip() if match else ""


def parse_compaction(text: str) -> str:
    """Summary text from a compaction reply: retained details, then the summary ("" if none)."""
    retain, summary = _tag(text, "retain"), _tag(text, "summary")
    if not summary:
        summary = re.sub(r"<retain>[\s\S]*?</retain>", "", text, flags=re.IGNORECASE)
        summary = re.sub(r"</?summary>", "", summary, flags=re.IGNORECASE).strip()
    if retain and summary:
        return f"{summary}\n\nDetails to keep:\n{retain}"
    return summary or retain


def messages_for_summary(messages: Sequence[Message], prompt: str) -> list[Message]:
    """A copy of history for a summary call: a trailing unanswered tool-call message is reduced to
    its text (or dropped) so the request stays valid, then the prompt is appended."""
    copy = list(messages)
    last = copy[-1] if copy else None
    if isinstance(last, AssistantMessage) and last.tool_calls:
        copy.pop()
        if last.text:
            copy.append(AssistantMessage(content=[TextPart(last.text)], model=last.model))
    copy.append(user_text(prompt))
    return copy


def estimate_usage(request: LlmRequest, content: Sequence[AssistantContent]) -> Usage:
    """What a reply the server sent no usage for cost, estimated (4 bytes a token): the request
    (messages, system prompt, tools) in, what streamed of the reply out. Nothing streamed:
    nothing (the server generated nothing, or said nothing about it)."""
    out = sum(_utf8_len(p.text) if isinstance(p, TextPart) else
              _utf8_len(p.thinking) if isinstance(p, ThinkingPart) else
              _utf8_len(p.name) + _utf8_len(p.arguments) for p in content)
    if not out:
        return Usage()
    usage = Usage(input=request_tokens(request), output=math.ceil(out / BYTES_PER_TOKEN), estimated=True)
    usage.total = usage.input + usage.output
    return usage


def request_tokens(request: LlmRequest) -> int:
    """A request's prompt, estimated (`json_tokens`): its messages, system prompt and tools."""
    return history_tokens(request.messages) + fixed_tokens(request.system_prompt, request.tools)


def fixed_tokens(system_prompt: str, tools: Sequence[Any]) -> int:
    """What every model call of a run carries besides the history, estimated (`json_tokens`)."""
    return json_tokens(system_prompt.encode() + msgspec.json.encode(tools))


# --- the estimate, calibrated ---------------------------------------------------------------

#: No request goes out estimated above this share of the window: the rest is the reply's room.
PROMPT_CEILING = 0.9


@dataclass(frozen=True)
class TokenRate:
    """Real tokens per estimated token (the estimate counts 4 bytes of JSON a token), measured on
    a real `usage`: a tokenizer counts number-heavy text at ~2.75 bytes a token, so the bare
    estimate under-read it and compaction came late (a prompt went out at 95% of the window).
    `tokens` turns an estimate into real tokens; `budget` a real budget into estimated ones
    (what the history helpers count in)."""

    scale: float = 1.0
    measured: bool = False
    #: Measured on a whole prompt (the history and what every call carries: the system prompt,
    #: the tools), not only on the history's growth between two replies.
    whole: bool = False

    @staticmethod
    def of(prompt_tokens: int, estimated: int, *, whole: bool = True) -> TokenRate:
        """The rate a real prompt of `prompt_tokens` for an estimate of `estimated` shows;
        bounded, so one odd reading (a server's usage of another thing) cannot run away."""
        scale = min(4.0, max(0.5, prompt_tokens / max(1, estimated)))
        return TokenRate(scale, measured=True, whole=whole)

    def tokens(self, estimated: int) -> int:
        return math.ceil(estimated * self.scale)

    def budget(self, tokens: int) -> int:
        return math.floor(tokens / self.scale)


def prompt_tokens(usage: Usage) -> int:
    """The real prompt tokens a reply's usage reports (0: none, or only an estimate)."""
    return 0 if usage.estimated else usage.input + usage.cache_read + usage.cache_write


def history_rate(messages: Sequence[Message], fixed: int | None = None) -> TokenRate:
    """The rate the last real usage of this history shows. With `fixed` (the estimate of what
    every call carries beside the history: the system prompt, the tools): the prompt of its
    newest reply that reported one, over the estimate of what was sent for it. Without: the
    growth between the two newest such replies, which does not depend on it. Only replies newer
    than the last compaction count (the history before an older one is not what was sent).
    Nothing to measure: the bare estimate."""
    compacted = max((m.timestamp for m in messages if isinstance(m, CompactionSummaryMessage)), default=0.0)
    seen: list[tuple[int, int]] = []  # (real prompt, estimate of the messages before it)
    for k in range(len(messages) - 1, -1, -1):
        reply = messages[k]
        if isinstance(reply, AssistantMessage) and reply.timestamp > compacted and prompt_tokens(reply.usage):
            seen.append((prompt_tokens(reply.usage), history_tokens(messages[:k])))
            if fixed is not None or len(seen) == 2:
                break
    if fixed is not None and seen:
        return TokenRate.of(seen[0][0], seen[0][1] + fixed)
    if len(seen) == 2 and seen[0][1] - seen[1][1] >= MIN_RATE_SPAN:
        return TokenRate.of(seen[0][0] - seen[1][0], seen[0][1] - seen[1][1], whole=False)
    return TokenRate()


#: The least growth (estimated tokens) between two replies that measures a rate: a few tokens
#: of a short reply say little about the tokenizer.
MIN_RATE_SPAN = 100


def estimate_tokens(message: Message) -> int:
    """A rough size of the message's JSON (`json_tokens`), enough to keep a request under a window."""
    return json_tokens(msgspec.json.encode(message))


_DIGITS = b"0123456789"


def json_tokens(data: bytes) -> int:
    """4 bytes a token, but a digit a token: tokenizers cut numbers into runs of one to three
    digits (Qwen2.5: one each), so number-heavy text runs 1-3 bytes a token, and at 4 the
    estimate read a quarter of it. The calibration (`TokenRate`) corrects the rest."""
    digits = len(data) - len(data.translate(None, _DIGITS))
    return math.ceil((len(data) - digits) / BYTES_PER_TOKEN) + digits


#: Of the window, kept free in a summary call beyond its reply's cap and the prompt: what the
#: byte estimate may under-read (a chat template's tokens, a denser tokenizer).
SUMMARY_MARGIN = 0.1


def summary_budget(window: int, cap: int, fixed: int) -> int:
    """Tokens the history part of one summary call may take: the window less the summary's
    cap (`cap`), what every call carries (`fixed`: the system prompt and the summary prompt)
    and a margin. Not half the window: that cut the oldest turns out of the summary."""
    return max(1, window - cap - fixed - math.ceil(window * SUMMARY_MARGIN))


@dataclass(frozen=True)
class SummaryChunks:
    """`older` split for summary calls: `chunks` in order (summarised one after another, each
    call given the summary so far), and the messages no call can take (`left_out`: a turn
    alone over the budget)."""

    chunks: list[list[Message]]
    left_out: int = 0


def summary_chunks(older: Sequence[Message], budget: int, carry: int,
                   measure: Callable[[Message], int] = estimate_tokens) -> SummaryChunks:
    """Every message of `older` in chunks of at most `budget` tokens: one chunk when all fit,
    else chunks of `budget - carry` (room for the summary carried from the chunk before). A
    turn (a reply and its tool results) is never split: a result without its call is refused
    by providers."""
    units = _turns(older)
    sizes = [sum(map(measure, unit)) for unit in units]
    if sum(sizes) <= budget:
        return SummaryChunks([list(older)] if older else [])
    room = max(1, budget - carry)
    chunks: list[list[Message]] = []
    current: list[Message] = []
    used = left_out = 0
    for unit, size in zip(units, sizes, strict=True):
        if size > room:
            left_out += len(unit)
            continue
        if current and used + size > room:
            chunks.append(current)
            current, used = [], 0
        current += unit
        used += size
    if current:
        chunks.append(current)
    return SummaryChunks(chunks, left_out)


def _turns(messages: Sequence[Message]) -> list[list[Message]]:
    """`messages` as units: a reply with the tool results after it, anything else alone."""
    units: list[list[Message]] = []
    for message in messages:
        if isinstance(message, ToolResultMessage) and units and isinstance(units[-1][0], AssistantMessage):
            units[-1].append(message)
        else:
            units.append([message])
    return units


def last_turns_start(messages: Sequence[Message], turns: int) -> int:
    """Index where the last `turns` loop turns begin.

    A turn is one assistant message with its tool results, preceded by the messages injected at
    the start of that turn (prompts, steering, custom), so the tail never starts with an orphaned
    tool result.
    """
    if turns <= 0:
        return len(messages)
    replies = [i for i, m in enumerate(messages) if isinstance(m, AssistantMessage)]
    if len(replies) < turns:
        return 0
    start = replies[-turns]
    while start > 0 and not isinstance(messages[start - 1], (AssistantMessage, ToolResultMessage)):
        start -= 1
    return start


def compacted_history(
    messages: Sequence[Message], summary: str, retain_last_turns: int, tokens_before: int = 0,
    budget: int = 0, keep: Sequence[Message] = (), first: str = "",
) -> list[Message]:
    """[CompactionSummaryMessage(summary, first_prompt=first)] + the `keep` messages (the current
    run's prompts, by identity) found before the tail + the tail: the messages of the last
    `retain_last_turns` turns, fewer while over `budget` (see `retained_start`)."""
    head: Message = CompactionSummaryMessage(summary=summary, tokens_before=tokens_before,
                                             first_prompt=first)
    start = retained_start(messages, retain_last_turns, budget, keep)
    return [head, *pinned(messages[:start], keep),
            *(m for m in messages[start:] if not isinstance(m, CompactionSummaryMessage))]


def retained_start(messages: Sequence[Message], retain_last_turns: int, budget: int = 0,
                   keep: Sequence[Message] = ()) -> int:
    """Where the tail a compaction keeps verbatim begins.

    The last `retain_last_turns` turns; with a `budget` (tokens, estimated), fewer while the tail
    and the pinned `keep` messages are over it (a history still at the threshold after compaction
    would be compacted again on the next call). Never fewer than the newest turn while history
    ends in its tool results: the model has not read them yet, and a summary of them written by
    the model before reading them would be invented."""
    floor = 1 if messages and isinstance(messages[-1], ToolResultMessage) else 0
    start = last_turns_start(messages, floor)
    for turns in range(max(retain_last_turns, floor), floor - 1, -1):
        start = last_turns_start(messages, turns)
        tail = [*pinned(messages[:start], keep), *messages[start:]]
        if not budget or history_tokens(tail) < budget:
            return start
    return start


FIRST_PROMPT_CUT = "\n[... the rest of this prompt was folded into the summary]"


def first_prompt(older: Sequence[Message], keep: Sequence[Message], limit: int) -> str:
    """The conversation's first user prompt, for a summary to carry verbatim: the one an
    earlier summary carries, else the first visible user message of `older` not in `keep`
    (a kept one stays in history as it is). Cut to about `limit` estimated tokens."""
    for message in older:
        if isinstance(message, CompactionSummaryMessage) and message.first_prompt:
            return message.first_prompt
    ids = {id(m) for m in keep}
    user = next((m for m in older if isinstance(m, UserMessage) and not m.hidden
                 and id(m) not in ids), None)
    text = "".join(p.text for p in user.content if isinstance(p, TextPart)) if user else ""
    return _head(text, limit)


def _head(text: str, limit: int) -> str:
    """`text`, or its head of about `limit` estimated tokens and a note that it was cut."""
    size = json_tokens(text.encode())
    if size <= limit:
        return text
    return text[:max(0, len(text) * limit // size - len(FIRST_PROMPT_CUT))] + FIRST_PROMPT_CUT


def pinned(messages: Sequence[Message], keep: Sequence[Message]) -> list[Message]:
    """The messages of `keep` (by identity) among `messages`, in order."""
    ids = {id(m) for m in keep}
    return [m for m in messages if id(m) in ids] if ids else []


def summarisable(messages: Sequence[Message], keep: Sequence[Message] = ()) -> bool:
    """Whether `messages` hold anything a summary would replace: not only kept messages and an
    earlier summary (a compaction call over nothing invents a conversation)."""
    ids = {id(m) for m in keep}
    return any(id(m) not in ids and not isinstance(m, CompactionSummaryMessage) for m in messages)


def history_tokens(messages: Sequence[Message]) -> int:
    """The estimated size of a history (see `estimate_tokens`)."""
    return sum(estimate_tokens(m) for m in messages)


# --- conversion at the LLM boundary -------------------------------------------------------

COMPACTION_SUMMARY_PREFIX = (
    "The conversation history before this point was compacted into the following summary:\n\n"
)
FIRST_PROMPT_PREFIX = "The conversation began with this message from the user (kept verbatim):\n\n"
BRANCH_SUMMARY_PREFIX = "The following is a summary of a branch that this conversation came back from:\n\n"
NO_RESULT_TEXT = "No result provided"


def to_llm_message(message: Message) -> LlmMessage | None:
    """One agent message as a model sees it (custom kinds become user messages); None drops it."""
    if isinstance(message, CompactionSummaryMessage):
        first = (f"{FIRST_PROMPT_PREFIX}<first_message>\n{message.first_prompt}\n</first_message>\n\n"
                 if message.first_prompt else "")
        return user_text(f"{first}{COMPACTION_SUMMARY_PREFIX}<summary>\n{message.summary}\n</summary>")
    if isinstance(message, BranchSummaryMessage):
        return user_text(f"{BRANCH_SUMMARY_PREFIX}<summary>\n{message.summary}\n</summary>")
    if isinstance(message, CustomMessage):
        return user_text(message.content)
    if isinstance(message, AssistantMessage) and message.stop_reason in ("error", "aborted"):
        return None  # a failed reply carries nothing a model should see again
    return message


def default_convert_to_llm(messages: list[Message]) -> list[LlmMessage]:
    """Default `convert_to_llm`: map custom kinds to user messages, drop failed replies, and give
    every unanswered tool call a `No result provided` error result so providers accept the list."""
    return LlmView().convert(messages)


_Open = tuple[tuple[str, str], ...]  # the (id, name) of tool calls not answered yet


class LlmView:
    """`default_convert_to_llm` for a history that mostly grows at its end (the loop converts
    it every turn): the conversion of the messages still at the front (the same objects, in
    order) is kept, and only the rest is converted. The result is always a new list."""

    def __init__(self) -> None:
        self._source: list[Message] = []
        self._out: list[LlmMessage] = []  # the conversion of `_source`, calls not closed yet
        self._marks: list[tuple[int, _Open]] = []  # per source message: len(_out), open calls after it
        self._open: _Open = ()

    def convert(self, messages: Sequence[Message]) -> list[LlmMessage]:
        keep = common_prefix(messages, self._source)
        if keep < len(self._source):
            self._back_to(keep)
        out, marks, open_calls = self._out, self._marks, self._open
        for message in messages[keep:]:
            converted = to_llm_message(message)
            if converted is not None:
                if isinstance(converted, ToolResultMessage):
                    call_id = converted.tool_call_id
                    open_calls = tuple(c for c in open_calls if c[0] != call_id)
                else:
                    out += _close_calls(open_calls)
                    open_calls = (tuple((c.id, c.name) for c in converted.tool_calls)
                                  if isinstance(converted, AssistantMessage) else ())
                out.append(converted)
            marks.append((len(out), open_calls))
        self._source.extend(messages[keep:])
        self._open = open_calls
        return out + _close_calls(open_calls)

    def _back_to(self, keep: int) -> None:
        """Forget the conversion of the source messages from `keep` on."""
        length, self._open = self._marks[keep - 1] if keep else (0, ())
        del self._source[keep:], self._marks[keep:], self._out[length:]


def _close_calls(open_calls: Sequence[tuple[str, str]]) -> list[LlmMessage]:
    return [
        ToolResultMessage(
            tool_call_id=call_id, tool_name=name, content=[TextPart(NO_RESULT_TEXT)], is_error=True
        )
        for call_id, name in open_calls
    ]


__all__ = [
    "CONTEXT_EXCEEDED",
    "context_exceeded_text",
    "exceeded_window",
    "refused_prompt",
    "estimate_tokens",
    "json_tokens",
    "estimate_usage",
    "history_tokens",
    "PROMPT_CEILING",
    "SUMMARY_MARGIN",
    "TokenRate",
    "fixed_tokens",
    "history_rate",
    "prompt_tokens",
    "request_tokens",
    "SummaryChunks",
    "summary_budget",
    "summary_chunks",
    "is_context_exceeded",
    "DEFAULT_CONTEXT_WINDOW",
    "CompactionConfig",
    "LlmView",
    "SizeMemo",
    "ToolOutputCache",
    "ToolOutputConfig",
    "ToolOutputStore",
    "UsageTracker",
    "common_prefix",
    "compacted_history",
    "pinned",
    "retained_start",
    "summarisable",
    "default_convert_to_llm",

    "should_compact",
]
