"""OpenAI chat-completions compatible provider (OpenAI, vLLM, llama.cpp, Ollama, OpenRouter…)."""

from __future__ import annotations

import base64
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from agent_bus.agents.gateway.providers.base import (
    MessageBuilder,
    Provider,
    ProviderRequest,
    SseEvent,
    StreamError,
    arguments_text,
    decode_json,
    flatten_schema,
)
from agent_bus.bus.messages import (
    AssistantMessage,
    ImagePart,
    LlmMessage,
    LlmRequest,
    StopReason,
    TextPart,
    ToolCall,
    ToolResultMessage,
    ToolSpec,
    Usage,
    UserContent,
    UserMessage,
)

_STOP_REASONS: dict[str, StopReason] = {
    "stop": "stop",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "length": "length",
    "content_filter": "error",
}


class OpenAIProvider(Provider):
    name = "openai"
    #: Set by an engine whose requests are decoded anew for every call (the gateway's): each
    #: run's converted history is kept, so a call converts only what it added.
    histories: Histories | None = None

    def url(self) -> str:
        return f"{self.base_url}/chat/completions"

    def build_request(self, request: LlmRequest, api_key: str | None) -> ProviderRequest:
        headers = {"content-type": "application/json", "accept": "text/event-stream"}
        if api_key:
            headers["authorization"] = f"Bearer {api_key}"
        return ProviderRequest(url=self.url(), headers=headers, body=self.build_body(request))

    def build_body(self, request: LlmRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": (convert_messages(request.system_prompt, request.messages)
                         if self.histories is None else self.histories.convert(request)),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if request.tools:
            body["tools"] = [convert_tool(t) for t in request.tools]
            body["tool_choice"] = convert_tool_choice(request.tool_choice)
            if self.parallel_tool_calls is not None:
                body["parallel_tool_calls"] = self.parallel_tool_calls
        if request.max_tokens is not None:
            body["max_tokens"] = request.max_tokens
        if request.temperature is not None:
            body["temperature"] = request.temperature
        if request.top_p is not None:
            body["top_p"] = request.top_p
        if request.seed is not None:
            body["seed"] = request.seed  # reproducible sampling (OpenAI, vLLM, llama.cpp, Ollama)
        if request.stop:
            body["stop"] = request.stop
        if request.reasoning:
            body["reasoning_effort"] = request.reasoning
        return body

    async def parse_stream(
        self, events: AsyncIterator[SseEvent], builder: MessageBuilder
    ) -> AssistantMessage:
        finish: str | None = None
        done = False
        async for event in events:
            if event.data.strip() == "[DONE]":
                done = True
                break
            finish = _apply_event(event.data, builder) or finish
        if finish is None and not done:
            raise StreamError("stream ended before completion (no finish_reason, no [DONE])")
        return _finish(self, builder, finish)


def _finish(provider: OpenAIProvider, builder: MessageBuilder, finish: str | None) -> AssistantMessage:
    reason: StopReason = _STOP_REASONS.get(finish or "stop", "stop")
    if reason == "stop" and builder.has_tool_calls():
        reason = "tool_use"
    error = (
        f"{provider.name}: response stopped by the provider (finish_reason `{finish}`)"
        if reason == "error"
        else None
    )
    return builder.finish(provider.name, provider.model, reason, error)


# The usual chunk's shape, decoded into structs: attribute reads instead of a chain of `dict.get`
# and `isinstance` per field (a third of the parsing's CPU per event). Anything else (a field of
# another type, a malformed chunk) is parsed by `_apply_chunk` from the generic decoding, as before.
class _Function(msgspec.Struct):
    name: str | None = None
    arguments: str | None = None


class _ToolDelta(msgspec.Struct):
    index: int | None = 0
    id: str | None = None
    function: _Function | None = None


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[_ToolDelta] | None = None


class _Choice(msgspec.Struct):
    delta: _Delta | None = None
    finish_reason: str | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] | None = None
    usage: Any = None
    error: Any = None


_chunk_decoder = msgspec.json.Decoder(_Chunk)


