"""Two invariants of the hub's event path that no other test pinned down (issue 29, item 6; both
are mutants of tests/mutation/run_mutants.py):

- `hub.replay`: a batch that stops because it scanned `limit` rows must not claim to reach the
  head (`upto == head`), or a reader stops early and silently skips the rest of the log.
- The heartbeat announcing seq N is published only after every event up to N: a subscriber that
  sees a heartbeat seq above its last event takes that for a loss.

Real SQLite and real ZeroMQ sockets, in this process (the pipeline's own log reader process too).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq

from agent_bus.bus import events as ev
from agent_bus.bus import protocol as p
from agent_bus.bus.pipeline import SUBSCRIBE_BEAT_GAP, EventPipeline, Retention
from agent_bus.bus.store.sqlite import SqliteStore as EventLog
from agent_bus.bus.store.sqlite import connect_reader, read_batch

BUDGET = 256 * 1024  # the default `replay_bytes`


def test_a_batch_cut_at_the_row_limit_does_not_claim_the_head(tmp_path: Path) -> None:
    total, limit = 2500, p.ReplayRequest().limit  # 2,000: the default
    assert limit == 2000
    log = EventLog(tmp_path / "events.db")
    body = ev.encode_event(ev.TopicMessage(topic="t", text="x"))
    rows = [(seq, 0.0, "topic_message", "", "", "", p.encode(p.Header(kind=p.EVENT, seq=seq,
             type="topic_message")), body) for seq in range(1, total + 1)]
    log.append(rows)
    db = connect_reader(log.uri)
    try:
        first = read_batch(db, p.ReplayRequest(since=0), total, BUDGET)
        assert (len(first.events), first.upto, first.head) == (limit, limit, total)
        seen = len(first.events)
        since = first.upto
        while since < total:  # a reader goes on until upto == head (docs/protocol.md, 5)
            batch = read_batch(db, p.ReplayRequest(since=since), total, BUDGET)
            seen += len(batch.events)
            since = batch.upto
        assert seen == total  # none skipped
        exact = read_batch(db, p.ReplayRequest(since=total - limit), total, BUDGET)
        assert exact.upto == total  # exactly `limit` rows left: this one does reach the head
    finally:
        db.close()
        log.close()


def test_a_heartbeat_is_published_after_the_events_it_counts(tmp_path: Path) -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    sub = ctx.socket(zmq.SUB)
    pipeline = None
    try:
        pub.linger = sub.linger = 0
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{port}")
        assert pub.poll(10_000), "the subscription never reached the XPUB"
        pub.recv()  # the subscription is in place: nothing published from now on is lost
        pipeline = EventPipeline(ctx, pub, tmp_path / "events.db", "s", lambda *a, **k: 0,
                                 lambda rows: None, BUDGET, 8192, Retention())
        for i in range(3):  # stamped, still in the pass's batch (the hub flushes per pass)
            pipeline.emit(ev.TopicMessage(topic="t", text=str(i)))
        pipeline.publish_heartbeat()
        got: list[tuple[str, int]] = []
        deadline = time.monotonic() + 10
        while not got or got[-1][0] != "hb":
            assert sub.poll(max(0.0, deadline - time.monotonic()) * 1000), got
            frames = sub.recv_multipart()
            header = msgspec.msgpack.decode(frames[2])
            got.append(("hb" if frames[0] == b"hb" else header["type"], header["seq"]))
        assert got == [("topic_message", 1), ("topic_message", 2), ("topic_message", 3),
                       ("hb", 3)], got
    finally:
        if pipeline is not None:
            pipeline.close()
        sub.close(0)
        pub.close(0)
        ctx.term()


def test_a_lone_subscription_is_answered_at_once_a_burst_once_per_gap(tmp_path: Path) -> None:
    """The heartbeat that confirms a new subscription is due at once when none went out within
    SUBSCRIBE_BEAT_GAP (a prompt's subscription waited the whole gap), else the gap after the
    last: a burst of subscriptions still costs the stream one heartbeat per gap."""
    ctx: zmq.Context[Any] = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pipeline = None
    subs: list[zmq.Socket[Any]] = []
    try:
        pub.linger = 0
        pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        pipeline = EventPipeline(ctx, pub, tmp_path / "events.db", "s", lambda *a, **k: 0,
                                 lambda rows: None, BUDGET, 8192, Retention())

        def subscribe(topic: bytes) -> tuple[float, float]:
            """Subscribe a new SUB socket; (just before, just after) the hub's side noted it."""
            sub = ctx.socket(zmq.SUB)
            sub.linger = 0
            subs.append(sub)
            sub.setsockopt(zmq.SUBSCRIBE, topic)
            sub.connect(f"tcp://127.0.0.1:{port}")
            assert pub.poll(10_000), "the subscription never reached the XPUB"
            before = time.monotonic()
            pipeline.drain_subscriptions()
            return before, time.monotonic()

        assert pipeline.sub_beat_at == math.inf  # nothing to answer
        before, after = subscribe(b"a/")
        assert before <= pipeline.sub_beat_at <= after  # due at once
        pipeline.publish_heartbeat()
        beat = time.monotonic()
        assert pipeline.sub_beat_at == math.inf
        _, after = subscribe(b"b/")  # due the gap after that heartbeat, or at once past it
        assert beat + SUBSCRIBE_BEAT_GAP - 1e-3 <= pipeline.sub_beat_at
        assert pipeline.sub_beat_at <= max(after, beat + SUBSCRIBE_BEAT_GAP)
    finally:
        if pipeline is not None:
            pipeline.close()
        for sub in subs:
            sub.close(0)
        pub.close(0)
        ctx.term()
