"""Shared fixtures for the LLM gateway tests: real HTTP against `agents.gateway.fakellm` servers."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from agent_bus.agents.gateway.engine import LlmEngine, ModelConfig
from agent_bus.agents.gateway.fakellm import FakeLLMServer, ScriptLike
from agent_bus.bus.messages import AssistantDelta, LlmRequest, RetryPolicy, ToolSpec, Usage, user_text

FAKE_KEY = "sk-FAKE-7f3a9c1e-do-not-leak-0x5EC12E7"
FAST_RETRY = RetryPolicy(base_delay=0.01, max_delay=0.05)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def fake_server() -> Iterator[Callable[[ScriptLike], FakeLLMServer]]:
    """Start fake servers on demand; all are closed at teardown."""
    servers: list[FakeLLMServer] = []

    def start(script: ScriptLike = None) -> FakeLLMServer:
        server = FakeLLMServer(script).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


def model_for(server: FakeLLMServer, provider: str = "openai", **overrides: Any) -> ModelConfig:
    fields: dict[str, Any] = {
        "alias": f"fake-{provider}",
        "provider": provider,
        "model": f"{provider}-fake-model",
        "base_url": server.base_url,
        "api_key_env": "FAKE_LLM_KEY",
        "timeout": 5.0,
        "connect_timeout": 2.0,
    }
    fields.update(overrides)
    return ModelConfig(**fields)


def engine_for(server: FakeLLMServer, provider: str = "openai", **overrides: Any) -> LlmEngine:
    return LlmEngine([model_for(server, provider, **overrides)], env={"FAKE_LLM_KEY": FAKE_KEY})


def request(text: str = "hello", *, retry: RetryPolicy = FAST_RETRY, **fields: Any) -> LlmRequest:
    return LlmRequest(messages=[user_text(text)], retry=retry, **fields)


TOOLS = [
    ToolSpec(
        name="read_file",
        description="Read a file",
        parameters={
            "type": "object",
            "properties": {"path": {"type": "string"}},
            "required": ["path"],
        },
    ),
    ToolSpec(
        name="search_files",
        description="Search files",
        parameters={
            "type": "object",
            "properties": {"pattern": {"type": "string"}, "path": {"type": "string"}},
        },
    ),
    ToolSpec(name="list_dir", description="List a directory"),
]


class DeltaLog:
    """Collects deltas and rebuilds each content part's streamed text by index."""

    def __init__(self) -> None:
        self.deltas: list[AssistantDelta] = []

    def __call__(self, delta: AssistantDelta) -> None:
        self.deltas.append(delta)

    def text_at(self, index: int) -> str:
        return "".join(d.delta for d in self.deltas if d.index == index)


class RetryLog:
    def __init__(self) -> None:
        self.calls: list[tuple[int, float, int, str]] = []
        self.usage: list[Usage] = []  # what each failed attempt billed

    async def __call__(self, attempt: int, delay: float, status: int, error: str,
                       usage: Usage) -> None:
        self.calls.append((attempt, delay, status, error))
        self.usage.append(usage)


#: Node ids of the tests that failed so far in this session: a module-scoped fixture compares
#: its length at set-up and teardown to learn whether one of its tests failed.
FAILED: list[str] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.failed:
        FAILED.append(item.nodeid)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "real_llm: against a real local model server; set AGENT_BUS_REAL_LLM=<base URL>")
