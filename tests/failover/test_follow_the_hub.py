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
from collections.abc import Callable, Iterator

import anyio
import pytest

from agent_bus.bus.client import connect
from tests.failover.conftest import hub_ports
from tests.support import Proc, until, wait_for


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


@pytest.fixture
def standin(clients: Callable[..., Proc]) -> Callable[..., Proc]:
    """Start `standin_proc.py` (stopped at the end with the other clients)."""
    import subprocess

    from tests.support import ROOT, py

    def start(*args: str) -> Proc:
        proc = Proc(py(str(ROOT / "tests" / "failover" / "standin_proc.py"), *args),
                    stdin=subprocess.PIPE)
        _standins.append(proc)
        proc.wait_ready()
        return proc

    return start


_standins: list[Proc] = []


@pytest.fixture(autouse=True)
def _stop_standins() -> Iterator[None]:
    try:
        yield
    finally:
        while _standins:
            _standins.pop().stop()


@pytest.mark.anyio
@pytest.mark.parametrize("names_leader", [True, False])
async def test_a_hub_that_is_not_the_leader_is_skipped(
        start_hub: Callable[[int], Proc], standin: Callable[..., Proc],
        names_leader: bool) -> None:
    """(b) The first endpoint answers `not_leader`: the peer moves on at once (to the endpoint
    the answer names, even when it is not the next in the list), without waiting out a silence
    window, and serves and requests on the leader."""
    port_s, port_x, port_b = hub_ports(3)
    start_hub(port_b)
    leader = f"tcp://127.0.0.1:{port_b}"
    stand = standin(str(port_s), "not-leader", *(["--leader", leader] if names_leader else []))
    # with a name, the dead endpoint between them is skipped; without, the list order has no
    # dead endpoint in the way
    middle = [f"tcp://127.0.0.1:{port_x}"] if names_leader else []
    started = time.monotonic()
    async with connect([f"tcp://127.0.0.1:{port_s}", *middle, leader], name="follower") as peer:
        took = time.monotonic() - started
        assert peer.hub == leader
        assert peer.counters.get("not_leader") == 1
        await peer.serve("echo", lambda req: req.body)
        assert await peer.request("echo", b"hi", key="k1") == b"hi"
    print(f"welcomed by the leader {took:.2f}s after the first hello")
    assert took < 2.0  # a silence window (3 s) would have been waited without not_leader
    assert _count(stand, "hello") == 1


@pytest.mark.anyio
async def test_a_leader_older_than_one_seen_is_not_settled_on(
        standin: Callable[..., Proc]) -> None:
    """The epoch rule: after a welcome with epoch 7, a hub welcoming with epoch 3 is refused
    (as `not_leader`: counted `stale_leader`) and the peer goes on to the next endpoint, whose
    epoch 9 it takes."""
    ports = hub_ports(3)
    hubs = [f"tcp://127.0.0.1:{port}" for port in ports]
    for port, epoch in zip(ports, (7, 3, 9), strict=True):
        standin(str(port), "welcome", "--epoch", str(epoch))
    async with connect(hubs, name="follower") as peer:
        assert peer.hub == hubs[0] and peer.epoch == 7
        # the stand-ins never beat: the peer leaves each after its silence window (3 s)
        await until(lambda: peer.connected and peer.epoch == 9, 20, "the epoch-9 hub")
        assert peer.hub == hubs[2]
        assert peer.counters.get("stale_leader") == 1


@pytest.mark.parametrize(("seconds", "path"), [(1.0, "repeats_answered"),
                                                (9.0, "repeats_attached")])
