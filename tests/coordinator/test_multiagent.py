"""Agents talking to agents through real processes: agent as a tool, abort propagation, call
cycles, and topics (issue 7, acceptance 1 and 2).

Two coordinators share one hub, so every agent-to-agent call and every topic message crosses
processes: `coord1` hosts boss, ping, t1, t2; `coord2` hosts helper, pong, t3.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager

import anyio
import pytest

from agent_bus.agents import commands as cmd
from agent_bus.agents.client.remote import connect
from agent_bus.agents.coordinator.multiagent import CALL_CYCLE, CALL_DEPTH, call_problem, publish_topic
from agent_bus.agents.gateway.fakellm import load_script
from agent_bus.bus import events as ev
from agent_bus.bus.client import Envelope, Peer
from agent_bus.bus.client import connect as connect_peer
from agent_bus.bus.errors import RemoteError
from agent_bus.bus.messages import UserMessage
from agent_bus.bus.watch import replay
from tests.coordinator.conftest import Stack, calls, start_stack, text
from tests.support import until

pytestmark = pytest.mark.anyio

MULTI_AGENTS = """
[[agents]]
name = "boss"
model = "x"
tools = []
agents = ["helper"]
system_prompt = "You are the boss. Delegate questions."

[[agents]]
name = "helper"
model = "x"
tools = []
system_prompt = "Helper: answers questions about fruit.\\nBe brief."

[[agents]]
name = "ping"
model = "x"
tools = []
agents = ["pong"]

[[agents]]
name = "pong"
model = "x"
tools = []
agents = ["ping"]

[[agents]]
name = "t1"
model = "x"
tools = ["publish"]
subscribe = [{ topic = "news" }]

[[agents]]
name = "t2"
model = "x"
tools = []
subscribe = [{ topic = "news" }]

[[agents]]
name = "t3"
model = "x"
tools = []
subscribe = [{ topic = "news", mode = "steer" }, { topic = "other" }]
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(tmp_path_factory.mktemp("multi"), worker=False,
                    coordinator=("boss", "ping", "t1", "t2"), agents=MULTI_AGENTS)
    try:
        s.coordinator("helper", "pong", "t3", name="coord2", state="agents2")
        yield s
    finally:
        s.close()


@asynccontextmanager
async def client(stack: Stack) -> AsyncIterator[Peer]:
    async with connect_peer(stack.endpoint, name="test-multi") as peer:
        yield peer


async def logged(peer: Peer, since: int = 0) -> list[Envelope]:
    """Every logged event after `since` (headers included: `parent` is not in `--json`)."""
    return [e async for e in replay(peer, since, [])]


async def wait_events(peer: Peer, since: int, done: Callable[[list[Envelope]], bool],
                      timeout: float = 10.0) -> list[Envelope]:
    """Events after `since`, live, until `done(events)`."""
    seen: list[Envelope] = []
    with anyio.fail_after(timeout):
        async with peer.subscribe([], since=since) as sub:
            async for envelope in sub:
                seen.append(envelope)
                if done(seen):
                    return seen
    raise AssertionError("the event stream ended")


def user_texts(events: list[Envelope], agent: str) -> list[str]:
    return [e.event.message.content[0].text for e in events  # type: ignore[union-attr]
            if isinstance(e.event, ev.MessageStart) and e.header.agent == agent
            and isinstance(e.event.message, UserMessage)]


def ended_with(events: list[Envelope], agent: str, needle: str) -> bool:
    """`agent` ended a run whose prompt or follow-ups contained `needle`."""
    runs = {e.header.run for e in events if e.header.agent == agent
            and isinstance(e.event, ev.MessageStart) and isinstance(e.event.message, UserMessage)
            and needle in e.event.message.content[0].text}  # type: ignore[union-attr]
    return any(isinstance(e.event, ev.AgentEnd) and e.header.run in runs for e in events)


# --- agent as a tool -------------------------------------------------------------------------


