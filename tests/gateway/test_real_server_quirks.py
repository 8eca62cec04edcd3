"""What real servers do, played by `busctl fake-llm`: model/window discovery, HTTP 400 context
errors, connections closed after each stream, `parallel_tool_calls`, aborts over the bus."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import msgspec
import pytest

from agent_bus.agents.coordinator.bus_adapters import BusLlmClient
from agent_bus.agents.gateway.engine import LlmEngine, ModelSetupError, models_from_env
from agent_bus.agents.gateway.fakellm import FakeLLMServer, ScriptLike
from agent_bus.agents.loop.abort import Abort
from agent_bus.bus.client import connect
from agent_bus.bus.messages import LlmRequest, user_text
from tests.gateway.conftest import FAST_RETRY, TOOLS, engine_for, request
from tests.support import Proc, busctl, until

pytestmark = pytest.mark.anyio


def env_engine(server: FakeLLMServer, **env: str) -> LlmEngine:
    """An engine configured the way a new user does it: `OPENAI_BASE_URL` alone (plus `env`)."""
    source = {"OPENAI_BASE_URL": server.base_url, **env}
    return LlmEngine(models_from_env(source), env=source)


async def test_base_url_alone_picks_the_one_model_and_its_window(fake_server: Callable[..., FakeLLMServer]) -> None:
    server = fake_server({"models": ["qwen-local"], "context_window": 4096})
    async with env_engine(server) as engine:
        await engine.discover()
        stats = engine.stats().models["openai"]
        reply = await engine.complete(request("hi"))
    assert (stats.model, stats.context_window) == ("qwen-local", 4096)
    assert "only model listed" in stats.model_from and "n_ctx" in stats.context_window_from
    assert reply.stop_reason == "stop" and server.bodies[-1]["model"] == "qwen-local"


@pytest.mark.parametrize("base", ["url", "base_url"])
async def test_an_anthropic_compatible_server_reports_its_window_before_the_first_call(
        fake_server: Callable[..., FakeLLMServer], base: str) -> None:
    """llama.cpp's `/v1/messages` side: `ANTHROPIC_BASE_URL` with or without /v1, `meta.n_ctx`."""
    server = fake_server({"models": ["qwen-local"], "context_window": 4096})
    source = {"ANTHROPIC_BASE_URL": getattr(server, base)}
    async with LlmEngine(models_from_env(source), env=source) as engine:
        await engine.discover()  # what the gateway does at start, before any call
        stats = engine.stats().models["anthropic"]
        reply = await engine.complete(request("hi"))
    assert reply.stop_reason == "stop" and server.requests[-1].path == "/v1/messages"
    assert [r.path for r in server.requests] == ["/v1/messages"]  # the GETs are not recorded
    assert (stats.model, stats.context_window) == ("qwen-local", 4096)
    assert stats.context_window_from == "server /v1/models meta.n_ctx"
    assert server.bodies[0]["model"] == "qwen-local"


async def test_llamacpp_props_gives_the_window_when_the_listing_does_not(
        fake_server: Callable[..., FakeLLMServer]) -> None:
    server = fake_server({"context_window": 2048})
    # a listing without meta (as from a proxy) still finds the running n_ctx at /props
    async with LlmEngine(models_from_env({"OPENAI_BASE_URL": server.base_url,
                                          "OPENAI_MODEL": "other"})) as engine:
        await engine.discover()
        stats = engine.stats().models["openai"]
    assert stats.context_window == 2048 and "/props" in stats.context_window_from
    assert stats.model == "other" and stats.model_from == "env OPENAI_MODEL"


async def test_env_window_overrides_the_server(fake_server: Callable[..., FakeLLMServer]) -> None:
    server = fake_server({"context_window": 4096})
    async with env_engine(server, OPENAI_CONTEXT_WINDOW="1500") as engine:
        await engine.discover()
        stats = engine.stats().models["openai"]
    assert (stats.context_window, stats.context_window_from) == (1500, "env OPENAI_CONTEXT_WINDOW")


async def test_a_bad_env_window_names_the_variable(fake_server: Callable[..., FakeLLMServer]) -> None:
    with pytest.raises(ModelSetupError, match="OPENAI_CONTEXT_WINDOW.*positive"):
        models_from_env({"OPENAI_BASE_URL": "http://127.0.0.1:9/v1", "OPENAI_CONTEXT_WINDOW": "4k"})


async def test_several_models_and_none_chosen_fails_with_the_list(
        fake_server: Callable[..., FakeLLMServer]) -> None:
    server = fake_server({"models": ["llama-3-8b", "qwen-7b"]})
    async with env_engine(server) as engine:
        with pytest.raises(ModelSetupError) as info:
            await engine.discover()
        reply = await engine.complete(request("hi"))
    text = str(info.value)
    assert "`llama-3-8b`" in text and "`qwen-7b`" in text and "OPENAI_MODEL=" in text
    assert reply.stop_reason == "error" and "OPENAI_MODEL=" in (reply.error or "")
    assert server.bodies == []  # nothing was sent with a guessed name


