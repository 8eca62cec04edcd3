"""Retry delays: exponential, capped, jittered, and bounded by a deadline.

One policy object, two ways to use it:

    policy = Backoff(first=0.05, factor=2.0, cap=2.0, jitter=0.5)
    for delay in policy.delays(deadline=time.monotonic() + 10):   # sync or async callers
        if try_once():
            break
        time.sleep(delay)

    reply = await retry(lambda: peer.request(...), retry_on=(HubLost,), policy=policy,
                        deadline=time.monotonic() + 30)

The knobs (all seconds except `factor` and `jitter`):
- `first`: the delay before the second attempt.
- `factor`: each delay is the previous one times this (1.0: a constant delay).
- `cap`: no delay grows past this (before jitter).
- `jitter`: the fraction of randomisation; each delay is drawn uniformly from
  `[d * (1 - jitter), d * (1 + jitter)]`, so many clients losing the same server at once do not
  come back in step (0: no randomisation; at most 1).
- `deadline` (per use, `time.monotonic()` based): no delay ends past it — the last one is trimmed
  to end at the deadline, and the delays stop once it has passed, so a caller never waits longer
  than it was allowed to. `math.inf` (the default) means retry forever.

Restarting the growth after a success is the caller's choice: call `delays()` again.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import anyio

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Backoff:
    """A retry policy; see the module docstring for the knobs."""

    first: float = 0.05
    factor: float = 2.0
    cap: float = 2.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        if not (self.first > 0 and self.cap >= self.first):
            raise ValueError(f"Backoff needs 0 < first <= cap (got first={self.first}, cap={self.cap})")
        if self.factor < 1:
            raise ValueError(f"Backoff.factor must be at least 1 (got {self.factor})")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"Backoff.jitter must be within 0..1 (got {self.jitter})")

    def delays(self, *, deadline: float = math.inf,
               rng: random.Random | None = None) -> Iterator[float]:
        """Endless delays (finite with a deadline): first, first*factor, ... up to cap, each
        jittered and trimmed so that sleeping it never passes `deadline` (monotonic)."""
        uniform = (rng or random).uniform
        base = self.first
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            delay = base * uniform(1 - self.jitter, 1 + self.jitter) if self.jitter else base
            yield min(delay, left)
            base = min(base * self.factor, self.cap)


async def retry(attempt: Callable[[], Awaitable[T]], *,
                retry_on: tuple[type[BaseException], ...],
                policy: Backoff = Backoff(),
                deadline: float = math.inf) -> T:
    """Await `attempt()` until it returns; on an exception in `retry_on`, sleep the policy's next
    delay and try again. Once the deadline has passed, the last such exception is raised.
    Any other exception (cancellation included) propagates at once."""
    delays = policy.delays(deadline=deadline)
    while True:
        try:
            return await attempt()
        except retry_on:
            delay = next(delays, None)
            if delay is None:
                raise
        await anyio.sleep(delay)
