"""Issue 8 §3: the event log under load — a watcher killed and resumed with `--since` ends with
exactly the log (no gap, no duplicate); a SIGKILLed hub loses no event it had published."""

from __future__ import annotations

import json
import signal
import sqlite3
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from agent_bus.bus.client import connect
from tests.store_cluster import Cluster
from tests.support import ROOT, Proc, busctl, py, wait_for

PUBLISHER = str(ROOT / "tests" / "fault" / "publisher_proc.py")


def log_seqs(state: Path) -> list[int]:
    db = sqlite3.connect(state / "events.db")
    try:
        return [row[0] for row in db.execute("SELECT seq FROM events ORDER BY seq")]
    finally:
        db.close()


def watched_seqs(proc: Proc) -> list[int]:
    """Seqs of the complete JSON lines a watcher printed (a line cut by SIGKILL is not seen)."""
    seqs = []
    for line in proc.lines:
        if line.startswith("{"):
            try:
                seqs.append(json.loads(line)["seq"])
            except ValueError:
                continue
    return seqs


def hub_proc(state: Path, endpoint: str = "tcp://127.0.0.1:0", store: str = "") -> Proc:
    return Proc(busctl("hub", "--hub", endpoint, "--state-dir", str(state),
                       "--heartbeat-interval", "0.2", *(["--store", store] if store else [])))


def killed_watcher_sees_the_whole_log(tmp_path: Path, total: int,
                                      log: Callable[[], list[int]] | None = None,
                                      store: str = "") -> None:
    """`log`: the seqs in the hub's store (default: its SQLite log)."""
    state = tmp_path / "hub"
    log_now = log or (lambda: log_seqs(state))
    hub = hub_proc(state, store=store)
    procs: list[Proc] = [hub]
    try:
        endpoint = hub.wait_ready()["endpoint"]
        seen: list[int] = []
        watcher = Proc(busctl("watch", "--hub", endpoint, "--json", "--since", "0"))
        procs.append(watcher)
        publisher = Proc(py(PUBLISHER, endpoint, str(total)))
        procs.append(publisher)
        publisher.wait_ready()
        for kill_at in (total // 4, total // 2, 3 * total // 4):  # three kills, under load
            wait_for(lambda: len(seen) + len(watched_seqs(watcher)) >= kill_at, 60,
                     f"the watcher to reach {kill_at} events")
            watcher.signal(signal.SIGKILL)
            watcher.stop()
            seen += watched_seqs(watcher)
            watcher = Proc(busctl("watch", "--hub", endpoint, "--json", "--since", str(seen[-1])))
            procs.append(watcher)
        publisher.wait_line(lambda s: s.startswith('{"done"'), 120)
        head = log_now()[-1]
        wait_for(lambda: (watched_seqs(watcher) or [0])[-1] >= head, 60,
                 "the last watcher to reach the head of the log")
        seen += watched_seqs(watcher)
        logged = log_now()
        assert len(logged) >= total
        assert seen[: len(logged)] == logged, "the resumed watchers' sequence differs from the log"
        assert len(seen) == len(set(seen)), "a duplicate"
    finally:
        for proc in reversed(procs):
            proc.stop()


def test_watcher_killed_three_times_matches_the_log(tmp_path: Path) -> None:
    killed_watcher_sees_the_whole_log(tmp_path, 20_000)


def test_watcher_killed_three_times_matches_the_jetstream_log(tmp_path: Path,
                                                              jetstream: Cluster) -> None:
    """The same with the hub's log in a JetStream stream (the log read from the servers)."""
    url = jetstream.stream_url()
    killed_watcher_sees_the_whole_log(
        tmp_path, 8_000, lambda: [seq for seq, _, _ in jetstream.stream_seqs(url)], url)


@pytest.mark.slow
def test_watcher_killed_three_times_matches_the_log_100k(tmp_path: Path) -> None:
    killed_watcher_sees_the_whole_log(tmp_path, 100_000)


@pytest.mark.anyio
async def test_sigkilled_hub_loses_no_published_event(tmp_path: Path) -> None:
    state = tmp_path / "hub"
    hub = hub_proc(state)
    publisher: Proc | None = None
    try:
        endpoint = hub.wait_ready()["endpoint"]
        received: list[tuple[int, bytes]] = []
        async with connect(endpoint, name="witness") as bus:
            async with bus.subscribe() as sub:
                publisher = Proc(py(PUBLISHER, endpoint, "200000"))
                publisher.wait_ready()

                async def read() -> None:
                    async for envelope in sub:
                        received.append((envelope.header.seq, envelope.event.text
                                         if hasattr(envelope.event, "text") else b""))
                        if len(received) == 5_000:
                            hub.signal(signal.SIGKILL)  # mid-stream, mid-batch
                            return

                with anyio.fail_after(60):
                    await read()
                # what was already in flight to us still counts as published
                with anyio.move_on_after(0.5):
                    async for envelope in sub:
                        received.append((envelope.header.seq, envelope.event.text
                                         if hasattr(envelope.event, "text") else b""))
        assert hub.popen.wait(5) == -signal.SIGKILL
        log = set(log_seqs(state))
        missing = [seq for seq, _ in received if seq not in log]
        assert not missing, f"{len(missing)} published events not in the log: {missing[:5]}"
        # A restarted hub continues the sequence after the log's last seq.
        last = max(log)
        hub2 = hub_proc(state)
        try:
            assert hub2.wait_ready()["seq"] == last
        finally:
            hub2.stop()
    finally:
        if publisher is not None:
            publisher.stop()
        hub.stop()
