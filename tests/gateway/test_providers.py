"""`LlmEngine` over real HTTP against the scripted fake servers: streaming, retries, limits, cancel."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence

import anyio
import msgspec
import pytest

from agent_bus.agents.gateway.engine import LlmEngine, ModelConfig
from agent_bus.agents.gateway.fakellm import FakeLLMServer, ScriptLike
from agent_bus.agents.loop.abort import Abort
from agent_bus.bus.messages import AssistantDelta, RetryPolicy, TextPart, ThinkingPart, ToolCall
from tests.gateway.conftest import FAKE_KEY, TOOLS, DeltaLog, RetryLog, engine_for, request
from tests.support import tight_timing

pytestmark = pytest.mark.anyio
StartServer = Callable[[ScriptLike], FakeLLMServer]

TWO_CALLS = {
    "text": "I will read the file and search at once.",
    "tool_calls": [
        {"name": "read_file", "arguments": {"path": "docs/notes.md"}, "id": "call_a"},
        {"name": "search_files", "arguments": {"pattern": "TODO", "path": "."}, "id": "call_b"},
    ],
    "chunk_size": 3,
}


def assert_deltas_rebuild(log: DeltaLog, content: Sequence[object]) -> None:
    indexes = [d.index for d in log.deltas]
    assert sorted(set(indexes)) == list(range(len(content)))
    for index, part in enumerate(content):
        streamed = log.text_at(index)
        if isinstance(part, TextPart):
            assert streamed == part.text
        elif isinstance(part, ThinkingPart):
            assert streamed == part.thinking
        elif isinstance(part, ToolCall):
            assert streamed == part.arguments


async def test_openai_stream_text_and_two_tool_calls(fake_server: StartServer) -> None:
    srv = fake_server([{"reply": {**TWO_CALLS, "interleave": True, "thinking": "Plan: two calls."}}])
    log = DeltaLog()
    async with engine_for(srv) as engine:
        msg = await engine.complete(request(tools=TOOLS), on_delta=log)
    assert msg.stop_reason == "tool_use" and msg.error is None
    assert msg.text == TWO_CALLS["text"]
    assert [(c.id, c.name, json.loads(c.arguments)) for c in msg.tool_calls] == [
        ("call_a", "read_file", {"path": "docs/notes.md"}),
        ("call_b", "search_files", {"pattern": "TODO", "path": "."}),
    ]
    assert isinstance(msg.content[0], ThinkingPart) and msg.content[0].thinking == "Plan: two calls."
    assert_deltas_rebuild(log, msg.content)
    assert len([d for d in log.deltas if d.kind == "tool_call"]) > 10  # arguments came in many pieces
    assert msg.usage.input > 0 and msg.usage.output > 0 and msg.provider == "openai"
    body = srv.requests[0].body
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["tools"][0]["function"]["name"] == "read_file" and body["tool_choice"] == "auto"
    assert srv.requests[0].headers["authorization"] == f"Bearer {FAKE_KEY}"


async def test_anthropic_stream_with_thinking_and_two_tool_calls(fake_server: StartServer) -> None:
    srv = fake_server([{"reply": {**TWO_CALLS, "thinking": "The user wants two things, so two calls."}}])
    log = DeltaLog()
    async with engine_for(srv, "anthropic") as engine:
        msg = await engine.complete(
            request(tools=TOOLS, system_prompt="Be brief.", tool_choice="read_file"), on_delta=log
        )
    assert msg.stop_reason == "tool_use" and msg.provider == "anthropic"
    thinking = msg.content[0]
    assert isinstance(thinking, ThinkingPart)
    assert thinking.thinking == "The user wants two things, so two calls." and thinking.signature.startswith(
        "fake-signature"
    )
    assert msg.text == TWO_CALLS["text"]
    assert [json.loads(c.arguments) for c in msg.tool_calls] == [
        {"path": "docs/notes.md"},
        {"pattern": "TODO", "path": "."},
    ]
    assert_deltas_rebuild(log, msg.content)
    assert [d.kind for d in log.deltas][0] == "thinking"
    body, headers = srv.requests[0].body, srv.requests[0].headers
    assert body["system"] == "Be brief." and body["tool_choice"] == {"type": "tool", "name": "read_file"}
    assert body["tools"][0]["input_schema"]["type"] == "object"
    assert headers["x-api-key"] == FAKE_KEY and headers["anthropic-version"]


async def test_429_with_retry_after_is_retried_once_after_about_a_second(fake_server: StartServer) -> None:
    srv = fake_server(
        [
            {"fail": {"status": 429, "retry_after": "1", "message": "slow down"}},
            {"reply": {"text": "ok now"}},
        ]
    )
    retries = RetryLog()
    async with engine_for(srv) as engine:
        started = time.monotonic()
        msg = await engine.complete(request(retry=RetryPolicy()), on_retry=retries)
        elapsed = time.monotonic() - started
    assert msg.stop_reason == "stop" and msg.text == "ok now"
    assert len(retries.calls) == 1
    attempt, delay, status, error = retries.calls[0]
    assert (attempt, delay, status) == (1, 1.0, 429) and "slow down" in error
    # waited the server's 1 s (the delay itself is pinned above); tight: little besides it
    assert 0.9 <= elapsed < (2.5 if tight_timing() else 10)
    assert len(srv.requests) == 2


async def test_five_503s_end_in_an_error_naming_the_status(fake_server: StartServer) -> None:
    srv = fake_server([{"fail": {"status": 503, "message": "upstream overloaded"}}] * 5)
    retries = RetryLog()
    async with engine_for(srv) as engine:
        msg = await engine.complete(request(), on_retry=retries)
        stats = engine.stats().models["fake-openai"]
    assert msg.stop_reason == "error" and msg.content == []
    assert msg.error is not None
    assert "openai" in msg.error and "503" in msg.error and "upstream overloaded" in msg.error
    assert "after 5 attempts" in msg.error
    assert len(srv.requests) == 5 and len(retries.calls) == 4
    assert [c[0] for c in retries.calls] == [1, 2, 3, 4]
    assert (stats.attempts, stats.retries, stats.errors) == (5, 4, 1)


async def test_400_is_not_retried(fake_server: StartServer) -> None:
    srv = fake_server(
        [{"fail": {"status": 400, "message": "messages: field required"}}, {"reply": {"text": "x"}}]
    )
    retries = RetryLog()
    async with engine_for(srv, "anthropic") as engine:
        msg = await engine.complete(request(), on_retry=retries)
    assert msg.stop_reason == "error" and msg.error is not None
    assert "anthropic" in msg.error and "400" in msg.error and "messages: field required" in msg.error
    assert len(srv.requests) == 1 and retries.calls == []


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
async def test_connection_dropped_mid_stream_is_retried_from_scratch(
    fake_server: StartServer, provider: str
) -> None:
    srv = fake_server([{"fail": {"kind": "drop", "after_events": 4}}, {"reply": {"text": "complete answer"}}])
    log, retries = DeltaLog(), RetryLog()
    async with engine_for(srv, provider) as engine:
        msg = await engine.complete(request(), on_delta=log, on_retry=retries)
    assert msg.stop_reason == "stop" and msg.text == "complete answer"
    assert len(retries.calls) == 1 and retries.calls[0][2] == 0
    assert log.deltas and "cut off" not in msg.text  # partial deltas were streamed, then dropped


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
async def test_dropped_streams_on_every_attempt_end_in_error_without_partial_content(
    fake_server: StartServer, provider: str
) -> None:
    srv = fake_server([{"fail": {"kind": "drop", "after_events": 4}}] * 2)
    async with engine_for(srv, provider) as engine:
        msg = await engine.complete(request(retry=RetryPolicy(max_attempts=2, base_delay=0.01)))
    assert msg.stop_reason == "error" and msg.content == []
    assert msg.error is not None and provider in msg.error and "after 2 attempts" in msg.error


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
async def test_malformed_sse_and_stream_errors_are_retried(fake_server: StartServer, provider: str) -> None:
    srv = fake_server(
        [
            {"fail": {"kind": "malformed"}},
            {"fail": {"kind": "stream_error", "message": "Overloaded"}},
            {"reply": {"text": "fine"}},
        ]
    )
    retries = RetryLog()
    async with engine_for(srv, provider) as engine:
        msg = await engine.complete(request(), on_retry=retries)
    assert msg.text == "fine" and len(retries.calls) == 2
    assert "not JSON" in retries.calls[0][3] or "malformed" in retries.calls[0][3]
    assert "Overloaded" in retries.calls[1][3]


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
async def test_llamacpp_sse_error_event_is_the_server_message(fake_server: StartServer,
                                                             provider: str) -> None:
    """llama.cpp's `event: error` (data `{"error": {"type": "server_error", ...}}`, no top-level
    type) reaches the user as the server's message, not as a stream that ended early."""
    said = "Failed to parse input: does not match the expected format"
    srv = fake_server([{"fail": {"kind": "server_error", "message": said}}] * 2)
    async with engine_for(srv, provider) as engine:
        msg = await engine.complete(request(retry=RetryPolicy(max_attempts=2, base_delay=0.01)))
    assert msg.stop_reason == "error" and "error event in stream: " in (msg.error or "")
    assert said in (msg.error or "")
    assert "ended before completion" not in (msg.error or "") and "after 2 attempts" in (msg.error or "")


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
async def test_abort_during_streaming_closes_the_connection_and_returns_aborted(
    fake_server: StartServer, provider: str
) -> None:
    srv = fake_server([{"reply": {"text": "word " * 200, "chunk_size": 5, "chunk_delay": 0.05}}])
    abort = Abort()
    aborted_at: list[float] = []

    def on_delta(delta: AssistantDelta) -> None:
        if len(aborted_at) == 0 and delta.kind == "text":
            aborted_at.append(time.monotonic())
            abort.set()

    async with engine_for(srv, provider) as engine:
        with anyio.fail_after(5):
            msg = await engine.complete(request(), on_delta=on_delta, abort=abort)
        closed_at = await anyio.to_thread.run_sync(srv.wait_disconnect, 2.0)
        stats = engine.stats().models[f"fake-{provider}"]
    assert msg.stop_reason == "aborted" and msg.tool_calls == []
    assert msg.text.startswith("word") and len(msg.text) < 1000
    assert closed_at is not None and closed_at - aborted_at[0] < 0.2
    assert stats.aborted == 1 and stats.in_flight == 0


