"""The replay reader is a child process of the hub (bus/replay_reader.py): a replay it was reading
when it died is still answered, the next one is served by a new reader, and the reader never
outlives its hub (SIGKILL included). It runs as SCHED_IDLE, and one the machine starves is
replaced by one at nice 10 that serves the waiting replays."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from agent_bus.bus import protocol as p
from agent_bus.bus.replay_reader import (
    PACE_SECONDS,
    PEER_REPLAY_QUEUE,
    REPLAY_LIMIT,
    ReplayReader,
)
from agent_bus.bus.store.sqlite import SqliteStore as EventLog
from agent_bus.bus.store.sqlite import connect_reader, read_batch
from tests.fault.test_budgets import start_hub, status
from tests.fault.test_fuzz import RawPeer
from tests.fault.test_replay_and_retention import publish
from tests.support import Proc, busctl, wait_for

# The reader process is what these tests are about: a hub that keeps no recent events in memory
# (`--recent-bytes 0`), so every replay, even of what was just published, reads the log there
# (bus/recent.py answers a live subscriber's gap from memory instead).
READER = ("--recent-bytes", "0")


def reader_pids(hub_pid: int) -> list[int]:
    """The hub's children running `bus.replay_reader`."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == hub_pid and b"agent_bus.bus.replay_reader" in cmdline:
            pids.append(int(entry))
    return pids


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def replay(peer: RawPeer, since: int = 0) -> tuple[p.Header, list[bytes]]:
    return peer.request(p.HUB_REPLAY, p.encode(p.ReplayRequest(since=since)), timeout=30)


def test_a_reader_that_dies_has_its_replays_answered_and_is_replaced(tmp_path: Path) -> None:
    hub = start_hub(tmp_path, *READER)
    ctx = zmq.Context()
    peer = RawPeer(ctx, hub.ready["endpoint"])  # type: ignore[attr-defined]
    try:
        peer.hello()
        publish(peer, 50)
        assert status(peer).seq >= 50
        header, frames = replay(peer)
        assert header.kind == p.REPLY and len(p.decode(frames[0], p.ReplayBatch).events) >= 50
        [reader] = wait_for(lambda: reader_pids(hub.pid), 10, "the hub's replay reader")
        # Frozen, the reader holds the next job; killed, it can never answer it: the hub must.
        os.kill(reader, signal.SIGSTOP)
        rid = p.new_id()
        peer.send([p.SIGNATURE, msgspec.msgpack.encode(
            {"kind": p.REQUEST, "id": rid, "service": p.HUB_REPLAY}),
            p.encode(p.ReplayRequest(since=0))])
        os.kill(reader, signal.SIGKILL)
        header, frames = peer.wait(lambda h: h.id == rid and h.kind in (p.REPLY, p.ERROR), 15)
        # Either the dead reader's job is failed for it, or (if the job was still queued in the
        # hub's socket when the reader died) the new reader serves it: never silence.
        if header.kind == p.ERROR:
            assert header.code == p.HANDLER_ERROR and "reader" in (header.error or "")
        [new_reader] = wait_for(lambda: [pid for pid in reader_pids(hub.pid) if pid != reader],
                                10, "a new replay reader")
        header, frames = replay(peer)
        assert header.kind == p.REPLY and len(p.decode(frames[0], p.ReplayBatch).events) >= 50
        assert alive(new_reader)
    finally:
        peer.close()
        ctx.term()
        hub.stop()


def started_reader(hub: Any) -> int:
    """Ask a replay (the reader starts with the first one) and return the reader's pid."""
    ctx = zmq.Context()
    peer = RawPeer(ctx, hub.ready["endpoint"])
    try:
        peer.hello()
        publish(peer, 1)
        assert replay(peer)[0].kind == p.REPLY
    finally:
        peer.close()
        ctx.term()
    [reader] = wait_for(lambda: reader_pids(hub.pid), 10, "the hub's replay reader")
    return int(reader)


def test_a_hub_that_never_replays_starts_no_reader(tmp_path: Path) -> None:
    hub = start_hub(tmp_path, *READER)
    try:
        ctx = zmq.Context()
        peer = RawPeer(ctx, hub.ready["endpoint"])  # type: ignore[attr-defined]
        try:
            peer.hello()
            publish(peer, 5)
            assert status(peer).seq >= 5
            # from the head: the client's publish confirmation, answered without the log
            assert replay(peer, since=10**9)[0].kind == p.REPLY
        finally:
            peer.close()
            ctx.term()
        assert reader_pids(hub.pid) == []
    finally:
        hub.stop()


