"""The guards a weak model needs: the repeat guard (same call N times in a row) and per-run turn bounds."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from agent_bus.agents.loop.agent import Agent
from agent_bus.agents.loop.run import REPEAT_STOP_TEXT, LoopConfig, LoopResult, run_loop
from agent_bus.bus.messages import ToolResultMessage, user_text
from tests.agents.conftest import FakeTools, Recorder, ScriptedLlm, call, reply

pytestmark = pytest.mark.anyio


def fetch(args: dict[str, Any], on_update: Any) -> str:
    return f"404 for {args['url']}"


async def run(llm: ScriptedLlm, config: LoopConfig) -> tuple[LoopResult, Recorder, FakeTools]:
    rec, tools = Recorder(), FakeTools({"fetch_url": fetch, "other": fetch})
    with anyio.fail_after(5):
        result = await run_loop([user_text("go")], [], config, llm, tools, rec)
    return result, rec, tools


def results(rec: Recorder) -> list[str]:
    return [e.message.text for e in rec.of("message_end") if isinstance(e.message, ToolResultMessage)]


def same_call(i: int, url: str = "http://x/a") -> Any:
    # the model writes its arguments differently each time: key order must not hide a repeat
    raw = f'{{"url": "{url}", "n": 1}}' if i % 2 else f'{{"n": 1, "url": "{url}"}}'
    return reply("", call(f"c{i}", "fetch_url", raw=raw))


async def test_third_identical_call_is_told_and_sixth_stops_the_run_with_error() -> None:
    llm = ScriptedLlm(*[same_call(i) for i in range(1, 8)])
    result, rec, tools = await run(llm, LoopConfig())
    texts = results(rec)
    assert len(texts) == 6 and len(llm.requests) == 6  # no seventh model call
    assert all("same arguments" not in t for t in texts[:2])
    assert "call 3 in a row of `fetch_url`" in texts[2] and texts[2].startswith("404 for http://x/a")
    assert "call 5 in a row" in texts[4]
    assert tools.executed == ["c1", "c2", "c3", "c4", "c5"]  # the sixth is not run
    stop = REPEAT_STOP_TEXT.format(name="fetch_url", count=6, limit=3)
    assert texts[5] == stop
    assert (result.stop_reason, result.error) == ("error", stop)
    assert rec.of("agent_end")[0].stop_reason == "error"


async def test_a_different_call_in_between_resets_the_count() -> None:
    script = [same_call(1), same_call(2), reply("", call("o", "other", url="y")), same_call(3),
              same_call(4), reply("done")]
    result, rec, _ = await run(ScriptedLlm(*script), LoopConfig())
    assert result.stop_reason == "stop"
    assert all("in a row" not in t for t in results(rec))


async def test_identical_calls_in_one_turn_count_and_the_limit_is_per_agent() -> None:
    batch = reply("", *[call(f"p{i}", "fetch_url", url="u") for i in range(4)])
    result, rec, _ = await run(ScriptedLlm(batch), LoopConfig(repeat_limit=2))
    texts = results(rec)
    assert "in a row" not in texts[0] and "call 2 in a row" in texts[1] and "call 3" in texts[2]
    assert texts[3] == REPEAT_STOP_TEXT.format(name="fetch_url", count=4, limit=2)
    assert result.stop_reason == "error"


async def test_repeat_limit_zero_turns_the_guard_off() -> None:
    llm = ScriptedLlm(*[same_call(i) for i in range(1, 8)], reply("fine"))
    result, rec, _ = await run(llm, LoopConfig(repeat_limit=0))
    assert result.stop_reason == "stop" and all("in a row" not in t for t in results(rec))


async def test_max_turns_bounds_one_run_only() -> None:
    script = [reply("", call(f"c{i}", "other", url=str(i))) for i in range(2)]
    llm = ScriptedLlm(*script, reply("summary"), reply("", call("d", "other", url="d")), reply("ok"))
    agent = Agent(llm, FakeTools({"other": fetch}), LoopConfig(max_iterations=50))
    with anyio.fail_after(5):
        first = await agent.prompt("go", max_turns=2)
        second = await agent.prompt("again")
    assert first.stop_reason == "max_iterations" and first.final_text.endswith("summary")
    assert second.stop_reason == "stop" and second.final_text == "ok"
