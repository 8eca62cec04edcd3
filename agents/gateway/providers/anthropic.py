"""Anthropic messages API provider (streaming)."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from agent_bus.agents.gateway.providers.base import (
    MessageBuilder,
    Provider,
    ProviderRequest,
    SseEvent,
    StreamError,
    arguments_object,
    decode_json,
    flatten_schema,
)
from agent_bus.bus.messages import (
    AssistantMessage,
    LlmMessage,
    LlmRequest,
    StopReason,
    TextPart,
    ThinkingPart,
    ToolCall,
    ToolResultMessage,
    ToolSpec,
    Usage,
    UserContent,
    UserMessage,
)

API_VERSION = "2023-06-01"
DEFAULT_MAX_TOKENS = 8192
THINKING_BUDGETS = {"minimal": 1024, "low": 1024, "medium": 4096, "high": 16384, "xhigh": 32768}
_STOP_REASONS: dict[str, StopReason] = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "pause_turn": "stop",
    "tool_use": "tool_use",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "refusal": "error",
}
# `server_error`: llama.cpp's (its HTTP 500 in a stream), retried as an HTTP 500 would be
_RETRYABLE_STREAM_ERRORS = {"overloaded_error", "api_error", "rate_limit_error", "server_error"}


class AnthropicProvider(Provider):
    name = "anthropic"

    def url(self) -> str:
        base = self.base_url if self.base_url.endswith("/v1") else f"{self.base_url}/v1"
        return f"{base}/messages"

    def build_request(self, request: LlmRequest, api_key: str | None) -> ProviderRequest:
        headers = {
            "content-type": "application/json",
            "accept": "text/event-stream",
            "anthropic-version": API_VERSION,
        }
        if api_key:
            headers["x-api-key"] = api_key
        return ProviderRequest(url=self.url(), headers=headers, body=self.build_body(request))

    def build_body(self, request: LlmRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": convert_messages(request.messages),
            "max_tokens": request.max_tokens or DEFAULT_MAX_TOKENS,
            "stream": True,
        }
        if request.system_prompt:
            body["system"] = request.system_prompt
        if request.tools:
            body["tools"] = [convert_tool(t) for t in request.tools]
            body["tool_choice"] = convert_tool_choice(request.tool_choice)
            if self.parallel_tool_calls is False and request.tool_choice != "none":
                body["tool_choice"]["disable_parallel_tool_use"] = True  # Anthropic's default is on
        if request.temperature is not None:
            body["temperature"] = request.temperature
        if request.top_p is not None:
            body["top_p"] = request.top_p
        if request.stop:
            body["stop_sequences"] = request.stop
        # no `seed`: Anthropic's API has none (the request's seed is not sent)
        if request.reasoning:
            _add_thinking(body, request.reasoning)
        return body

    async def parse_stream(
        self, events: AsyncIterator[SseEvent], builder: MessageBuilder
    ) -> AssistantMessage:
        state = _StreamState()
        async for event in events:
            payload = decode_json(event.data)
            if not isinstance(payload, dict):
                raise StreamError(f"malformed event (expected an object): {event.data!r}")
            if event.event == "error" or (isinstance(payload.get("error"), dict)
                                          and "type" not in payload):
                # llama.cpp's `/v1/messages` sends `event: error` with data `{"error": {...}}`
                # and no top-level type; Anthropic's data says `"type": "error"` as well
                _raise_stream_error(payload.get("error") or payload)
            _apply_event(payload, builder, state)
            if state.stopped:
                break
        if not state.stopped:
            raise StreamError("stream ended before completion (no message_stop)")
        return _finish(self, builder, state.stop_reason)


def _add_thinking(body: dict[str, Any], reasoning: str) -> None:
    budget = int(reasoning) if reasoning.isdigit() else THINKING_BUDGETS.get(reasoning, 4096)
    body["thinking"] = {"type": "enabled", "budget_tokens": budget}
    body["max_tokens"] = max(body["max_tokens"], budget + 4096)
    body.pop("temperature", None)  # extended thinking requires the default temperature


def _finish(provider: AnthropicProvider, builder: MessageBuilder, raw: str | None) -> AssistantMessage:
    reason: StopReason = _STOP_REASONS.get(raw or "end_turn", "stop")
    error = (
        f"{provider.name}: response stopped by the provider (stop_reason `{raw}`)"
        if reason == "error"
        else None
    )
    return builder.finish(provider.name, provider.model, reason, error)


class _StreamState:
    __slots__ = ("stop_reason", "stopped", "input_usage")

    def __init__(self) -> None:
        self.stop_reason: str | None = None
        self.stopped = False
        self.input_usage: dict[str, Any] = {}


def _apply_event(payload: dict[str, Any], builder: MessageBuilder, state: _StreamState) -> None:
    kind = payload.get("type")
    if kind == "message_start":
        state.input_usage = dict((payload.get("message") or {}).get("usage") or {})
        builder.usage = parse_usage(state.input_usage)
    elif kind == "content_block_start":
        _start_block(payload.get("index", 0), payload.get("content_block") or {}, builder)
    elif kind == "content_block_delta":
        _apply_block_delta(payload.get("index", 0), payload.get("delta") or {}, builder)
    elif kind == "message_delta":
        state.stop_reason = (payload.get("delta") or {}).get("stop_reason") or state.stop_reason
        builder.usage = parse_usage({**state.input_usage, **(payload.get("usage") or {})})
    elif kind == "message_stop":
        state.stopped = True
    elif kind == "error":
        _raise_stream_error(payload.get("error") or {})


def _raise_stream_error(error: dict[str, Any]) -> None:
    kind = str(error.get("type") or "error")
    message = str(error.get("message") or msgspec.json.encode(error).decode())
    raise StreamError(f"error event in stream: {kind}: {message}", retryable=kind in _RETRYABLE_STREAM_ERRORS)


def _start_block(index: int, block: dict[str, Any], builder: MessageBuilder) -> None:
    kind = block.get("type")
    if kind == "text":
        builder.add(index, "text", block.get("text") or "")
    elif kind == "thinking":
        builder.add(index, "thinking", block.get("thinking") or "")
        builder.set_signature(index, block.get("signature") or "")
    elif kind in ("tool_use", "server_tool_use"):
        builder.open(index, "tool_call", block.get("id") or "", block.get("name") or "")
        if block.get("input"):
            builder.add(index, "tool_call", msgspec.json.encode(block["input"]).decode())
    # redacted_thinking and unknown blocks are dropped: they cannot be shown or replayed as-is


def _apply_block_delta(index: int, delta: dict[str, Any], builder: MessageBuilder) -> None:
    kind = delta.get("type")
    if kind == "text_delta":
        builder.add(index, "text", delta.get("text") or "")
    elif kind == "thinking_delta":
        builder.add(index, "thinking", delta.get("thinking") or "")
    elif kind == "signature_delta":
        builder.set_signature(index, delta.get("signature") or "")
    elif kind == "input_json_delta" and builder.has(index):
        builder.add(index, "tool_call", delta.get("partial_json") or "")


def parse_usage(raw: dict[str, Any]) -> Usage:
    usage = Usage(
        input=int(raw.get("input_tokens") or 0),
        output=int(raw.get("output_tokens") or 0),
        cache_read=int(raw.get("cache_read_input_tokens") or 0),
        cache_write=int(raw.get("cache_creation_input_tokens") or 0),
    )
    usage.total = usage.input + usage.output + usage.cache_read + usage.cache_write
    return usage


# --- our messages → Anthropic messages -----------------------------------------------------


def convert_messages(messages: list[LlmMessage]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for message in messages:
        if isinstance(message, UserMessage):
            out.append({"role": "user", "content": [_user_block(p) for p in message.content]})
        elif isinstance(message, ToolResultMessage):
            _push_tool_result(out, _tool_result(message))
        elif message.stop_reason not in ("error", "aborted"):
            blocks = _assistant_blocks(message)
            if blocks:
                out.append({"role": "assistant", "content": blocks})
    return out


def _push_tool_result(out: list[dict[str, Any]], block: dict[str, Any]) -> None:
    """Consecutive tool results share one user message, as the API expects."""
    last = out[-1] if out else None
    if last and last["role"] == "user" and all(b["type"] == "tool_result" for b in last["content"]):
        last["content"].append(block)
    else:
        out.append({"role": "user", "content": [block]})


def _user_block(part: UserContent) -> dict[str, Any]:
    if isinstance(part, TextPart):
        return {"type": "text", "text": part.text}
    data = base64.b64encode(part.data).decode()
    return {"type": "image", "source": {"type": "base64", "media_type": part.mime_type, "data": data}}


def _assistant_blocks(message: AssistantMessage) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    for part in message.content:
        if isinstance(part, TextPart) and part.text:
            blocks.append({"type": "text", "text": part.text})
        elif isinstance(part, ThinkingPart) and part.signature:
            blocks.append({"type": "thinking", "thinking": part.thinking, "signature": part.signature})
        elif isinstance(part, ToolCall):
            blocks.append({"type": "tool_use", "id": part.id, "name": part.name,
                           "input": arguments_object(part.arguments)})
    return blocks


def _tool_result(message: ToolResultMessage) -> dict[str, Any]:
    content = [_user_block(p) for p in message.content] or [{"type": "text", "text": "(no output)"}]
    block: dict[str, Any] = {"type": "tool_result", "tool_use_id": message.tool_call_id, "content": content}
    if message.is_error:
        block["is_error"] = True
    return block


def convert_tool(tool: ToolSpec) -> dict[str, Any]:
    return {
        "name": tool.name,
        "description": tool.description,
        "input_schema": flatten_schema(tool.parameters),
    }


def convert_tool_choice(choice: str) -> dict[str, Any]:
    if choice == "required":
        return {"type": "any"}
    if choice in ("auto", "none"):
        return {"type": choice}
    return {"type": "tool", "name": choice}