def test_the_reader_does_not_outlive_its_hub(tmp_path: Path) -> None:
    hub = start_hub(tmp_path, *READER)
    try:
        reader = started_reader(hub)
        os.kill(hub.pid, signal.SIGKILL)  # the hub alone: its process group is left alone
        wait_for(lambda: not alive(reader), 10, "the reader to exit with its hub")
    finally:
        hub.stop()


def test_a_stopped_hub_stops_its_reader(tmp_path: Path) -> None:
    hub = start_hub(tmp_path, *READER)
    try:
        reader = started_reader(hub)
        os.kill(hub.pid, signal.SIGTERM)  # the hub alone, as `busctl up` stops it
        assert hub.popen.wait(10) == 0
        wait_for(lambda: not alive(reader), 10, "the reader to exit with its hub")
    finally:
        hub.stop()


def nice_and_policy(pid: int) -> tuple[int, int]:
    return os.getpriority(os.PRIO_PROCESS, pid), os.sched_getscheduler(pid)


def test_a_starved_idle_class_reader_is_replaced_and_its_replays_answered(tmp_path: Path) -> None:
    """An idle-class reader gets no CPU while the machine is saturated (measured: 0.35% of a core
    beside one busy process per core). Starvation is made certain here by stopping the reader
    (SIGSTOP: it gets no CPU at all): after 1 s the hub replaces it with a reader at nice 10,
    hands that one every waiting replay, and each is answered once; `replay_reader_starved`
    counts it."""
    hub = start_hub(tmp_path, *READER)
    ctx = zmq.Context()
    peer = RawPeer(ctx, hub.ready["endpoint"])  # type: ignore[attr-defined]
    try:
        peer.hello()
        publish(peer, 100)
        assert status(peer).seq >= 100
        assert replay(peer)[0].kind == p.REPLY  # starts the reader
        [reader] = wait_for(lambda: reader_pids(hub.pid), 10, "the hub's replay reader")
        assert nice_and_policy(reader) == (10, os.SCHED_IDLE)
        os.kill(reader, signal.SIGSTOP)
        ids = [p.new_id() for _ in range(PEER_REPLAY_QUEUE)]  # as many as one peer may
        started = time.monotonic()
        for rid in ids:
            peer.send([p.SIGNATURE, msgspec.msgpack.encode(
                {"kind": p.REQUEST, "id": rid, "service": p.HUB_REPLAY}),
                p.encode(p.ReplayRequest(since=0))])
        answers = []
        while len(answers) < len(ids):
            header, frames = peer.wait(lambda h: h.id in ids, 30)
            assert header.kind == p.REPLY, header
            assert len(p.decode(frames[0], p.ReplayBatch).events) >= 100
            answers.append(header.id)
        assert sorted(answers) == sorted(ids), "a replay answered twice, or not at all"
        assert time.monotonic() - started >= 1.0  # the stopped reader answered nothing
        assert status(peer).counters.get("replay_reader_starved", 0) == 1
        assert not alive(reader)
        [replacement] = reader_pids(hub.pid)
        assert nice_and_policy(replacement) == (10, os.SCHED_OTHER)
        with pytest.raises(TimeoutError):  # no second answer to any of them
            peer.wait(lambda h: h.id in ids, 0.5)
    finally:
        peer.close()
        ctx.term()
        hub.stop()


def test_replay_priority_low_runs_the_reader_at_nice_10(tmp_path: Path) -> None:
    hub = start_hub(tmp_path, *READER, "--replay-priority", "low")
    try:
        reader = started_reader(hub)
        assert nice_and_policy(reader) == (10, os.SCHED_OTHER)
    finally:
        hub.stop()


def test_a_bad_replay_priority_is_refused_naming_the_flag() -> None:
    proc = Proc(busctl("hub", "--hub", "tcp://127.0.0.1:0", "--replay-priority", "fast"))
    try:
        assert proc.popen.wait(20) == 2
        assert "--replay-priority" in proc.output() and "'idle', 'low'" in proc.output()
    finally:
        proc.stop()