async def test_agent_as_tool_end_to_end(stack: Stack) -> None:
    stack.script([
        calls(("ask_helper", {"prompt": "What colour is a banana?"})),   # boss
        text("Bananas are yellow."),                                      # helper
        text("The helper says bananas are yellow."),                      # boss
    ])
    async with client(stack) as peer:
        since = (await peer.status()).seq
        async with connect(stack.endpoint, name="test-boss") as bus:
            run = await bus.prompt("boss", "ask the helper about bananas", new_session=True,
                                   experiment="exp-ma")
            result = await run.result()
        assert (result.stop_reason, result.final_text) == (
            "stop", "The helper says bananas are yellow.")
        events = await logged(peer, since)

    boss = [e for e in events if e.header.run == run.run_id]
    end = next(e.event for e in boss if isinstance(e.event, ev.ToolExecutionEnd))
    assert end.tool_name == "ask_helper" and not end.is_error
    assert end.result.content[0].text == "Bananas are yellow."  # type: ignore[union-attr]
    helper_run = end.result.details["run_id"]
    details = dict(end.result.details)  # type: ignore[union-attr]
    assert details.pop("session").startswith("coord2.")  # a fresh session of the callee's host
    assert details == {"agent": "helper", "run_id": helper_run, "stop_reason": "stop"}

    helper = [e for e in events if e.header.run == helper_run]
    assert helper and all(e.header.agent == "helper" for e in helper)
    start = helper[0].event
    assert isinstance(start, ev.AgentStart) and start.parent_run_id == run.run_id
    # every event the helper's coordinator publishes carries the caller's run as `parent`
    # (the gateway's message_update events do not: LlmRequest has no parent)
    assert all(e.header.parent == run.run_id for e in helper
               if not isinstance(e.event, ev.MessageUpdate))
    assert all(e.header.experiment == "exp-ma" for e in boss + helper)  # inherited
    assert isinstance(helper[-1].event, ev.AgentEnd)
    assert helper[-1].event.final_text == "Bananas are yellow."
    # the callee ran inside the caller's tool call, in seq order
    seqs = {id(e): e.header.seq for e in events}
    tool_start = next(e for e in boss if isinstance(e.event, ev.ToolExecutionStart))
    tool_end = next(e for e in boss if isinstance(e.event, ev.ToolExecutionEnd))
    assert seqs[id(tool_start)] < helper[0].header.seq < helper[-1].header.seq < seqs[id(tool_end)]

    # the boss was offered the helper (described by its system prompt), publish and tool_output
    tools = {t["function"]["name"]: t["function"] for t in stack.srv.requests[0].body["tools"]}
    assert sorted(tools) == ["ask_helper", "publish", "tool_output"]
    assert "Helper: answers questions about fruit." in tools["ask_helper"]["description"]
    assert tools["ask_helper"]["parameters"]["required"] == ["prompt"]
    # the helper got the prompt as its user message
    assert stack.srv.requests[1].body["messages"][-1]["content"] in (
        "What colour is a banana?", [{"type": "text", "text": "What colour is a banana?"}])


async def test_aborting_the_caller_aborts_the_callee(stack: Stack) -> None:
    stack.script([
        calls(("ask_helper", {"prompt": "take your time"})),             # boss
        {"reply": {"text": "never sent"}, "delay": 30},                  # helper: stuck
    ])
    async with client(stack) as peer:
        since = (await peer.status()).seq
        async with connect(stack.endpoint, name="test-abort") as bus:
            run = await bus.prompt("boss", "delegate something slow")

            def helper_started(seen: list[Envelope]) -> bool:
                return any(isinstance(e.event, ev.AgentStart) and e.header.agent == "helper"
                           for e in seen)

            await wait_events(peer, since, helper_started)
            await until(lambda: len(stack.srv.requests) == 2, 10, "the helper's model request")
            t0 = time.monotonic()
            await bus.abort("boss")
            result = await run.result()
        assert result.stop_reason == "aborted"

        def helper_ended(seen: list[Envelope]) -> bool:
            return any(isinstance(e.event, ev.AgentEnd) and e.header.agent == "helper"
                       for e in seen)

        events = await wait_events(peer, since, helper_ended, timeout=5)
        assert time.monotonic() - t0 < 3
    helper_end = next(e for e in events
                      if isinstance(e.event, ev.AgentEnd) and e.header.agent == "helper")
    assert helper_end.event.stop_reason == "aborted"  # type: ignore[union-attr]
    assert helper_end.header.parent == run.run_id
    async with connect(stack.endpoint, name="test-abort-2") as bus:
        assert not (await bus.state("helper")).is_running


