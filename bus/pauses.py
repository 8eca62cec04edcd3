"""Noticing that this process itself was paused, so its peers are not blamed for the silence.

A process stopped for a while (a stolen CPU, a slow fsync in its loop, SIGSTOP, a VM paused)
wakes to find every peer "silent" since before the pause, while their heartbeats wait unread:
in the kernel's socket buffers, not yet moved into ZeroMQ's queues by its I/O thread, which
was paused too. Judged then, every live peer would be dropped. So a pass that runs later than
it was due by more than an allowance counts as a pause, and nobody's silence is judged until a
whole liveness window has passed since it: each peer gets a full window of this process
running to be heard. A peer whose connection closed is still noticed at once (the hub's
probes: bus/probing.py).

Both ends use it: the hub for its peers (bus/hub.py), a client for its hub (bus/housekeeping.py).
Measured before (tests/fault/test_hub_beats.py): a hub paused for twice its 0.6 s window while a
peer flooded events dropped both of its live peers after 6 of 10 pauses; a hub and a client
paused together, the client reconnected after every pause.
"""

from __future__ import annotations

import math


class PauseWatch:
    """Pure bookkeeping: the owner says when each pass was due and when it ran (`ran`), and asks
    whether a silence of `window` seconds may be judged now (`may_judge`)."""

    def __init__(self, allowance: float) -> None:
        self.allowance = allowance  # seconds late a pass may run without counting as a pause
        self.resumed_at = -math.inf  # monotonic: the end of the last pause

    def ran(self, now: float, due: float) -> bool:
        """A pass due at `due` (monotonic) runs at `now`: whether it was paused."""
        if now - due <= self.allowance:
            return False
        self.resumed_at = now
        return True

    def may_judge(self, now: float, window: float) -> bool:
        """Whether this process has been running for `window` seconds since its last pause."""
        return now - self.resumed_at > window
