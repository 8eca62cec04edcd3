"""Sessions are the unit of concurrency (issue 15): one agent runs many sessions at once, each
with only its own messages; verbs address a run or a session; several coordinators share new
sessions and a continued session reaches the one holding it. Real processes throughout: hub,
gateway -> FakeLLMServer, tool worker, coordinator(s)."""

from __future__ import annotations

import functools
import json
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from agent_bus.agents.client.remote import connect
from agent_bus.agents.gateway.fakellm import load_script
from agent_bus.bus.errors import PeerLost, RemoteError
from tests.coordinator.conftest import Stack, start_stack
from tests.support import busctl, until

pytestmark = pytest.mark.anyio

AGENTS = """
[[agents]]
name = "c"
model = "x"
tools = []
system_prompt = "You answer."

[[agents]]
name = "w"
model = "x"
tools = ["gate"]
system_prompt = "You wait."
"""

# gate calls for prompts saying "hold"; any other prompt (and any tool result) gets an answer.
RULES: list[dict[str, Any]] = [
    {"contains": ["hold"], "tool_result": False, "reply": {"tool_calls": [
        {"name": "gate", "arguments": {"path": "GATE"}}]}},
    {"contains": [], "tool_result": True, "reply": {"text": "released"}},
]


def script(stack: Stack, gate: Path | None = None, delay: float = 0.0) -> None:
    rules = json.loads(json.dumps(RULES).replace("GATE", str(gate or "")))
    rules.append({"contains": [], "tool_result": False, "reply": {"text": "answer to {last_user}"},
                  "delay": delay})
    s = load_script({"rules": rules})
    stack.srv.set_script(s, clear_requests=True)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(tmp_path_factory.mktemp("sessions"), coordinator=("c", "w"), agents=AGENTS)
    try:
        yield s
    finally:
        s.close()


async def cli_run(*args: str) -> subprocess.CompletedProcess[str]:
    """`busctl ARGS` in a thread: blocking the event loop would silence the test's own peer,
    and the hub drops a peer silent for its liveness window (2 s here)."""
    return await anyio.to_thread.run_sync(functools.partial(
        subprocess.run, busctl(*args), capture_output=True, text=True, timeout=30))


def user_texts(body: dict[str, Any]) -> list[str]:
    out = []
    for m in body["messages"]:
        if m["role"] != "user":
            continue
        content = m["content"]
        out.append(content if isinstance(content, str) else content[0]["text"])
    return out


async def test_run_many_runs_sessions_concurrently_each_with_its_own_messages(
        stack: Stack) -> None:
    script(stack, delay=1.0)
    async with connect(stack.endpoint, name="t-many") as bus:
        started = time.monotonic()
        single = await bus.run("c", "baseline")
        one_run = time.monotonic() - started
        stack.srv.requests.clear()
        prompts = [("c", f"task-{i}") for i in range(8)]
        started = time.monotonic()
        results = await bus.run_many(prompts, concurrency=8)
        wall = time.monotonic() - started
    assert single.final_text == "answer to baseline" and one_run >= 1.0
    assert [r.final_text for r in results] == [f"answer to task-{i}" for i in range(8)]
    assert len({r.session for r in results}) == 8  # a fresh session each
    # one after the other this would take 8 x one_run; concurrently about one_run
    assert wall < 2.0 and wall < 2 * one_run, (wall, one_run)
    requests = [user_texts(r.body) for r in stack.srv.requests]
    assert sorted(requests) == [[f"task-{i}"] for i in range(8)]  # only its own messages


async def test_verbs_take_the_run_id_prefix_watch_prints(stack: Stack, tmp_path: Path) -> None:
    """Issue 49, item 4: `steer`/`abort --run` take a prefix of a live run's id (the 8 characters
    `busctl watch` prints); a prefix several live runs share is refused, listing them."""
    gate = tmp_path / "gate"
    script(stack, gate)
    async with connect(stack.endpoint, name="t-prefix") as bus:
        runs = []
        # run ids are random hex: at most 17 runs until two share their first character
        while len({r.run_id[0] for r in runs}) == len(runs):
            runs.append(await bus.prompt("w", f"hold {len(runs)}"))
        await until(lambda: len(stack.srv.requests) >= len(runs), 20, "every model request")
        shared = runs[-1].run_id[0]
        twins = sorted(r.run_id for r in runs if r.run_id.startswith(shared))
        one = runs[0]
        steered = await cli_run("steer", "w", "--run", one.run_id[:8], "look here", "--hub",
                                stack.endpoint)
        assert steered.returncode == 0 and one.run_id in steered.stdout, steered
        ambiguous = await cli_run("abort", "w", "--run", shared, "--hub", stack.endpoint)
        assert ambiguous.returncode == 1, ambiguous
        assert all(t in ambiguous.stderr for t in twins) and "give more" in ambiguous.stderr, \
            ambiguous.stderr
        aborted = await cli_run("abort", "w", "--run", one.run_id[:8], "--hub", stack.endpoint)
        assert aborted.returncode == 0 and one.run_id in aborted.stdout, aborted
        assert (await one.result()).stop_reason == "aborted"
        gate.write_text("open")
        for run in runs[1:]:
            assert (await run.result()).stop_reason != "aborted"