def _apply_event(data: str, builder: MessageBuilder) -> str | None:
    """Apply one SSE event's chunk; its finish_reason, if any."""
    try:
        chunk = _chunk_decoder.decode(data)
    except msgspec.DecodeError:  # not the usual shape (or not JSON): the generic path says how
        generic = decode_json(data)
        if not isinstance(generic, dict):
            raise StreamError(f"malformed chunk (expected an object): {data!r}") from None
        return _apply_chunk(generic, builder)
    if chunk.error:
        raise StreamError(f"error event in stream: {_error_message(chunk.error)}")
    if isinstance(chunk.usage, dict):
        builder.usage = parse_usage(chunk.usage)
    finish = None
    for choice in chunk.choices or ():
        delta = choice.delta
        if delta is not None:
            _apply_typed_delta(delta, builder)
        finish = choice.finish_reason or finish
    return finish


def _apply_typed_delta(delta: _Delta, builder: MessageBuilder) -> None:
    """`_apply_delta` for a decoded `_Delta`: the same parts, in the same order."""
    reasoning = delta.reasoning_content or delta.reasoning
    if reasoning:
        builder.add_run("thinking", reasoning)
    if delta.content:
        builder.add_run("text", delta.content)
    for call in delta.tool_calls or ():
        key = ("tool", call.index)
        function = call.function
        name, arguments = (function.name, function.arguments) if function is not None else ("", "")
        if not builder.has(key):
            builder.open(key, "tool_call", call.id or "", name or "")
        else:
            builder.update_call(key, call.id or "", name or "")
        builder.add(key, "tool_call", arguments or "")


def _apply_chunk(chunk: dict[str, Any], builder: MessageBuilder) -> str | None:
    if chunk.get("error"):
        raise StreamError(f"error event in stream: {_error_message(chunk['error'])}")
    if isinstance(chunk.get("usage"), dict):
        builder.usage = parse_usage(chunk["usage"])
    finish = None
    for choice in chunk.get("choices") or []:
        _apply_delta(choice.get("delta") or {}, builder)
        finish = choice.get("finish_reason") or finish
    return finish


def _apply_delta(delta: dict[str, Any], builder: MessageBuilder) -> None:
    reasoning = delta.get("reasoning_content") or delta.get("reasoning")
    if isinstance(reasoning, str) and reasoning:
        builder.add_run("thinking", reasoning)
    if isinstance(delta.get("content"), str) and delta["content"]:
        builder.add_run("text", delta["content"])
    for call in delta.get("tool_calls") or []:
        _apply_tool_delta(call, builder)


def _apply_tool_delta(call: dict[str, Any], builder: MessageBuilder) -> None:
    key = ("tool", call.get("index", 0))
    function = call.get("function") or {}
    if not builder.has(key):
        builder.open(key, "tool_call", call.get("id") or "", function.get("name") or "")
    else:
        builder.update_call(key, call.get("id") or "", function.get("name") or "")
    builder.add(key, "tool_call", function.get("arguments") or "")


def _error_message(error: Any) -> str:
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)


