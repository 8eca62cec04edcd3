"""The agent loop through real processes: hub, gateway -> FakeLLMServer, tool worker, coordinator.

Events are checked as `busctl watch --json --since 0 --no-follow --run RUN` prints them from the
hub's log (global seq order across the coordinator, gateway and worker).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agent_bus.agents.client.remote import connect
from agent_bus.agents.loop.agent import PROMPT_BUSY, RESET_BUSY
from agent_bus.agents.loop.run import ABORTED_TEXT
from agent_bus.bus.errors import RemoteError
from tests.coordinator.conftest import Stack, calls, collapse, role, text, types
from tests.support import until

pytestmark = pytest.mark.anyio


async def run_prompt(stack: Stack, agent: str, prompt: str, **kwargs: Any) -> tuple[str, Any]:
    async with connect(stack.endpoint, name="test-client") as bus:
        run = await bus.prompt(agent, prompt, **kwargs)
        result = await run.result()
    return run.run_id, result


def tool_events(events: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(type, call id or role) for the tool phase: starts, ends and tool-result messages."""
    out = []
    for e in events:
        if e["type"] in ("tool_execution_start", "tool_execution_end"):
            out.append((e["type"], e["tool_call_id"]))
        elif e["type"] in ("message_start", "message_end") and role(e) == "tool_result":
            out.append((e["type"], e["message"]["tool_call_id"]))
    return out


async def test_prompt_without_tools_event_order(stack: Stack) -> None:
    stack.script([text("Hello there, human friend.")])
    run_id, result = await run_prompt(stack, "a", "hi", new_session=True, experiment="exp-1")
    assert result.stop_reason == "stop"
    assert result.final_text == "Hello there, human friend."
    assert result.run_id == run_id and result.agent == "a"

    events = await stack.watch(run_id)
    assert collapse(types(events)) == [
        "agent_start", "turn_start", "message_start", "message_end", "message_start",
        "message_update+", "message_end", "turn_end", "agent_end",
    ]
    assert [role(e) for e in events if e["type"] == "message_start"] == ["user", "assistant"]
    assert all(e["agent"] == "a" and e["run_id"] == run_id for e in events)
    assert all(e.get("experiment") == "exp-1" for e in events)
    streamed = "".join(e["delta"]["delta"] for e in events if e["type"] == "message_update")
    assert streamed == "Hello there, human friend."
    assert [e["seq"] for e in events] == sorted(e["seq"] for e in events)
    turn_end = next(e for e in events if e["type"] == "turn_end")
    assert turn_end.get("tool_results", []) == []
    end = events[-1]
    assert end["final_text"] == "Hello there, human friend."
    assert end.get("stop_reason", "stop") == "stop"  # omitted when it is the default
    assert sum(u["total"] for u in end["usage"].values()) > 0
    # the model saw the system prompt and the user text through the gateway
    body = stack.srv.requests[0].body
    assert body["messages"][-1]["content"] in ("hi", [{"type": "text", "text": "hi"}])


async def test_tool_calls_then_next_turn(stack: Stack) -> None:
    stack.script([
        calls(("echo", {"text": "one"}), ("echo", {"text": "two"})),
        text("All echoed."),
    ])
    run_id, result = await run_prompt(stack, "a", "echo twice", new_session=True)
    assert (result.stop_reason, result.final_text) == ("stop", "All echoed.")
    events = await stack.watch(run_id)
    names = collapse(types(events))
    assert names == [
        "agent_start", "turn_start", "message_start", "message_end",
        "message_start", "message_update+", "message_end",
        "tool_execution_start", "tool_execution_start",
        names[9], names[10],  # the two ends, in completion order
        "message_start", "message_end", "message_start", "message_end",
        "turn_end",
        "turn_start", "message_start", "message_update+", "message_end", "turn_end",
        "agent_end",
    ]
    assert set(names[9:11]) == {"tool_execution_end"}
    starts = [e for e in events if e["type"] == "tool_execution_start"]
    assert [(s["tool_name"], s["args"]) for s in starts] == [
        ("echo", {"text": "one"}), ("echo", {"text": "two"})]
    ends = {e["tool_call_id"]: e for e in events if e["type"] == "tool_execution_end"}
    assert ends["call_0_echo"]["result"]["content"][0]["text"] == "one"
    assert not ends["call_0_echo"].get("is_error", False) and ends["call_0_echo"]["duration"] >= 0
    results = [e["message"] for e in events
               if e["type"] == "message_end" and role(e) == "tool_result"]
    assert [m["tool_call_id"] for m in results] == ["call_0_echo", "call_1_echo"]
    first_turn_end = next(e for e in events if e["type"] == "turn_end")
    assert [r["tool_call_id"] for r in first_turn_end["tool_results"]] == [
        "call_0_echo", "call_1_echo"]
    # the second model request carried the tool results
    second = stack.srv.requests[1].body["messages"]
    assert [m["content"] for m in second if m["role"] == "tool"] == ["one", "two"]