async def test_cancelling_the_caller_closes_the_stream_at_once(fake_server: StartServer) -> None:
    srv = fake_server([{"reply": {"text": "word " * 200, "chunk_size": 5, "chunk_delay": 0.05}}])
    first = anyio.Event()
    async with engine_for(srv) as engine:
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.complete, request(), lambda d: first.set())
            await first.wait()
            cancelled_at = time.monotonic()
            tg.cancel_scope.cancel()
        closed_at = await anyio.to_thread.run_sync(srv.wait_disconnect, 2.0)
        assert engine.stats().models["fake-openai"].in_flight == 0
    assert closed_at is not None and closed_at - cancelled_at < 0.2


async def test_concurrency_limit_two_with_six_requests(fake_server: StartServer) -> None:
    srv = fake_server({"rules": [{"contains": [], "reply": {"text": "parallel " * 10, "chunk_delay": 0.01}}]})
    results = []
    async with engine_for(srv, max_concurrency=2) as engine:

        async def one(i: int) -> None:
            results.append(await engine.complete(request(f"q{i}")))

        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(one, i)
        stats = engine.stats().models["fake-openai"]
    assert [m.stop_reason for m in results] == ["stop"] * 6
    assert srv.max_in_flight == 2 and len(srv.requests) == 6
    assert stats.max_in_flight == 2 and stats.queued == 0 and stats.in_flight == 0


