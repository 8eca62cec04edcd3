"""When the hub probes its peers after the ROUTER reports closed connections.

The ROUTER's monitor says that a connection closed, not whose it was. A probe (the hub's
`_probe`: a heartbeat to every peer with a ROUTER-made routing id) finds out: the send to a
closed connection fails, and that peer is dropped at once instead of at its heartbeat deadline.
libzmq removes a closed connection's route a moment after reporting the close, so one probe may
come too early: they repeat, at gaps doubling from `FIRST_GAP` to `MAX_GAP`, for at most
`PROBE_FOR` seconds, and stop as soon as every reported close is accounted for: a peer a probe
dropped, a peer that said `bye` (its connection closes next), or a connection that failed its
handshake (it was nobody's: e.g. a client checking that the hub's port answers).

Every probe wakes every live peer. Probing at a fixed 5 ms for the whole 0.3 s after any
client left (`busctl run`, `busctl status` …) cost each idle tool worker ~15 ms of CPU and the
hub ~20 ms per departure, measured on the 2-core VM, 2026-12-01.
"""

from __future__ import annotations

import math
from collections import deque

FIRST_GAP = 0.001  # seconds from a reported close to the first probe, then doubling...
MAX_GAP = 0.05  # ...up to this
PROBE_FOR = 0.3  # seconds after the last reported close that probing may go on
EXPECT_FOR = 1.0  # seconds an expected close (a bye, a failed handshake) may take to be reported


class ProbeSchedule:
    """Pure bookkeeping (no sockets): the hub reports closes, byes and what probes found, and
    asks `due(now)`; `next_at` is the time of the next probe (math.inf: none)."""

    def __init__(self) -> None:
        self.next_at = math.inf
        self.unexplained = 0  # reported closes that no bye or probe accounts for yet
        self._expected: deque[float] = deque()  # expiry times of expected closes not yet reported
        self._gap = FIRST_GAP
        self._until = 0.0

    def closed(self, count: int, now: float) -> None:
        """The monitor reported `count` closed connections."""
        while self._expected and self._expected[0] <= now:
            self._expected.popleft()
        for _ in range(count):
            if self._expected:
                self._expected.popleft()  # e.g. the connection of a peer that said bye
            else:
                self.unexplained += 1
        if self.unexplained:
            self._gap = FIRST_GAP
            self._until = now + PROBE_FOR
            self.next_at = min(self.next_at, now + FIRST_GAP)

    def expect_close(self, now: float) -> None:
        """A close that needs no probe is coming (a peer said bye, a handshake failed); a bye
        may also arrive just after its connection's close was reported."""
        if self.unexplained:
            self.found(1)
        else:
            self._expected.append(now + EXPECT_FOR)

    def found(self, count: int) -> None:
        """A probe (or a bye) accounted for `count` reported closes."""
        self.unexplained = max(0, self.unexplained - count)
        if not self.unexplained:
            self.next_at = math.inf

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def probed(self, now: float) -> None:
        """A probe ran at `now` (after `found` for what it dropped): schedule the next."""
        if not self.unexplained or now >= self._until:
            self.unexplained = 0  # left to the heartbeat deadline (e.g. a peer with its own id)
            self.next_at = math.inf
            return
        self._gap = min(self._gap * 2, MAX_GAP)
        self.next_at = now + self._gap
