"""An Agent keeps the tool-output store it is given, even an empty one: the coordinator serves
`tool_output` from that store and persists it, so a cut output's ref must land there."""

from __future__ import annotations

import re

import pytest

from agent_bus.agents.loop.agent import Agent
from agent_bus.agents.loop.context import ToolOutputStore
from agent_bus.agents.loop.run import LoopConfig
from tests.agents.conftest import FakeTools, ScriptedLlm, call, reply


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_a_cut_output_is_kept_in_the_store_given_even_when_it_was_empty() -> None:
    store = ToolOutputStore()  # empty, so falsy (`__len__`): must still be the one used
    llm = ScriptedLlm(reply("", call("c1", "dump")), reply("done"))
    agent = Agent(llm, FakeTools({"dump": lambda a, u: "z" * 60_000}), LoopConfig(),
                  output_store=store)
    await agent.prompt("go")
    assert agent.output_store is store
    cut = llm.requests[1].messages[-1].text  # type: ignore[union-attr]
    ref = re.search(r"ref=([0-9a-f]+)", cut)[1]  # type: ignore[index]
    assert store.get(ref) == "z" * 60_000
