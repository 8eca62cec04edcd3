"""The provider seam: turn an `LlmRequest` into one HTTP request, and an SSE stream into a message.

A provider is two methods (see `Provider`): `build_request` (pure: request in, URL + headers +
JSON body out) and `parse_stream` (SSE events in, content parts into a `MessageBuilder`, whose
deltas the engine hands on, the finished `AssistantMessage` returned). Everything about HTTP
itself (retries, limits, timeouts, cancellation, usage accounting) lives in
`agents.gateway.engine`; providers never touch the network.

Stream failures are raised as `StreamError` (with `retryable`), never returned as a message: a
partial stream must not pass for a complete one. Their text quotes the offending data uncut: the
engine redacts secrets from it first and only then cuts it to length (a cut first could leave a
piece of an echoed key that redaction no longer recognises).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, Literal

import msgspec

from agent_bus.bus.errors import AgentBusError
from agent_bus.bus.messages import (
    AssistantContent,
    AssistantDelta,
    AssistantMessage,
    LlmRequest,
    StopReason,
    TextPart,
    ThinkingPart,
    ToolCall,
    Usage,
)

DeltaCallback = Callable[[AssistantDelta], "Awaitable[None] | None"]


class StreamError(AgentBusError):
    """The response stream broke: malformed SSE, an error event, or an end before completion."""

    def __init__(self, message: str, *, retryable: bool = True, status: int = 0) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.status = status


class ProviderRequest(msgspec.Struct):
    """One HTTP POST, fully described. `headers` may hold the API key: never log or repr it."""

    url: str
    headers: dict[str, str]
    body: dict[str, Any]

    def __repr__(self) -> str:  # the headers carry the secret
        return f"ProviderRequest(url={self.url!r})"


class SseEvent(msgspec.Struct):
    event: str
    data: str


class Provider:
    """Base of the provider adapters. Subclasses set `name` and implement the two methods."""

    name: str = "provider"

    def __init__(self, base_url: str, model: str) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        # True: ask for several tool calls per turn (llama.cpp defaults to one); None: say nothing.
        self.parallel_tool_calls: bool | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(base_url={self.base_url!r}, model={self.model!r})"

    def build_request(self, request: LlmRequest, api_key: str | None) -> ProviderRequest:
        """Describe the streaming HTTP call for `request`. Pure; must not raise on valid input."""
        raise NotImplementedError

    async def parse_stream(
        self, events: AsyncIterator[SseEvent], builder: MessageBuilder
    ) -> AssistantMessage:
        """Consume `events` into `builder` and return the final message (the engine hands the
        builder's deltas on between reads: `iter_sse`'s `after_read`).

        Raises `StreamError` when the stream is malformed, reports an error, or ends early."""
        raise NotImplementedError


# --- SSE -----------------------------------------------------------------------------------


class SseParser:
    """Incremental SSE parser over the raw bytes of a response body.

    Lines end at LF, CRLF or CR (a CRLF split across two chunks counts once); they are decoded
    as UTF-8 only when whole, so a character split across chunks is never broken. Only these
    three end a line: httpx's `aiter_lines` also split at U+2028, U+0085 and the other
    `str.splitlines` breaks, which may appear raw inside a JSON string and cut an event in two.
    Working on bytes also spares the three generator layers (bytes, text, lines) per chunk."""

    __slots__ = ("_rest", "_after_cr", "_event", "_data")

    def __init__(self) -> None:
        self._rest: list[bytes] = []  # the unfinished line's pieces (joined once it ends)
        self._after_cr = False  # the last chunk ended with CR: a LF starting the next ends nothing
        self._event = ""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[SseEvent]:
        """The events completed by `chunk`."""
        if not chunk:
            return []
        if self._after_cr and chunk[:1] == b"\n":
            chunk = chunk[1:]
        self._after_cr = chunk[-1:] == b"\r"
        if b"\r" in chunk:
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        rest = self._rest
        if rest:  # a line began in an earlier chunk: a long one is joined once, not at each
            rest.append(chunk)
            if b"\n" not in chunk:
                return []
            chunk = b"".join(rest)
            rest.clear()
        *lines, tail = chunk.split(b"\n")
        if tail:
            rest.append(tail)
        events: list[SseEvent] = []
        data = self._data
        for line in lines:
            # The usual lines inline (a method call each was a fifth of the parsing's CPU):
            # `data: ...` and the blank line that ends the event; `_line` does the rest.
            if line.startswith(b"data: "):
                data.append(line[6:].decode("utf-8", "replace"))
            elif line:
                self._line(line, events)
            else:
                if data:
                    events.append(SseEvent(event=self._event or "message", data="\n".join(data)))
                    data = self._data = []
                self._event = ""
        return events

    def close(self) -> list[SseEvent]:
        """The last event, when the body ended without the blank line after it."""
        events: list[SseEvent] = []
        if self._rest:
            self._line(b"".join(self._rest), events)
            self._rest.clear()
        self._line(b"", events)
        return events

    def _line(self, line: bytes, events: list[SseEvent]) -> None:
        if line.startswith(b"data:"):
            value = line[6:] if line[5:6] == b" " else line[5:]
            self._data.append(value.decode("utf-8", "replace"))
        elif not line:
            if self._data:
                events.append(SseEvent(event=self._event or "message", data="\n".join(self._data)))
                self._data = []
            self._event = ""
        elif line == b"data":  # a field without a colon has the empty value
            self._data.append("")
        elif line.startswith(b"event:"):
            value = line[7:] if line[6:7] == b" " else line[6:]
            self._event = value.decode("utf-8", "replace")
        # other fields (id, retry) and comments (`:`) carry nothing a provider uses


async def iter_sse(chunks: AsyncIterator[bytes],
                   after_read: Callable[[], Awaitable[None]] | None = None
                   ) -> AsyncGenerator[SseEvent, None]:
    """Group the body's SSE lines into events (`event:` + joined `data:` lines). `after_read`
    runs once the events of each read are consumed, before the next read is waited for (the
    engine hands a read's deltas over there: `MessageBuilder.release`)."""
    parser = SseParser()
    async for chunk in chunks:
        for event in parser.feed(chunk):
            yield event
        if after_read is not None:
            await after_read()
    for event in parser.close():
        yield event


def decode_json(data: str) -> Any:
    try:
        return msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise StreamError(f"malformed SSE data (expected JSON): {data!r}") from exc


# --- assembling a message from deltas ------------------------------------------------------

PartKind = Literal["text", "thinking", "tool_call"]


class _Part:
    __slots__ = ("kind", "chunks", "signature", "call_id", "name")

    def __init__(self, kind: PartKind, call_id: str = "", name: str = "") -> None:
        self.kind: PartKind = kind
        self.chunks: list[str] = []
        self.signature = ""
        self.call_id = call_id
        self.name = name

    def build(self) -> AssistantContent:
        joined = "".join(self.chunks)
        if self.kind == "text":
            return TextPart(joined)
        if self.kind == "thinking":
            return ThinkingPart(joined, signature=self.signature)
        return ToolCall(id=self.call_id, name=self.name, arguments=joined or "{}")


class MessageBuilder:
    """Ordered content parts keyed by the provider's block id; appends make deltas.

    `index` in each `AssistantDelta` is the position of the part in the final `content` list.
    A provider builds synchronously (`open`, `add`, `add_run`): the deltas wait in order, and
    appends to the same part in a row become one delta (their texts joined). `release` hands
    the waiting ones to `on_delta`; the engine calls it once per socket read (`iter_sse`'s
    `after_read`) and at the stream's end. The SSE events of one read arrived together, so
    nothing is later for it: with a model's small chunks (a few characters each, ~30 a turn of
    tool calls) the gateway then sends and the hub logs a few `message_update`s and partial
    replies a read instead of one per SSE event. `on_last_read` is called by `release(last=True)`
    (the stream's end, the message complete) before it hands over the last read's deltas.
    Without `on_delta` (the coordinator assembling an aborted call's partials) no delta waits."""

    def __init__(self, on_delta: DeltaCallback | None = None, *,
                 on_last_read: Callable[[], None] | None = None) -> None:
        self._on_delta = on_delta
        self._on_last_read = on_last_read
        # Waiting deltas: [part index, texts]; made into `AssistantDelta`s when handed over.
        self._pending: list[tuple[int, list[str]]] = []
        self._parts: list[_Part] = []
        self._keys: dict[object, int] = {}
        self.usage = Usage()

    def open(self, key: object, kind: PartKind, call_id: str = "", name: str = "") -> int:
        self._parts.append(_Part(kind, call_id, name))
        index = len(self._parts) - 1
        self._keys[key] = index
        if kind == "tool_call":
            self._queue(index, "")
        return index

    def has(self, key: object) -> bool:
        return key in self._keys

    def add(self, key: object, kind: PartKind, text: str) -> None:
        """Append to the part `key`, opening it (with `kind`) when unseen."""
        index = self._keys.get(key)
        if index is None:
            index = self.open(key, kind)
        self._add_at(index, text)

    def add_run(self, kind: PartKind, text: str) -> None:
        """Append to the last part when it has `kind`, else open a new one (OpenAI text/reasoning)."""
        index = len(self._parts) - 1
        if index < 0 or self._parts[index].kind != kind:
            index = self.open(("run", len(self._parts)), kind)
        self._add_at(index, text)

    async def release(self, *, last: bool = False) -> None:
        """Hand the waiting deltas to `on_delta`, in order."""
        if last and self._on_last_read is not None:
            self._on_last_read()
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        on_delta = self._on_delta
        assert on_delta is not None  # nothing is queued without it
        parts = self._parts
        for index, texts in pending:
            part = parts[index]
            # The part's id and name as they are now: a later chunk may have filled them in.
            result = on_delta(AssistantDelta(kind=part.kind, delta=texts[0] if len(texts) == 1
                                             else "".join(texts), index=index,
                                             tool_call_id=part.call_id, tool_name=part.name))
            if inspect.isawaitable(result):
                await result

    def _add_at(self, index: int, text: str) -> None:
        if text:
            self._parts[index].chunks.append(text)
            self._queue(index, text)

    def _queue(self, index: int, text: str) -> None:
        if self._on_delta is not None:
            pending = self._pending
            if pending and pending[-1][0] == index:
                pending[-1][1].append(text)
            else:
                pending.append((index, [text]))

    def set_signature(self, key: object, signature: str) -> None:
        if key in self._keys:
            self._parts[self._keys[key]].signature += signature

    def update_call(self, key: object, call_id: str = "", name: str = "") -> None:
        part = self._parts[self._keys[key]]
        part.call_id = part.call_id or call_id
        part.name = part.name or name

    def content(self) -> list[AssistantContent]:
        return [p.build() for p in self._parts]

    def partial_content(self) -> list[AssistantContent]:
        """What streamed so far, minus tool calls (their arguments may be cut off)."""
        return [p.build() for p in self._parts if p.kind != "tool_call"]

    def has_tool_calls(self) -> bool:
        return any(p.kind == "tool_call" for p in self._parts)

    def finish(
        self, provider: str, model: str, stop_reason: StopReason, error: str | None = None
    ) -> AssistantMessage:
        return AssistantMessage(
            content=self.content(),
            stop_reason=stop_reason,
            usage=self.usage,
            model=model,
            provider=provider,
            error=error,
        )


# --- tool calls in the history -------------------------------------------------------------


def arguments_object(raw: str) -> dict[str, Any]:
    """A tool call's arguments as a provider must get them: a JSON object, `{}` for anything
    else. The history keeps what the model said verbatim, so a call cut at max_tokens holds
    unterminated JSON; sent on, llama.cpp refuses every later request of the session over it
    (HTTP 500 "Failed to parse tool call arguments as JSON"). The error result the loop put
    beside the call says why it never ran."""
    value = _object(raw)
    return {} if value is None else value


def arguments_text(raw: str) -> str:
    """`arguments_object` as the JSON text of an OpenAI-format call: `raw` itself when it is an
    object (the very bytes the model wrote, so a server's prompt cache still matches)."""
    return raw if raw and _object(raw) is not None else "{}"


def _object(raw: str) -> dict[str, Any] | None:
    try:
        value = msgspec.json.decode(raw or "{}")
    except msgspec.DecodeError:
        return None
    return value if isinstance(value, dict) else None


# --- tool schemas --------------------------------------------------------------------------


def flatten_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """Return `schema` with every local `$ref` inlined, `$defs` dropped and a root of type object.

    Recursive references (which cannot be inlined) become `{}` (any value). A root that is not an
    object schema becomes an empty object schema: providers reject anything else."""
    defs = {**schema.get("definitions", {}), **schema.get("$defs", {})}
    flat = _inline(schema, defs, ())
    if not isinstance(flat, dict):
        flat = {}
    for key in ("$defs", "definitions", "$schema"):
        flat.pop(key, None)
    if flat.get("type") != "object":
        if "properties" in flat and "type" not in flat:
            flat["type"] = "object"
        else:
            flat = {"type": "object", "properties": {}}
    flat.setdefault("properties", {})
    return flat


def _inline(node: Any, defs: dict[str, Any], seen: tuple[str, ...]) -> Any:
    if isinstance(node, list):
        return [_inline(item, defs, seen) for item in node]
    if not isinstance(node, dict):
        return node
    ref = node.get("$ref")
    if isinstance(ref, str):
        name = ref.rsplit("/", 1)[-1]
        if name in seen or name not in defs:
            return {}
        rest = {k: v for k, v in node.items() if k != "$ref"}
        return {**_inline(defs[name], defs, (*seen, name)), **_inline(rest, defs, seen)}
    return {k: _inline(v, defs, seen) for k, v in node.items() if k not in ("$defs", "definitions")}
