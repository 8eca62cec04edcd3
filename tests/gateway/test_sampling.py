"""Sampling parameters from `[models.x]`, the environment and the agent reach the server's body."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from agent_bus.agents.gateway.engine import LlmEngine, ModelSetupError, models_from_env
from agent_bus.agents.gateway.fakellm import FakeLLMServer
from tests.gateway.conftest import engine_for, request

pytestmark = pytest.mark.anyio


async def test_env_sampling_is_sent_and_the_request_wins(fake_server: Callable[..., FakeLLMServer]) -> None:
    server = fake_server(None)
    env = {"OPENAI_BASE_URL": server.base_url, "OPENAI_MODEL": "m", "OPENAI_TEMPERATURE": "0.2",
           "OPENAI_TOP_P": "0.9", "OPENAI_MAX_TOKENS": "64", "OPENAI_SEED": "42",
           "OPENAI_STOP": '["</end>", "STOP"]'}
    async with LlmEngine(models_from_env(env), env=env) as engine:
        await engine.complete(request("hi"))
        await engine.complete(request("hi", temperature=1.0, seed=7, stop=["x"]))  # the agent's own
    first, second = server.bodies
    assert (first["temperature"], first["top_p"], first["max_tokens"], first["seed"]) == (0.2, 0.9, 64, 42)
    assert first["stop"] == ["</end>", "STOP"]
    assert (second["temperature"], second["seed"], second["stop"], second["top_p"]) == (1.0, 7, ["x"], 0.9)


async def test_nothing_set_sends_nothing(fake_server: Callable[..., FakeLLMServer]) -> None:
    server = fake_server(None)
    async with engine_for(server) as engine:
        await engine.complete(request("hi"))
    assert not {"temperature", "top_p", "max_tokens", "seed", "stop"} & set(server.bodies[0])


async def test_anthropic_gets_top_p_and_stop_sequences_but_no_seed(
        fake_server: Callable[..., FakeLLMServer]) -> None:
    server = fake_server(None)
    async with engine_for(server, "anthropic", seed=3, top_p=0.5, stop=["END"]) as engine:
        await engine.complete(request("hi"))
    body = server.bodies[0]
    assert body["top_p"] == 0.5 and body["stop_sequences"] == ["END"] and "seed" not in body


@pytest.mark.parametrize(("name", "value", "match"), [
    ("OPENAI_TEMPERATURE", "warm", "OPENAI_TEMPERATURE.*a number"),
    ("OPENAI_SEED", "1.5", "OPENAI_SEED.*an integer"),
    ("OPENAI_STOP", "[1, 2]", "OPENAI_STOP.*JSON list of strings"),
])
def test_bad_env_sampling_names_the_variable(name: str, value: str, match: str) -> None:
    with pytest.raises(ModelSetupError, match=match):
        models_from_env({"OPENAI_BASE_URL": "http://127.0.0.1:9/v1", name: value})
    assert models_from_env({"OPENAI_BASE_URL": "http://x/v1", "OPENAI_STOP": "END"})[0].stop == ["END"]
