"""Publish guarantees through a real hub: `aclose()` flushes, `confirm()` acknowledges, and an
event the hub never confirmed is counted (`events_unconfirmed`), never lost silently."""

from __future__ import annotations

import json
import signal
import sqlite3
import time
from pathlib import Path

import anyio
import pytest

from agent_bus.bus import events as ev
from agent_bus.bus import protocol as p
from agent_bus.bus.client import Peer, connect
from agent_bus.bus.errors import HubLost
from tests.bus.helpers import kill_hub, restartable_ports, start_hub
from tests.support import Proc, py, running, until

PUBLISHER = str(Path(__file__).with_name("publish_proc.py"))


def logged_topics(state: Path, run: str) -> list[str]:
    """The `topic` of every event of `run` in the hub's log, in seq order (read from SQLite)."""
    db = sqlite3.connect(state / "events.db")
    try:
        bodies = db.execute("SELECT body FROM events WHERE run = ? ORDER BY seq", (run,))
        return [ev.decode_event(body).topic for (body,) in bodies]  # type: ignore[union-attr]
    finally:
        db.close()


@pytest.mark.parametrize("attempt", range(10))
def test_publish_then_close_logs_every_event(hub: dict, attempt: int) -> None:
    """2,000 × 64 KB from a real peer process, then a normal close: all logged by the time
    the process has closed its peer (the close waits for the hub's confirmation)."""
    run = f"burst-{attempt}"
    with running(py(PUBLISHER, hub["endpoint"], run, "--count", "2000")) as proc:
        done = json.loads(proc.wait_line(lambda s: s.startswith('{"done"'), 90))
        assert proc.popen.wait(10) == 0, proc.output()
    assert done["counters"].get("events_unconfirmed", 0) == 0, done
    assert logged_topics(hub["state"], run) == [str(i) for i in range(2000)]



@pytest.mark.anyio
async def test_confirmed_publish_is_in_the_log_when_it_returns(hub: dict) -> None:
    async with connect(hub["endpoint"], name="confirmer") as peer:
        for i in range(300):
            await peer.publish(ev.TopicMessage(topic=str(i), text="y" * 1000), run="acked")
        head = await peer.confirm()
        assert logged_topics(hub["state"], "acked") == [str(i) for i in range(300)]
        assert head >= 300
        await peer.publish(ev.TopicMessage(topic="last", text=""), run="acked", confirm=True)
        assert logged_topics(hub["state"], "acked")[-1] == "last"
        assert peer.counters.get("events_unconfirmed", 0) == 0


@pytest.mark.anyio
async def test_a_confirmation_is_answered_while_the_peers_replays_wait(hub: dict) -> None:
    """A peer whose share of the log reader is taken (4 replays waiting: a subscription's gap
    fills, a journal read) still gets its publish confirmed: a confirmation reads nothing, so
    the per-peer replay limit does not refuse it (it did, `overloaded`, failing an experiment
    cell whose result was already logged)."""
    async with connect(hub["endpoint"], name="cells") as peer:
        for i in range(3000):
            await peer.publish(ev.TopicMessage(topic=str(i), text="x" * 2000), run="log")
        await peer.confirm()
        everything = p.encode(p.ReplayRequest(since=0, limit=2000))
        confirmed: list[int] = []

        async def replay() -> None:
            await peer.request(p.HUB_REPLAY, everything, timeout=60)

        async def cell(i: int) -> None:
            await peer.publish(ev.TopicMessage(topic=str(i), text=""), run="cells")
            confirmed.append(await peer.confirm())

        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(replay)
            for i in range(20):
                tg.start_soon(cell, i)
    assert len(confirmed) == 20 and min(confirmed) > 3000, confirmed
    assert sorted(logged_topics(hub["state"], "cells"), key=int) == [str(i) for i in range(20)]


@pytest.mark.anyio
async def test_close_with_the_hub_gone_counts_the_unconfirmed_events(hub: dict) -> None:
    peer = Peer(hub["endpoint"], name="orphan", flush_timeout=1.0)
    async with peer:
        for i in range(10):
            await peer.publish(ev.TopicMessage(topic=str(i), text=""), run="orphan")
        await peer.confirm()
        hub["proc"].signal(signal.SIGKILL)
        hub["proc"].popen.wait(5)
        for i in range(50):
            await peer.publish(ev.TopicMessage(topic=str(i), text=""), run="orphan")
        started = time.monotonic()
    # The close waited for the flush (bounded by flush_timeout, or the hub's liveness window
    # if the silence was noticed first), then counted what the hub never confirmed.
    assert time.monotonic() - started < 4.0
    assert peer.counters["events_unconfirmed"] == 50


@pytest.mark.anyio
async def test_confirm_raises_when_the_hub_is_gone(hub: dict) -> None:
    async with connect(hub["endpoint"], name="orphan") as peer:
        hub["proc"].signal(signal.SIGKILL)
        hub["proc"].popen.wait(5)
        for i in range(20):
            await peer.publish(ev.TopicMessage(topic=str(i), text=""), run="orphan")
        with anyio.fail_after(10), pytest.raises(HubLost):
            await peer.confirm()
        assert peer.counters["events_unconfirmed"] == 20


@pytest.mark.anyio
async def test_events_on_a_connection_lost_to_a_hub_restart_are_counted(tmp_path: Path) -> None:
    """The reconnect closes the old socket (linger 0), discarding what it still queued: those
    events are counted, the next confirm() says so, and later events are confirmed as usual."""
    (port, events), state = restartable_ports(2), tmp_path / "state"
    first = start_hub(port, events, state)
    second: Proc | None = None
    try:
        async with connect(f"tcp://127.0.0.1:{port}", name="survivor") as peer:
            for i in range(10):
                await peer.publish(ev.TopicMessage(topic=str(i), text=""), run="restart")
            await peer.confirm()
            old_session = peer.welcome.hub_session if peer.welcome else ""
            kill_hub(first, port, events)
            for i in range(30):
                await peer.publish(ev.TopicMessage(topic=f"gone{i}", text=""), run="restart")
            second = start_hub(port, events, state)
            await until(lambda: peer.welcome and peer.welcome.hub_session != old_session, 15,
                        "the peer to say hello to the restarted hub")
            assert peer.counters["events_unconfirmed"] == 30
            with anyio.fail_after(10), pytest.raises(HubLost, match="^30 events published "):
                await peer.confirm()
            for i in range(10, 15):
                await peer.publish(ev.TopicMessage(topic=str(i), text=""), run="restart")
            await peer.confirm()  # nothing lost since the last report
        assert logged_topics(state, "restart") == [str(i) for i in range(15)]
    finally:
        first.stop()
        if second is not None:
            second.stop()
