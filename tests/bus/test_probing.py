"""Probing after closed connections (bus/probing.py): the schedule on its own, then a real hub
whose live peers are no longer woken ~60 times each time a client leaves, while a peer whose
connection closes is still dropped at once."""

from __future__ import annotations

import math
import signal
import time
from pathlib import Path

import pytest
import zmq

from agent_bus.bus import probing
from agent_bus.bus import protocol as p
from agent_bus.bus.client import connect
from agent_bus.bus.probing import ProbeSchedule
from tests.fault.test_fuzz import RawPeer
from tests.support import Proc, busctl, py, wait_for

# A raw peer in a process of its own, idle once welcomed (the test kills it).
VICTIM = """
import json, sys, threading, zmq
from tests.fault.test_fuzz import RawPeer
peer = RawPeer(zmq.Context(), sys.argv[1], "victim")
peer.hello()
print(json.dumps({"ready": "victim"}), flush=True)
threading.Event().wait()
"""

# --- the schedule -----------------------------------------------------------------------------


def probe_times(schedule: ProbeSchedule, start: float, found_at: float = math.inf) -> list[float]:
    """Run the schedule from `start`: when it probes (a probe at or after `found_at` finds the
    closed connection's peer)."""
    times = []
    while schedule.next_at != math.inf:
        now = schedule.next_at
        times.append(round(now - start, 6))
        if now >= found_at:
            schedule.found(1)
        schedule.probed(now)
    return times


def test_probes_back_off_and_stop_after_the_window() -> None:
    s = ProbeSchedule()
    s.closed(1, 100.0)
    times = probe_times(s, 100.0)
    assert times[:6] == [0.001, 0.003, 0.007, 0.015, 0.031, 0.063]  # doubling gaps
    assert all(b - a <= probing.MAX_GAP + 1e-9 for a, b in zip(times, times[1:], strict=False))
    assert times[-1] <= probing.PROBE_FOR + probing.MAX_GAP
    assert len(times) <= 12  # a fixed 5 ms for 0.3 s was 60
    assert s.unexplained == 0


def test_probing_stops_once_the_peer_is_found() -> None:
    s = ProbeSchedule()
    s.closed(1, 0.0)
    assert probe_times(s, 0.0, found_at=0.002) == [0.001, 0.003]


def test_two_closes_need_two_peers_found() -> None:
    s = ProbeSchedule()
    s.closed(2, 0.0)
    s.found(1)
    assert s.next_at != math.inf
    s.found(1)
    assert s.next_at == math.inf


@pytest.mark.parametrize("bye_first", [True, False])
def test_a_peer_that_said_bye_explains_its_close(bye_first: bool) -> None:
    s = ProbeSchedule()
    if bye_first:
        s.expect_close(0.0)
        s.closed(1, 0.01)
    else:
        s.closed(1, 0.0)
        s.expect_close(0.0005)
    assert s.unexplained == 0 and s.next_at == math.inf


def test_a_bye_explains_only_a_close_that_follows_soon() -> None:
    s = ProbeSchedule()
    s.expect_close(0.0)
    s.closed(1, probing.EXPECT_FOR + 0.1)  # someone else's, long after
    assert s.unexplained == 1 and s.next_at == pytest.approx(probing.EXPECT_FOR + 0.101)


# --- a real hub -------------------------------------------------------------------------------


def heartbeats_within(peer: RawPeer, seconds: float) -> int:
    count = 0
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if not peer.sock.poll(left * 1000):
            break
        frames = peer.sock.recv_multipart()
        if p.decode_header(frames[1]).kind == p.HEARTBEAT:
            count += 1
    return count


@pytest.fixture
def hub(tmp_path: Path):  # type: ignore[no-untyped-def]
    # A long heartbeat interval: every heartbeat the watcher gets in the test is a probe.
    proc = Proc(busctl("hub", "--hub", "tcp://127.0.0.1:0", "--state-dir", str(tmp_path / "hub"),
                       "--heartbeat-interval", "30"))
    try:
        proc.ready = proc.wait_ready()  # type: ignore[attr-defined]
        yield proc
    finally:
        proc.stop()


@pytest.mark.anyio
async def test_clients_leaving_do_not_wake_the_live_peers(hub: Proc) -> None:
    endpoint = hub.ready["endpoint"]  # type: ignore[attr-defined]
    ctx = zmq.Context()
    watcher = RawPeer(ctx, endpoint, "watcher")
    try:
        watcher.hello()
        for _ in range(5):  # like five `busctl status` runs: hello, a request, bye, close
            async with connect(endpoint, name="visitor") as visitor:
                await visitor.status()
        # A fixed 5 ms for 0.3 s after each close sent the watcher 5 x 60 heartbeats.
        assert heartbeats_within(watcher, 0.6) <= 2
    finally:
        watcher.close()
        ctx.term()


def test_a_killed_peer_is_still_dropped_at_once_and_probing_stops(hub: Proc) -> None:
    endpoint = hub.ready["endpoint"]  # type: ignore[attr-defined]
    ctx = zmq.Context()
    watcher = RawPeer(ctx, endpoint, "watcher")
    victim = Proc(py("-c", VICTIM, endpoint))
    try:
        watcher.hello()
        victim.wait_ready()
        assert watcher.counters().get("peers_disconnected", 0) == 0
        victim.signal(signal.SIGKILL)
        # Dropped by a probe: the heartbeat deadline (30 s x liveness 3) is far past this wait.
        wait_for(lambda: watcher.counters().get("peers_disconnected", 0) == 1, timeout=20,
                 what="the killed peer dropped for its closed connection")
        # (the heartbeats that came during the wait were read and skipped by `counters`)
        assert heartbeats_within(watcher, 0.6) <= 8  # and then no more probes: 52 before
    finally:
        victim.stop()
        watcher.close()
        ctx.term()