def test_reader_lifecycle_idle_starved_low_calm_idle(tmp_path: Path) -> None:
    """The hub's side of the reader (`ReplayReader`) driven directly, with real processes and a
    real log: an idle-class reader that gets no CPU (stopped) is replaced by a low-class one that
    answers the held job once; after `calm_after` without a job that one is retired, and the
    next job starts an idle-class reader again. Nothing is left running after `close`."""
    log = EventLog(tmp_path / "events.db")
    header = p.encode(p.Header(kind=p.EVENT, id="e1", type="custom", seq=1))
    log.append([(1, time.time(), "custom", "", "", "", header, b"\x81\xa4type\xa6custom")])
    ctx = zmq.Context()
    reader = ReplayReader(ctx, log.uri, 256 * 1024)
    reader.calm_after = 0.3
    procs = []

    def answered(req_id: str) -> list[str]:
        got: list[str] = []
        deadline = time.monotonic() + 20
        while not got and time.monotonic() < deadline:
            if reader.sock.poll(50):
                got = [rid for _, rid, code, _ in reader.answers() if not code]
            got += [rid for _, rid, _, _ in reader.check(time.monotonic())]
        return got

    try:
        assert reader.submit(b"peer", "r1", 1, p.ReplayRequest())
        assert answered("r1") == ["r1"]
        first = reader._proc
        assert first is not None and nice_and_policy(first.pid) == (10, os.SCHED_IDLE)
        procs.append(first)
        os.kill(first.pid, signal.SIGSTOP)
        assert reader.submit(b"peer", "r2", 1, p.ReplayRequest())
        assert answered("r2") == ["r2"]  # after STARVED_AFTER, from the replacement
        assert reader.starved == 1 and reader.pending == 0
        second = reader._proc
        assert second is not None and second is not first
        procs.append(second)
        assert nice_and_policy(second.pid) == (10, os.SCHED_OTHER)
        wait_for(lambda: reader.check(time.monotonic()) == [] and reader._proc is None, 10,
                 "the low-class reader to be retired")
        wait_for(lambda: (reader.check(time.monotonic()), second.poll())[1] is not None, 10,
                 "the retired reader to exit")
        assert first.poll() is not None  # the killed one was reaped meanwhile
        assert reader.submit(b"peer", "r3", 1, p.ReplayRequest())
        assert answered("r3") == ["r3"]
        third = reader._proc
        assert third is not None and nice_and_policy(third.pid) == (10, os.SCHED_IDLE)
        procs.append(third)
    finally:
        reader.close()
        ctx.term()
        log.close()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert all(proc.poll() is not None for proc in procs)


def voluntary_switches() -> int:
    """This thread's voluntary context switches (it blocked) so far."""
    for line in Path("/proc/thread-self/status").read_text().splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches in /proc/thread-self/status")


@pytest.mark.skipif(not Path("/proc/thread-self/status").exists(), reason="Linux /proc only")
def test_reading_a_big_batch_blocks_every_few_hundred_microseconds(tmp_path: Path) -> None:
    """Pacing (bus/replay_reader.py): a reader reading a long batch blocks after every
    PACE_SECONDS, so a request the scheduler keeps waiting behind it (EEVDF lag, even with the
    reader at SCHED_IDLE) waits that long at most, not a whole batch (~4 ms for ~1,800 events)."""
    log = EventLog(tmp_path / "events.db")
    body = b"\x81\xa4type\xa6custom"
    rows = [(seq, time.time(), "custom", "a", "r", "",
             p.encode(p.Header(kind=p.EVENT, id=f"e{seq}", type="custom", seq=seq)), body)
            for seq in range(1, REPLAY_LIMIT + 1)]
    log.append(rows)
    db = connect_reader(log.uri)
    try:
        switches, cpu = voluntary_switches(), time.thread_time()
        batch = read_batch(db, p.ReplayRequest(limit=REPLAY_LIMIT), REPLAY_LIMIT, 64 * 1024 * 1024)
        switches, cpu = voluntary_switches() - switches, time.thread_time() - cpu
    finally:
        db.close()
        log.close()
    assert len(batch.events) == REPLAY_LIMIT and batch.upto == batch.head
    # One block per PACE_SECONDS of reading at least (the clock is wall time, so a reader kept
    # off the CPU blocks more often, never less); a factor of 4 for the 32 rows between looks.
    assert switches >= cpu / (4 * PACE_SECONDS) - 1, (switches, cpu)
