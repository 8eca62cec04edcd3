"""What the hub has logged of the events a peer published: the `Ledger` behind `Peer.confirm()`.

A `hub.replay` request is answered only after the hub has committed every event it read before
it, and ZeroMQ keeps one connection's messages in order, so its reply confirms every event the
peer sent before it on the same socket (docs/reliability.md, "Publish guarantees"). A socket
closed on a reconnect (linger 0) discards what it still queued: the events sent on it since the
last confirmation are counted in `counters["events_unconfirmed"]` (not resent: some may be in the
log already, and the hub does not deduplicate), and the next `confirm()` raises `HubLost` naming
how many.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import anyio

from agent_bus.bus import protocol as p
from agent_bus.bus.errors import HubLost, RequestError

if TYPE_CHECKING:
    from agent_bus.bus.link import PeerLink

log = logging.getLogger("bus.client")

# A replay that starts past any seq: the reply carries no events, only the log's head.
CONFIRM_BODY = p.encode(p.ReplayRequest(since=2**62, limit=1))


class Ledger:
    """A peer's publish accounting: of the events it handed to a socket
    (`Outbox.events_sent`), how many the hub confirmed (the rest of the current socket's are in
    flight), and how many unconfirmed ones a closed socket took with it (all; and, with the
    refused ones, as far as `confirm()` has reported them)."""

    def __init__(self, peer: PeerLink) -> None:
        self._peer = peer
        self.confirmed = 0
        self.unconfirmed = 0
        self._reported = 0
        self.confirming = False  # a background confirmation is in flight

    def in_flight(self) -> bool:
        """Events were sent that the hub has not confirmed yet."""
        return self._peer.outbox.events_sent > self.confirmed

    async def confirm(self) -> int:
        """`Peer.confirm()`: the round trip, then `HubLost` when events may be missing."""
        peer = self._peer
        try:
            head = await self.round_trip()
        finally:
            missing = self.unconfirmed + peer.counters.get("events_refused", 0)
            lost = missing - self._reported
            self._reported = missing
        if lost:
            raise HubLost(f"{lost} events published since the last `confirm()` may be missing "
                          f"from the log of the hub at {peer.hub}: their connection closed "
                          "before the hub confirmed them (counted in `events_unconfirmed`) or "
                          "the hub refused them (`events_refused`)", p.HUB_LOST)
        return head

    async def round_trip(self) -> int:
        """One `hub.replay` round trip: its reply follows the events sent before it on the same
        socket, logged. (Held events are sent before the request, so they count too.)"""
        outbox = self._peer.outbox
        mark = outbox.events_sent + outbox.held_events()
        reply = await self._peer.request(p.HUB_REPLAY, CONFIRM_BODY, timeout=None)
        self.confirmed = max(self.confirmed, mark)
        return p.decode(reply, p.ReplayBatch).head

    async def in_background(self) -> None:
        """Confirm what was sent so far, so that a lost connection counts only the events sent
        since (about a second's worth), not every event it ever carried."""
        try:
            await self.round_trip()
        except RequestError:
            pass  # the connection was lost: closing it counted the unconfirmed events
        finally:
            self.confirming = False

    async def flush_on_close(self, timeout: float) -> None:
        """Wait, at most `timeout`, until the hub confirms every event published so far:
        closing the socket soon after would discard a backlog still queued in it. What stays
        unconfirmed is counted when the socket closes."""
        peer = self._peer
        if peer.welcome is None or (not self.in_flight() and not peer.outbox.items):
            return  # nothing in flight: no round trip (most CLI commands publish nothing)
        with anyio.CancelScope(shield=True), anyio.move_on_after(timeout):
            try:
                await self.round_trip()
            except RequestError as exc:  # the hub went away: counted at the close below
                log.warning("%s: published events not confirmed before closing: %s",
                            peer.name, exc)

    def refused(self, header: p.Header) -> None:
        """The hub refused one of the events (docs/protocol.md §6, §8): counted (`confirm()`
        reports it), logged the first time and every 1000th."""
        peer = self._peer
        peer.count("events_refused")
        n = peer.counters["events_refused"]
        if n == 1 or n % 1000 == 0:
            log.warning("%s: the hub refused an event (#%d): %s", peer.name, n, header.error)

    def socket_closed(self) -> None:
        """The socket is gone with whatever it still queued: count the events sent on it that
        the hub never confirmed. On a reconnect, held events (never sent) wait for the next
        connection; on close they are counted too."""
        peer = self._peer
        outbox, counters = peer.outbox, peer.counters
        lost = outbox.events_sent - self.confirmed
        self.confirmed = outbox.events_sent
        if outbox.items:
            dropped, replies = outbox.drop(events=peer.closing)
            lost += dropped
            if replies:
                counters["reply_lost"] = counters.get("reply_lost", 0) + replies
        if not lost:
            return
        self.unconfirmed += lost
        counters["events_unconfirmed"] = self.unconfirmed
        log.warning("%s: %d published events were not confirmed by the hub at %s before the "
                    "connection closed; they may be missing from its log", peer.name, lost,
                    peer.hub)
