"""Issue 8 §8: resource hygiene. Peers that come and go leave nothing behind in the hub (file
descriptors, memory, registry); every process shuts down in under 5 s with its peers already dead."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent_bus.bus.client import connect
from tests.cli.conftest import start_up
from tests.fault.conftest import FAULT_TOOLS, proc_fds, proc_rss_kb
from tests.support import Proc, busctl, until, wait_for

SHUTDOWN_BOUND = 5.0

TOPOLOGY = """
[models.x]
provider = "openai"
base_url = "http://127.0.0.1:9/v1"
model = "m"

[[agents]]
name = "a"
model = "x"
"""


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[tuple[str, Proc]]:
    proc = Proc(busctl("hub", "--hub", "tcp://127.0.0.1:0", "--state-dir", str(tmp_path / "hub"),
                       "--heartbeat-interval", "0.2"))
    try:
        yield proc.wait_ready()["endpoint"], proc
    finally:
        proc.stop()


async def peer_cycles(endpoint: str, hub_pid: int, cycles: int) -> None:
    async def cycle(i: int) -> None:
        async with connect(endpoint, name=f"cycle-{i}") as peer:
            async def handler(req) -> bytes:  # noqa: ANN001
                return b""
            await peer.serve(f"svc.cycle.{i}", handler)
            await peer.status()  # the registration has been handled

    async with connect(endpoint, name="observer") as observer:
        for i in range(20):  # warm-up: allocator pools, SQLite pages, zmq internals
            await cycle(i)

        async def settled() -> bool:
            status = await observer.status()
            return [p.name for p in status.peers] == ["observer"] and not any(
                s.name.startswith("svc.cycle.") for s in status.services)

        await until(settled, 10, "the hub to list only the observer")
        fds, rss = proc_fds(hub_pid), proc_rss_kb(hub_pid)
        for i in range(cycles):
            await cycle(20 + i)
        await until(settled, 10, "the hub to forget every peer")
        # closed connections are reaped by libzmq's I/O thread
        await until(lambda: proc_fds(hub_pid) <= fds, 10, "the hub's fds back to baseline")
        grown = proc_rss_kb(hub_pid) - rss
        # bounded, not per-peer: the event log's page cache and counters may grow a little
        assert grown < 8 * 1024, f"hub RSS grew {grown} kB over {cycles} peer cycles"


@pytest.mark.anyio
async def test_hub_forgets_a_hundred_peers(hub: tuple[str, Proc]) -> None:
    endpoint, proc = hub
    await peer_cycles(endpoint, proc.pid, 100)


@pytest.mark.slow
@pytest.mark.anyio
async def test_hub_forgets_a_thousand_peers_and_twenty_workers(hub: tuple[str, Proc]) -> None:
    endpoint, proc = hub
    await peer_cycles(endpoint, proc.pid, 1000)
    fds = proc_fds(proc.pid)
    for i in range(20):
        worker = Proc(busctl("worker", "--hub", endpoint, "--tools", FAULT_TOOLS, "--name", f"w{i}"))
        try:
            worker.wait_ready()
        finally:
            worker.stop()
    wait_for(lambda: proc_fds(proc.pid) <= fds, 10, "the hub's fds back to their baseline")


def stopped_within(proc: Proc, bound: float = SHUTDOWN_BOUND) -> float:
    started = time.monotonic()
    proc.signal(signal.SIGTERM)
    proc.popen.wait(bound + 5)
    took = time.monotonic() - started
    assert took < bound, f"{proc.args[2:4]} took {took:.1f}s to stop"
    return took


def test_hub_stops_fast_with_its_peers_dead(hub: tuple[str, Proc]) -> None:
    endpoint, proc = hub
    worker = Proc(busctl("worker", "--hub", endpoint, "--tools", FAULT_TOOLS))
    try:
        worker.wait_ready()
        worker.signal(signal.SIGKILL)
        worker.popen.wait(5)
        stopped_within(proc)
    finally:
        worker.stop()


@pytest.mark.parametrize("piece", ["worker", "gateway", "coordinator"])
def test_piece_stops_fast_with_the_hub_dead(tmp_path: Path, hub: tuple[str, Proc],
                                            piece: str) -> None:
    endpoint, hub_proc = hub
    topology = tmp_path / "t.toml"
    topology.write_text(TOPOLOGY)
    args = {
        "worker": ["--tools", FAULT_TOOLS],
        "gateway": ["--topology", str(topology)],
        "coordinator": ["--topology", str(topology), "--state-dir", str(tmp_path / "agents")],
    }[piece]
    proc = Proc(busctl(piece, "--hub", endpoint, *args))
    try:
        proc.wait_ready()
        hub_proc.signal(signal.SIGKILL)
        hub_proc.popen.wait(5)
        stopped_within(proc)
    finally:
        proc.stop()


def test_up_stops_fast_with_a_child_dead(tmp_path: Path) -> None:
    topology = tmp_path / "t.toml"
    topology.write_text(TOPOLOGY + '\n[[workers]]\ntools = ["' + FAULT_TOOLS + '"]\n')
    proc, ready = start_up(tmp_path, "-c", str(topology))
    try:
        line = proc.wait_line(lambda s: s.startswith("processes"), 5)
        hub_pid = int(line.split("hub[")[1].split("]")[0])
        import os

        os.kill(hub_pid, signal.SIGKILL)  # its peers now talk to nobody
        started = time.monotonic()
        proc.signal(signal.SIGINT)
        proc.popen.wait(SHUTDOWN_BOUND + 5)
        assert time.monotonic() - started < SHUTDOWN_BOUND
    finally:
        proc.stop()