async def test_parallel_slow_tools_end_in_completion_order(stack: Stack) -> None:
    stack.script([
        calls(("slow", {"label": "A", "seconds": 0.6}), ("slow", {"label": "B", "seconds": 0.05}),
              ("slow", {"label": "C", "seconds": 0.3})),
        text("done"),
    ])
    run_id, result = await run_prompt(stack, "a", "go slow", new_session=True)
    assert result.final_text == "done"
    phase = tool_events(await stack.watch(run_id))
    assert phase == [
        ("tool_execution_start", "call_0_slow"),
        ("tool_execution_start", "call_1_slow"),
        ("tool_execution_start", "call_2_slow"),
        ("tool_execution_end", "call_1_slow"),
        ("tool_execution_end", "call_2_slow"),
        ("tool_execution_end", "call_0_slow"),
        ("message_start", "call_0_slow"), ("message_end", "call_0_slow"),
        ("message_start", "call_1_slow"), ("message_end", "call_1_slow"),
        ("message_start", "call_2_slow"), ("message_end", "call_2_slow"),
    ]


async def test_sequential_agent_runs_one_call_at_a_time(stack: Stack) -> None:
    stack.script([
        calls(("slow", {"label": "A", "seconds": 0.2}), ("slow", {"label": "B", "seconds": 0.01})),
        text("done in order"),
    ])
    run_id, result = await run_prompt(stack, "s", "go in order", new_session=True)
    assert result.final_text == "done in order"
    events = await stack.watch(run_id)
    assert tool_events(events) == [
        ("tool_execution_start", "call_0_slow"), ("tool_execution_end", "call_0_slow"),
        ("message_start", "call_0_slow"), ("message_end", "call_0_slow"),
        ("tool_execution_start", "call_1_slow"), ("tool_execution_end", "call_1_slow"),
        ("message_start", "call_1_slow"), ("message_end", "call_1_slow"),
    ]
    # agent "s" is offered only its listed tools (plus the built-in tool_output)
    offered = sorted(t["function"]["name"] for t in stack.srv.requests[0].body["tools"])
    assert offered == ["echo", "slow", "tool_output"]


