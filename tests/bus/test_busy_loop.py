"""A peer whose own event loop is busy past the liveness window keeps its connection.

Issue 11 §8: the shipped client must never drop a live hub because its loop was busy. While the
loop publishes without yielding, the hub's heartbeats arrive and wait unread (the sends also
consume the edge of ZeroMQ's notification fd); they are word from the hub all the same. Before
the fix, the first housekeeping pass after the burst declared the hub lost and the reconnect
discarded the queued events (`events_unconfirmed`).
"""

from __future__ import annotations

import time

import pytest

from agent_bus.bus import events as ev
from agent_bus.bus.client import connect
from agent_bus.bus.peer import PeerState


@pytest.mark.anyio
async def test_a_loop_busy_past_the_liveness_window_does_not_lose_the_hub(hub: dict) -> None:
    async with connect(hub["endpoint"], name="busy") as peer:
        await peer.status()
        assert peer.welcome is not None
        expiry = peer.welcome.heartbeat_interval * peer.welcome.liveness
        busy_until = time.monotonic() + expiry + 1.0
        sent = 0
        # User code that keeps the loop busy: it computes, and publishes every millisecond.
        # `publish` does not yield while there is room to send, so no other task of this peer
        # runs until the loop ends (this is the load under test, not a wait for a condition).
        # Held events go out every HOLD_MAX publishes (~1 s here): the hub keeps hearing us.
        while time.monotonic() < busy_until:
            await peer.publish(ev.TopicMessage(topic=str(sent), text="x"), run="busy")
            sent += 1
            spin_until = time.monotonic() + 0.001
            while time.monotonic() < spin_until:
                pass
        await peer.confirm()  # raises HubLost had the peer dropped the connection
        assert peer.state is PeerState.READY
        assert peer.counters.get("events_unconfirmed", 0) == 0, peer.counters
        assert sent > 0
