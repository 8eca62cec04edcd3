"""Events too large for the live stream go out as stubs (an empty body frame); a `Subscription`
reads their bodies from the log, so a subscriber sees every event whole and in order, while what
the hub queues for a subscriber stays small (docs/protocol.md, "Event stubs")."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import zmq

from agent_bus.bus import events as ev
from agent_bus.bus import protocol as p
from agent_bus.bus.client import connect
from tests.support import until

pytestmark = pytest.mark.anyio

INLINE = 8 * 1024  # the hub's default publish_inline_bytes


async def test_subscription_gets_large_events_whole_and_in_order(hub: dict[str, Any]) -> None:
    texts = ["small-1", "L" * (INLINE * 12), "small-2", "M" * (INLINE + 1), "small-3"]
    ctx = zmq.Context()
    raw = ctx.socket(zmq.SUB)
    raw.linger = 0
    raw.setsockopt(zmq.SUBSCRIBE, b"ext/")
    raw.setsockopt(zmq.SUBSCRIBE, p.HEARTBEAT_TOPIC)
    raw.connect(hub["events"])
    try:
        # Subscribed once the hub's heartbeat reaches it (sent soon after each new subscription):
        # an event published before that would not reach this socket (ZeroMQ's slow joiner).
        await until(lambda: raw.poll(0) and raw.recv_multipart()[0] == p.HEARTBEAT_TOPIC, 10,
                    "the raw subscriber's subscription reached the hub (its heartbeat)")
        async with connect(hub["endpoint"], name="stubs") as peer, \
                peer.subscribe(["ext/"]) as events:
            for text in texts:
                await peer.publish(ev.TopicMessage(topic="t", text=text), agent="a")
            got: list[str] = []
            seqs: list[int] = []
            with anyio.fail_after(10):
                async for envelope in events:
                    assert isinstance(envelope.event, ev.TopicMessage)
                    got.append(envelope.event.text)
                    seqs.append(envelope.header.seq)
                    if len(got) == len(texts):
                        break
            assert got == texts and seqs == sorted(seqs)
            status = await peer.status()
            assert status.counters.get("published_stubs") == 2
        # what a raw subscriber saw: the two large events as stubs (an empty body frame)
        bodies = []
        while raw.poll(1000) and len(bodies) < len(texts):
            frames = raw.recv_multipart()
            if frames[0] != p.HEARTBEAT_TOPIC:
                bodies.append(frames[3])
        assert [len(b) == 0 for b in bodies] == [False, True, False, True, False]
    finally:
        raw.close(0)
        ctx.term()
