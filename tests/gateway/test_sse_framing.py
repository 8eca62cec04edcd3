"""SSE framing as real servers send it, over real HTTP: the fake server streams the given bytes
verbatim, one HTTP chunk each (so a split between chunks reaches the parser as a split)."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from agent_bus.agents.gateway.fakellm import FakeLLMServer, ScriptLike
from agent_bus.agents.gateway.providers.base import SseParser
from tests.gateway.conftest import DeltaLog, engine_for, request

pytestmark = pytest.mark.anyio
StartServer = Callable[[ScriptLike], FakeLLMServer]

# Characters of 2, 3 and 4 UTF-8 bytes, and the line breaks `str.splitlines` knows beyond
# CR and LF (U+2028, U+0085, U+001C), which JSON carries raw inside strings.
PIECES = ["Grüße ", "→ ✓ ", "😀 done", " a\u2028b\x85c\x1cd"]
TEXT = "".join(PIECES)


def openai_events(pieces: list[str] = PIECES) -> list[str]:
    """The `data` of each event of an OpenAI text stream, `[DONE]` last."""
    chunks = [{"choices": [{"index": 0, "delta": {"content": p}, "finish_reason": None}]}
              for p in pieces]
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    return [json.dumps(c, ensure_ascii=False) for c in chunks] + ["[DONE]"]


def body(events: list[str], *, eol: str = "\n", prefix: str = "data: ") -> bytes:
    return "".join(f"{prefix}{data}{eol}{eol}" for data in events).encode()


async def complete(fake_server: StartServer, chunks: list[bytes]) -> tuple[str, DeltaLog]:
    srv = fake_server([{"reply": {"sse": chunks}}])
    log = DeltaLog()
    async with engine_for(srv) as engine:
        msg = await engine.complete(request(), on_delta=log)
    assert msg.error is None and msg.stop_reason == "stop", msg.error
    assert log.text_at(0) == msg.text
    return msg.text, log


def one_byte_chunks(data: bytes) -> list[bytes]:
    return [data[i:i + 1] for i in range(len(data))]


@pytest.mark.parametrize("eol", ["\n", "\r\n", "\r"], ids=["lf", "crlf", "cr"])
async def test_line_endings(fake_server: StartServer, eol: str) -> None:
    text, _ = await complete(fake_server, [body(openai_events(), eol=eol)])
    assert text == TEXT


@pytest.mark.parametrize("eol", ["\n", "\r\n", "\r"], ids=["lf", "crlf", "cr"])
async def test_every_byte_its_own_chunk(fake_server: StartServer, eol: str) -> None:
    """Lines, CRLF pairs and multi-byte characters all split across chunks."""
    chunks = one_byte_chunks(body(openai_events(), eol=eol))
    text, _ = await complete(fake_server, chunks)
    assert text == TEXT
    # The engine hands a read's deltas over as one, and one read may hold every chunk: count
    # the events the parser makes of the chunks fed one by one (a CRLF split in two ends one
    # line, not two).
    parser = SseParser()
    events = [event for chunk in chunks for event in parser.feed(chunk)] + parser.close()
    assert [event.data for event in events] == openai_events()


async def test_data_without_the_space(fake_server: StartServer) -> None:
    text, _ = await complete(fake_server, [body(openai_events(), prefix="data:")])
    assert text == TEXT


async def test_comments_event_names_and_other_fields_are_skipped(fake_server: StartServer) -> None:
    events = openai_events()
    chunks = [b": keep-alive\n\n", b"retry: 1000\nid: 7\n"]
    chunks += [f": ping\nevent: chunk\nid: {i}\ndata: {data}\n\n".encode()
               for i, data in enumerate(events)]
    text, _ = await complete(fake_server, chunks)
    assert text == TEXT


async def test_data_over_several_lines_is_joined(fake_server: StartServer) -> None:
    """JSON may be cut into several `data:` lines: they join with a newline (JSON whitespace)."""
    chunks = []
    for data in openai_events():
        lines = data.replace(", ", ",\n").split("\n")
        chunks.append("".join(f"data: {line}\n" for line in lines).encode() + b"\n")
    text, _ = await complete(fake_server, chunks)
    assert text == TEXT


async def test_events_split_anywhere_across_chunks(fake_server: StartServer) -> None:
    data = body(openai_events(), eol="\r\n")
    chunks = [data[i:i + 7] for i in range(0, len(data), 7)]  # cuts fall mid-line and mid-char
    text, _ = await complete(fake_server, chunks)
    assert text == TEXT


@pytest.mark.parametrize("tail", ["", "\n", "\r"], ids=["none", "lf", "cr"])
async def test_a_last_event_without_its_blank_line(fake_server: StartServer, tail: str) -> None:
    events = openai_events()
    chunks = [body(events[:-1]), f"data: {events[-1]}{tail}".encode()]
    text, _ = await complete(fake_server, chunks)
    assert text == TEXT


async def test_a_finish_without_done_and_without_blank_line(fake_server: StartServer) -> None:
    events = openai_events()[:-1]  # no [DONE]: the finish_reason completes the message
    text, _ = await complete(fake_server, [body(events[:-1]), f"data: {events[-1]}".encode()])
    assert text == TEXT


async def test_anthropic_named_events_with_crlf_split(fake_server: StartServer) -> None:
    events = [
        ("message_start", {"type": "message_start", "message": {"usage": {"input_tokens": 3}}}),
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "text", "text": ""}}),
        *[("content_block_delta", {"type": "content_block_delta", "index": 0,
                                   "delta": {"type": "text_delta", "text": p}}) for p in PIECES],
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                           "usage": {"output_tokens": 5}}),
        ("message_stop", {"type": "message_stop"}),
    ]
    data = "".join(f"event: {name}\r\ndata: {json.dumps(payload, ensure_ascii=False)}\r\n\r\n"
                   for name, payload in events).encode()
    srv = fake_server([{"reply": {"sse": one_byte_chunks(data)}}])
    log = DeltaLog()
    async with engine_for(srv, "anthropic") as engine:
        msg = await engine.complete(request(), on_delta=log)
    assert msg.error is None and msg.text == TEXT and log.text_at(0) == TEXT
    assert msg.usage.input == 3 and msg.usage.output == 5


@pytest.mark.parametrize("split", [False, True], ids=["whole", "every-byte"])
async def test_a_gzip_encoded_stream_is_decoded(fake_server: StartServer, split: bool) -> None:
    """A compressing proxy: the bytes go through httpx's decoder before the parser."""
    data = body(openai_events(), eol="\r\n")
    chunks = one_byte_chunks(data) if split else [data]
    srv = fake_server([{"reply": {"sse": chunks, "gzip": True}}])
    log = DeltaLog()
    async with engine_for(srv) as engine:
        msg = await engine.complete(request(), on_delta=log)
    assert msg.error is None and msg.text == TEXT and log.text_at(0) == TEXT


async def test_a_long_event_over_many_chunks(fake_server: StartServer) -> None:
    """One event far longer than a chunk (a whole answer at once): its pieces join once."""
    long_text = "ü" * 100_000 + "✓"
    data = body(openai_events([long_text]))
    chunks = [data[i:i + 1000] for i in range(0, len(data), 1000)]
    text, log = await complete(fake_server, chunks)
    assert text == long_text and len(log.deltas) == 1
