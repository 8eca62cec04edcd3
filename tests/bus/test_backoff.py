"""bus/backoff.py: the delays grow, cap, jitter within bounds, and never pass the deadline."""

from __future__ import annotations

import itertools
import random
import time

import anyio
import pytest

from agent_bus.bus.backoff import Backoff, retry


def test_delays_double_up_to_the_cap_without_jitter() -> None:
    delays = list(itertools.islice(Backoff(first=0.1, factor=2, cap=0.5, jitter=0).delays(), 6))
    assert delays == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5, 0.5])


def test_jitter_stays_within_its_fraction_and_varies() -> None:
    policy = Backoff(first=1.0, factor=1.0, cap=1.0, jitter=0.5)
    delays = list(itertools.islice(policy.delays(rng=random.Random(3)), 200))
    assert all(0.5 <= d <= 1.5 for d in delays)
    assert max(delays) - min(delays) > 0.5  # spread out, not one value


def test_no_delay_ends_past_the_deadline() -> None:
    policy = Backoff(first=10.0, cap=10.0, jitter=0)
    deadline = time.monotonic() + 0.2
    first = next(policy.delays(deadline=deadline))
    assert 0 < first <= 0.2  # trimmed to the time left
    assert list(policy.delays(deadline=time.monotonic() - 1)) == []  # already past: none


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"first": 0}, "first"), ({"first": 1, "cap": 0.5}, "cap"), ({"factor": 0.5}, "factor"),
    ({"jitter": 1.5}, "jitter"),
])
def test_bad_knobs_are_refused_naming_them(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        Backoff(**kwargs)


@pytest.mark.anyio
async def test_retry_returns_once_the_attempt_succeeds() -> None:
    tries: list[int] = []

    async def flaky() -> str:
        tries.append(1)
        if len(tries) < 3:
            raise ConnectionError("not yet")
        return "ok"

    policy = Backoff(first=0.001, cap=0.002)
    assert await retry(flaky, retry_on=(ConnectionError,), policy=policy) == "ok"
    assert len(tries) == 3


@pytest.mark.anyio
async def test_retry_raises_the_last_error_at_the_deadline_and_others_at_once() -> None:
    async def always(exc: BaseException) -> None:
        raise exc

    policy = Backoff(first=0.01, cap=0.02)
    started = time.monotonic()
    with pytest.raises(ConnectionError, match="down"):
        await retry(lambda: always(ConnectionError("down")), retry_on=(ConnectionError,),
                    policy=policy, deadline=started + 0.1)
    assert time.monotonic() - started < 5  # bounded by the deadline (slack for a loaded machine)
    with anyio.fail_after(5), pytest.raises(KeyError):
        await retry(lambda: always(KeyError("x")), retry_on=(ConnectionError,), policy=policy)
