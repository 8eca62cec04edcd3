"""A serving process's window of keyed requests (bus/keyed.py): bounded by count, bytes and time,
finished keys dropped oldest first, running keys never; and expiring costs the oldest finished
key alone, not a walk past every running one (a coordinator holds a run per cell)."""

from __future__ import annotations

import time

from agent_bus.bus.keyed import Final, KeyWindow


def test_running_keys_stay_and_the_oldest_finished_go_first_past_the_limit() -> None:
    window = KeyWindow(ttl=600, limit=10, max_bytes=1 << 20)
    running = [window.begin("agent.a", f"run-{i}", f"r{i}") for i in range(8)]
    for i in range(6):
        window.end(window.begin("llm", f"call-{i}", f"c{i}"), Final("reply", b"x"))
    # 8 running + 6 finished = 14 > 10: the 4 oldest finished went, every running one stayed
    assert len(window) == 10
    assert [window.get("llm", f"call-{i}") is None for i in range(6)] == [True] * 4 + [False] * 2
    assert all(window.get("agent.a", f"run-{i}") is entry for i, entry in enumerate(running))


def test_finished_keys_past_their_time_go_and_their_bytes_with_them() -> None:
    window = KeyWindow(ttl=60, limit=100, max_bytes=1 << 20)
    entry = window.begin("llm", "k", "r1")
    window.partial(entry, b"p" * 100)
    window.end(entry, Final("reply", b"f" * 50))
    assert window.get("llm", "k") is entry and window._bytes == 150
    window._expire(entry.ended + 61)  # a minute after it ended: past its time (no waiting)
    assert window.get("llm", "k") is None and window._bytes == 0


def test_bytes_bound_the_finished_keys() -> None:
    window = KeyWindow(ttl=600, limit=1000, max_bytes=1000)
    for i in range(5):
        window.end(window.begin("tool.x", f"k{i}", f"r{i}"), Final("reply", b"y" * 400))
    assert window._bytes <= 1000
    assert window.get("tool.x", "k4") is not None and window.get("tool.x", "k0") is None


def test_expiring_walks_no_running_key() -> None:
    """With a thousand running keys ahead of the finished ones, finishing keys costs about what
    it costs with none running (each end looks at the oldest finished key only)."""

    def cost(running: int) -> float:
        window = KeyWindow(ttl=600, limit=100, max_bytes=1 << 30)
        for i in range(running):
            window.begin("agent.a", f"run-{i}", f"r{i}")
        started = time.perf_counter()
        for i in range(3000):
            window.end(window.begin("llm", f"c{i}", f"q{i}"), Final("reply", b"z"))
        return time.perf_counter() - started

    baseline = min(cost(0) for _ in range(3))
    with_running = min(cost(1000) for _ in range(3))
    assert with_running < baseline * 5, (baseline, with_running)  # walking them: ~100x
