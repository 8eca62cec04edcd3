"""The replay pacer (bus/replay_pacing.py), pure: which finished `hub.replay` answers the hub may
send, and when. No sockets; times are given."""

from __future__ import annotations

import math

from agent_bus.bus.replay_pacing import BUSY_FOR, ReplayPacer

KIB = 1024
RATE = 4096 * KIB  # 4 MiB/s: a 512 KiB answer pays 0.125 s, well under BUSY_FOR


def answer(name: str, size: int, code: bytes = b"") -> tuple[bytes, str, bytes, bytes]:
    return (b"peer", name, code, b"x" * size)


def names(answers: list[tuple[bytes, str, bytes, bytes]]) -> list[str]:
    return [a[1] for a in answers]


def test_on_an_idle_bus_everything_goes_at_once() -> None:
    pacer = ReplayPacer(RATE)
    pacer.add([answer("a", 512 * KIB), answer("b", 512 * KIB), answer("c", 512 * KIB)])
    assert len(pacer) == 3 and pacer.held_bytes == 3 * 512 * KIB
    assert names(pacer.release(10.0)) == ["a", "b", "c"]
    assert len(pacer) == 0 and pacer.held_bytes == 0 and pacer.next_at == math.inf
    assert pacer.waited == 0


def test_while_requests_flow_answers_leave_at_the_rate() -> None:
    pacer = ReplayPacer(RATE)
    pacer.routed(10.0)
    pacer.add([answer("a", 512 * KIB), answer("b", 512 * KIB), answer("c", 256 * KIB)])
    assert names(pacer.release(10.0)) == ["a"]  # the first goes at once
    assert pacer.next_at == 10.125  # when `a` is paid for
    assert pacer.release(10.1) == []
    pacer.routed(10.1)  # requests still flow
    assert names(pacer.release(10.125)) == ["b"]
    assert pacer.next_at == 10.25 and pacer.held_bytes == 256 * KIB
    pacer.routed(10.2)
    assert names(pacer.release(10.25)) == ["c"]
    assert pacer.next_at == math.inf and pacer.held_bytes == 0
    assert pacer.waited == 2  # `b` and `c`, each counted once however often it was held back


def test_time_spent_idle_is_not_credit_for_later() -> None:
    pacer = ReplayPacer(RATE)
    pacer.routed(12.0)
    pacer.add([answer("a", 512 * KIB), answer("b", 512 * KIB)])
    assert names(pacer.release(12.0)) == ["a"]
    assert pacer.next_at == 12.125


def test_when_requests_stop_what_is_held_goes_at_once() -> None:
    pacer = ReplayPacer(256 * KIB)  # 256 KiB/s: a 512 KiB answer pays 2 s, past BUSY_FOR
    pacer.routed(10.0)
    pacer.add([answer(str(i), 512 * KIB) for i in range(5)])
    assert names(pacer.release(10.0)) == ["0"]
    assert pacer.next_at == 10.0 + BUSY_FOR  # the end of the traffic comes first
    assert pacer.release(10.0 + BUSY_FOR - 0.01) == []
    assert names(pacer.release(10.0 + BUSY_FOR)) == ["1", "2", "3", "4"]


def test_errors_are_not_charged_and_keep_their_place() -> None:
    pacer = ReplayPacer(RATE)
    pacer.routed(10.0)
    pacer.add([answer("a", 512 * KIB), answer("b", 512 * KIB), answer("e", 40, b"handler_error"),
               answer("c", 1)])
    assert names(pacer.release(10.0)) == ["a"]  # `e` waits behind `b`: one requester's order
    assert names(pacer.release(10.125)) == ["b", "e"]  # `e` pays nothing, `c` waits for `b`
    assert pacer.next_at == 10.25
    pacer.add([answer("f", 40, b"handler_error")])
    assert names(pacer.release(10.25)) == ["c", "f"]


def test_an_error_first_in_line_may_go_at_once() -> None:
    pacer = ReplayPacer(RATE)
    pacer.routed(10.0)
    pacer.add([answer("a", 512 * KIB)])
    assert names(pacer.release(10.0)) == ["a"]
    pacer.add([answer("e", 40, b"handler_error"), answer("b", 512 * KIB)])
    assert pacer.next_at == -math.inf
    assert names(pacer.release(10.01)) == ["e"]
    assert pacer.next_at == 10.125


def test_rate_zero_never_holds() -> None:
    pacer = ReplayPacer(0)
    pacer.routed(10.0)
    pacer.add([answer("a", 512 * KIB), answer("b", 512 * KIB)])
    assert pacer.next_at == -math.inf
    assert names(pacer.release(10.0)) == ["a", "b"]
