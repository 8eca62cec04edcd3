"""Agent: run lifecycle, queues, abort from another task, entry-point errors, state."""

from __future__ import annotations

import uuid
from contextlib import aclosing
from typing import Any

import anyio
import pytest

from agent_bus.agents.loop.abort import Abort
from agent_bus.agents.loop.agent import Agent, AgentError
from agent_bus.agents.loop.run import LoopConfig, LoopResult
from agent_bus.bus.events import Event, event_type
from agent_bus.bus.messages import (
    AssistantDelta,
    AssistantMessage,
    LlmRequest,
    Message,
    TextPart,
    ToolResultMessage,
    Usage,
    UserMessage,
    user_text,
)
from tests.agents.conftest import FakeTools, Recorder, ScriptedLlm, call, reply
from tests.support import until

pytestmark = pytest.mark.anyio


class Gate:
    """An LLM script entry that signals `entered` and then blocks until cancelled."""

    def __init__(self) -> None:
        self.entered = anyio.Event()

    async def __call__(self, request: LlmRequest) -> AssistantMessage:
        self.entered.set()
        await anyio.sleep_forever()
        raise AssertionError("unreachable")


class StreamingGate(ScriptedLlm):
    """Streams one delta, then blocks: abort must keep the partial text."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = anyio.Event()

    async def complete(self, request: LlmRequest, on_delta: Any = None, *,
                       abort: Abort | None = None) -> AssistantMessage:
        if self.requests:
            return await super().complete(request, on_delta)
        self.requests.append(request)
        await on_delta(AssistantDelta(kind="text", delta="partial"))
        self.entered.set()
        await anyio.sleep_forever()
        raise AssertionError("unreachable")


def texts(messages: list[Message]) -> list[str]:
    return [m.content[0].text for m in messages if isinstance(m, UserMessage)]  # type: ignore[union-attr]


async def test_run_returns_final_text_and_tracks_state() -> None:
    persisted: list[str] = []
    agent = Agent(
        ScriptedLlm(reply("", call("c1", "echo"), total=5), reply("hello", total=7),
                    reply("again", total=11)),
        FakeTools({"echo": lambda a, u: "x"}),
        LoopConfig(model="m1"),
        on_message_end=lambda m: persisted.append(type(m).__name__),
    )
    seen_pending: list[set[str]] = []
    agent.subscribe(lambda e: seen_pending.append(set(agent.state.pending_tool_calls)) if event_type(e) == "tool_execution_start" else None)
    run_ids_at_start: list[str] = []
    agent.subscribe(lambda e: run_ids_at_start.append(agent.run_id) if event_type(e) == "agent_start" else None)
    with anyio.fail_after(5):
        assert await agent.run("hi") == "hello"
    assert persisted == ["UserMessage", "AssistantMessage", "ToolResultMessage", "AssistantMessage"]
    assert len(agent.state.messages) == 4 and not agent.is_running
    assert seen_pending == [{"c1"}] and agent.state.pending_tool_calls == set()
    # a fresh uuid4 per run, already set when the run's first event is emitted
    assert uuid.UUID(hex=agent.run_id).version == 4 and run_ids_at_start == [agent.run_id]
    assert [t.name for t in agent.state.tools] == ["echo"]
    # usage is summed per model over both model calls of the run (5 + 7)
    assert agent.state.usage == {"m": Usage(total=12)}
    first = agent.run_id
    assert await agent.run("more") == "again"
    assert agent.run_id != first and run_ids_at_start == [first, agent.run_id]
    assert agent.state.usage == {"m": Usage(total=23)}  # runs accumulate until reset


async def test_subscribe_awaits_listeners_in_order_and_unsubscribes() -> None:
    agent = Agent(ScriptedLlm(reply("a"), reply("b")), FakeTools())
    order: list[str] = []

    async def first(e: Event) -> None:
        await anyio.lowlevel.checkpoint()
        order.append("1:" + event_type(e))

    unsubscribe = agent.subscribe(first)
    agent.subscribe(lambda e: order.append("2:" + event_type(e)))
    await agent.run("x")
    assert order[:4] == ["1:agent_start", "2:agent_start", "1:turn_start", "2:turn_start"]
    unsubscribe()
    order.clear()
    await agent.run("y")
    assert order and all(o.startswith("2:") for o in order)


async def test_run_stream_yields_whole_run() -> None:
    agent = Agent(ScriptedLlm(reply("streamed")), FakeTools())
    with anyio.fail_after(5):
        async with aclosing(agent.run_stream("hi")) as stream:
            types = [event_type(e) async for e in stream]
    assert types[0] == "agent_start" and types[-1] == "agent_end" and "message_update" in types
    assert not agent.is_running


async def test_prompt_while_running_and_reset_while_running_are_refused() -> None:
    gate = Gate()
    agent = Agent(ScriptedLlm(gate), FakeTools())
    async with anyio.create_task_group() as tg:
        tg.start_soon(agent.prompt, "hi")
        with anyio.fail_after(5):
            await gate.entered.wait()
        with pytest.raises(AgentError, match=r"^Agent is already processing a prompt\. Use steer\(\) or follow_up\(\) to queue messages, or wait for completion\.$"):
            await agent.prompt("again")
        with pytest.raises(AgentError, match=r"^Agent is already processing\. Wait for completion before resetting\.$"):
            agent.reset()
        with pytest.raises(AgentError, match="before continuing"):
            await agent.continue_()
        assert len(agent.state.messages) == 1  # transcript not corrupted
        agent.abort()
    assert not agent.is_running


async def test_abort_during_llm_call_keeps_partial_and_agent_is_reusable() -> None:
    llm = StreamingGate()
    llm.script.append(reply("fresh"))
    agent = Agent(llm, FakeTools())
    rec = Recorder()
    agent.subscribe(rec)
    results: list[LoopResult] = []

    async def go() -> None:
        results.append(await agent.prompt("hi"))

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(go)
            await llm.entered.wait()
            agent.abort()
            await agent.wait_for_idle()
    last = agent.state.messages[-1]
    assert isinstance(last, AssistantMessage)
    assert (last.stop_reason, last.error, last.text) == ("aborted", "Operation aborted", "partial")
    assert rec.types()[-3:] == ["message_end", "turn_end", "agent_end"]
    end = rec.of("agent_end")[0]
    assert (end.stop_reason, end.error) == ("aborted", "Operation aborted")
    assert results[0].stop_reason == "aborted" and agent.state.error == "Operation aborted"
    assert await agent.run("again") == "fresh"
    assert agent.state.error is None  # cleared when a run starts


@pytest.mark.parametrize("mode", ["parallel", "sequential"])
async def test_abort_mid_tools_synthesizes_results_and_ends_aborted(mode: str) -> None:
    entered = anyio.Event()

    async def hang(args: dict[str, Any], on_update: Any) -> str:
        entered.set()
        await anyio.sleep_forever()
        return ""

    tools = FakeTools({"hang": hang, "echo": lambda a, u: "ok"})
    llm = ScriptedLlm(reply("", call("c1", "echo"), call("c2", "hang"), call("c3", "echo")))
    agent = Agent(llm, tools, LoopConfig(tool_execution=mode))  # type: ignore[arg-type]
    rec = Recorder()
    agent.subscribe(rec)
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(agent.prompt, "hi")
            await entered.wait()
            if mode == "parallel":  # c3 runs beside the hanging c2: let it finish first
                await until(lambda: len(rec.of("tool_execution_end")) == 2, 5, "c1 and c3 to end")
            agent.abort()
    ends = {e.tool_call_id: (e.result.text, e.is_error) for e in rec.of("tool_execution_end")}
    assert ends["c1"] == ("ok", False)
    assert ends["c2"] == ("Operation aborted", True)
    # sequential: c3 waits behind c2 and never runs; parallel: it ran to its end beside c2
    assert ends["c3"] == (("ok", False) if mode == "parallel" else ("Operation aborted", True))
    assert tools.executed == (["c1", "c2", "c3"] if mode == "parallel" else ["c1", "c2"])
    starts = [e.tool_call_id for e in rec.of("tool_execution_start")]
    assert sorted(starts) == ["c1", "c2", "c3"] and len(rec.of("tool_execution_end")) == 3
    results = [m.tool_call_id for m in agent.state.messages if isinstance(m, ToolResultMessage)]
    assert results == ["c1", "c2", "c3"]
    assert rec.types()[-2:] == ["turn_end", "agent_end"]
    assert rec.of("agent_end")[0].stop_reason == "aborted"
    assert agent.state.pending_tool_calls == set() and not agent.is_running


async def test_queued_messages_survive_abort() -> None:
    gate = Gate()
    agent = Agent(ScriptedLlm(gate, reply("one"), reply("two")), FakeTools())
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(agent.prompt, "hi")
            await gate.entered.wait()
            agent.steer("steer me")
            agent.follow_up("then this")
            agent.abort()
    assert agent.has_queued_messages() and len(agent.steering) == 1 and len(agent.follow_ups) == 1
    assert await agent.run("resume") == "two"
    assert texts(agent.state.messages)[-3:] == ["resume", "steer me", "then this"]


async def test_steer_from_another_task_is_injected_next_turn() -> None:
    entered, release = anyio.Event(), anyio.Event()

    async def slow(args: dict[str, Any], on_update: Any) -> str:
        entered.set()
        await release.wait()
        return "slow"

    llm = ScriptedLlm(reply("", call("c1", "slow")), reply("done"))
    agent = Agent(llm, FakeTools({"slow": slow}))
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(agent.prompt, "hi")
            await entered.wait()
            agent.steer("change of plan")
            release.set()
    assert texts(llm.requests[1].messages) == ["hi", "change of plan"]  # type: ignore[arg-type]


@pytest.mark.parametrize(("mode", "calls"), [("one-at-a-time", 3), ("all", 2)])
async def test_follow_up_queue_modes(mode: str, calls: int) -> None:
    llm = ScriptedLlm(reply("a"), reply("b"), reply("c"))
    agent = Agent(llm, FakeTools(), LoopConfig(follow_up_mode=mode))  # type: ignore[arg-type]
    agent.follow_up("f1")
    agent.follow_up("f2")
    await agent.run("hi")
    assert len(llm.requests) == calls
    assert texts(agent.state.messages) == ["hi", "f1", "f2"]


async def test_steering_all_mode_injects_everything_in_first_turn() -> None:
    llm = ScriptedLlm(reply("a"))
    agent = Agent(llm, FakeTools(), LoopConfig(steering_mode="all"))
    agent.steer("s1")
    agent.steer(user_text("s2"))
    await agent.run("hi")
    assert texts(llm.requests[0].messages) == ["hi", "s1", "s2"]  # type: ignore[arg-type]


async def test_continue_errors_and_queue_draining() -> None:
    llm = ScriptedLlm(reply("a"), reply("b"), reply("c"))
    agent = Agent(llm, FakeTools())
    with pytest.raises(AgentError, match="^No messages to continue from$"):
        await agent.continue_()
    await agent.run("hi")
    with pytest.raises(AgentError, match="^Cannot continue from message role: assistant$"):
        await agent.continue_()
    agent.steer("s1")
    agent.steer("s2")
    result = await agent.continue_()  # one-at-a-time: s1 as the prompt, s2 from the loop's poll
    assert result.final_text == "c" and len(llm.requests) == 3
    roles = [type(m).__name__ for m in agent.state.messages]
    assert roles == ["UserMessage", "AssistantMessage", "UserMessage", "AssistantMessage", "UserMessage", "AssistantMessage"]


async def test_continue_from_user_tail_and_from_follow_up() -> None:
    llm = ScriptedLlm(reply("a"), reply("b"))
    agent = Agent(llm, FakeTools(), messages=[user_text("pending question")])
    assert (await agent.continue_()).final_text == "a"
    agent.follow_up("f")
    assert (await agent.continue_()).final_text == "b"
    assert texts(agent.state.messages) == ["pending question", "f"]


async def test_failed_run_sets_error_and_agent_stays_usable() -> None:
    agent = Agent(ScriptedLlm(RuntimeError("provider exploded"), reply("recovered")), FakeTools())
    result = await agent.prompt("hi")
    assert (result.stop_reason, agent.state.error) == ("error", "provider exploded")
    assert await agent.run("again") == "recovered"
    assert agent.state.error is None


async def test_reset_clears_conversation() -> None:
    agent = Agent(ScriptedLlm(reply("a")), FakeTools())
    await agent.run("hi")
    agent.follow_up("later")
    agent.reset()
    assert (agent.state.messages, agent.has_queued_messages(), agent.state.usage) == ([], False, {})


async def test_context_left_percent_from_last_reply() -> None:
    agent = Agent(ScriptedLlm(reply("a", total=32_000)), FakeTools(), LoopConfig(compaction=None))
    assert agent.context_left_percent() is None
    await agent.run("hi")
    assert agent.context_left_percent() == 75


async def test_prompt_accepts_message_lists() -> None:
    llm = ScriptedLlm(reply("ok"))
    agent = Agent(llm, FakeTools())
    await agent.prompt([user_text("a"), UserMessage(content=[TextPart("b")])])
    assert texts(agent.state.messages) == ["a", "b"]