def parse_usage(raw: dict[str, Any]) -> Usage:
    prompt = int(raw.get("prompt_tokens") or 0)
    output = int(raw.get("completion_tokens") or 0)
    cached = int((raw.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return Usage(input=prompt - cached, output=output, cache_read=cached, total=prompt + output)


# --- our messages → chat-completions messages ---------------------------------------------


def convert_messages(system_prompt: str, messages: list[LlmMessage]) -> list[dict[str, Any]]:
    head: list[dict[str, Any]] = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return _convert(messages, head)


# runs whose converted history `Histories` keeps (the most recent calls'): as many as a big
# experiment runs at once (64 thrashed at 1,000 sessions)
HISTORIES_KEPT = 2048
# and the most messages they hold together: the memory held between calls stays bounded (tens
# of MB at a few kB a message) whatever the histories' length
HISTORY_MESSAGES_KEPT = 20_000


class Histories:
    """The chat-completions form of the history of each recent run, by run id.

    A run's next model call repeats its history and adds a turn: only the added messages are
    converted when the rest equals what was converted last time. That test compares the
    messages (msgspec's `==`, in C: about a quarter of converting them again, ~150 us for a
    history of 25 tool-call turns; nothing for the very objects seen last time, which the
    gateway hands again for a run's unchanged messages). Only for messages never changed in
    place after a call (the gateway's): a change to an object seen last time would go
    unnoticed. A caller that keeps its own history objects must not use it."""

    def __init__(self, kept: int = HISTORIES_KEPT, messages: int = HISTORY_MESSAGES_KEPT) -> None:
        self._kept, self._most = kept, messages
        self._runs: OrderedDict[str, tuple[list[LlmMessage], list[dict[str, Any]]]] = OrderedDict()
        self._held = 0  # messages in `_runs`

    def convert(self, request: LlmRequest) -> list[dict[str, Any]]:
        messages, run = request.messages, request.run_id
        seen = self._runs.pop(run, None) if run else None
        if seen is not None:
            self._held -= len(seen[0])
        if seen is not None and len(seen[0]) <= len(messages) and messages[:len(seen[0])] == seen[0]:
            converted = _convert(messages[len(seen[0]):], list(seen[1]))
        else:
            converted = _convert(messages, [])
        if run and len(messages) <= self._most:
            self._runs[run] = (list(messages), converted)
            self._held += len(messages)
            while len(self._runs) > self._kept or self._held > self._most:
                self._held -= len(self._runs.popitem(last=False)[1][0])
        system = request.system_prompt
        return [{"role": "system", "content": system}, *converted] if system else list(converted)


def _convert(messages: list[LlmMessage], out: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Append `messages` converted to `out`. Each message's form depends on it alone (so
    `Histories` may convert a history piecewise)."""
    # Runs on the whole history at every model call: the common kinds come first, and each
    # message is walked once.
    for message in messages:
        if isinstance(message, ToolResultMessage):
            _tool_result(message, out)
        elif isinstance(message, UserMessage):
            out.append({"role": "user", "content": _user_content(message.content)})
        elif message.stop_reason not in ("error", "aborted"):
            assistant = _assistant(message)
            if assistant is not None:
                out.append(assistant)
    return out


def _user_content(parts: list[UserContent]) -> str | list[dict[str, Any]]:
    if all(isinstance(p, TextPart) for p in parts):
        return "".join(p.text for p in parts if isinstance(p, TextPart))
    return [_user_part(p) for p in parts]


def _user_part(part: UserContent) -> dict[str, Any]:
    if isinstance(part, TextPart):
        return {"type": "text", "text": part.text}
    data = base64.b64encode(part.data).decode()
    return {"type": "image_url", "image_url": {"url": f"data:{part.mime_type};base64,{data}"}}


def _assistant(message: AssistantMessage) -> dict[str, Any] | None:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for part in message.content:
        if isinstance(part, ToolCall):
            function = {"name": part.name, "arguments": arguments_text(part.arguments)}
            calls.append({"id": part.id, "type": "function", "function": function})
        elif isinstance(part, TextPart):
            texts.append(part.text)
    text = "".join(texts)
    if not text and not calls:
        return None
    out: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        out["tool_calls"] = calls
    return out


def _tool_result(message: ToolResultMessage, out: list[dict[str, Any]]) -> None:
    """Tool messages carry text only; images follow in a user message."""
    content = message.content
    images: list[ImagePart] = []
    if len(content) == 1 and isinstance(content[0], TextPart):  # the usual result: one text
        text = content[0].text
    else:
        text = "".join(p.text for p in content if isinstance(p, TextPart))
        images = [p for p in content if isinstance(p, ImagePart)]
    text = text or ("(error)" if message.is_error else "(no output)")
    out.append({"role": "tool", "tool_call_id": message.tool_call_id, "content": text})
    if images:
        parts: list[UserContent] = [TextPart(f"Image(s) returned by tool `{message.tool_name}`:"), *images]
        out.append({"role": "user", "content": [_user_part(p) for p in parts]})


def convert_tool(tool: ToolSpec) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description,
            "parameters": flatten_schema(tool.parameters),
        },
    }


def convert_tool_choice(choice: str) -> str | dict[str, Any]:
    if choice in ("auto", "none", "required"):
        return choice
    return {"type": "function", "function": {"name": choice}}


__all__ = ["Histories", "OpenAIProvider", "convert_messages", "convert_tool", "convert_tool_choice",
           "parse_usage"]