async def test_call_cycle_fails_fast(stack: Stack) -> None:
    stack.script([
        calls(("ask_pong", {"prompt": "ask ping back"})),                # ping
        calls(("ask_ping", {"prompt": "hello again, ping"})),            # pong
        text("pong could not ask ping"),                                 # pong
        text("ping done"),                                               # ping
    ])
    async with client(stack) as peer:
        since = (await peer.status()).seq
        t0 = time.monotonic()
        with anyio.fail_after(10):
            async with connect(stack.endpoint, name="test-cycle") as bus:
                result = await bus.run("ping", "start the cycle", new_session=True)
        assert time.monotonic() - t0 < 5
        assert (result.stop_reason, result.final_text) == ("stop", "ping done")
        events = await logged(peer, since)
    pong_end = next(e for e in events if e.header.agent == "pong"
                    and isinstance(e.event, ev.ToolExecutionEnd))
    assert pong_end.event.tool_name == "ask_ping" and pong_end.event.is_error
    message = pong_end.event.result.content[0].text  # type: ignore[union-attr]
    assert "Call cycle: ping -> pong -> ping" in message
    assert pong_end.event.duration < 1.0
    # ping never started a second run
    assert sum(isinstance(e.event, ev.AgentStart) and e.header.agent == "ping"
               for e in events) == 1
    ping_tool = next(e.event for e in events if e.header.agent == "ping"
                     and isinstance(e.event, ev.ToolExecutionEnd))
    assert not ping_tool.is_error
    assert ping_tool.result.content[0].text == "pong could not ask ping"  # type: ignore[union-attr]


async def test_coordinator_refuses_cycles_and_depth() -> None:
    assert call_problem(["a", "b"], "a") is not None and call_problem(["a", "b"], "c") is None
    code, depth_text = call_problem(["a", "b", "c", "d", "e"], "f") or ("", "")
    assert code == CALL_DEPTH and "depth limit (4)" in depth_text
    assert call_problem(["a", "b", "c", "d"], "e") is None  # a -> b -> c -> d -> e: depth 4


async def test_coordinator_checks_the_chain_of_a_prompt(stack: Stack) -> None:
    async with client(stack) as peer:
        t0 = time.monotonic()
        with pytest.raises(RemoteError) as cycle:
            await peer.request("agent.helper", cmd.encode(cmd.Prompt(
                text="x", call_chain=["boss", "helper", "pong"])))
        assert cycle.value.code == CALL_CYCLE and "boss -> helper -> pong -> helper" in str(
            cycle.value)
        with pytest.raises(RemoteError) as deep:
            await peer.request("agent.helper", cmd.encode(cmd.Prompt(
                text="x", call_chain=["a", "b", "c", "d", "e"])))
        assert deep.value.code == CALL_DEPTH and "(4)" in str(deep.value)
        assert time.monotonic() - t0 < 1


# --- topics ----------------------------------------------------------------------------------


async def publish_and_wait(peer: Peer, text_: str, agents: tuple[str, ...],
                           sender: str = "tester", experiment: str = "") -> list[Envelope]:
    since = (await peer.status()).seq
    async with peer.subscribe([], since=since) as sub:
        await publish_topic(peer, "news", text_, sender, experiment=experiment)
        seen: list[Envelope] = []
        with anyio.fail_after(10):
            async for envelope in sub:
                seen.append(envelope)
                if all(ended_with(seen, a, text_) for a in agents):
                    return seen
    raise AssertionError("the event stream ended")


