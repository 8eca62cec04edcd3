"""An idle Agent keeps no per-run cache of its history: the converted view (`LlmView`) and the
size memos (`SizeMemo`, the loop's and the tool-output cache's) speed up the turns of one run,
but a coordinator holds many idle sessions, and each memo held a reference and a size per
history message (and, after a compaction, the replaced messages) until the session's next run."""

from __future__ import annotations

import gc

import pytest

from agent_bus.agents.loop.agent import Agent
from agent_bus.agents.loop.context import LlmView, SizeMemo, default_convert_to_llm
from agent_bus.agents.loop.run import LoopConfig
from agent_bus.bus.messages import Message
from tests.agents.conftest import FakeTools, ScriptedLlm, call, reply


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _caches_holding(history: list[Message]) -> list[object]:
    """Every live LlmView or SizeMemo that still refers to a message of `history`."""
    ids = {id(m) for m in history}
    gc.collect()  # a finished run's objects may sit in reference cycles
    found: list[object] = []
    for obj in gc.get_objects():
        if isinstance(obj, LlmView):
            held = obj._source  # noqa: SLF001 - what the view keeps is the point of the test
        elif isinstance(obj, SizeMemo):
            held = obj._messages  # noqa: SLF001
        else:
            continue
        if any(id(m) in ids for m in held):
            found.append(obj)
    return found


@pytest.mark.anyio
async def test_an_idle_agent_keeps_no_view_or_size_memo_of_its_history() -> None:
    llm = ScriptedLlm(
        reply("", call("c1", "echo", text="a"), call("c2", "echo", text="b")),
        reply("", call("c3", "echo", text="c")),
        reply("done"),
    )
    agent = Agent(llm, FakeTools({"echo": lambda a, u: str(a["text"])}), LoopConfig())
    await agent.prompt("go")
    assert len(agent.state.messages) == 7  # prompt, 2 tool turns (3 results), final answer
    assert _caches_holding(agent.state.messages) == []
    # A second run starts from a cold memo and still sees the whole history.
    llm.script.append(reply("again"))
    await agent.prompt("more")
    assert llm.requests[-1].messages == default_convert_to_llm(agent.state.messages[:8])
    assert _caches_holding(agent.state.messages) == []
