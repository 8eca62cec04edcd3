"""Load: many agents on one coordinator, each running turns of parallel tool calls against a
zero-latency scripted model, over several tool workers (issue 8, point 5).

All real processes: hub, gateway (-> an in-test FakeLLMServer), N workers, one coordinator
hosting every agent. Each agent's run: `turns` turns of 4 parallel `step` calls, then one turn
answering with text. The fake model's rules key on the trailing tool results (`done-<turn>`),
so one rule set drives every agent in lock-step without per-agent steps.

Checks: every run finishes (stop, no error); no event lost: per run exactly the events the run
implies (agent_start .. agent_end, turn numbers contiguous 1..turns+1, one start/end per tool
call, one message_start/end per message, the same number of streamed deltas for every run), the
hub's log has contiguous seqs, and the total count of run events equals the sum the runs imply.
Reports p50/p99 tool-call latency (coordinator-measured `duration`, and hub-stamped
tool_execution_start -> end).

The default (CI) size is 40 agents x 3 tool turns x 4 calls over 4 workers; the issue's full
size (200 x 5 x 4 over 8 workers) is marked slow: `pytest -m slow tests/load`.
"""

from __future__ import annotations

import collections
import statistics
import time
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from agent_bus.agents import commands as cmd
from agent_bus.agents.gateway.fakellm import load_script
from agent_bus.bus import events as ev
from agent_bus.bus import protocol as p
from agent_bus.bus.client import connect
from agent_bus.bus.messages import AssistantMessage, TextPart, ToolCall
from tests.coordinator.conftest import start_stack
from tests.support import busctl

pytestmark = pytest.mark.anyio

CALLS = 4
STEP_TOOL = '''
from agent_bus.tools import tool


@tool
def step(turn: str, k: str) -> str:
    """One step of a load-test turn: answers `done-<turn>`."""
    return f"done-{turn}/{k}"
'''


def agents_toml(n: int) -> str:
    return "".join(f'\n[[agents]]\nname = "a{i:03d}"\nmodel = "x"\ntools = ["step"]\n'
                   for i in range(n))


def load_rules(turns: int) -> dict[str, Any]:
    """Rules: first request -> 4 calls of turn 1; results `done-t` -> 4 calls of turn t+1;
    results `done-<turns>` -> a text answer. chunk_size is large so each reply streams in a
    fixed number of deltas."""
    def four(turn: int) -> dict[str, Any]:
        return {"text": "", "chunk_size": 10_000, "tool_calls": [
            {"name": "step", "arguments": {"turn": str(turn), "k": str(k)}} for k in range(CALLS)]}

    rules: list[dict[str, Any]] = [
        {"tool_result": True, "results_contain": [f"done-{turns}/"],
         "reply": {"text": "finished", "chunk_size": 10_000}}]
    for t in range(turns - 1, 0, -1):
        rules.append({"tool_result": True, "results_contain": [f"done-{t}/"], "reply": four(t + 1)})
    rules.append({"tool_result": False, "reply": four(1)})
    return {"rules": rules, "echo": True}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


async def _replay_all(peer: Any) -> list[tuple[p.Header, Any]]:
    out: list[tuple[p.Header, Any]] = []
    since = 0
    while True:
        batch = p.decode(await peer.request(p.HUB_REPLAY, p.encode(p.ReplayRequest(
            since=since, limit=10_000)), timeout=30), p.ReplayBatch)
        for header_bytes, body in batch.events:
            out.append((p.decode_header(header_bytes), ev.decode_event(body)))
        if batch.upto >= batch.head or batch.upto <= since:
            return out
        since = batch.upto


def _streamable(message: Any) -> str:
    """An assistant message's text and tool-call arguments, in order: what its deltas carry."""
    if not isinstance(message, AssistantMessage):
        return ""
    return "".join(part.text if isinstance(part, TextPart) else
                   part.arguments if isinstance(part, ToolCall) else "" for part in message.content)