async def test_context_exceeded_is_marked_and_teaches_the_window(
        fake_server: Callable[..., FakeLLMServer]) -> None:
    server = fake_server({"context_window": 300})
    async with engine_for(server, context_window=128_000) as engine:
        reply = await engine.complete(request("word " * 2000))
        stats = engine.stats().models["fake-openai"]
    assert reply.stop_reason == "error" and "context_exceeded" in (reply.error or "")
    assert "exceed_context_size_error" in (reply.error or "") and stats.attempts == 1
    assert stats.context_window == 300  # learned from the error's n_ctx


async def test_parallel_tool_calls_is_sent_with_tools_only(fake_server: Callable[..., FakeLLMServer]) -> None:
    server = fake_server(None)
    async with engine_for(server) as engine:
        await engine.complete(request("use tools", tools=TOOLS))
        await engine.complete(request("no tools"))
    with_tools, without = server.bodies
    assert with_tools["parallel_tool_calls"] is True and "parallel_tool_calls" not in without
    async with engine_for(server, parallel_tool_calls=None) as engine:
        await engine.complete(request("use tools", tools=TOOLS))
    assert "parallel_tool_calls" not in server.bodies[-1]


async def test_a_connection_closed_after_each_stream_is_resent_without_an_attempt(
        fake_server: Callable[..., FakeLLMServer]) -> None:
    server = fake_server({"close_after_stream": True})
    async with engine_for(server) as engine:
        replies = [await engine.complete(request(f"run {i}")) for i in range(3)]
        stats = engine.stats().models["fake-openai"]
    assert [r.stop_reason for r in replies] == ["stop"] * 3
    assert server.dropped == 2 and stats.resent == 2  # the 2nd and 3rd reused a dead connection
    assert (stats.attempts, stats.retries) == (3, 0)


async def test_cancelling_a_call_counts_as_an_abort(fake_server: Callable[..., FakeLLMServer]) -> None:
    server = fake_server({"steps": [{"reply": {"text": "slow " * 50, "chunk_delay": 0.05}}]})
    async with engine_for(server) as engine:
        streaming = anyio.Event()

        async def on_delta(_delta: object) -> None:
            streaming.set()

        async with anyio.create_task_group() as tg:  # cancelled once the reply streams (not
            tg.start_soon(engine.complete, request("hi"), on_delta)  # during window discovery)
            await streaming.wait()
            tg.cancel_scope.cancel()
        assert engine.stats().models["fake-openai"].aborted == 1


# --- over the bus ------------------------------------------------------------------------


@pytest.fixture
def slow_fake() -> Iterator[FakeLLMServer]:
    script: ScriptLike = {"models": ["qwen-local"], "context_window": 4096,
                          "rules": [{"contains": [], "reply": {"text": "word " * 400, "chunk_size": 5,
                                                               "chunk_delay": 0.01}}]}
    with FakeLLMServer(script) as srv:
        yield srv


@pytest.fixture
def env_gateway(hub: dict, slow_fake: FakeLLMServer) -> Iterator[Proc]:
    proc = Proc(busctl("gateway", "--hub", hub["endpoint"], "--name", "gw-env"),
                env={"OPENAI_BASE_URL": slow_fake.base_url})
    try:
        proc.ready = proc.wait_ready()  # type: ignore[attr-defined]
        yield proc
    finally:
        proc.stop()


async def test_gateway_ready_line_names_the_discovered_model(env_gateway: Proc) -> None:
    ready = env_gateway.ready  # type: ignore[attr-defined]
    assert ready["model"] == "qwen-local" and ready["context_window"] == 4096


async def test_an_aborted_call_keeps_its_text_model_and_the_gateway_counts_it(
        hub: dict, env_gateway: Proc, slow_fake: FakeLLMServer) -> None:
    async with connect(hub["endpoint"], name="abort-test") as peer:
        llm = BusLlmClient(peer, agent="a")
        abort = Abort()

        async def abort_when_streaming() -> None:
            # abort once the gateway has streamed some text (its `message_update` events)
            with anyio.fail_after(10):
                async with peer.subscribe(["agent/a/"]) as events:
                    async for envelope in events:
                        if envelope.header.type == "message_update":
                            break
            abort.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(abort_when_streaming)
            with anyio.fail_after(10):
                reply = await llm.complete(LlmRequest(messages=[user_text("go")], retry=FAST_RETRY),
                                           abort=abort)
        assert reply.stop_reason == "aborted" and reply.text.startswith("word ")
        assert len(reply.text) < len("word " * 400) and reply.model == "qwen-local"
        assert llm.context_window("") == 4096
        async def aborts() -> int:
            stats = msgspec.msgpack.decode(await peer.request("gateway.gw-env", b""))
            return int(stats["models"]["openai"]["aborted"])

        assert await until(aborts, 10, "the gateway to count the abort") == 1


def test_fake_llm_cli_serves_models_and_props(tmp_path: Path) -> None:
    script = tmp_path / "s.json"
    script.write_text(json.dumps({"models": ["m1"], "context_window": 4096}))
    proc = Proc(busctl("fake-llm", "--script", str(script)))
    try:
        base = proc.wait_ready()["base_url"]
        import httpx

        models = httpx.get(f"{base}/models").json()
        props = httpx.get(base.removesuffix("/v1") + "/props").json()
    finally:
        proc.stop()
    assert models["data"][0]["id"] == "m1" and models["data"][0]["meta"]["n_ctx"] == 4096
    assert props["default_generation_settings"]["n_ctx"] == 4096