@pytest.mark.parametrize(
    ("provider", "finish", "expected"),
    [
        ("openai", "length", "length"),
        ("anthropic", "length", "length"),
        ("openai", "content_filter", "error"),
        ("anthropic", "stop", "stop"),
    ],
)
async def test_finish_reasons_map_to_stop_reasons(
    fake_server: StartServer, provider: str, finish: str, expected: str
) -> None:
    srv = fake_server([{"reply": {"text": "truncated", "finish": finish}}])
    async with engine_for(srv, provider) as engine:
        msg = await engine.complete(request())
    assert msg.stop_reason == expected and msg.text == "truncated"
    assert (msg.error is not None) == (expected == "error")


async def test_api_key_never_leaks(fake_server: StartServer, caplog: pytest.LogCaptureFixture) -> None:
    echo = f"Incorrect API key provided: {FAKE_KEY}"
    srv = fake_server(
        [{"fail": {"status": 503, "message": echo}}, {"fail": {"status": 401, "message": echo}}]
    )
    retries = RetryLog()
    caplog.set_level(logging.DEBUG)
    async with engine_for(srv) as engine:
        msg = await engine.complete(request(), on_retry=retries)
        texts = [
            msg.error or "",
            repr(engine),
            str(engine.models),
            repr(engine.models),
            msgspec.json.encode(engine.stats()).decode(),
            caplog.text,
            retries.calls[0][3],
        ]
    assert srv.requests[0].headers["authorization"].endswith(FAKE_KEY)  # it was sent…
    assert msg.stop_reason == "error" and "401" in (msg.error or "")  # …and the error is still useful
    for text in texts:
        assert FAKE_KEY not in text
    assert "***" in (msg.error or "")