async def test_topic_reaches_each_subscriber_exactly_once(stack: Stack) -> None:
    stack.script([])  # every agent echoes its prompt
    async with client(stack) as peer:
        since = (await peer.status()).seq
        await publish_and_wait(peer, "BREAKING-42", ("t1", "t2", "t3"), experiment="exp-topic")
        # a second message is a barrier: a duplicate of the first would have come before it
        await publish_and_wait(peer, "BARRIER-7", ("t1", "t2", "t3"))
        events = await logged(peer, since)
    for agent in ("t1", "t2", "t3"):
        got = [t for t in user_texts(events, agent) if "BREAKING-42" in t]
        assert got == ["[news] tester: BREAKING-42"], agent
        runs = {e.header.run for e in events if e.header.agent == agent
                and isinstance(e.event, ev.MessageStart) and "BREAKING-42" in str(e.event)}
        assert len(runs) == 1
        assert all(e.header.experiment == "exp-topic" for e in events if e.header.run in runs)
    topic_events = [e for e in events if isinstance(e.event, ev.TopicMessage)]
    assert [(e.event.topic, e.event.text, e.event.sender, e.header.agent)  # type: ignore[union-attr]
            for e in topic_events] == [("news", "BREAKING-42", "tester", "tester"),
                                       ("news", "BARRIER-7", "tester", "tester")]
    assert topic_events[0].header.experiment == "exp-topic"
    # and `busctl watch` shows it
    shown = await stack.watch_all("--type", "topic_message", "--since", str(since))
    assert [(e["topic"], e["text"], e["agent"]) for e in shown] == [
        ("news", "BREAKING-42", "tester"), ("news", "BARRIER-7", "tester")]


async def test_publish_tool_skips_the_sender_and_queues_for_a_busy_agent(stack: Stack) -> None:
    # t2 is busy (its model reply is slow) when t1 publishes: t2 gets it as a follow-up in the
    # same run; t3 (idle) gets a run of its own; t1 does not receive its own message.
    stack.srv.set_script(load_script({
        "steps": [{"reply": {"text": "t2 slow answer"}, "delay": 1.0}],
        "rules": [
            {"contains": ["please publish"], "reply": {"tool_calls": [
                {"name": "publish", "arguments": {"topic": "news", "text": "FROM-T1-9"}}]}},
            {"contains": [], "tool_result": True, "reply": {"text": "published it"}},
        ],
        "echo": True,
    }), clear_requests=True)
    async with client(stack) as peer, connect(stack.endpoint, name="test-pub") as bus:
        since = (await peer.status()).seq
        busy = await bus.prompt("t2", "think slowly", new_session=True)
        await until(lambda: len(stack.srv.requests) == 1, 10, "t2's model request")
        published = await bus.run("t1", "please publish", new_session=True)
        assert published.final_text == "published it"
        busy_result = await busy.result()
        assert busy_result.final_text == "echo: [news] t1: FROM-T1-9"  # the follow-up's reply
        events = await publish_and_wait(peer, "BARRIER-8", ("t1", "t2", "t3"))
        events = await logged(peer, since)
    assert user_texts(events, "t2")[:2] == ["think slowly", "[news] t1: FROM-T1-9"]
    assert len({e.header.run for e in events if e.header.agent == "t2"
                and isinstance(e.event, ev.MessageStart)
                and "FROM-T1-9" in str(e.event)}) == 1
    assert "[news] t1: FROM-T1-9" in user_texts(events, "t3")
    assert not any("FROM-T1-9" in t for t in user_texts(events, "t1")[1:])
    message = next(e for e in events if isinstance(e.event, ev.TopicMessage))
    assert (message.header.agent, message.header.run) == ("t1", published.run_id)


async def test_parallel_asks_of_one_agent_take_turns(stack: Stack) -> None:
    # Two calls to the same callee in one turn: the second finds it busy and waits its turn.
    stack.script([
        calls(("ask_helper", {"prompt": "first question"}),
              ("ask_helper", {"prompt": "second question"})),             # boss
        text("answer one"),                                               # helper, run 1
        text("answer two"),                                               # helper, run 2
        text("both answered"),                                            # boss
    ])
    async with client(stack) as peer:
        since = (await peer.status()).seq
        with anyio.fail_after(10):
            async with connect(stack.endpoint, name="test-turns") as bus:
                result = await bus.run("boss", "ask twice", new_session=True)
        assert result.final_text == "both answered"
        events = await logged(peer, since)
    ends = [e.event for e in events if e.header.agent == "boss"
            and isinstance(e.event, ev.ToolExecutionEnd)]
    assert sorted(e.result.content[0].text for e in ends) == ["answer one", "answer two"]
    assert not any(e.is_error for e in ends)
    helper_runs = [e.header.run for e in events if e.header.agent == "helper"
                   and isinstance(e.event, ev.AgentStart)]
    assert len(helper_runs) == 2 and {e.result.details["run_id"] for e in ends} == set(helper_runs)
