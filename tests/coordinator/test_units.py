"""In-process pieces of the coordinator: persistence, hook resolution, the agent's tool view."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agent_bus.agents.coordinator.bus_adapters import AgentTools
from agent_bus.agents.coordinator.persistence import ConversationStore
from agent_bus.agents.coordinator.process import (
    CoordinatorError,
    CoordinatorSettings,
    build_configs,
    loop_config,
    resolve_hook,
)
from agent_bus.agents.gateway.engine import ModelConfig
from agent_bus.agents.launch.topology import AgentSpec
from agent_bus.agents.loop.context import ToolOutputStore
from agent_bus.bus.messages import (
    AssistantMessage,
    TextPart,
    ToolCallRequest,
    ToolInfo,
    ToolResult,
    user_text,
)
from agent_bus.bus.protocol import ServiceInfo
from agent_bus.bus.toolnames import NAME_RULE
from agent_bus.tools.executor import _tool_info
from tests.coordinator.fixtures.hooks import no_shouting

pytestmark = pytest.mark.anyio


# --- persistence ---------------------------------------------------------------------------


def test_recorder_appends_then_rewrites_when_history_is_replaced(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path)
    session, loaded = store.load("a")
    assert loaded == []
    rec = store.recorder("a", session)
    history: list[Any] = [user_text("one")]
    rec.sync(history)
    history.append(AssistantMessage(content=[TextPart("two")]))
    rec.sync(history)
    rec.sync(history)  # nothing new: no write
    assert (rec.appends, rec.rewrites) == (2, 0)
    history[:] = [user_text("summary"), history[1]]  # compaction-style replacement
    rec.sync(history)
    assert rec.rewrites == 1
    history.clear()  # reset
    rec.sync(history)
    history.append(user_text("fresh"))
    rec.sync(history)
    store.close()

    again = ConversationStore(tmp_path)
    session2, messages = again.load("a")
    assert session2 == session
    assert [m.content[0].text for m in messages] == ["fresh"]
    again.close()


def test_new_session_and_agents_are_separate(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path)
    s1 = store.current_session("a")
    store.recorder("a", s1).sync([user_text("a1")])
    store.recorder("b", store.current_session("b")).sync([user_text("b1")])
    s2 = store.new_session("a")
    assert s2 != s1 and store.current_session("a") == s2
    assert store.load("a") == (s2, [])
    assert [m.content[0].text for m in store.messages("a", s1)] == ["a1"]
    assert [m.content[0].text for m in store.load("b")[1]] == ["b1"]
    assert store.sessions("a") == [s1, s2]
    store.close()


async def test_tool_outputs_survive_a_reopen(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path)
    ref = store.output_store("a").put("the full text")
    store.close()
    reopened = ConversationStore(tmp_path).output_store("a")
    result = await reopened.handle(ToolCallRequest(call_id="c", name="tool_output",
                                                   arguments=f'{{"ref": "{ref}", "offset": 4}}'))
    assert result.text == "full text" and not result.is_error


# --- configuration -------------------------------------------------------------------------


def test_resolve_hook_both_spellings() -> None:
    assert resolve_hook("tests.coordinator.fixtures.hooks:no_shouting") is no_shouting
    assert resolve_hook("tests.coordinator.fixtures.hooks.no_shouting") is no_shouting


@pytest.mark.parametrize("path, why", [
    ("tests.coordinator.fixtures.nope:fn", "ModuleNotFoundError"),
    ("tests.coordinator.fixtures.hooks:missing", "AttributeError"),
    ("nodots", "ValueError"),
])
def test_bad_hook_names_the_agent_and_hook(path: str, why: str) -> None:
    spec = AgentSpec("writer", hooks={"before_tool_call": path})
    with pytest.raises(CoordinatorError) as err:
        build_configs(CoordinatorSettings(hub="tcp://127.0.0.1:1", agents=[spec]))
    text = str(err.value)
    assert text.startswith(f"agent 'writer': cannot load hook before_tool_call = {path!r}: {why}")


def test_loop_config_from_spec() -> None:
    spec = AgentSpec("w", model="big", system_prompt="S", tool_execution="sequential",
                     max_iterations=7, require_done_tool=True, steering_mode="all",
                     hooks={"before_tool_call": "tests.coordinator.fixtures.hooks:no_shouting"})
    models = [ModelConfig(alias="small", provider="openai", model="s", context_window=1000),
              ModelConfig(alias="big", provider="openai", model="b", context_window=9000)]
    config = loop_config(spec, models)
    assert (config.agent, config.model, config.system_prompt) == ("w", "big", "S")
    assert (config.tool_execution, config.max_iterations, config.require_done_tool) == (
        "sequential", 7, True)
    assert config.steering_mode == "all" and config.context_window == 9000
    assert config.before_tool_call is no_shouting


# --- the agent's tool view -----------------------------------------------------------------


class FakeExecutor:
    def __init__(self) -> None:
        self.requests: list[ToolCallRequest] = []
        self.got_update_sink: list[bool] = []

    async def catalog(self) -> list[ToolInfo]:
        return [ToolInfo(name=n) for n in ("echo", "slow", "tool_output")]

    async def execute(self, request: ToolCallRequest, on_update: Any = None) -> ToolResult:
        self.requests.append(request)
        self.got_update_sink.append(on_update is not None)
        return ToolResult(content=[TextPart(f"ran {request.name}")])


async def test_agent_tools_restricts_and_serves_tool_output_locally() -> None:
    inner, store = FakeExecutor(), ToolOutputStore()
    tools = AgentTools(inner, ["echo"], store, experiment="e1")
    assert [t.name for t in await tools.catalog()] == ["echo", "tool_output"]
    result = await tools.execute(ToolCallRequest(call_id="1", name="echo"), lambda p: None)
    assert result.text == "ran echo"
    assert inner.requests[0].experiment == "e1" and inner.got_update_sink == [True]
    denied = await tools.execute(ToolCallRequest(call_id="2", name="slow"))
    assert denied.is_error and denied.text == "Error: Unknown tool 'slow'"
    ref = store.put("kept")
    local = await tools.execute(ToolCallRequest(call_id="3", name="tool_output",
                                                arguments=f'{{"ref": "{ref}"}}'))
    assert local.text == "kept" and len(inner.requests) == 1

    everything = AgentTools(inner, ["*"], store)
    assert [t.name for t in await everything.catalog()] == ["echo", "slow", "tool_output"]
    assert await AgentTools(inner, [], store).catalog() == []


class CatalogOf(FakeExecutor):
    """An executor whose catalog holds what an older hub (one that checked nothing) passes on."""

    def __init__(self, tools: list[ToolInfo]) -> None:
        super().__init__()
        self.tools = tools

    async def catalog(self) -> list[ToolInfo]:
        return self.tools


async def test_an_agent_never_offers_a_tool_no_model_api_takes_and_says_so_once() -> None:
    live = [ToolInfo(name="echo"), ToolInfo(name="js bad name!"), ToolInfo(name="x" * 65),
            ToolInfo(name="9lives"), ToolInfo(name="listy", parameters={"type": "array"}), ToolInfo(name="fine_too",
            parameters={"type": "object", "properties": {"a": {"type": "string"}}})]
    told: list[tuple[str, str]] = []

    async def on_skipped(name: str, why: str) -> None:
        told.append((name, why))

    shared: set[tuple[str, str]] = set()
    tools = AgentTools(CatalogOf(live), ["*"], ToolOutputStore(), on_skipped=on_skipped,
                       told=shared)
    for _ in range(3):
        assert [t.name for t in await tools.catalog()] == ["echo", "fine_too", "tool_output"]
    assert [name for name, _ in told] == ["js bad name!", "x" * 65, "9lives", "listy"]  # once each
    assert NAME_RULE in told[0][1] and "\"object\"" in told[3][1], told
    other_session = AgentTools(CatalogOf(live), ["*"], ToolOutputStore(), on_skipped=on_skipped,
                               told=shared)
    await other_session.catalog()
    assert len(told) == 4  # the agent said it once, whichever session looked
    named = AgentTools(CatalogOf(live), ["echo"], ToolOutputStore(), on_skipped=on_skipped)
    await named.catalog()
    assert len(told) == 4  # a tool the agent does not take is none of its business


def test_malformed_or_invalid_tool_meta_is_left_out_naming_why() -> None:
    def service(name: str, meta: Any) -> ServiceInfo:
        return ServiceInfo(name=name, peers=1, capacity=1, load=0, queued=0, meta=meta)

    good = _tool_info(service("tool.count", {"name": "other", "parameters": {
        "type": "object", "properties": {}}, "timeout": 5}))
    assert isinstance(good, ToolInfo) and (good.name, good.timeout) == ("count", 5.0)
    bare = _tool_info(service("tool.bare", {}))  # no meta: a tool without arguments
    assert isinstance(bare, ToolInfo) and bare.name == "bare"
    assert _tool_info(service("llm", {})) is None
    assert _tool_info(ServiceInfo(name="tool.gone", peers=0, capacity=0, load=0, queued=0)) is None
    for meta, words in [({"description": 7}, "`meta` is not a ToolInfo"),
                        ({"parameters": ["a"]}, "`meta` is not a ToolInfo"),
                        ({"parameters": None}, "`meta` is not a ToolInfo"),
                        ({"parameters": {"type": "string"}}, "JSON Schema object"),
                        ({"timeout": -1}, "timeout")]:
        why = _tool_info(service("tool.t", meta))
        assert isinstance(why, str) and words in why, (meta, why)
    assert "must match" in str(_tool_info(service("tool.a.b", {})))
