"""OpenAI stream chunks: the typed decoding (`openai._apply_event`, the usual shape) and the
generic one (`_apply_chunk`, any JSON) must build the same deltas and message, and fail alike."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anyio
import msgspec
import pytest

from agent_bus.agents.gateway.providers import (
    MessageBuilder,
    OpenAIProvider,
    StreamError,
    iter_sse,
)
from agent_bus.agents.gateway.providers.openai import _apply_chunk, _finish
from agent_bus.bus.messages import AssistantDelta, AssistantMessage


def _choice(delta: Any, finish: Any = None) -> str:
    return json.dumps({"id": "c", "object": "chat.completion.chunk", "model": "m",
                       "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


CALL0 = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}
STREAMS: dict[str, list[str]] = {
    "text and usage": [_choice({"role": "assistant", "content": ""}), _choice({"content": "Hel"}),
                       _choice({"content": "lo"}), _choice({}, "stop"),
                       json.dumps({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2,
                                   "prompt_tokens_details": {"cached_tokens": 1}}})],
    "reasoning then text": [_choice({"reasoning_content": "think"}), _choice({"reasoning": "more"}),
                            _choice({"reasoning_content": "", "reasoning": "x"}),
                            _choice({"content": "ok"}), _choice({}, "stop")],
    "tool calls": [_choice({"tool_calls": [CALL0]}),
                   _choice({"tool_calls": [{"index": 0, "function": {"arguments": "{\"a\""}}]}),
                   _choice({"tool_calls": [{"index": 1, "id": "call_2", "function": {"name": "g"}}]}),
                   _choice({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}),
                   _choice({}, "tool_calls")],
    "index null, missing, late id and name": [
        _choice({"tool_calls": [{"index": None, "function": {"arguments": "{"}}]}),
        _choice({"tool_calls": [{"function": {"arguments": "}"}}]}),
        _choice({"tool_calls": [{"index": 0, "id": "late", "function": {"name": "late_name"}}]}),
        _choice({"tool_calls": [{"index": 0, "function": None}]}), _choice({}, "stop")],
    "odd field types": [_choice({"content": ["not", "a", "string"]}), _choice({"content": 7}),
                        _choice({"reasoning_content": {}, "reasoning": "r"}), _choice(None),
                        _choice({"tool_calls": None}), _choice({"content": "x"}, 0),
                        _choice({"content": "y"}, "length"),
                        json.dumps({"choices": None, "usage": "n/a"}),
                        json.dumps({"choices": [], "error": None, "extra": [1, 2]})],
}


async def _reads(reads: list[list[str]]) -> AsyncIterator[bytes]:
    """A response body: each read one chunk holding its SSE events."""
    for datas in reads:
        yield "".join(f"data: {data}\n\n" for data in datas).encode()


async def _typed(datas: list[str]) -> tuple[list[AssistantDelta], AssistantMessage]:
    """The engine's way, each event in a read of its own: its deltas handed on after it."""
    deltas: list[AssistantDelta] = []
    builder = MessageBuilder(deltas.append)
    message = await OpenAIProvider("http://x/v1", "m").parse_stream(
        iter_sse(_reads([[data] for data in datas]), builder.release), builder)
    await builder.release(last=True)
    return deltas, msgspec.structs.replace(message, timestamp=0.0)


async def _generic(datas: list[str]) -> tuple[list[AssistantDelta], AssistantMessage]:
    deltas: list[AssistantDelta] = []
    builder = MessageBuilder(deltas.append)
    finish = None
    for data in datas:
        finish = _apply_chunk(msgspec.json.decode(data), builder) or finish
        await builder.release()
    message = _finish(OpenAIProvider("http://x/v1", "m"), builder, finish)
    return deltas, msgspec.structs.replace(message, timestamp=0.0)


@pytest.mark.parametrize("name", list(STREAMS))
def test_the_typed_and_the_generic_decoding_build_the_same_message(name: str) -> None:
    datas = STREAMS[name]
    assert anyio.run(_typed, datas) == anyio.run(_generic, datas)


@pytest.mark.parametrize(("data", "message"), [
    (json.dumps({"error": {"message": "overloaded"}}), "error event in stream: overloaded"),
    (json.dumps({"error": "bad"}), "error event in stream: bad"),
    (json.dumps([1, 2]), "malformed chunk (expected an object): '[1, 2]'"),
    ("{not json", "malformed SSE data (expected JSON): '{not json'"),
])
def test_a_bad_chunk_fails_the_stream_with_the_same_text(data: str, message: str) -> None:
    with pytest.raises(StreamError) as failure:
        anyio.run(_typed, [_choice({"content": "a"}), data])
    assert str(failure.value) == message


async def _per_read(reads: list[list[str]]) -> tuple[list[AssistantDelta], list[int]]:
    """The engine's way: a builder whose deltas are handed on once per read, the last read's
    after `on_last_read` (told how many deltas went before it)."""
    deltas: list[AssistantDelta] = []
    marks: list[int] = []
    builder = MessageBuilder(deltas.append, on_last_read=lambda: marks.append(len(deltas)))
    await OpenAIProvider("http://x/v1", "m").parse_stream(iter_sse(_reads(reads), builder.release),
                                                          builder)
    await builder.release(last=True)
    return deltas, marks


def test_a_reads_deltas_are_one_per_part_in_order_and_the_last_read_is_announced() -> None:
    calls = STREAMS["tool calls"]  # call_1 opens, gets `{"a"`, call_2 opens; call_1 gets `: 1}`
    deltas, marks = anyio.run(_per_read, [calls[:3], [*calls[3:], "[DONE]"]])
    assert [(d.index, d.delta, d.tool_call_id, d.tool_name) for d in deltas] == [
        (0, '{"a"', "call_1", "f"), (1, "", "call_2", "g"), (0, ": 1}", "call_1", "f")]
    assert marks == [2]  # before the last read's deltas, after the first read's
    text = STREAMS["text and usage"]  # one read: the text's two events are one delta
    deltas, marks = anyio.run(_per_read, [[*text, "[DONE]"]])
    assert [(d.index, d.delta) for d in deltas] == [(0, "Hello")] and marks == [0]
