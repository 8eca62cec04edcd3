"""The hub's window of recent events (bus/recent.py): a replay that starts within it is answered
from memory with exactly what the log's reader would answer, and a live subscriber's gap is
filled from it without the reader process."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import anyio
import msgspec
import pytest

from agent_bus.bus import events as ev
from agent_bus.bus import protocol as p
from agent_bus.bus.client import connect
from agent_bus.bus.recent import BATCH_BYTES, RecentEvents
from agent_bus.bus.store import Retention, Row, open_reader, open_store
from tests.support import Proc, busctl

TYPES = [("topic_message", "a1", "r1", ""), ("message_update", "a2", "r2", "exp-1"),
         ("tool_execution_start", "a1", "r3", "exp-2"), ("topic_message", "a3", "r1", "exp-1")]


def make_rows(first: int, count: int, body_bytes: int = 60) -> tuple[list[Row], list[bytes], int]:
    """`count` rows from seq `first`, of the kinds in TYPES in turn, as the pipeline stamps
    them (a real header; the topic the hub publishes under)."""
    rows: list[Row] = []
    topics: list[bytes] = []
    size = 0
    for seq, (type_, agent, run, experiment) in zip(range(first, first + count),
                                                    itertools.cycle(TYPES), strict=False):
        header = msgspec.msgpack.encode(p.Header(
            kind=p.EVENT, id=f"id{seq}", type=type_, agent=agent, run=run,
            experiment=experiment, seq=seq, ts=1000.0 + seq))
        body = bytes([seq % 251]) * (body_bytes + seq % 7)
        rows.append((seq, 1000.0 + seq, type_, agent, run, experiment, header, body))
        topics.append(p.event_topic(ev.event_family(type_), agent, run, type_))
        size += len(header) + len(body)
    return rows, topics, size


def seqs_of(batch: p.ReplayBatch) -> list[int]:
    return [p.decode_header(header).seq for header, _ in batch.events]


def test_it_keeps_the_newest_batches_within_its_bytes() -> None:
    window = RecentEvents(max_bytes=50_000)
    for first in range(1, 1001, 100):
        window.add(*make_rows(first, 100))
    assert window.bytes <= 50_000
    assert window.last_seq == 1000
    assert 1 < window.first_seq <= 1000 - 100  # older batches dropped, more than one kept
    # what it still references is what it counts: dropped batches' rows are freed at once
    # (not when the list is compacted: 256 KiB events took the hub past its memory budget)
    held = sum(len(row[6]) + len(row[7]) for rows, _, _ in window._batches for row in rows)
    assert held == window.bytes
    assert RecentEvents(0).read_batch(p.ReplayRequest(since=0), 0) is None


def test_a_replay_from_before_the_window_or_not_at_the_head_goes_to_the_log() -> None:
    window = RecentEvents(max_bytes=1 << 20)
    window.add(*make_rows(101, 50))
    assert window.read_batch(p.ReplayRequest(since=99), 150) is None  # seq 100 is not held
    assert window.read_batch(p.ReplayRequest(since=100), 151) is None  # the head is not held
    assert window.read_batch(p.ReplayRequest(since=150), 150) is None  # nothing to read
    batch = window.read_batch(p.ReplayRequest(since=100), 150)
    assert batch is not None and seqs_of(batch) == list(range(101, 151))
    assert (batch.upto, batch.head) == (150, 150)


def test_seqs_that_stop_being_contiguous_empty_the_window() -> None:
    window = RecentEvents(max_bytes=1 << 20)
    window.add(*make_rows(1, 10))
    window.add(*make_rows(15, 10))  # 11..14 never reached it (a store that resynced its head)
    assert (window.first_seq, window.last_seq) == (15, 24)
    assert window.read_batch(p.ReplayRequest(since=5), 24) is None


@pytest.mark.parametrize("request_", [
    p.ReplayRequest(since=0),
    p.ReplayRequest(since=37),
    p.ReplayRequest(since=37, limit=9),
    p.ReplayRequest(since=10, topics=["tool."]),
    p.ReplayRequest(since=10, topics=["msg.a2", "topic.a3"]),
    p.ReplayRequest(since=3, experiment="exp-1"),
    p.ReplayRequest(since=3, experiment="exp-1", topics=["topic."]),
    p.ReplayRequest(since=0, experiment="nobody"),
], ids=repr)
def test_the_window_answers_what_the_logs_reader_answers(tmp_path: Path,
                                                         request_: p.ReplayRequest) -> None:
    """Whole replays, batch after batch to the head, read from the window and from a real
    SQLite log holding the same rows, give the same events and the same head; each batch
    from the window stays within its byte budget."""
    store = open_store("", tmp_path / "events.db", "test", Retention())
    window = RecentEvents(max_bytes=1 << 22)
    head = 0
    try:
        for first in range(1, 2001, 250):  # batches as the pipeline appends them
            rows, topics, size = make_rows(first, 250, body_bytes=200)
            store.append(rows)
            window.add(rows, topics, size)
            head = rows[-1][0]
        reader = open_reader(store.reader_uri)
        try:
            from_log = replay_all(lambda r: reader.read_batch(r, head, 4096), request_)
        finally:
            reader.close()
        batches: list[p.ReplayBatch] = []

        def from_window(r: p.ReplayRequest) -> p.ReplayBatch:
            batch = window.read_batch(r, head, 4096)
            assert batch is not None
            batches.append(batch)
            return batch

        assert replay_all(from_window, request_) == from_log
        assert len(batches) > 1
        for batch in batches:  # within the budget, but for the event that crosses it
            sizes = [len(h) + len(b) for h, b in batch.events]
            assert sum(sizes[:-1]) < 4096
    finally:
        store.close()


def replay_all(read, request: p.ReplayRequest) -> tuple[list[tuple[bytes, bytes]], int]:  # type: ignore[no-untyped-def]
    """Every event of a replay, asking batch after batch as a client does, and the head."""
    events: list[tuple[bytes, bytes]] = []
    since = request.since
    while True:
        batch = read(msgspec.structs.replace(request, since=since))
        events.extend((bytes(h), bytes(b)) for h, b in batch.events)
        if batch.upto >= batch.head:
            return events, batch.head
        assert batch.upto > since
        since = batch.upto


def test_budget_is_at_most_the_batch_bytes() -> None:
    window = RecentEvents(max_bytes=1 << 24)
    window.add(*make_rows(1, 4000, body_bytes=100))
    batch = window.read_batch(p.ReplayRequest(since=0), 4000, budget=1 << 20)
    assert batch is not None
    assert sum(len(h) + len(b) for h, b in batch.events[:-1]) < BATCH_BYTES < 4000 * 100


@pytest.mark.anyio
@pytest.mark.parametrize("recent_bytes", [None, 0])
async def test_a_live_subscribers_gap_is_filled_from_memory(tmp_path: Path,
                                                            recent_bytes: int | None) -> None:
    """A subscriber loses events on the wire (as one past its PUB queue does): the gap is filled,
    every seq once and in order; by the hub itself from memory (its `replay_from_memory`
    counter), or by the log's reader with `--recent-bytes 0`."""
    extra = [] if recent_bytes is None else ["--recent-bytes", str(recent_bytes)]
    hub = Proc(busctl("hub", "--hub", "tcp://127.0.0.1:0", "--state-dir", str(tmp_path / "s"),
                      *extra))
    try:
        endpoint = hub.wait_ready()["endpoint"]
        async with connect(endpoint, name="watcher") as peer:
            async with peer.subscribe() as sub:
                for i in range(40):
                    await peer.publish(ev.TopicMessage(topic="t", text=str(i)))
                texts: list[str] = []
                seqs: list[int] = []
                with anyio.fail_after(20):
                    lost = 0
                    while lost < 25:  # lose 25 live events on the wire
                        frames = await sub._recv()
                        if frames[0] != p.HEARTBEAT_TOPIC:
                            lost += 1
                    async for envelope in sub:
                        if isinstance(envelope.event, ev.TopicMessage):
                            texts.append(envelope.event.text)
                            seqs.append(envelope.header.seq)
                            if len(texts) == 15 + 25:
                                break
                # (the first 25 were lost before anything was read: all 40 come in order)
                status = await peer.status()
        assert texts == [str(i) for i in range(40)]
        assert seqs == sorted(set(seqs))
        assert sub.filled == 25
        from_memory = status.counters.get("replay_from_memory", 0)
        if recent_bytes == 0:
            assert from_memory == 0
            assert status.budgets["recent_bytes"].limit == 0
        else:
            assert from_memory >= 1
            assert status.budgets["recent_bytes"].used > 0
    finally:
        hub.stop()


def test_retention_that_removes_rows_empties_the_window(tmp_path: Path) -> None:
    """The window never answers with an event the log no longer has: the pipeline empties it
    when retention removed anything (here: a run's deltas once it ended)."""
    import zmq

    from agent_bus.bus.pipeline import EventPipeline

    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.bind("inproc://recent-test")
    pipeline = EventPipeline(ctx, pub, tmp_path / "events.db", "s", lambda *a: 0,
                             lambda rows: None, 256 * 1024, 8192,
                             Retention(deltas_until_end=True), recent_bytes=1 << 20)
    try:
        for type_ in ("message_update", "message_update", "message_end"):
            pipeline.stamp(p.Header(kind=p.EVENT, type=type_, run="r1"), b"\x80")
        pipeline.flush()
        assert len(pipeline.recent) == 1
        pipeline.tick(time.monotonic())  # drops r1's deltas from the log
        assert len(pipeline.recent) == 0
    finally:
        pipeline.close()
        pub.close(0)
        ctx.term()
