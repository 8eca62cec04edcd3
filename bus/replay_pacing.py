"""When the hub sends finished `hub.replay` answers: at once on an idle bus, at a byte rate while
requests are being routed.

A replay of big events moves a lot of memory: each 512 KiB event is copied in from the log
reader and out to the client by the hub's I/O thread, and request p99 beside an unpaced replay
of 512 KiB events was 1.9-2.4x idle on 2 cores (~1,000 batches a second), much as any process
copying 512 KiB buffers 30-100 times a second costs, whatever its priority
(bench/results/2026-12-01.md). Live traffic comes first: while a request was routed in the last `BUSY_FOR`
seconds, answers leave at most at `rate` bytes a second (each one waits until the previous one's
bytes are paid for at that rate); `BUSY_FOR` after requests stop, everything held leaves at
once. Error answers are small and go in order with the rest, without being charged.

Pure bookkeeping (no sockets): the hub reports routed requests and finished answers, asks
`release(now)` for what may go, and wakes up at `next_at`.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

# Seconds after a routed request during which replay answers are paced: longer than the gaps
# of a working bus (a tool's or a model's pause, a busy machine's scheduling delay), short
# enough that a replay right after the traffic stops is soon at full speed again.
BUSY_FOR = 1.0

# (requester's routing id, request id, error code (b"": none), body: a zmq.Frame or bytes)
Answer = tuple[bytes, str, bytes, Any]


class ReplayPacer:
    """Holds finished replay answers while requests flow; `rate` 0 never holds one."""

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self.busy_until = -math.inf  # requests were routed until BUSY_FOR before this
        self.held_bytes = 0
        self.waited = 0  # answers that were held back at least once (`replay_paced` in status)
        self._counted = 0  # of the held answers, from the first: how many `waited` counts
        self._held: deque[Answer] = deque()
        self._free_at = -math.inf  # when the bytes released so far are paid for at `rate`

    def __len__(self) -> int:
        return len(self._held)

    @property
    def next_at(self) -> float:
        """When something held may go (math.inf: nothing is held)."""
        if not self._held:
            return math.inf
        if self.rate <= 0 or self._held[0][2]:  # unpaced, or an error first
            return -math.inf
        return min(self._free_at, self.busy_until)

    def routed(self, now: float) -> None:
        """A request was routed to a peer at `now` (the hub's own services do not count)."""
        self.busy_until = now + BUSY_FOR

    def add(self, answers: list[Answer]) -> None:
        for answer in answers:
            self._held.append(answer)
            self.held_bytes += len(answer[3])

    def release(self, now: float) -> list[Answer]:
        """The held answers that may go at `now`, in order."""
        held = self._held
        out: list[Answer] = []
        paced = self.rate > 0 and now < self.busy_until
        while held:
            answer = held[0]
            if not answer[2] and paced and now < self._free_at:  # errors are not charged
                self.waited += len(held) - self._counted
                self._counted = len(held)
                break
            out.append(held.popleft())
            self._counted = max(0, self._counted - 1)
            size = len(answer[3])
            self.held_bytes -= size
            if paced and not answer[2]:
                self._free_at = max(self._free_at, now) + size / self.rate
        return out
