"""Clients that follow the hub (issue 52, items 3 and 4), with real processes.

A takeover, as a client sees it, without the standby feature: hub A is SIGKILLed and hub B is
started on the same SQLite log (a standby taking over continues the same log). Every client
has the list [A, B]: it moves to B when A's heartbeats stop, re-registers, resumes its
subscription from the last seq it delivered, and re-sends its keyed requests in flight.
"""

from __future__ import annotations

import json
import signal
import time
from collections import Counter
from collections.abc import Callable

import anyio

from agent_bus.bus.client import connect
from tests.failover.conftest import hub_ports
from tests.support import Proc, wait_for


def _lines(proc: Proc, field: str) -> list[object]:
    out = []
    for line in proc.output().splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if field in record:
                out.append(record[field])
    return out


def _count(proc: Proc, field: str) -> int:
    return len(_lines(proc, field))


def test_clients_follow_a_takeover_to_the_next_hub(
        start_hub: Callable[[int], Proc], clients: Callable[..., Proc]) -> None:
    """(a) requester, server and subscriber with [A, B]: A SIGKILLed, B started on A's log:
    they move to B, re-register, requests flow again, the subscriber sees every seq once."""
    port_a, port_b = hub_ports(2)
    hubs = f"tcp://127.0.0.1:{port_a},tcp://127.0.0.1:{port_b}"
    hub_a = start_hub(port_a)
    server = clients("serve", hubs)
    server.wait_ready()
    subscriber = clients("subscribe", hubs)
    subscriber.wait_ready()
    requester = clients("request", hubs)
    requester.wait_ready()
    wait_for(lambda: _count(requester, "answer") >= 20, 20, "answers through hub A")

    hub_a.signal(signal.SIGKILL)
    hub_a.popen.wait(5)
    before = _count(requester, "answer")
    killed = time.monotonic()
    start_hub(port_b)
    for proc in (server, subscriber, requester):
        proc.wait_line(lambda s: '"moved"' in s, 20)
    wait_for(lambda: _count(requester, "answer") >= before + 20, 30, "answers through hub B")
    moved_in = time.monotonic() - killed
    print(f"requests flowed again on hub B {moved_in:.1f}s after hub A was killed")

    assert requester.popen.stdin is not None
    requester.popen.stdin.close()
    print(requester.wait_line(lambda s: s.startswith('{"done"'), 30))
    ran = Counter(_lines(server, "ran"))
    answered = Counter(_lines(requester, "answer"))
    assert max(ran.values()) == 1, [k for k, n in ran.items() if n > 1]  # never run twice
    assert max(answered.values()) == 1, [k for k, n in answered.items() if n > 1]
    assert set(answered) == set(ran)  # every request answered, the one in flight included
    assert len(answered) == int(requester.wait_line(lambda s: '"done"' in s)
                                .split('"done": ')[1].split(",")[0])

    async def head() -> int:
        async with connect(f"tcp://127.0.0.1:{port_b}", name="check") as peer:
            return (await peer.status()).seq

    last = anyio.run(head)
    wait_for(lambda: last in _lines(subscriber, "seq"), 20, f"the subscriber at seq {last}")
    seqs = [s for s in _lines(subscriber, "seq") if isinstance(s, int) and s <= last]
    assert not _lines(subscriber, "gap")
    assert len(seqs) == len(set(seqs)), "a seq delivered twice"
    assert seqs == list(range(seqs[0], last + 1)), "a hole in the seqs"
    assert seqs[0] < 20  # it subscribed before the traffic: the moves are inside the range
