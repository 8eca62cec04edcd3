"""A peer's periodic duties, in one background task (`Housekeeping.run`, started by `bus.peer`):
expire its calls client-side, notice the hub's silence and reconnect, send heartbeats, confirm
the events published about once a second while they flow (`Ledger.in_background`), and retry
the messages the high-water mark held back. Between passes it sleeps as long as its next duty
allows (`idle_delay`). It sees the peer through `PeerLink` (bus/link.py), like the other parts.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING

import anyio
import anyio.abc
import zmq

from agent_bus.bus import protocol as p
from agent_bus.bus.link import PeerState
from agent_bus.bus.pauses import PauseWatch
from agent_bus.bus.rpc import REPLY_GRACE

if TYPE_CHECKING:
    from agent_bus.bus.ledger import Ledger
    from agent_bus.bus.link import PeerLink
    from agent_bus.bus.rpc import Calls

log = logging.getLogger("bus.client")

HOUSEKEEPING = 0.1  # seconds between checks of hub silence, heartbeats and client-side expiry
# ... while something needs watching that closely; an idle peer sleeps until its next duty, at
# most this long (`Housekeeping.delay`; not longer than REPLY_GRACE: see `idle_delay`).
HOUSEKEEPING_IDLE = REPLY_GRACE
CONFIRM_EVERY = 1.0  # seconds between background confirmations while events flow

_HEARTBEAT = [p.SIGNATURE, p.encode(p.Header(kind=p.HEARTBEAT))]


class Housekeeping:
    """One peer's periodic task: `run` it in the peer's task group (it ends with the group)."""

    def __init__(self, peer: PeerLink, calls: Calls, ledger: Ledger) -> None:
        self._peer = peer
        self._calls = calls  # the requests the peer made: expired here
        self._ledger = ledger  # its publish accounting: confirmed here while events flow
        self._next_beat = self._next_confirm = 0.0  # monotonic; due at once
        # A pass that wakes a heartbeat interval late: this process was paused (or its loop
        # blocked), and the hub's silence is not judged for a window after (bus/pauses.py).
        self._pauses = PauseWatch(allowance=1.0)

    async def run(self, tg: anyio.abc.TaskGroup) -> None:
        """Forever: sleep until the next duty (`delay`), then do what is due."""
        peer = self._peer
        self._next_beat = self._next_confirm = time.monotonic()
        while True:
            delay = self.delay()
            due = time.monotonic() + delay
            await anyio.sleep(delay)
            now = time.monotonic()
            self._calls.expire(now)
            if peer.sock is None:
                continue
            welcome = peer.welcome
            if welcome is not None:
                interval = welcome.heartbeat_interval
                expiry = interval * welcome.liveness
            else:
                interval, expiry = 1.0, 3.0
            self._pauses.allowance = interval
            self._pauses.ran(now, due)
            if self._hub_silent(now, expiry):
                continue
            if peer.outbox.stalled():
                peer.flush_soon()  # events held back by the HWM
            self._confirm(now, tg)
            self._beat(now, interval)

    def delay(self) -> float:
        """Seconds to the next pass (`idle_delay`): HOUSEKEEPING while messages are held back
        (the HWM) or the link is not welcomed."""
        peer = self._peer
        welcome = peer.welcome
        if welcome is None or peer.sock is None or peer.outbox.items:
            return HOUSEKEEPING
        due = min(self._next_beat,
                  peer.last_heard + welcome.heartbeat_interval * welcome.liveness,
                  self._calls.first_expiry())
        if self.should_confirm():
            due = min(due, self._next_confirm)
        return idle_delay(due)

    def should_confirm(self) -> bool:
        """Events went out that the hub has not confirmed, and no confirmation is under way."""
        ledger = self._ledger
        return (self._peer.state is PeerState.READY and not ledger.confirming
                and ledger.in_flight())

    def _hub_silent(self, now: float, expiry: float) -> bool:
        """The hub said nothing for `expiry` s: the connection is dropped (the peer's connection
        loop makes the next)."""
        peer = self._peer
        if now - peer.last_heard <= expiry:
            return False
        # What waits unread is word from the hub too: a loop kept busy by its own sends (which
        # take the edge of ZeroMQ's fd) may not have drained it yet.
        peer.drain()
        if now - peer.last_heard <= expiry:
            return False
        # Paused itself (a stopped process, a VM that was not scheduled): the hub's heartbeats
        # may still be in the kernel's buffers, not yet moved to the socket by ZeroMQ's I/O
        # thread, which was paused too. A whole window of this process running decides.
        if not self._pauses.may_judge(now, expiry):
            return False
        peer.count("hub_silent")
        # Said once, when a ready link is lost: the first connect and each retry while the hub
        # stays down are quiet (a WARNING every few seconds told nothing new); the peer's
        # welcome handler says when it is back.
        say = log.warning if peer.state is PeerState.READY else log.debug
        say("%s: no word from the hub at %s for %.1fs; reconnecting", peer.name, peer.hub, expiry)
        peer.reconnect()
        return True

    def _confirm(self, now: float, tg: anyio.abc.TaskGroup) -> None:
        """About once a second while events flow: a confirmation in the background."""
        if now < self._next_confirm or not self.should_confirm():
            return
        self._next_confirm = now + CONFIRM_EVERY
        self._ledger.confirming = True
        tg.start_soon(self._ledger.in_background)

    def _beat(self, now: float, interval: float) -> None:
        """A heartbeat every `interval` (the hub's) while welcomed."""
        if self._peer.welcome is None or now < self._next_beat:
            return
        self._next_beat = now + interval
        with contextlib.suppress(zmq.ZMQError):
            self._peer.send_now(_HEARTBEAT)


def idle_delay(due: float) -> float:
    """Seconds until the next duty falls `due` (monotonic: a heartbeat, a confirmation, the first
    expiry of a call in flight, the moment the hub's silence would mean it is lost: each never
    later than the 0.1 s scan noticed it), at most HOUSEKEEPING_IDLE.

    An idle peer (a tool worker between calls) then wakes about once a second instead of ten
    times: each wake-up of an idle process cost ~0.3 ms of CPU on the test machine (an idle
    worker: 3.5-4 -> ~1 ms/s). A call started meanwhile cannot expire before the next pass (its
    expiry is at least REPLY_GRACE away)."""
    return min(HOUSEKEEPING_IDLE, max(HOUSEKEEPING, due - time.monotonic()))