async def test_missing_key_variable_is_named(fake_server: StartServer) -> None:
    srv = fake_server(None)
    engine = LlmEngine(
        [
            ModelConfig(
                alias="m", provider="openai", model="x", base_url=srv.base_url, api_key_env="MY_UNSET_KEY_VAR"
            )
        ],
        env={},
    )
    async with engine:
        msg = await engine.complete(request())
    assert msg.stop_reason == "error" and "`MY_UNSET_KEY_VAR` is not set" in (msg.error or "")
    assert srv.requests == []


async def test_unreachable_endpoint_names_the_url(fake_server: StartServer) -> None:
    srv = fake_server(None)
    url = srv.base_url
    srv.close()  # nothing listens there any more
    engine = LlmEngine(
        [ModelConfig(alias="m", provider="openai", model="x", base_url=url, connect_timeout=1.0)]
    )
    async with engine:
        with anyio.fail_after(5):
            msg = await engine.complete(request(retry=RetryPolicy(max_attempts=2, base_delay=0.01)))
    assert msg.stop_reason == "error" and f"{url}/chat/completions" in (msg.error or "")
    assert "cannot reach" in (msg.error or "")


async def test_first_byte_timeout(fake_server: StartServer) -> None:
    srv = fake_server([{"reply": {"text": "late"}, "delay": 2.0}])
    async with engine_for(srv, timeout=0.2) as engine:
        with anyio.fail_after(5):
            msg = await engine.complete(request(retry=RetryPolicy(max_attempts=1)))
    assert msg.stop_reason == "error" and "ReadTimeout" in (msg.error or "")


async def test_no_model_configured_explains_how_to_configure() -> None:
    async with LlmEngine.from_env(env={}) as engine:
        msg = await engine.complete(request())
    assert msg.stop_reason == "error"
    for name in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "ANTHROPIC_API_KEY"):
        assert name in (msg.error or "")


async def test_from_env_with_a_local_base_url_and_unknown_alias(fake_server: StartServer) -> None:
    srv = fake_server(None)
    async with LlmEngine.from_env(env={"OPENAI_BASE_URL": srv.base_url, "OPENAI_MODEL": "local"}) as engine:
        msg = await engine.complete(request("hi there"))
        missing = await engine.complete(request(model="nope"))
    assert msg.text == "echo: hi there" and msg.model == "local"
    assert "authorization" not in srv.requests[0].headers
    assert (
        missing.stop_reason == "error"
        and "`nope`" in (missing.error or "")
        and "`openai`" in (missing.error or "")
    )


async def test_usage_cost_and_stats_per_model_agent_and_run(fake_server: StartServer) -> None:
    usage = {"input": 1000, "output": 500, "cached": 2000}
    srv = fake_server([{"reply": {"text": "a", "usage": usage}}] * 3)
    async with engine_for(srv, input_price=2.0, output_price=8.0, cache_read_price=0.5) as engine:
        first = await engine.complete(request(agent="alice", run_id="r1"))
        await engine.complete(request(agent="alice", run_id="r2"))
        await engine.complete(request(agent="bob", run_id="r2"))
        stats = engine.stats()
    assert (first.usage.input, first.usage.output, first.usage.cache_read) == (1000, 500, 2000)
    assert first.usage.cost == pytest.approx((1000 * 2 + 500 * 8 + 2000 * 0.5) / 1e6)
    assert stats.agents["alice"].output == 1000 and stats.agents["bob"].output == 500
    assert stats.runs["r2"].input == 2000 and stats.models["fake-openai"].requests == 3
    assert stats.models["fake-openai"].usage.cost == pytest.approx(3 * first.usage.cost)


@pytest.mark.parametrize("key", [f"{FAKE_KEY}\nline2", f"{FAKE_KEY}é", f"  {FAKE_KEY}\n"])
async def test_malformed_keys_fail_fast_without_leaking(fake_server: StartServer, key: str) -> None:
    srv = fake_server(None)
    config = ModelConfig(alias="m", provider="openai", model="x", base_url=srv.base_url, api_key_env="K")
    async with LlmEngine([config], env={"K": key}) as engine:
        msg = await engine.complete(request("hi"))
    if key.strip() == FAKE_KEY:  # surrounding whitespace (a key read from a file) is stripped
        assert msg.text == "echo: hi"
    else:
        assert msg.stop_reason == "error" and "after 1 attempt)" in (msg.error or "")
        assert FAKE_KEY not in (msg.error or "") and "sk-FAKE" not in (msg.error or "")
