"""PauseWatch (bus/pauses.py): a pass later than due by more than the allowance is a pause, and
no silence is judged until a whole window has passed since the last one."""

from __future__ import annotations

from agent_bus.bus.pauses import PauseWatch


def test_silence_is_judged_only_a_window_after_the_last_pause() -> None:
    watch = PauseWatch(allowance=0.2)
    assert watch.may_judge(0.0, 0.6)  # never paused
    assert not watch.ran(10.2, 10.0)  # late by the allowance: not a pause
    assert watch.may_judge(10.2, 0.6)
    assert watch.ran(11.5, 10.3)  # a pass due at 10.3 ran at 11.5
    assert not watch.may_judge(11.5, 0.6)
    assert not watch.may_judge(12.1, 0.6)  # exactly a window after: not yet
    assert watch.may_judge(12.2, 0.6)
    assert watch.ran(13.0, 12.5)  # the next pause starts a new window
    assert not watch.may_judge(13.5, 0.6)
