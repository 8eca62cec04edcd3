"""Journaled before published without waiting: with `Peer.before_send` set to the store's commit
(as the coordinator sets it), a held event is handed to the socket only after the writes made
before it are committed, even when the peer flushes before the end-of-iteration commit runs,
and the events of one iteration travel together (one multi-body message per run of a type)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from agent_bus.agents.coordinator.persistence import ConversationStore, JournaledRun
from agent_bus.bus import events as ev
from agent_bus.bus import protocol as p
from agent_bus.bus.client import connect
from tests.bus.test_event_coalescing import RecordingHub, recording_hub
from tests.coordinator.test_group_commit import stored_runs
from tests.support import until

pytestmark = pytest.mark.anyio


class CheckingHub(RecordingHub):
    """Records, with each event message, the journal as another connection saw it on arrival."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seen: list[tuple[str, set[str]]] = []
        super().__init__(p.MAX_EVENT_BODIES)

    def on_event(self, header: dict[str, Any], bodies: list[bytes]) -> None:
        journal = stored_runs(self.path)  # at once, before anything else runs here
        for body in bodies:
            self.seen.append((msgspec.msgpack.decode(body)["topic"], journal))
        super().on_event(header, bodies)


def run(run_id: str) -> JournaledRun:
    return JournaledRun(run_id=run_id, agent="a", session="s", coordinator="c")


async def test_an_event_leaves_only_after_the_writes_before_it_are_committed(
        tmp_path: Path) -> None:
    store = ConversationStore(tmp_path)
    store.defer_commits()
    rec = CheckingHub(store.path)
    try:
        async with connect(rec.endpoint, name="journaling") as peer:
            peer.before_send = store.commit
            # One iteration: an event is held first (its flush is scheduled before the group's
            # commit callback), then a write, then more events; nobody awaits the commit.
            await peer.publish(ev.TopicMessage(topic="before", text=""), run="r")
            store.run_begin(run("r1"))
            for i in range(3):
                await peer.publish(ev.TopicMessage(topic=f"after {i}", text=""), run="r")
            await until(lambda: len(rec.seen) == 4, what="the four events")
            assert [t for t, _ in rec.seen] == ["before", "after 0", "after 1", "after 2"]
            assert all("r1" in journal for _, journal in rec.seen), rec.seen
            assert [len(b) for _, b in rec.events] == [4]  # one iteration, one message
            # A write followed by a request (not held): the held events before it go first,
            # committed; the request itself is not held back.
            store.run_begin(run("r2"))
            await peer.publish(ev.TopicMessage(topic="start", text=""), run="r")
            await peer.request(p.HUB_REPLAY, p.encode(p.ReplayRequest(since=2**62, limit=1)))
            assert rec.seen[-1] == ("start", {"r1", "r2"})
    finally:
        rec.close()
        store.close()


async def test_without_the_hook_nothing_changes_for_other_peers(tmp_path: Path) -> None:
    with recording_hub(p.MAX_EVENT_BODIES) as rec:
        async with connect(rec.endpoint, name="plain") as peer:
            assert peer.before_send is None
            await peer.publish(ev.TopicMessage(topic="x", text=""), run="r")
            await until(lambda: len(rec.bodies()) == 1, what="the event")
