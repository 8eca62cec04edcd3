"""Cancellation always lands (issue 11, contract 4; docs/protocol.md, "Cancellation").

A real hub and a real `busctl worker` (shell enabled, plus tests/bus/cancel_tools.py). Each
round cancels, from the requester, calls that are known to be running: a shell command with a
background child (`run_shell`), a sync tool in a worker thread and an async tool on the loop.
A shell is cancelled as soon as it has written its pid file, which
is often before the worker's `open_process` has returned (the window where a cancellation once
killed the shell alone and left its child running); the Python tools once they report `running`.
After every round: no shell process is left, the hub shows every service idle, the worker still
has all its slots (each batch runs `CONCURRENCY` calls at once, so a leaked slot stalls the next
batch), every cancelled request was answered by the worker, and nothing was made up for the
requester. The rounds are parametrized: CI runs all of them, so the soak must pass `ROUNDS`
times in a row; `-m slow` runs the full 200 cancels of each kind in one go.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from agent_bus.bus import protocol as p
from agent_bus.bus.client import Peer, connect
from agent_bus.bus.messages import ToolCallRequest, ToolResult
from agent_bus.tools.executor import BusToolExecutor
from tests.support import Proc, busctl, running, until
from tests.tools.fixtures.procs import alive, call

pytestmark = pytest.mark.anyio

ROUNDS = 20
PER_KIND = 10  # x ROUNDS = 200 cancels of each kind per CI run
FULL_PER_KIND = 200
CONCURRENCY = 4
START_TIMEOUT = 10.0  # a call reports `running` within milliseconds; this only bounds a stall
# The shell writes its pid and its background child's to a file of its own (renamed into place,
# so a file that exists is complete), then waits for the child.
SHELL = 'sleep 30 & echo "$$ $!" > {id}.tmp && mv {id}.tmp {id}.pids; wait'
POLL = 0.002  # seconds between looks for a pid file, within START_TIMEOUT
KINDS = {
    "shell": ("run_shell", {}),
    "sync": ("block_sync", {}),
    "async": ("block_async", {}),
}


@pytest.fixture(scope="module")
def soak_bus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("soak")
    (tmp / "ws").mkdir()
    hub_args = busctl("hub", "--hub", "tcp://127.0.0.1:0", "--state-dir", str(tmp / "hub"))
    with running(hub_args) as hub:
        endpoint = hub.wait_ready()["endpoint"]
        worker_args = busctl("worker", "--hub", endpoint, "--tools", "agent_bus.tools.builtin",
                             "--tools", "tests.bus.cancel_tools", "--shell",
                             "--sandbox", "off",  # follows the shells by host pid (see below)
                             "--workspace", str(tmp / "ws"), "--concurrency", str(CONCURRENCY))
        with running(worker_args) as worker:
            worker.wait_ready(20)
            yield {"endpoint": endpoint, "hub": hub, "worker": worker, "ws": tmp / "ws"}


@pytest.mark.parametrize("round_", range(ROUNDS))
async def test_cancel_soak(soak_bus: dict[str, Any], round_: int) -> None:
    await _soak(soak_bus, PER_KIND)


@pytest.mark.slow
async def test_cancel_soak_full(soak_bus: dict[str, Any]) -> None:
    await _soak(soak_bus, FULL_PER_KIND)


async def _soak(bus: dict[str, Any], per_kind: int) -> None:
    worker: Proc = bus["worker"]
    async with connect(bus["endpoint"], name="soak") as peer:
        tools = BusToolExecutor(peer)
        answered_before = await _answered(peer)
        outcome = _Outcome()
        for kind in KINDS:
            for first in range(0, per_kind, CONCURRENCY):
                ids = [f"{kind}-{i}" for i in range(first, min(first + CONCURRENCY, per_kind))]
                async with anyio.create_task_group() as tg:
                    for call_id in ids:
                        tg.start_soon(_cancel_when_running, tools, kind, call_id, outcome,
                                      bus["ws"])
        assert outcome.stalled == [], "calls that never reported running (a slot leaked?)"
        assert outcome.made_up == [], "a cancelled call returned a result"
        assert len(outcome.pids) == 2 * per_kind
        await until(lambda: not [pid for pid in outcome.pids if alive(pid)], timeout=5,
                    what="every shell and its background child to be killed")
        await until(lambda: _idle(peer), timeout=5, what="every tool service to be idle")
        total = per_kind * len(KINDS)
        with contextlib.suppress(AssertionError):  # the assertion below says what is missing
            await until(lambda: _answered_at_least(peer, answered_before + total), timeout=15,
                        what="every cancelled request to be answered")
        answered = await _answered(peer) - answered_before
        assert answered == total, (f"{answered} of {total} cancelled requests answered; hub "
                                   f"counters {(await peer.status()).counters}, requester "
                                   f"counters {peer.counters}")
        assert _children(worker.pid) == []
        assert worker.popen.poll() is None


class _Outcome:
    def __init__(self) -> None:
        self.pids: list[int] = []
        self.stalled: list[str] = []
        self.made_up: list[ToolResult] = []


async def _cancel_when_running(tools: BusToolExecutor, kind: str, call_id: str,
                               outcome: _Outcome, ws: Path) -> None:
    """Start the call and cancel it (the requester leaves) as soon as it runs."""
    name, args = KINDS[kind]
    if kind == "shell":
        args = {"command": SHELL.format(id=call_id)}
    request: ToolCallRequest = call(name, call_id, **args)
    is_running = anyio.Event()

    async def on_update(partial: ToolResult) -> None:
        is_running.set()

    async def cancel_when_running(scope: anyio.CancelScope) -> None:
        with anyio.move_on_after(START_TIMEOUT):
            if kind == "shell":
                outcome.pids.extend(await _pids_from(ws / f"{call_id}.pids"))
            else:
                await is_running.wait()
            scope.cancel()
            return
        outcome.stalled.append(call_id)
        scope.cancel()

    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(cancel_when_running, scope)
            outcome.made_up.append(await tools.execute(request, on_update))


async def _pids_from(path: Path) -> list[int]:
    while not path.exists():
        await anyio.sleep(POLL)  # a poll interval; the caller bounds the wait
    pids = [int(pid) for pid in path.read_text().split()]
    path.unlink()  # the next round reuses the call ids
    return pids


async def _idle(peer: Peer) -> bool:
    status = await peer.status()
    return all(svc.load == 0 and svc.queued == 0 for svc in status.services)


async def _answered(peer: Peer) -> int:
    """Answers to requests their requester had left: counted by the hub as stale when it has
    forgotten the request, or forwarded and counted by the requester (which left the call)."""
    status: p.Status = await peer.status()
    c = status.counters
    return (c.get("stale_replies", 0) + c.get("cancel_ignored", 0)
            + peer.counters.get("stale_replies", 0))


async def _answered_at_least(peer: Peer, n: int) -> bool:
    return await _answered(peer) >= n


def _children(pid: int) -> list[int]:
    """Live child processes of `pid` (a shell the worker failed to kill and reap)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue  # exited meanwhile
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry.name))
    return found
