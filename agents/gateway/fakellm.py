"""Scripted fake LLM servers speaking the real OpenAI and Anthropic wire formats over real HTTP.

    with FakeLLMServer(script) as srv:       # 127.0.0.1, a free port
        srv.base_url                         # "http://127.0.0.1:PORT/v1" (works for both providers)
        srv.requests, srv.max_in_flight, srv.disconnects

One server answers `POST /v1/chat/completions` (OpenAI) and `POST /v1/messages` (Anthropic), both
streaming (SSE, chunked transfer encoding) and non-streaming (`"stream": false`).

Script (a `Script`, a list of steps, a dict, or a JSON/TOML file with the same shape):

    {"steps": [ STEP, ... ],   # consumed one per request, in order, whatever the endpoint
     "rules": [ RULE, ... ],   # used once the steps are spent: first match wins
     "echo": true,             # no step, no rule: reply "echo: <last user text>"
     "models": ["fake-model"], # GET /v1/models lists these (the request's `model` is ignored)
     "context_window": 0,      # >0: /v1/models (meta.n_ctx) and /props (n_ctx) report it, and a
                               # prompt counted longer (JSON bytes / bytes_per_token) gets
                               # llama.cpp's HTTP 400 `exceed_context_size_error` with `n_ctx`
     "close_after_stream": false,  # true: like llama.cpp, the connection is dead after a stream
                               # (without saying so): the next request on it gets no answer
     "close_idle_after": 0.0,  # >0: a keep-alive connection idle this many seconds is closed
                               # (a server's keep-alive timeout)
     "close_delimited": false,  # true: streams go out with `Connection: close`, no length and
                               # no chunking, and end when the server closes (legal HTTP/1.1;
                               # simple servers and proxies do it). `busctl fake-llm --close-delimited`
     "strict_tool_json": false, # true: like llama.cpp, a request whose history holds a tool call
                               # whose arguments are not JSON gets HTTP 500 "Failed to parse tool
                               # call arguments as JSON" (`--strict-tool-json`)
     "cut_at_max_tokens": false,  # true: a reply longer than the request's `max_tokens` is cut
                               # there, finish `length` (a tool call mid-arguments, unterminated
                               # JSON), as a real server does (`--cut-at-max-tokens`)
     "bytes_per_token": 4.0,   # the fake tokenizer: usage, the window and `max_tokens` count
                               # JSON bytes / this; real ones count fewer bytes a token for digits
                               # (2.75 measured on number-heavy text) (`--bytes-per-token`)
     "parallel": 0,            # >0: this many slots, as llama.cpp's `--parallel N`: at most N
                               # requests are answered at once, the others wait their turn in
                               # arrival order (`--parallel`)
     "token_ms": 0.0,          # >0: streamed events spaced this many milliseconds apart (a
                               # reply's own `chunk_delay` wins), a model's decoding pace
                               # (`--token-ms`)
     "stamp": false}           # true: each `{sent_at}` in a streamed event becomes the server's
                               # clock as the event is written (time.time(), 6 decimals): a
                               # reader on this machine sees how long a delta took to reach it
                               # (bench/bench_pace.py). Give a reply `chunk_size` 10 so that each
                               # "{sent_at} " is a chunk of its own

    STEP  = {"reply": REPLY, "delay": 0.0}           # delay = seconds before the first byte
          | {"fail": FAIL,   "delay": 0.0}
    REPLY = {"text": "...", "thinking": "...",
             "tool_calls": [{"name": "f", "arguments": {...} or "raw json", "id": ""}],
             "finish": "stop|tool_calls|length|content_filter" (default: from the content),
             "usage": {"input": 0, "output": 0, "cached": 0},   (default: estimated)
             "chunk_size": 4, "chunk_delay": 0.0, "interleave": false}
    FAIL  = {"kind": "status", "status": 429, "message": "...", "retry_after": "1", "retry_after_ms": 0}
          | {"kind": "drop", "after_events": 3}      # stream a few events, then close the socket
          | {"kind": "malformed", "data": "{this is not json"}   # an SSE event, data not JSON
          | {"kind": "stream_error", "message": "..."}   # an error event inside a 200 stream
          | {"kind": "server_error", "message": "..."}   # llama.cpp's: `event: error`, data
                                                         # {"error": {"code": 500, "type": "server_error"}}
    RULE  = {"contains": ["word", ...],   # any of them in the last user text (case-insensitive); [] = any
             "tool_result": false,        # true: only right after tool results; null: either
             "system": ["word", ...],     # any of them in the system prompt (case-insensitive); [] = any
             "model": ["name", ...],      # the request's model is one of them; [] = any
             "results_contain": ["w"],    # any of them in the trailing tool results; [] = any
             "offers": ["tool", ...],     # every one of them is among the offered tools; [] = any
             "delay": 0.0,                # seconds before the first byte (simulated latency)
             "reply": REPLY}

A FAIL's `message` and `data` may echo the caller's API key (the `Authorization: Bearer` or
`x-api-key` header), as some OpenAI-compatible proxies do in their 401 errors: `{api_key}` is the
whole key, `{api_key:N}` its first N characters and `{api_key:-N}` its last N (a masked or cut key).

Every condition a rule gives must hold. `system` and `model` let one server drive several agents
deterministically: give each agent its own system prompt (or model name) and key its rules on it.

In rule replies, `{last_user}`, `{tool_results}` (one `- result` line each, cut to 200 characters),
`{tool_results_full}` (the results in full, separated by blank lines) and `{tool_results_json}` (a
JSON array of the results) are filled in from the request, in the text and in every string of the
tool calls' arguments; tool calls the request does not offer are dropped (so demos loop sanely).
`DEMO_SCRIPT` (from `agents/demo/fakellm_demo.json`) makes an agent call `list_dir`, `read_file`
and `search_files` in parallel, then summarise the results.

CLI: `python -m agent_bus.agents.gateway.fakellm --script FILE --port N` (default script: the demo).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import re
import socket
import sys
import threading
import time
import tomllib
import zlib
from collections.abc import Sequence
from email.utils import formatdate
from html import escape
from http import HTTPStatus
from pathlib import Path
from types import TracebackType
from typing import Annotated, Any, Literal

import click
import msgspec

# --- script model --------------------------------------------------------------------------


class FakeToolCall(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    name: str
    arguments: dict[str, Any] | str = msgspec.field(default_factory=dict)
    id: str = ""

    def arguments_json(self) -> str:
        return self.arguments if isinstance(self.arguments, str) else json.dumps(self.arguments)


class FakeUsage(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    input: int = 0
    output: int = 0
    cached: int = 0
    cache_write: int = 0


class Reply(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    text: str = ""
    thinking: str = ""
    tool_calls: list[FakeToolCall] = msgspec.field(default_factory=list)
    finish: str | None = None
    usage: FakeUsage | None = None
    chunk_size: int = 4
    chunk_delay: float = 0.0
    interleave: bool = False
    # Sent verbatim instead of the events built from the fields above, one HTTP chunk each: tests
    # of SSE framing (line endings, events or characters split across chunks). JSON: base64.
    sse: list[bytes] = msgspec.field(default_factory=list)
    gzip: bool = False  # the stream sent with `content-encoding: gzip`, flushed at every chunk

    def finish_reason(self) -> str:
        return self.finish or ("tool_calls" if self.tool_calls else "stop")


FailKind = Literal["status", "drop", "malformed", "stream_error", "server_error"]


class Fail(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    kind: FailKind = "status"
    status: int = 500
    message: str = "scripted failure"
    retry_after: str | None = None
    retry_after_ms: int | None = None
    after_events: int = 3
    data: str = "{this is not json"
    partial_text: str = "This answer is cut off before it ends, so it must never be used as complete."


class Step(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    reply: Reply | None = None
    fail: Fail | None = None
    delay: float = 0.0


class Rule(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    reply: Reply
    contains: list[str] = msgspec.field(default_factory=list)
    tool_result: bool | None = False
    system: list[str] = msgspec.field(default_factory=list)
    model: list[str] = msgspec.field(default_factory=list)
    results_contain: list[str] = msgspec.field(default_factory=list)
    offers: list[str] = msgspec.field(default_factory=list)
    delay: float = 0.0


class Script(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    steps: list[Step] = msgspec.field(default_factory=list)
    rules: list[Rule] = msgspec.field(default_factory=list)
    echo: bool = True
    # What real servers do (llama.cpp's quirks by default off, so old scripts behave the same):
    models: list[str] = msgspec.field(default_factory=lambda: ["fake-model"])  # GET /v1/models
    context_window: int = 0  # >0: reported by /v1/models and /props; longer prompts get HTTP 400
    close_after_stream: bool = False  # drop the next request on a connection that streamed
    close_idle_after: float = 0.0  # >0: close a keep-alive connection idle this long (seconds)
    close_delimited: bool = False  # streams end by closing the connection (no length, no chunks)
    strict_tool_json: bool = False  # HTTP 500 for a history holding tool-call arguments not JSON
    cut_at_max_tokens: bool = False  # replies cut at the request's `max_tokens` (finish `length`)
    # the fake tokenizer: prompts, replies, the window and `max_tokens` are counted with it
    bytes_per_token: Annotated[float, msgspec.Meta(gt=0)] = 4.0
    # a model server's pace: N slots (0: no limit) and milliseconds between streamed events
    parallel: Annotated[int, msgspec.Meta(ge=0)] = 0
    token_ms: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    stamp: bool = False  # `{sent_at}` in a streamed event: the clock when it is written


ScriptLike = Script | Sequence[Step | dict[str, Any]] | dict[str, Any] | str | Path | None


def load_script(source: ScriptLike) -> Script:
    """A `Script` from a Script, a list of steps, a dict, or a path to a JSON/TOML file."""
    if source is None:
        return Script()
    if isinstance(source, Script):
        return source
    if isinstance(source, (str, Path)):
        return _load_file(Path(source))
    if isinstance(source, dict):
        return msgspec.convert(source, Script)
    steps = [s if isinstance(s, Step) else msgspec.convert(s, Step) for s in source]
    return Script(steps=steps)


def _load_file(path: Path) -> Script:
    raw = path.read_bytes()
    data = tomllib.loads(raw.decode()) if path.suffix == ".toml" else msgspec.json.decode(raw)
    if isinstance(data, list):
        return load_script(data)
    return msgspec.convert(data, Script)


DEMO_SCRIPT_PATH = Path(__file__).parent.parent / "demo" / "fakellm_demo.json"


def demo_script() -> Script:
    return load_script(DEMO_SCRIPT_PATH)


# --- what a request says -------------------------------------------------------------------


class Conversation(msgspec.Struct):
    last_user: str = ""
    tool_results: list[str] = msgspec.field(default_factory=list)
    after_tool_result: bool = False
    offered_tools: list[str] = msgspec.field(default_factory=list)
    system: str = ""
    model: str = ""


def read_conversation(api: str, body: dict[str, Any]) -> Conversation:
    messages = body.get("messages") or []
    tools = body.get("tools") or []
    offered = [(t.get("function") or t).get("name", "") for t in tools if isinstance(t, dict)]
    if body.get("tool_choice") in ("none", {"type": "none"}):
        offered = []
    if api == "openai":
        conv = _openai_conversation(messages)
    else:
        conv = _anthropic_conversation(messages)
    conv.offered_tools = offered
    conv.model = str(body.get("model") or "")
    if api == "openai":
        conv.system = "\n".join(_text_of(m.get("content")) for m in messages
                                if isinstance(m, dict) and m.get("role") in ("system", "developer"))
    else:
        conv.system = _text_of(body.get("system"))
    return conv


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            _text_of(b.get("content")) if b.get("type") == "tool_result" else b.get("text", "")
            for b in content
            if isinstance(b, dict)
        )
    return ""


def _openai_conversation(messages: list[dict[str, Any]]) -> Conversation:
    conv = Conversation()
    users = [m for m in messages if m.get("role") == "user"]
    conv.last_user = _text_of(users[-1].get("content")) if users else ""
    # Tool results end the request, possibly followed by image-only user messages (how tool
    # images travel in this format); a user message with text means a new prompt.
    def after_tools(m: dict[str, Any]) -> bool:
        return m.get("role") == "tool" or (m.get("role") == "user" and not _text_of(m.get("content")))

    trailing = list(itertools.takewhile(after_tools, reversed(messages)))
    conv.tool_results = [_text_of(m.get("content")) for m in reversed(trailing) if m.get("role") == "tool"]
    conv.after_tool_result = bool(conv.tool_results)
    return conv


def _anthropic_conversation(messages: list[dict[str, Any]]) -> Conversation:
    conv = Conversation()
    for message in messages:
        if message.get("role") != "user":
            continue
        blocks = message.get("content")
        results = (
            [b for b in blocks if isinstance(b, dict) and b.get("type") == "tool_result"]
            if isinstance(blocks, list)
            else []
        )
        if not results:
            conv.last_user = _text_of(blocks)
    last = messages[-1] if messages else {}
    blocks = last.get("content") if last.get("role") == "user" else None
    if isinstance(blocks, list):
        conv.tool_results = [
            _text_of(b.get("content"))
            for b in blocks
            if isinstance(b, dict) and b.get("type") == "tool_result"
        ]
    conv.after_tool_result = bool(conv.tool_results)
    return conv


def choose_step(script: Script, conv: Conversation) -> Step:
    """The first matching rule's reply (filled in and fitted to the offered tools) with its
    delay, else an echo."""
    for rule in script.rules:
        if _matches(rule, conv):
            reply = _fill(rule.reply, conv)
            if reply.text or reply.tool_calls or reply.thinking:
                return Step(reply=reply, delay=rule.delay)
    return Step(reply=Reply(text=f"echo: {conv.last_user}"))


def _any_in(words: list[str], text: str) -> bool:
    text = text.lower()
    return not words or any(word.lower() in text for word in words)


def _matches(rule: Rule, conv: Conversation) -> bool:
    if rule.tool_result is not None and rule.tool_result != conv.after_tool_result:
        return False
    if rule.model and conv.model not in rule.model:
        return False
    if rule.offers and not set(rule.offers) <= set(conv.offered_tools):
        return False
    return (_any_in(rule.contains, conv.last_user) and _any_in(rule.system, conv.system)
            and _any_in(rule.results_contain, "\n".join(conv.tool_results)))


def _fill(reply: Reply, conv: Conversation) -> Reply:
    results = "\n".join(f"- {r[:200].strip()}" for r in conv.tool_results) or "(no tool results)"
    values = {
        "{last_user}": conv.last_user,
        "{tool_results}": results,
        "{tool_results_full}": "\n\n".join(r.strip() for r in conv.tool_results),
        "{tool_results_json}": json.dumps(conv.tool_results),
    }

    def fill(value: Any) -> Any:
        if isinstance(value, str):
            for key, new in values.items():
                if key in value:
                    value = value.replace(key, new)
            return value
        if isinstance(value, dict):
            return {k: fill(v) for k, v in value.items()}
        if isinstance(value, list):
            return [fill(v) for v in value]
        return value

    calls = [msgspec.structs.replace(c, arguments=fill(c.arguments))
             for c in reply.tool_calls if c.name in conv.offered_tools]
    finish = reply.finish if reply.finish or calls else "stop"
    return msgspec.structs.replace(reply, text=fill(reply.text), tool_calls=calls, finish=finish)


# --- wire formats --------------------------------------------------------------------------


def _split(text: str, size: int) -> list[str]:
    size = max(1, size)
    return [text[i : i + size] for i in range(0, len(text), size)]


def _usage(reply: Reply, body: dict[str, Any], bytes_per_token: float = 4.0) -> FakeUsage:
    if reply.usage is not None:
        return reply.usage
    out = (len(reply.text) + len(reply.thinking) + sum(len(c.arguments_json()) for c in reply.tool_calls))
    return FakeUsage(input=prompt_tokens(body, bytes_per_token), output=int(out / bytes_per_token) + 1)


def prompt_tokens(body: dict[str, Any], bytes_per_token: float = 4.0) -> int:
    """The fake tokenizer's count of a request's prompt: the JSON bytes of its messages, system
    prompt (Anthropic's) and tools (a real server's template puts them in the prompt too) /
    `bytes_per_token`."""
    size = sum(len(json.dumps(body[key])) for key in ("messages", "system", "tools") if body.get(key))
    return int(size / bytes_per_token) + 1


def cut_reply(reply: Reply, max_tokens: int, bytes_per_token: float = 4.0) -> Reply:
    """`reply` as a server with `max_tokens` sends it: cut where its output reaches the limit
    (thinking, text, then each tool call's arguments), finish `length`. A call cut mid-arguments
    keeps its unterminated JSON, as llama.cpp streams it; calls past the cut are dropped."""
    budget = int(max(1, max_tokens) * bytes_per_token)  # the fake's tokenizer (see `_usage`)
    calls = [c.arguments_json() for c in reply.tool_calls]
    if len(reply.thinking) + len(reply.text) + sum(map(len, calls)) <= budget:
        return reply
    thinking = reply.thinking[:budget]
    text = reply.text[:budget - len(thinking)]
    left = budget - len(thinking) - len(text)
    cut: list[FakeToolCall] = []
    for call, arguments in zip(reply.tool_calls, calls, strict=True):
        if left <= 0:
            break
        cut.append(msgspec.structs.replace(call, arguments=arguments[:left]))
        left -= len(arguments)
    return msgspec.structs.replace(reply, thinking=thinking, text=text, tool_calls=cut, finish="length")


def bad_tool_json(messages: Any) -> str | None:
    """llama.cpp's error for the first tool call of an OpenAI-format history whose arguments are
    not JSON (its chat template parses them all), else None."""
    for message in messages if isinstance(messages, list) else ():
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        for call in calls if isinstance(calls, list) else ():
            arguments = (call.get("function") or {}).get("arguments") if isinstance(call, dict) else None
            if not isinstance(arguments, str):
                continue
            try:
                json.loads(arguments)
            except json.JSONDecodeError as exc:
                return ("Failed to parse tool call arguments as JSON: [json.exception.parse_error.101] "
                        f"parse error at line {exc.lineno}, column {exc.colno}: "
                        f"syntax error while parsing value; last read: '{arguments[-40:]}'")
    return None


def _sse(data: Any, event: str | None = None) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data)
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n".encode()


class _Ids:
    _counter = itertools.count(1)
    _lock = threading.Lock()

    @classmethod
    def next(cls, prefix: str) -> str:
        with cls._lock:
            return f"{prefix}_{next(cls._counter):04d}"


def _call_ids(reply: Reply, prefix: str) -> list[str]:
    return [c.id or _Ids.next(prefix) for c in reply.tool_calls]


# OpenAI chat completions


def openai_events(reply: Reply, model: str, body: dict[str, Any]) -> list[bytes]:
    cid = _Ids.next("chatcmpl")
    # The bytes json.dumps gives for the whole chunk, its fixed part encoded once per reply, not
    # once per event (the largest Python cost of the fake per streamed call; issue 32).
    head = (f'data: {{"id": {json.dumps(cid)}, "object": "chat.completion.chunk", '
            f'"created": {int(time.time())}, "model": {json.dumps(model)}, '
            '"choices": [{"index": 0, "delta": ')

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        ending = "null" if finish is None else json.dumps(finish)
        return f'{head}{json.dumps(delta)}, "finish_reason": {ending}}}]}}\n\n'.encode()

    events = [chunk({"role": "assistant", "content": ""})]
    events += [chunk({"reasoning_content": piece}) for piece in _split(reply.thinking, reply.chunk_size)]
    events += [chunk({"content": piece}) for piece in _split(reply.text, reply.chunk_size)]
    events += [chunk({"tool_calls": [d]}) for d in _openai_tool_deltas(reply)]
    events.append(chunk({}, reply.finish_reason()))
    if (body.get("stream_options") or {}).get("include_usage"):
        u = _usage(reply, body)
        events.append(
            _sse(
                {
                    "id": cid,
                    "object": "chat.completion.chunk",
                    "model": model,
                    "choices": [],
                    "usage": _openai_usage(u),
                }
            )
        )
    events.append(_sse("[DONE]"))
    return events


def _openai_tool_deltas(reply: Reply) -> list[dict[str, Any]]:
    per_call: list[list[dict[str, Any]]] = []
    for index, (call, cid) in enumerate(zip(reply.tool_calls, _call_ids(reply, "call"), strict=True)):
        first = {
            "index": index,
            "id": cid,
            "type": "function",
            "function": {"name": call.name, "arguments": ""},
        }
        pieces = [
            {"index": index, "function": {"arguments": p}}
            for p in _split(call.arguments_json(), reply.chunk_size)
        ]
        per_call.append([first, *pieces])
    if not reply.interleave:
        return [d for deltas in per_call for d in deltas]
    merged = itertools.chain.from_iterable(itertools.zip_longest(*per_call))
    return [d for d in merged if d is not None]


def _openai_usage(u: FakeUsage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.input + u.cached,
        "completion_tokens": u.output,
        "total_tokens": u.input + u.cached + u.output,
        "prompt_tokens_details": {"cached_tokens": u.cached},
    }


def openai_json(reply: Reply, model: str, body: dict[str, Any]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.text or None}
    if reply.thinking:
        message["reasoning_content"] = reply.thinking
    if reply.tool_calls:
        message["tool_calls"] = [
            {"id": cid, "type": "function", "function": {"name": c.name, "arguments": c.arguments_json()}}
            for c, cid in zip(reply.tool_calls, _call_ids(reply, "call"), strict=True)
        ]
    choice = {"index": 0, "message": message, "finish_reason": reply.finish_reason()}
    return {
        "id": _Ids.next("chatcmpl"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": _openai_usage(_usage(reply, body)),
    }


# Anthropic messages

_ANTHROPIC_STOP = {
    "stop": "end_turn",
    "tool_calls": "tool_use",
    "length": "max_tokens",
    "content_filter": "refusal",
}


def _event(kind: str, **fields: Any) -> bytes:
    """An Anthropic SSE event: the event name repeats the payload's `type`."""
    return _sse({"type": kind, **fields}, kind)


def anthropic_events(reply: Reply, model: str, body: dict[str, Any]) -> list[bytes]:
    u = _usage(reply, body)
    usage = {"input_tokens": u.input, "output_tokens": 1, "cache_read_input_tokens": u.cached}
    usage["cache_creation_input_tokens"] = u.cache_write
    message: dict[str, Any] = {"id": _Ids.next("msg"), "type": "message", "role": "assistant", "model": model}
    message.update(content=[], stop_reason=None, stop_sequence=None, usage=usage)
    events = [_event("message_start", message=message), _event("ping")]
    for index, (block, deltas) in enumerate(_anthropic_blocks(reply)):
        events.append(_event("content_block_start", index=index, content_block=block))
        events += [_event("content_block_delta", index=index, delta=d) for d in deltas]
        events.append(_event("content_block_stop", index=index))
    stop = _ANTHROPIC_STOP.get(reply.finish_reason(), reply.finish_reason())
    delta = {"stop_reason": stop, "stop_sequence": None}
    events.append(_event("message_delta", delta=delta, usage={"output_tokens": u.output}))
    events.append(_event("message_stop"))
    return events


def _anthropic_blocks(reply: Reply) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    size = reply.chunk_size
    blocks: list[tuple[dict[str, Any], list[dict[str, Any]]]] = []
    if reply.thinking:
        deltas = [{"type": "thinking_delta", "thinking": p} for p in _split(reply.thinking, size)]
        deltas.append({"type": "signature_delta", "signature": f"fake-signature-{len(reply.thinking)}"})
        blocks.append(({"type": "thinking", "thinking": "", "signature": ""}, deltas))
    if reply.text:
        blocks.append(
            (
                {"type": "text", "text": ""},
                [{"type": "text_delta", "text": p} for p in _split(reply.text, size)],
            )
        )
    for call, cid in zip(reply.tool_calls, _call_ids(reply, "toolu"), strict=True):
        pieces = [
            {"type": "input_json_delta", "partial_json": p} for p in _split(call.arguments_json(), size)
        ]
        blocks.append(({"type": "tool_use", "id": cid, "name": call.name, "input": {}}, pieces))
    return blocks


def anthropic_json(reply: Reply, model: str, body: dict[str, Any]) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if reply.thinking:
        content.append(
            {
                "type": "thinking",
                "thinking": reply.thinking,
                "signature": f"fake-signature-{len(reply.thinking)}",
            }
        )
    if reply.text:
        content.append({"type": "text", "text": reply.text})
    for call, cid in zip(reply.tool_calls, _call_ids(reply, "toolu"), strict=True):
        content.append(
            {
                "type": "tool_use",
                "id": cid,
                "name": call.name,
                "input": _object_or_empty(call.arguments_json()),
            }
        )
    u = _usage(reply, body)
    return {
        "id": _Ids.next("msg"),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": _ANTHROPIC_STOP.get(reply.finish_reason(), reply.finish_reason()),
        "stop_sequence": None,
        "usage": {"input_tokens": u.input, "output_tokens": u.output, "cache_read_input_tokens": u.cached},
    }


def _object_or_empty(arguments: str) -> Any:
    """A tool_use block's `input`: the arguments, or {} for a call cut mid-JSON."""
    try:
        return json.loads(arguments or "{}")
    except ValueError:
        return {}


def error_body(api: str, status: int, message: str) -> dict[str, Any]:
    if api == "openai":
        kind = (
            "rate_limit_exceeded"
            if status == 429
            else "server_error"
            if status >= 500
            else "invalid_request_error"
        )
        return {"error": {"message": message, "type": kind, "code": status}}
    kind = {429: "rate_limit_error", 529: "overloaded_error"}.get(
        status, "api_error" if status >= 500 else "invalid_request_error"
    )
    return {"type": "error", "error": {"type": kind, "message": message}}


_KEY_ECHO = re.compile(r"\{api_key(?::(-?\d+))?\}")


def echo_key(text: str, key: str) -> str:
    """`text` with `{api_key}`, `{api_key:N}` (first N chars) and `{api_key:-N}` (last N) filled."""

    def fill(match: re.Match[str]) -> str:
        if match.group(1) is None:
            return key
        n = int(match.group(1))
        return key[:n] if n >= 0 else key[n:]

    return _KEY_ECHO.sub(fill, text)


def request_key(headers: dict[str, str]) -> str:
    """The API key a request carried: `x-api-key` (Anthropic) or `Authorization: Bearer` (OpenAI)."""
    lowered = {k.lower(): v for k, v in headers.items()}
    auth = lowered.get("authorization", "")
    return lowered.get("x-api-key") or auth.removeprefix("Bearer ").strip()


def stream_error_event(api: str, message: str) -> bytes:
    if api == "openai":
        return _sse({"error": {"message": message, "type": "server_error"}})
    return _sse({"type": "error", "error": {"type": "overloaded_error", "message": message}}, "error")


# --- the server ----------------------------------------------------------------------------


class RecordedRequest(msgspec.Struct):
    path: str
    headers: dict[str, str]
    body: Any
    started: float
    ended: float | None = None
    client_closed: float | None = None
    #: The usage a streamed reply sent, once all of it went out (None: none was sent, e.g. a
    #: failure or a client that left first): what a test sums as "billed by the server".
    usage: FakeUsage | None = None


class _ClientGone(Exception):
    pass


_APIS = {
    "/v1/chat/completions": "openai",
    "/chat/completions": "openai",
    "/v1/messages": "anthropic",
    "/messages": "anthropic",
}

# What `http.server` sent, so that replies look the same as when this was a ThreadingHTTPServer.
_SERVER_HEADER = f"BaseHTTP/0.6 Python/{sys.version.split()[0]}"
_REASONS = {status.value: status.phrase for status in HTTPStatus}
_HEAD_END = re.compile(rb"\r?\n\r?\n")
_MAX_HEAD = 64 * 1024 + 100 * 65536  # http.server's limits: a 64 KiB request line, 100 headers
_log = logging.getLogger(__name__)
# Not socketserver's 5: a burst of new connections (8 close-delimited streams at once; 1,000
# sessions in bench_scale) overflowed it, and each dropped SYN was resent a second later,
# serialising the burst. The kernel caps it at net.core.somaxconn.
_BACKLOG = 4096


class _Date:
    """The `Date` header, formatted once a second (not once a response)."""

    second = -1
    text = ""

    @classmethod
    def now(cls) -> str:
        second = int(time.time())
        if second != cls.second:
            cls.second, cls.text = second, formatdate(second, usegmt=True)
        return cls.text


class _Connection(asyncio.Protocol):
    """One client connection, served on the fake's event loop: requests read and answered one
    at a time (HTTP/1.1 keep-alive), as `http.server`'s handler did in a thread per connection.
    An asyncio server because that thread per connection took most of the fake's CPU at 1,000
    concurrent sessions (bench_scale, issue 32): the scale bench measured the fake, not the bus."""

    def __init__(self, owner: FakeLLMServer) -> None:
        self.owner = owner
        self.transport: asyncio.Transport | None = None
        self.task: asyncio.Task[None] | None = None
        self.path = ""
        self.headers: dict[str, str] = {}
        self.close_connection = False
        self._buffer = bytearray()
        self._eof = False  # the client closed its side, or the connection is gone
        self._lost = False
        self._input: asyncio.Future[bool] | None = None  # woken by data, EOF or loss
        self._drained: asyncio.Future[None] | None = None  # while writing is paused
        self._paused = False
        self._record: RecordedRequest | None = None
        self._dead = False  # set after a stream when the script says `close_after_stream`
        self._served = False  # a request was answered on this connection
        self._raw_body = False  # this stream is close-delimited: body bytes as they are, then close

    # --- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        # SSE chunks must go out now, not after a 40 ms delayed ACK (Nagle). asyncio sets this
        # itself only on sockets made with proto IPPROTO_TCP, which an accepted one is not.
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.owner._connections.add(self)
        self.task = asyncio.get_running_loop().create_task(self._run())

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        self._wake(True)

    def eof_received(self) -> bool:
        self._eof = True
        self._wake(True)
        return True  # half-closed: answers may still be written, as the threaded server could

    def connection_lost(self, exc: Exception | None) -> None:
        self._eof = self._lost = True
        self._wake(True)
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self.owner._connections.discard(self)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def _wake(self, value: bool) -> None:
        if self._input is not None and not self._input.done():
            self._input.set_result(value)

    # --- reading

    async def _wait_input(self, timeout: float | None = None) -> bool:
        """Wait for more bytes, EOF or loss (True), or `timeout` seconds (False)."""
        loop = asyncio.get_running_loop()
        self._input = waiter = loop.create_future()
        timer = loop.call_later(timeout, self._wake, False) if timeout is not None else None
        try:
            woken: bool = await waiter
            return woken
        finally:
            self._input = None
            if timer is not None:
                timer.cancel()

    async def _read_head(self) -> bytes | None:
        """The request line and headers; None at EOF (or past http.server's size limits)."""
        start = 0
        while (end := _HEAD_END.search(self._buffer, start)) is None:
            if self._eof or len(self._buffer) > _MAX_HEAD:
                return None
            start = max(0, len(self._buffer) - 3)
            await self._wait_input()
        head = bytes(self._buffer[: end.start()])
        del self._buffer[: end.end()]
        return head

    async def _read_body(self) -> Any:
        length = int(self._header("content-length") or 0)
        while len(self._buffer) < length and not self._eof:
            await self._wait_input()
        raw = bytes(self._buffer[:length])
        del self._buffer[:length]
        try:
            return json.loads(raw or b"null")
        except ValueError:
            return None

    def _header(self, name: str) -> str | None:
        for key, value in self.headers.items():
            if key.lower() == name:
                return value
        return None

    # --- one request after another

    async def _run(self) -> None:
        try:
            while not self.close_connection and not self._lost:
                await self._one_request()
        except (_ClientGone, ConnectionError) as error:
            # a client that goes away (an aborted run) is normal: one debug line
            _log.debug("client %s went away: %s", self._peer(), error)
        except asyncio.CancelledError:
            pass
        except Exception:
            _log.exception("fake-llm: error serving %s", self._peer())
        finally:
            if self.transport is not None and not self._lost:
                self.transport.close()

    def _peer(self) -> Any:
        return self.transport.get_extra_info("peername") if self.transport is not None else None

    async def _one_request(self) -> None:
        # `close_idle_after`: a server's keep-alive timeout, counted from the end of a response
        # (not from the accept: a client may be slow to send its first request)
        idle = self.owner.script.close_idle_after
        if idle > 0 and self._served and not self._buffer and not self._eof:
            if not await self._wait_input(idle):
                self.owner._count_idle_close()
                self.close_connection = True
                return
        head = await self._read_head()
        if head is None:
            self.close_connection = True
            return
        method = self._parse(head)
        if method is None:
            return
        if method == "GET":
            self.do_GET()
        elif method == "POST":
            await self.do_POST()
        else:
            self._send_error(501, f"Unsupported method ({method!r})")
        self._served = True

    def _parse(self, head: bytes) -> str | None:
        """Method, path and headers, as http.server reads them; None after a 400 answer."""
        lines = head.decode("iso-8859-1").split("\n")
        words = lines[0].rstrip("\r").split()
        if len(words) != 3 or not words[2].startswith("HTTP/1."):
            self._send_error(400, f"Bad request version ({lines[0].rstrip()!r})")
            return None
        method, self.path, version = words
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, colon, value = line.rstrip("\r").partition(":")
            if not colon:
                self._send_error(400, "Bad request headers")
                return None
            headers[name] = value.strip()
        self.headers = headers
        # HTTP/1.1 keeps the connection unless it says close; HTTP/1.0 closes unless keep-alive
        connection = (self._header("connection") or "").lower()
        self.close_connection = connection == "close" or (
            version == "HTTP/1.0" and connection != "keep-alive")
        if (self._header("expect") or "").lower() == "100-continue" and version != "HTTP/1.0":
            self._write(b"HTTP/1.1 100 Continue\r\n\r\n")
        return method

    # --- the routes

    def do_GET(self) -> None:
        script = self.owner.script
        window = script.context_window
        if self.path.rstrip("/") in ("/v1/models", "/models"):
            meta = {"n_ctx": window, "n_ctx_train": max(window, 32768)} if window else {}
            data = [{"id": m, "object": "model", "owned_by": "fake-llm", **({"meta": meta} if meta else {})}
                    for m in script.models]
            self._send_json(200, {"object": "list", "data": data})
        elif self.path.rstrip("/") == "/props" and window:
            self._send_json(200, {"default_generation_settings": {"n_ctx": window},
                                  "total_slots": max(script.parallel, 1)})
        else:
            self._send_json(404, {"error": {"message": f"no route for GET {self.path}"}})

    async def do_POST(self) -> None:
        api = _APIS.get(self.path.split("?")[0])
        body = await self._read_body()
        if self._dead:  # llama.cpp: the connection that streamed is closed, unannounced
            self.owner._count_dropped()
            await self._drop()
            return
        if api is None or not isinstance(body, dict):
            self._send_json(
                404 if api is None else 400, error_body(api or "openai", 400, f"bad request to {self.path}")
            )
            return
        owner = self.owner
        record = self._record = owner._begin(self.path, dict(self.headers), body)
        try:
            async with owner._slot():
                await self._serve(api, body, owner._next_step(api, body), record)
        except (_ClientGone, BrokenPipeError, ConnectionResetError):
            owner._closed(record)
            self.close_connection = True
        finally:
            owner._end(record)
            self._record = None

    # --- steps

    async def _serve(self, api: str, body: dict[str, Any], step: Step, record: RecordedRequest) -> None:
        await self._pause(step.delay)
        refusal = self._refusal(api, body)
        if refusal is not None:
            self._send_json(*refusal)
            return
        stream = bool(body.get("stream"))
        model = str(body.get("model") or "fake-model")
        if step.fail is not None:
            await self._fail(api, step.fail, stream, model, body)
            return
        reply = self._fitted(step.reply or Reply(), body)
        if stream:
            events = reply.sse or (openai_events if api == "openai" else anthropic_events)(
                reply, model, body)
            pace = reply.chunk_delay or self.owner.script.token_ms / 1000
            await self._stream(events, pace, gzip=reply.gzip)
            record.usage = None if reply.sse else _usage(reply, body)
            self._dead = self.owner.script.close_after_stream
        else:
            self._send_json(200, (openai_json if api == "openai" else anthropic_json)(reply, model, body))

    def _fitted(self, reply: Reply, body: dict[str, Any]) -> Reply:
        """`reply` as this server sends it: cut at `max_tokens` (`cut_at_max_tokens`), its usage
        counted by the script's tokenizer (`bytes_per_token`) unless the step gives one."""
        if reply.sse:
            return reply
        script = self.owner.script
        max_tokens = body.get("max_tokens")
        if script.cut_at_max_tokens and isinstance(max_tokens, int):
            reply = cut_reply(reply, max_tokens, script.bytes_per_token)
        if reply.usage is None:
            reply = msgspec.structs.replace(reply, usage=_usage(reply, body, script.bytes_per_token))
        return reply

    def _refusal(self, api: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]] | None:
        """What llama.cpp refuses before it generates anything, as (status, body): a prompt
        past the window (400), a history holding tool-call arguments that are not JSON (500)."""
        script = self.owner.script
        window = script.context_window
        # Sized only against a window: re-encoding the whole conversation per request was 30%
        # of the fake's Python time at 1,000 sessions (bench_scale, py-spy --gil; issue 32).
        prompt = prompt_tokens(body, script.bytes_per_token) if window else 0
        if window and prompt > window:
            message = (f"request ({prompt} tokens) exceeds the available context size ({window} tokens), "
                       "try increasing it")
            self.owner._count_refusal()
            return 400, {"error": {"code": 400, "message": message, "type": "exceed_context_size_error",
                                   "n_prompt_tokens": prompt, "n_ctx": window}}
        bad = bad_tool_json(body.get("messages")) if api == "openai" and script.strict_tool_json else None
        if bad is not None:
            self.owner._count_tool_json_refusal()
            return 500, {"error": {"code": 500, "message": bad, "type": "server_error"}}
        return None

    async def _fail(self, api: str, fail: Fail, stream: bool, model: str, body: dict[str, Any]) -> None:
        key = request_key(self.headers)
        message, data = echo_key(fail.message, key), echo_key(fail.data, key)
        if fail.kind == "status":
            headers = {}
            if fail.retry_after is not None:
                headers["retry-after"] = fail.retry_after
            if fail.retry_after_ms is not None:
                headers["retry-after-ms"] = str(fail.retry_after_ms)
            self._send_json(fail.status, error_body(api, fail.status, message), headers)
            return
        partial = Reply(text=fail.partial_text, chunk_size=6)
        events = (openai_events if api == "openai" else anthropic_events)(partial, model, body)
        if fail.kind == "drop":
            self._start_stream()
            for event in events[: fail.after_events]:
                await self._chunk(event)
            await self._drop()
        elif fail.kind == "malformed":
            await self._stream([*events[:2], f"data: {data}\n\n".encode(), *events[2:]], 0.0)
        elif fail.kind == "server_error":
            error = {"error": {"code": 500, "message": message, "type": "server_error"}}
            await self._stream([*events[:2], _sse(error, "error")], 0.0)
        else:
            await self._stream([*events[:2], stream_error_event(api, message)], 0.0)

    # --- low-level writing

    def _head(self, status: int, headers: list[tuple[str, str]]) -> bytes:
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, '')}", f"Server: {_SERVER_HEADER}",
                 f"Date: {_Date.now()}", *(f"{name}: {value}" for name, value in headers)]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1", "strict")

    def _send_json(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(payload).encode()
        head = self._head(status, [("content-type", "application/json"), ("content-length", str(len(data))),
                                   *(headers or {}).items()])
        self._last_write(head + data)

    def _send_error(self, status: int, message: str) -> None:
        """http.server's `send_error`: a short HTML page, then the connection is closed."""
        data = f"<html><body><h1>Error {status}</h1><p>{escape(message)}</p></body></html>\n".encode()
        self.close_connection = True
        self._write(self._head(status, [("Connection", "close"), ("Content-Type", "text/html;charset=utf-8"),
                                        ("Content-Length", str(len(data)))]) + data)

    def _start_stream(self, *, gzip: bool = False) -> None:
        headers = [("content-type", "text/event-stream")]
        if gzip:
            headers.append(("content-encoding", "gzip"))
        headers.append(("cache-control", "no-cache"))
        self._raw_body = self.owner.script.close_delimited
        if self._raw_body:  # the body ends when this connection closes (RFC 9112 6.3, rule 8)
            headers.append(("connection", "close"))
            self.close_connection = True
        else:
            headers.append(("transfer-encoding", "chunked"))
        self._write(self._head(200, headers))  # the head alone first: no body bytes needed with it

    async def _chunk(self, data: bytes) -> None:
        self._write(data if self._raw_body else b"%x\r\n%b\r\n" % (len(data), data))
        await self._flush()

    async def _stream(self, events: list[bytes], delay: float, *, gzip: bool = False) -> None:
        self._start_stream(gzip=gzip)
        if gzip:  # a sync flush per chunk: each arrives decodable, as from a compressing proxy
            packer = zlib.compressobj(wbits=31)
            events = [packer.compress(e) + packer.flush(zlib.Z_SYNC_FLUSH) for e in events]
            events.append(packer.flush())
        stamp = self.owner.script.stamp and not gzip
        for event in events:  # one write each, as a server sends each token when it has it
            if stamp and SENT_AT in event:
                event = event.replace(SENT_AT, b"%.6f" % time.time())
            self._write(event if self._raw_body else b"%x\r\n%b\r\n" % (len(event), event))
            if self._paused:
                await self._flush()
            if delay > 0:
                await self._pause(delay)
        self._last_write(b"" if self._raw_body else b"0\r\n\r\n")
        await self._flush()

    def _last_write(self, data: bytes) -> None:
        """The response ends here: count it as ended before the client can see the last byte."""
        if self._record is not None:
            self.owner._end(self._record)
        if data:
            self._write(data)

    def _write(self, data: bytes) -> None:
        # what a blocking send() raised once the client had reset the connection
        if self._lost or self.transport is None or self.transport.is_closing():
            raise BrokenPipeError("the client closed the connection")
        self.transport.write(data)

    async def _flush(self, *, all_of_it: bool = False) -> None:
        """Wait while the client reads slower than we write (or, `all_of_it`, until it has it all)."""
        assert self.transport is not None
        if all_of_it and self.transport.get_write_buffer_size() and not self._lost:
            self.transport.set_write_buffer_limits(high=0)  # pauses until the buffer is empty
        if self._paused and not self._lost:
            self._drained = asyncio.get_running_loop().create_future()
            await self._drained
            self._drained = None

    async def _drop(self) -> None:
        self.close_connection = True
        await self._flush(all_of_it=True)  # what was written goes out first, as with a blocking socket
        try:
            assert self.transport is not None
            self.transport.get_extra_info("socket").shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    async def _pause(self, seconds: float) -> None:
        """Wait `seconds`, watching the socket: raise `_ClientGone` as soon as the client closes."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while (left := deadline - loop.time()) > 0 and not self.owner._stopping.is_set():
            if self._eof:
                raise _ClientGone()
            await self._wait_input(left)


SENT_AT = b"{sent_at}"  # with `stamp`: replaced by the clock as the event is written


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class FakeLLMServer:
    """A running fake; also a context manager. Thread-safe counters, readable from any thread.

    It serves on an asyncio event loop: in a thread of its own after `start()`, or in the
    calling thread with `serve_forever()`."""

    def __init__(self, script: ScriptLike = None, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.script = load_script(script)
        self.requests: list[RecordedRequest] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.disconnects: list[float] = []  # time.monotonic() when a client closed mid-response
        self.dropped = 0  # requests dropped unanswered on a connection dead after its stream
        self.idle_closed = 0  # keep-alive connections closed after `close_idle_after` idle
        self.context_refusals = 0  # HTTP 400 answers to prompts longer than `context_window`
        self.tool_json_refusals = 0  # HTTP 500 answers to histories with tool-call arguments not JSON
        self._cursor = 0
        self._lock = threading.Condition()
        self._stopping = threading.Event()
        self._connections: set[_Connection] = set()
        # Bound and listening now, as http.server did: the port is known and connections queue
        # before serving starts.
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._socket.bind((host, port))
            self._socket.listen(_BACKLOG)
        except OSError:
            self._socket.close()
            raise
        self._address: tuple[str, int] = self._socket.getsockname()[:2]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Future[None] | None = None
        # `parallel` slots, made on the serving loop at the first request (remade when a new
        # script changes their number; requests holding the old ones finish on them)
        self._slots: tuple[int, asyncio.Semaphore] | None = None
        self._thread: threading.Thread | None = None

    def set_script(self, script: ScriptLike, *, clear_requests: bool = False) -> None:
        """Replace the script (its steps start again from the first); thread-safe."""
        loaded = load_script(script)
        with self._lock:
            self.script = loaded
            self._cursor = 0
            if clear_requests:
                del self.requests[:]

    @property
    def port(self) -> int:
        return int(self._address[1])

    @property
    def url(self) -> str:
        return f"http://{self._address[0]!s}:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def start(self) -> FakeLLMServer:
        loop = self._new_loop()
        self._thread = threading.Thread(target=self._run, args=(loop,), name="fakellm", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stopping.set()
        loop, stopped = self._loop, self._stopped
        if loop is not None and stopped is not None:
            try:
                loop.call_soon_threadsafe(_settle, stopped)
            except RuntimeError:  # the loop has already closed
                pass
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._socket.close()

    def __enter__(self) -> FakeLLMServer:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def serve_forever(self) -> None:
        """Serve in the calling thread until interrupted (CLI use)."""
        try:
            self._run(self._new_loop())
        finally:
            self._stopping.set()
            self._socket.close()

    def _new_loop(self) -> asyncio.AbstractEventLoop:
        # made here, not in the serving thread, so that `close()` right after `start()` finds it
        self._loop = asyncio.new_event_loop()
        self._stopped = self._loop.create_future()
        return self._loop

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            loop.run_until_complete(self._serve())
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _serve(self) -> None:
        assert self._stopped is not None
        server = await asyncio.get_running_loop().create_server(
            lambda: _Connection(self), sock=self._socket, backlog=_BACKLOG)
        try:
            await self._stopped
        finally:
            server.close()
            connections = list(self._connections)
            for connection in connections:
                assert connection.transport is not None
                connection.transport.abort()
            tasks = [c.task for c in connections if c.task is not None]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await server.wait_closed()

    def wait_disconnect(self, timeout: float) -> float | None:
        """Block until a client has closed a connection mid-response; its monotonic time, or None."""
        with self._lock:
            self._lock.wait_for(lambda: bool(self.disconnects), timeout=timeout)
            return self.disconnects[0] if self.disconnects else None

    @property
    def bodies(self) -> list[Any]:
        with self._lock:
            return [r.body for r in self.requests]

    # --- called by the connections (on the event loop's thread)

    def _slot(self) -> contextlib.AbstractAsyncContextManager[Any]:
        """A slot to answer in: with `parallel` N, the N+1th request waits here (FIFO, as
        asyncio's semaphore wakes its waiters) until one of the N ends; else no wait."""
        n = self.script.parallel
        if n <= 0:
            return contextlib.nullcontext()
        if self._slots is None or self._slots[0] != n:
            self._slots = (n, asyncio.Semaphore(n))
        return self._slots[1]

    def _next_step(self, api: str, body: dict[str, Any]) -> Step:
        with self._lock:
            if self._cursor < len(self.script.steps):
                self._cursor += 1
                return self.script.steps[self._cursor - 1]
        if self.script.rules or self.script.echo:
            return choose_step(self.script, read_conversation(api, body))
        return Step(fail=Fail(status=500, message="fake-llm script exhausted"))

    def _count_dropped(self) -> None:
        with self._lock:
            self.dropped += 1

    def _count_idle_close(self) -> None:
        with self._lock:
            self.idle_closed += 1

    def _count_refusal(self) -> None:
        with self._lock:
            self.context_refusals += 1

    def _count_tool_json_refusal(self) -> None:
        with self._lock:
            self.tool_json_refusals += 1

    def _begin(self, path: str, headers: dict[str, str], body: Any) -> RecordedRequest:
        record = RecordedRequest(path=path, headers=headers, body=body, started=time.monotonic())
        with self._lock:
            self.requests.append(record)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        return record

    def _end(self, record: RecordedRequest) -> None:
        with self._lock:
            if record.ended is not None:
                return
            record.ended = time.monotonic()
            self.in_flight -= 1
            self._lock.notify_all()

    def _closed(self, record: RecordedRequest) -> None:
        with self._lock:
            record.client_closed = time.monotonic()
            self.disconnects.append(record.client_closed)
            self._lock.notify_all()


# --- CLI -----------------------------------------------------------------------------------


@click.command("fake-llm")
@click.option(
    "--script",
    "script_path",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="JSON or TOML script (steps/rules/echo); default: the built-in parallel-tools demo.",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to bind.")
@click.option("--port", default=0, show_default=True, type=int, help="Port to bind (0: any free port).")
@click.option("--close-delimited", is_flag=True, default=False,
              help="Stream replies with `Connection: close` and end each by closing the connection "
                   "(no length, no chunking), as simple servers and proxies do.")
@click.option("--strict-tool-json", is_flag=True, default=False,
              help="As llama.cpp: HTTP 500 for a request whose history holds tool-call arguments "
                   "that are not JSON.")
@click.option("--cut-at-max-tokens", is_flag=True, default=False,
              help="Cut a reply at the request's max_tokens (finish `length`, a tool call's "
                   "arguments mid-JSON), as a real server does.")
@click.option("--bytes-per-token", type=click.FloatRange(min=0.5), default=None,
              help="The fake tokenizer's bytes a token (default: the script's, 4); real tokenizers "
                   "count fewer for number-heavy text (2.75).")
@click.option("--parallel", type=click.IntRange(min=0), default=None, metavar="N",
              help="Answer at most N requests at once (slots, as llama.cpp's `--parallel N`); the "
                   "others wait in arrival order. 0: no limit (default: the script's, 0).")
@click.option("--token-ms", type=click.FloatRange(min=0), default=None, metavar="X",
              help="Milliseconds between streamed events (a model's decoding pace; a reply's own "
                   "chunk_delay wins). Default: the script's, 0.")
def fake_llm_command(script_path: str | None, host: str, port: int, close_delimited: bool,
                     strict_tool_json: bool, cut_at_max_tokens: bool, bytes_per_token: float | None,
                     parallel: int | None, token_ms: float | None) -> None:
    """Serve a scripted fake OpenAI + Anthropic API (for demos and tests)."""
    script = load_script(script_path) if script_path else demo_script()
    # a flag turns a quirk on; it never turns off what the script asks for
    quirks = {"close_delimited": close_delimited, "strict_tool_json": strict_tool_json,
              "cut_at_max_tokens": cut_at_max_tokens}
    script = msgspec.structs.replace(script, **{k: True for k, on in quirks.items() if on})
    if bytes_per_token is not None:
        script = msgspec.structs.replace(script, bytes_per_token=bytes_per_token)
    if parallel is not None:
        script = msgspec.structs.replace(script, parallel=parallel)
    if token_ms is not None:
        script = msgspec.structs.replace(script, token_ms=token_ms)
    server = FakeLLMServer(script, host=host, port=port)
    # One JSON ready line first (`busctl up` and tests wait for it), then a human line.
    click.echo(json.dumps({"ready": "fake-llm", "base_url": server.base_url}))
    click.echo(f"fake-llm listening on {server.base_url} (OPENAI_BASE_URL / ANTHROPIC_BASE_URL)")
    sys.stdout.flush()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


def main(argv: list[str] | None = None) -> int:
    fake_llm_command.main(args=argv, prog_name="python -m agent_bus.agents.gateway.fakellm",
                          standalone_mode=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