async def run_load(tmp: Path, n_agents: int, turns: int, n_workers: int, budget: float) -> None:
    tools = tmp / "load_tools.py"
    tools.write_text(STEP_TOOL)
    stack = start_stack(tmp, worker=False, coordinator=None, agents=agents_toml(n_agents))
    try:
        stack.srv.set_script(load_script(load_rules(turns)), clear_requests=True)
        for w in range(n_workers):
            stack.start(f"w{w}", busctl("worker", "--hub", stack.endpoint, "--tools", str(tools),
                                        "--concurrency", "8", "--name", f"w{w}",
                                        "--workspace", str(tmp)))
        stack.start("coordinator", busctl(
            "coordinator", "--hub", stack.endpoint, "--topology", str(stack.topology),
            "--state-dir", str(tmp / "agents"), "--name", "coordinator"), timeout=60)
        names = [f"a{i:03d}" for i in range(n_agents)]
        results: dict[str, cmd.RunResult] = {}

        async with connect(stack.endpoint, name="load-driver") as peer:
            async def one(name: str) -> None:
                body = cmd.encode(cmd.Prompt(text=f"go {name}", new_session=True))
                last = b""
                async with peer.stream(cmd.agent_service(name), body, timeout=budget) as replies:
                    async for last in replies:  # noqa: B007 - the final reply is the last one
                        pass
                results[name] = msgspec.msgpack.decode(last, type=cmd.RunResult)

            t0 = time.monotonic()
            with anyio.fail_after(budget):
                async with anyio.create_task_group() as tg:
                    for name in names:
                        tg.start_soon(one, name)
            wall = time.monotonic() - t0
            # every run has ended, so all its events are in the log (logged before published)
            logged = await _replay_all(peer)

        assert sorted(results) == names
        bad = {n: (r.stop_reason, r.error) for n, r in results.items()
               if r.stop_reason != "stop" or r.error or r.final_text != "finished"}
        assert not bad, bad
        run_of = {r.run_id: n for n, r in results.items()}
        assert len(run_of) == n_agents

        seqs = [h.seq for h, _ in logged]
        assert seqs == list(range(1, len(seqs) + 1)), "the log has a gap or a duplicate"
        per_run: dict[str, list[tuple[p.Header, Any]]] = collections.defaultdict(list)
        for header, event in logged:
            if header.run in run_of:
                per_run[header.run].append((header, event))
        assert set(per_run) == set(run_of)

        tool_turns = turns
        n_turns = tool_turns + 1
        n_calls = tool_turns * CALLS
        n_messages = 1 + n_turns + n_calls  # prompt, one assistant per turn, the tool results
        expected = {"agent_start": 1, "agent_end": 1, "turn_start": n_turns, "turn_end": n_turns,
                    "message_start": n_messages, "message_end": n_messages,
                    "tool_execution_start": n_calls, "tool_execution_end": n_calls}
        durations: list[float] = []
        hub_latency: list[float] = []
        updates = 0
        for run_id, items in per_run.items():
            kinds = [h.type for h, _ in items]
            assert kinds[0] == "agent_start" and kinds[-1] == "agent_end", (run_id, kinds[:3])
            counts = collections.Counter(kinds)
            updates += counts.pop("message_update", 0)
            assert dict(counts) == expected, (run_of[run_id], dict(counts))
            # no delta lost: what streamed is what each reply holds, in order (how many
            # `message_update`s carry it depends on how the stream was read: the gateway joins
            # a read's deltas)
            streamed = "".join(e.delta.delta for _, e in items if isinstance(e, ev.MessageUpdate))
            assert streamed == "".join(_streamable(e.message) for _, e in items
                                       if isinstance(e, ev.MessageEnd)), run_of[run_id]
            starts = [e.turn for _, e in items if isinstance(e, ev.TurnStart)]
            ends = [e.turn for _, e in items if isinstance(e, ev.TurnEnd)]
            assert starts == ends == list(range(1, n_turns + 1)), (run_of[run_id], starts, ends)
            started: dict[str, float] = {}
            for header, event in items:
                if isinstance(event, ev.ToolExecutionStart):
                    started[event.tool_call_id] = header.ts
                elif isinstance(event, ev.ToolExecutionEnd):
                    assert not event.is_error, event
                    durations.append(event.duration)
                    hub_latency.append(header.ts - started.pop(event.tool_call_id))
            assert not started, "a tool call started and never ended"
        assert updates >= n_agents * n_turns, updates  # every reply streamed
        assert sum(len(v) for v in per_run.values()) == n_agents * sum(expected.values()) + updates
        assert len(durations) == n_agents * n_calls

        print(f"\nload: {n_agents} agents x {tool_turns} turns x {CALLS} calls over {n_workers} "
              f"workers: {len(durations)} tool calls, {len(logged)} events in {wall:.1f}s")
        print(f"tool-call latency (coordinator `duration`): p50 "
              f"{statistics.median(durations) * 1e3:.1f} ms, p99 "
              f"{percentile(durations, 0.99) * 1e3:.1f} ms, max {max(durations) * 1e3:.1f} ms")
        print(f"tool-call latency (hub ts start->end): p50 "
              f"{statistics.median(hub_latency) * 1e3:.1f} ms, p99 "
              f"{percentile(hub_latency, 0.99) * 1e3:.1f} ms")
        for name, proc in stack.procs.items():
            assert proc.popen.poll() is None, f"{name} died:\n{proc.output()[-2000:]}"
    finally:
        stack.close()


async def test_agents_in_parallel_over_workers_lose_nothing(tmp_path: Path) -> None:
    await run_load(tmp_path, n_agents=40, turns=3, n_workers=4, budget=60)


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_two_hundred_agents_five_turns_of_four_calls_over_eight_workers(
        tmp_path: Path) -> None:
    await run_load(tmp_path, n_agents=200, turns=5, n_workers=8, budget=400)