async def test_verbs_address_a_run_or_a_session(stack: Stack, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    script(stack, gate)
    async with connect(stack.endpoint, name="t-verbs") as bus:
        one = await bus.prompt("w", "hold one")
        two = await bus.prompt("w", "hold two")
        await until(lambda: len(stack.srv.requests) >= 2, 10, "both model requests")
        assert one.session != two.session and one.run_id != two.run_id
        with pytest.raises(RemoteError) as ambiguous:
            await bus.steer("w", "which one?")
        assert ambiguous.value.code == "ambiguous"
        assert one.run_id in str(ambiguous.value) and two.run_id in str(ambiguous.value)
        assert "--run" in str(ambiguous.value)
        cli = await cli_run("abort", "w", "--hub", stack.endpoint)
        assert cli.returncode != 0 and "--run" in cli.stderr and one.run_id in cli.stderr, cli
        status = await cli_run("status", "--hub", stack.endpoint, "--json")
        w = json.loads(status.stdout)["agents"]["w"]
        live = {i["session"]: i for i in w["sessions"] if i["state"] == "running"}
        assert {one.session, two.session} <= set(live) and w["live"] == 2
        assert live[one.session]["run_id"] == one.run_id and w["stored"] >= 2
        detail = await bus.steer("w", "look at this", run=one.run_id)
        assert one.run_id in detail and "1 steering" in detail
        cli = await cli_run("abort", "w", "because I said so", "--hub", stack.endpoint,
                            "--session", two.session)
        assert cli.returncode == 0 and two.run_id in cli.stdout, cli
        aborted = await two.result()
        assert aborted.stop_reason == "aborted" and "because I said so" in (aborted.error or "")
        gate.write_text("open")
        steered = await one.result()
        # the steering reached run one's next model request, not run two
        assert steered.final_text == "answer to look at this"
        assert user_texts(stack.srv.requests[-1].body) == ["hold one", "look at this"]
        ends = await stack.watch(two.run_id)
        end = [e for e in ends if e["type"] == "agent_end"]
        assert len(end) == 1 and "because I said so" in end[0]["error"]
        start = next(e for e in ends if e["type"] == "agent_start")
        assert start["session"] == two.session
        # nothing runs now: steering would leak into an unrelated run, so it is refused
        with pytest.raises(RemoteError) as idle:
            await bus.steer("w", "late")
        assert idle.value.code == "idle" and "busctl run" in str(idle.value)
        with pytest.raises(RemoteError) as idle_session:
            await bus.follow_up("w", "late", session=one.session)
        assert idle_session.value.code == "idle" and f"-c {one.session}" in str(idle_session.value)


def test_busctl_run_starts_fresh_sessions_and_continues_with_c(stack: Stack) -> None:
    script(stack)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(busctl("run", "--hub", stack.endpoint, "--agent", "c", *args),
                              capture_output=True, text=True, timeout=30)

    first, second = run("apples"), run("pears")
    assert (first.returncode, first.stdout) == (0, "answer to apples\n"), first
    assert second.returncode == 0, second
    assert [user_texts(r.body) for r in stack.srv.requests] == [["apples"], ["pears"]]
    session = first.stderr.split("session ", 1)[1].split()[0]
    assert session.startswith("coordinator.") and session not in second.stderr
    named = run("-c", session, "plums")
    last = run("-c", "figs")  # the last session is `named`'s
    assert named.returncode == 0 and last.returncode == 0, (named, last)
    assert user_texts(stack.srv.requests[2].body) == ["apples", "plums"]
    assert user_texts(stack.srv.requests[3].body) == ["apples", "plums", "figs"]
    unknown = run("-c", "coordinator.nosuch", "hi")
    assert unknown.returncode != 0 and "no session `coordinator.nosuch`" in unknown.stderr


async def test_two_coordinators_share_sessions_and_fail_only_their_own_runs(
        tmp_path: Path) -> None:
    stack = start_stack(tmp_path, coordinator=None, agents=AGENTS)
    try:
        stack.coordinator("c", "w", name="co1", state="s1")
        stack.coordinator("c", "w", name="co2", state="s2")
        script(stack, tmp_path / "gate", delay=0.3)
        # resume_wait=0: co1 is not restarted here, so its run cannot resume (tests/durable)
        async with connect(stack.endpoint, name="t-two", resume_wait=0) as bus:
            results = await bus.run_many([("c", f"q{i}") for i in range(20)], concurrency=20)
            holders = [r.session.partition(".")[0] for r in results]
            assert sorted(set(holders)) == ["co1", "co2"], holders
            assert min(holders.count("co1"), holders.count("co2")) >= 5, holders
            # continuing a session reaches the coordinator holding it (its own state dir)
            for first in (holders.index("co1"), holders.index("co2")):
                session = results[first].session
                cont = await cli_run("run", "--hub", stack.endpoint, "--agent", "c",
                                     "-c", session, "more")
                assert cont.returncode == 0, cont
                assert user_texts(stack.srv.requests[-1].body) == [f"q{first}", "more"]
            # one held run on each; killing co1 fails only co1's
            runs = {}
            for coord in ("co1", "co2"):  # a named new session: created where its id says
                runs[coord] = await bus.prompt("w", "hold", session=f"{coord}.held",
                                               new_session=True)
            await until(lambda: len(stack.srv.requests) >= 24, 10, "both held model requests")
            with pytest.raises(RemoteError) as busy:
                await bus.prompt("w", "again", session="co1.held")
            assert busy.value.code == "agent_busy"  # one run per session
            stack.procs["co1"].signal(signal.SIGKILL)
            with pytest.raises(PeerLost), anyio.fail_after(10):
                await runs["co1"].result()
            (tmp_path / "gate").write_text("open")
            with anyio.fail_after(10):
                survived = await runs["co2"].result()
            assert survived.final_text == "released"
    finally:
        stack.close()