def test_a_keyed_request_in_flight_survives_the_hub_and_runs_once(
        start_hub: Callable[[int], Proc], clients: Callable[..., Proc],
        seconds: float, path: str) -> None:
    """(c) A keyed request to a slow server, in flight when hub A is SIGKILLed: re-sent on B
    with its key, answered exactly once, and the server ran it once. Short: it ends while no
    hub is up (its answer is lost, kept in the server's window) and the repeat is answered from
    it; long: the repeat arrives while it runs and is attached to it."""
    port_a, port_b = hub_ports(2)
    hubs = f"tcp://127.0.0.1:{port_a},tcp://127.0.0.1:{port_b}"
    hub_a = start_hub(port_a)
    server = clients("serve", hubs)
    server.wait_ready()
    requester = clients("request", hubs, "--slow", str(seconds))
    requester.wait_ready()
    server.wait_line(lambda s: '"started"' in s, 10)
    hub_a.signal(signal.SIGKILL)
    hub_a.popen.wait(5)
    start_hub(port_b)
    requester.wait_line(lambda s: '"answer"' in s, 30)
    assert _lines(requester, "answer") == ["slow-1"]
    assert _lines(server, "started") == ["slow-1"]  # ran once, on the server that survived
    wait_for(lambda: any(c.get(path) == 1 for c in _lines(server, "counters")  # type: ignore[union-attr]
                         ), 10, f"the server's {path}")
    assert any(c.get("requests_resent") == 1 for c in _lines(requester, "counters"))  # type: ignore[union-attr]


@pytest.mark.anyio
async def test_without_a_next_hub_a_keyed_call_still_ends(
        start_hub: Callable[[int], Proc], clients: Callable[..., Proc]) -> None:
    """No hub takes over: an unkeyed call fails `hub_lost` when the silence is noticed, a keyed
    one waits for the next hub but no longer than its own deadline (or RESEND_WAIT)."""
    from agent_bus.bus.errors import DeadlineExceeded, HubLost

    port_a, port_none = hub_ports(2)
    hubs = [f"tcp://127.0.0.1:{port_a}", f"tcp://127.0.0.1:{port_none}"]
    hub_a = start_hub(port_a)
    server = clients("serve", ",".join(hubs))
    server.wait_ready()
    async with connect(hubs, name="caller") as peer:
        outcomes: dict[str, tuple[type, float]] = {}

        async def call(name: str, key: str) -> None:
            try:
                await peer.request("slow", b"30", key=key, timeout=6)
            except (HubLost, DeadlineExceeded) as exc:
                outcomes[name] = (type(exc), time.monotonic() - killed)

        killed = time.monotonic()
        async with anyio.create_task_group() as tg:
            tg.start_soon(call, "keyed", "never-answered")
            tg.start_soon(call, "unkeyed", "")
            await until(lambda: len(_lines(server, "started")) == 2, 10, "both calls started")
            killed = time.monotonic()
            hub_a.signal(signal.SIGKILL)
    assert outcomes["unkeyed"][0] is HubLost
    assert outcomes["keyed"][0] is DeadlineExceeded
    assert outcomes["unkeyed"][1] < outcomes["keyed"][1] < 6 + 2


def test_a_keyed_stream_sees_each_partial_once_across_a_move(
        start_hub: Callable[[int], Proc], clients: Callable[..., Proc]) -> None:
    """A keyed streamed request whose partials flow while hub A is SIGKILLed and B comes up:
    the server's partials sent meanwhile are lost with A, the repeat on B is attached and
    re-sent every partial from the first, and the client drops those it had: each partial
    once, in order, then the final answer once."""
    port_a, port_b = hub_ports(2)
    hubs = f"tcp://127.0.0.1:{port_a},tcp://127.0.0.1:{port_b}"
    hub_a = start_hub(port_a)
    server = clients("serve", hubs)
    server.wait_ready()
    requester = clients("request", hubs, "--stream", "20")
    requester.wait_ready()
    requester.wait_line(lambda s: '"p2"' in s, 10)
    hub_a.signal(signal.SIGKILL)
    hub_a.popen.wait(5)
    start_hub(port_b)
    requester.wait_line(lambda s: '"streamed"' in s, 40)
    assert _lines(requester, "body") == [f"p{i}" for i in range(20)] + ["done"], requester.output()
    assert _lines(server, "started") == ["stream-1"]
    wait_for(lambda: any(c.get("repeats_attached") == 1 for c in _lines(server, "counters")  # type: ignore[union-attr]
                         ), 10, "the repeat attached")