async def test_steering_during_a_tool_is_injected_next_turn(stack: Stack, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    stack.script([
        calls(("gate", {"path": str(gate)}), ("echo", {"text": "also this"})),
        text("steered reply"),
    ])
    async with connect(stack.endpoint, name="test-steer") as bus:
        run = await bus.prompt("a", "wait at the gate", new_session=True)
        await until(Path(str(gate) + ".started").exists, 10, "the gate tool to start")
        await bus.steer("a", "please also say hi")
        gate.write_text("open")
        result = await run.result()
    assert result.final_text == "steered reply"
    events = await stack.watch(run.run_id)
    names = types(events)
    # nothing in the batch was skipped: both calls ended without error
    ends = [e for e in events if e["type"] == "tool_execution_end"]
    assert sorted(e["tool_call_id"] for e in ends) == ["call_0_gate", "call_1_echo"]
    assert not any(e.get("is_error", False) for e in ends)
    # the steering message opens turn 2, right after turn_start
    second = names.index("turn_start", names.index("turn_end"))
    assert names[second + 1: second + 3] == ["message_start", "message_end"]
    steered = events[second + 2]["message"]
    assert steered["role"] == "user" and steered["content"][0]["text"] == "please also say hi"
    # and the model saw it after the tool results
    last = stack.srv.requests[1].body["messages"]
    assert [m["role"] for m in last[-3:]] == ["tool", "tool", "user"]


async def test_done_tool_ends_the_run(stack: Stack) -> None:
    stack.script([
        calls(("finish", {"message": "The answer is 42."}), text="Finishing now."),
        text("this reply must not be requested"),
    ])
    run_id, result = await run_prompt(stack, "a", "finish up", new_session=True)
    assert (result.stop_reason, result.final_text) == ("done", "The answer is 42.")
    assert len(stack.srv.requests) == 1
    events = await stack.watch(run_id)
    tool_msgs = [e["message"] for e in events if e["type"] == "message_end" and role(e) == "tool_result"]
    assert [m["content"][0]["text"] for m in tool_msgs] == ["Task complete"]
    assert types(events)[-2:] == ["turn_end", "agent_end"]
    assert events[-1]["final_text"] == "The answer is 42."


async def test_abort_mid_tool_cancels_it_on_the_worker(stack: Stack, tmp_path: Path) -> None:
    marker = tmp_path / "cancelled"
    stack.script([calls(("wait_cancel", {"marker": str(marker)})), text("after abort")])
    async with connect(stack.endpoint, name="test-abort") as bus:
        run = await bus.prompt("a", "block", new_session=True)
        await until(Path(str(marker) + ".started").exists, 10, "the tool to start")
        state = await bus.state("a")
        assert state.is_running and state.pending_tool_calls == ["call_0_wait_cancel"]
        await bus.abort("a")
        result = await run.result()
        assert result.stop_reason == "aborted" and result.error == ABORTED_TEXT
        # the tool creates the file, then writes it: wait for the content, not the name
        await until(lambda: marker.exists() and marker.read_text() == "cancelled", 5,
                    "the worker's side of the cancellation to fire")
        state = await bus.state("a")
        assert not state.is_running and state.pending_tool_calls == []

        events = await stack.watch(run.run_id)
        assert types(events)[-2:] == ["turn_end", "agent_end"]
        assert events[-1].get("stop_reason") == "aborted"
        end = next(e for e in events if e["type"] == "tool_execution_end")
        assert end.get("is_error", False) and end["result"]["content"][0]["text"] == ABORTED_TEXT

        stack.script([text("back again")])
        again = await (await bus.prompt("a", "still there?")).result()
        assert (again.stop_reason, again.final_text) == ("stop", "back again")


async def test_busy_state_and_reset(stack: Stack, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    stack.script([calls(("gate", {"path": str(gate)})), text("gated")])
    async with connect(stack.endpoint, name="test-busy") as bus:
        run = await bus.prompt("a", "hold")
        # one run per session: a second prompt to the same session is refused, not queued
        with pytest.raises(RemoteError) as busy:
            await bus.prompt("a", "second prompt", session=run.session)
        assert str(busy.value).startswith(PROMPT_BUSY) and busy.value.code == "agent_busy"
        assert run.session in str(busy.value)
        with pytest.raises(RemoteError) as refused:
            await bus.reset("a", session=run.session)
        assert str(refused.value).startswith(RESET_BUSY)
        gate.write_text("open")
        assert (await run.result()).final_text == "gated"
        state = await bus.state("a")
        assert state.message_count == 4 and state.session  # user, assistant, tool result, assistant
        await bus.reset("a")
        assert (await bus.state("a")).message_count == 0


async def test_hook_from_dotted_path_and_spec_experiment(stack: Stack) -> None:
    stack.script([calls(("echo", {"text": "HELLO"}), ("echo", {"text": "quiet"})), text("ok")])
    run_id, result = await run_prompt(stack, "h", "echo both", new_session=True)
    assert result.final_text == "ok"
    events = await stack.watch(run_id)
    ends = {e["tool_call_id"]: e for e in events if e["type"] == "tool_execution_end"}
    assert ends["call_0_echo"].get("is_error") is True
    assert ends["call_0_echo"]["result"]["content"][0]["text"] == "Blocked: 'HELLO' is shouting"
    assert ends["call_1_echo"]["result"]["content"][0]["text"] == "quiet"
    # no experiment on the prompt: the agent spec's experiment tags every event
    assert {e.get("experiment") for e in events} == {"spec-exp"}


def test_busctl_run_json(stack: Stack) -> None:
    import json
    import subprocess

    from tests.support import busctl

    stack.script([calls(("echo", {"text": "via cli"})), text("cli done")])
    out = subprocess.run(busctl("run", "--hub", stack.endpoint, "--agent", "a", "--json",
                                "--new-session", "use echo"),
                         capture_output=True, text=True, timeout=20)
    assert out.returncode == 0, out.stderr
    events = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert events[0]["type"] == "agent_start" and events[-1]["type"] == "agent_end"
    assert events[-1]["final_text"] == "cli done"
    assert "tool_execution_end" in types(events)
