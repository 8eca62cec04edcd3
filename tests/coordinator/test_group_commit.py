"""The conversation store's group commit (`ConversationStore.defer_commits`): the writes of one
event-loop iteration share one transaction, `committed()` waits for it, a failed write is undone
alone, and nothing is visible to another connection before the commit."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import anyio
import pytest

from agent_bus.agents.coordinator.persistence import ConversationStore, JournaledRun
from agent_bus.bus.messages import user_text

pytestmark = pytest.mark.anyio


def stored_runs(path: Path) -> set[str]:
    """Run ids in the journal as another process (connection) sees them."""
    db = sqlite3.connect(path)
    try:
        return {r for (r,) in db.execute("SELECT run_id FROM runs")}
    finally:
        db.close()


def run(run_id: str) -> JournaledRun:
    return JournaledRun(run_id=run_id, agent="a", session="s", coordinator="c")


async def test_writes_of_one_iteration_share_one_commit(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path)
    store.defer_commits()
    try:
        before = store.commits

        async def session(i: int) -> None:  # what each session does for an event
            store.run_begin(run(f"r{i}"))
            store.append("a", f"s{i}", 0, [user_text(f"hello {i}")])
            await store.committed()
            assert f"r{i}" in stored_runs(store.path)  # durable before it would be published

        async with anyio.create_task_group() as tg:
            for i in range(10):
                tg.start_soon(session, i)
        assert store.commits - before == 1  # 20 writes of 10 sessions, one transaction
        assert stored_runs(store.path) == {f"r{i}" for i in range(10)}
        assert [m.content for m in store.messages("a", "s3")] == [user_text("hello 3").content]
    finally:
        store.close()


async def test_nothing_is_visible_before_the_commit_and_close_commits(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path)
    store.defer_commits()
    store.run_begin(run("r1"))
    assert stored_runs(store.path) == set()  # still in the open group
    assert [r.run_id for r in store.live_runs("c")] == ["r1"]  # this connection sees it
    store.close()  # commits what is pending
    assert stored_runs(store.path) == {"r1"}


async def test_a_failed_write_is_undone_alone(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path)
    store.defer_commits()
    try:
        store.new_session("a", "s1")
        store.run_begin(run("r1"))
        with pytest.raises(sqlite3.IntegrityError):
            store.new_session("a", "s1")  # the same session again: its savepoint is undone
        store.run_begin(run("r2"))
        await store.committed()
        assert stored_runs(store.path) == {"r1", "r2"}
        assert store.sessions("a") == ["s1"]
    finally:
        store.close()


def test_outside_an_event_loop_each_write_commits_at_once(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path)
    store.defer_commits()
    try:
        store.run_begin(run("r1"))
        assert stored_runs(store.path) == {"r1"}
    finally:
        store.close()


async def test_a_history_grown_by_several_messages_is_synced_once_in_the_commit(
        tmp_path: Path) -> None:
    """`at_commit` (what the coordinator's sessions use at each message end): the recorder
    syncs once per group, just before it commits, so the messages are durable with the group
    and a turn's tool results cost one insert; outside a loop it syncs at once."""
    store = ConversationStore(tmp_path)
    store.defer_commits()
    try:
        store.new_session("a", "s1")
        await store.committed()
        recorder = store.recorder("a", "s1")
        history = []
        for i in range(4):  # four messages ending in one iteration, each asking for a sync
            history.append(user_text(f"result {i}"))
            store.at_commit(lambda: recorder.sync(history))
        assert recorder.appends == 0  # not yet: at the commit
        await store.committed()
        assert recorder.appends == 1
        other = ConversationStore(tmp_path)  # another connection sees all four
        try:
            assert [m.content for m in other.messages("a", "s1")] == [m.content for m in history]
        finally:
            other.close()
    finally:
        store.close()
    plain = ConversationStore(tmp_path)
    try:
        recorder = plain.recorder("a", "s1", history)
        history.append(user_text("later"))
        plain.at_commit(lambda: recorder.sync(history))  # no deferred commits: synced now
        assert len(plain.messages("a", "s1")) == 5
    finally:
        plain.close()


async def test_group_commits_copy_the_wal_back_on_a_thread(tmp_path: Path) -> None:
    """SQLite's automatic checkpoint (which runs inside the commit crossing its threshold, in
    the coordinator's event loop) is off; the event log's `Checkpointer` thread copies the WAL
    back every CHECKPOINT_COMMITS commits, and the WAL starts over after each copy, so it stays
    about one cycle big however long the coordinator runs; the thread ends with the store.
    Without the thread the WAL holds every commit: 4 cycles."""
    import threading
    import time

    from agent_bus.agents.coordinator import persistence

    store = ConversationStore(tmp_path)
    store.defer_commits()
    wal = Path(f"{store.path}-wal")
    cycle = persistence.CHECKPOINT_COMMITS
    checkpointer = store._checkpointer
    assert checkpointer is not None
    try:
        assert store.db.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0
        text = "x" * 2000  # a message row and its index: a few pages a commit
        for i in range(4 * cycle):
            store.append("a", "s", i, [user_text(f"{i} {text}")])
            await store.committed()
            if i == cycle // 2:
                half = wal.stat().st_size  # half a cycle's WAL, to size the bound
            if (i + 1) % cycle == 0:  # the copy asked for: its end, whatever the machine's speed
                deadline = time.monotonic() + 30
                while checkpointer.done < checkpointer.asks and time.monotonic() < deadline:
                    await anyio.sleep(0.005)
                assert checkpointer.done == checkpointer.asks == (i + 1) // cycle
        # one cycle and the commit that started it over, not four cycles (8 halves)
        assert wal.stat().st_size <= 3 * half, (wal.stat().st_size, half)
        assert len(store.messages("a", "s")) == 4 * cycle
    finally:
        store.close()
    assert not [t for t in threading.enumerate() if t.name == "conversation-store-checkpoint"]
