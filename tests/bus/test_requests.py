"""Requests through a real hub process: load balancing, no_service, peer loss, hub restart."""

from __future__ import annotations

import json
import signal
import time

import anyio
import pytest

from agent_bus.bus import errors
from agent_bus.bus.client import PeerState, connect
from tests.bus.helpers import kill_hub, restartable_ports, serving_peers, start_hub, started_line
from tests.support import tight_timing, until

pytestmark = pytest.mark.anyio

STREAM_PACE = 0.01  # seconds between a streaming handler's partial replies


async def test_capacity_one_each_and_twenty_concurrent_requests(hub: dict) -> None:
    with serving_peers(hub["endpoint"], 2, "--capacity", "1") as procs:
        async with connect(hub["endpoint"], name="requester") as peer:
            replies: list[dict] = []

            async def one() -> None:
                body = await peer.request("echo", json.dumps({"delay": 0.02}).encode(), timeout=20)
                replies.append(json.loads(body))

            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    for _ in range(20):
                        tg.start_soon(one)
            assert len(replies) == 20
            assert {r["pid"] for r in replies} == {proc.pid for proc in procs}
            served = 0
            for proc in procs:  # each server reports the most it ever held at once
                stats = json.loads(await peer.request(f"stats.{proc.pid}", b""))
                assert stats["max_active"] == 1
                served += stats["served"]
            assert served == 20


async def test_no_service_after_deadline_unless_a_peer_registers(hub: dict) -> None:
    async with connect(hub["endpoint"], name="requester") as peer:
        t0 = time.monotonic()
        with pytest.raises(errors.NoService) as info:
            await peer.request("nobody.home", b"x", timeout=0.5)
        elapsed = time.monotonic() - t0
        assert info.value.code == "no_service"
        # the hub answers at the deadline, not at once; that it answered at all (before the
        # client's own REPLY_GRACE) is the NoService above. Tight: within its 0.1 s expiry scan.
        assert 0.45 <= elapsed, elapsed
        if tight_timing():
            assert elapsed < 0.5 + 0.3, elapsed

        async with connect(hub["endpoint"], name="late-server") as server:
            results: list[bytes] = []

            async def ask() -> None:
                results.append(await peer.request("late", b"ping", timeout=5))

            async def late(req) -> bytes:  # type: ignore[no-untyped-def]
                return b"pong:" + req.body

            async with anyio.create_task_group() as tg:
                tg.start_soon(ask)
                # the request is queued at the hub before anyone serves `late`
                await until(lambda: _queued(peer, "late"), 5, "the request to be queued")
                await server.serve("late", late)
            assert results == [b"pong:ping"]


async def _queued(peer, name: str) -> bool:  # type: ignore[no-untyped-def]
    status = await peer.status()
    return any(s.name == name and s.queued == 1 for s in status.services)


async def test_serving_peer_killed_mid_request_gives_peer_lost(hub: dict) -> None:
    with serving_peers(hub["endpoint"], 1) as (server,):
        async with connect(hub["endpoint"], name="requester") as peer:
            pid = server.pid
            outcome: list[BaseException] = []
            killed_at = 0.0

            async def ask() -> None:
                try:
                    await peer.request("slow", b"30", timeout=20)
                except errors.RequestError as exc:
                    outcome.append(exc)

            async with anyio.create_task_group() as tg:
                tg.start_soon(ask)
                await anyio.to_thread.run_sync(started_line, server)
                server.signal(signal.SIGKILL)
                killed_at = time.monotonic()
            lost_after = time.monotonic() - killed_at
            assert len(outcome) == 1 and isinstance(outcome[0], errors.PeerLost), outcome
            assert lost_after < 3.5, lost_after
            status = await peer.status()
            assert all(info.pid != pid for info in status.peers)
            assert all(s.name != "slow" for s in status.services)


async def test_idempotent_request_is_redispatched_when_its_server_dies(hub: dict) -> None:
    with serving_peers(hub["endpoint"], 2, "--idempotent") as procs:
        async with connect(hub["endpoint"], name="requester") as peer:
            result: list[bytes] = []

            async def ask() -> None:
                result.append(await peer.request("slow", b"0.5", timeout=20))

            async with anyio.create_task_group() as tg:
                tg.start_soon(ask)
                first = await anyio.to_thread.run_sync(
                    lambda: _first_started(procs))
                victim = next(p for p in procs if p.pid == first)
                victim.signal(signal.SIGKILL)
            survivor = next(p for p in procs if p.pid != first)
            assert result == [f"done by {survivor.pid}".encode()]
            status = await peer.status()
            assert [s.peers for s in status.services if s.name == "slow"] == [1]


def _first_started(procs) -> int:  # type: ignore[no-untyped-def]
    """The pid of whichever server printed a `started` line first (each waits on its own
    line-arrival condition for a short slice, inside an overall deadline)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for proc in procs:
            try:
                return started_line(proc, timeout=0.05)["pid"]
            except TimeoutError:
                pass
    raise TimeoutError("no server started the request")


async def test_hub_restart_on_same_endpoint_peers_reregister(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (port, events), state = restartable_ports(2), tmp_path / "state"
    endpoint = f"tcp://127.0.0.1:{port}"
    hub = start_hub(port, events, state)
    try:
        with serving_peers(endpoint, 1):
            async with connect(endpoint, name="requester") as peer:
                assert json.loads(await peer.request("echo", b"{}"))["served"] == 1
                pending: list[BaseException] = []

                async def in_flight() -> None:
                    try:
                        await peer.request("slow", b"60", timeout=60)
                    except errors.RequestError as exc:
                        pending.append(exc)

                async with anyio.create_task_group() as tg:
                    tg.start_soon(in_flight)
                    await until(lambda: _serving(peer, "slow"), 5, "slow to be in flight")
                    kill_hub(hub, port, events)
                    hub.stop()
                    hub = start_hub(port, events, state)
                # the request in flight during the outage failed with HubLost
                assert len(pending) == 1 and isinstance(pending[0], errors.HubLost), pending

                async def echo_works() -> bool:
                    try:
                        return bool(await peer.request("echo", b"{}", timeout=1))
                    except errors.RequestError:
                        return False

                await until(echo_works, 15, "requests to succeed after the restart")
                status = await peer.status()
                assert {s.name for s in status.services} >= {"echo", "slow"}
                assert len(status.peers) == 2
    finally:
        hub.stop()


async def _serving(peer, name: str) -> bool:  # type: ignore[no-untyped-def]
    status = await peer.status()
    return any(s.name == name and s.load == 1 for s in status.services)


async def test_client_shuts_down_quickly_when_the_hub_is_gone(hub: dict) -> None:
    with anyio.fail_after(10):
        async with connect(hub["endpoint"], name="orphan") as peer:
            await peer.status()
            hub["proc"].signal(signal.SIGKILL)
            await anyio.to_thread.run_sync(hub["proc"].popen.wait, 5)
            with pytest.raises(errors.RequestError):
                await peer.request("echo", b"", timeout=0.5)
            t0 = time.monotonic()
        assert time.monotonic() - t0 < 5


async def test_stream_cancelled_mid_way_cancels_the_server(hub: dict) -> None:
    async with connect(hub["endpoint"], name="server") as server, \
            connect(hub["endpoint"], name="requester") as peer:
        cancelled = anyio.Event()

        async def ticker(req) -> bytes:  # type: ignore[no-untyped-def]
            try:
                for i in range(1000):
                    await req.partial(str(i).encode())
                    await anyio.sleep(STREAM_PACE)  # behaviour under test, not a wait
            finally:
                if req.cancelled.is_set():
                    cancelled.set()
            return b"end"

        await server.serve("ticker", ticker)
        got = []
        async with peer.stream("ticker", b"", timeout=10) as replies:
            async for part in replies:
                got.append(part)
                if len(got) == 3:
                    break
        assert got == [b"0", b"1", b"2"]
        with anyio.fail_after(5):
            await cancelled.wait()
        assert peer.requests_in_flight == 0
        # the service is free again
        assert await until(lambda: _idle(peer, "ticker"), 5, "ticker to be idle")


async def _idle(peer, name: str) -> bool:  # type: ignore[no-untyped-def]
    status = await peer.status()
    return any(s.name == name and s.load == 0 for s in status.services)


async def test_frozen_peer_is_declared_lost_after_missed_heartbeats(hub: dict) -> None:
    """SIGSTOP keeps the connection open, so only the heartbeat deadline can notice."""
    with serving_peers(hub["endpoint"], 1) as (server,):
        async with connect(hub["endpoint"], name="requester") as peer:
            outcome: list[BaseException] = []

            async def ask() -> None:
                try:
                    await peer.request("slow", b"30", timeout=20)
                except errors.RequestError as exc:
                    outcome.append(exc)

            async with anyio.create_task_group() as tg:
                tg.start_soon(ask)
                await anyio.to_thread.run_sync(started_line, server)
                server.signal(signal.SIGSTOP)
                stopped_at = time.monotonic()
            lost_after = time.monotonic() - stopped_at
            server.signal(signal.SIGCONT)
            assert len(outcome) == 1 and isinstance(outcome[0], errors.PeerLost), outcome
            # liveness 3 x 1 s heartbeat: not before the heartbeats ran out, and long before
            # the request's 20 s deadline (tight: one interval's slack, on a quiet machine)
            assert 1.5 < lost_after < (3.5 if tight_timing() else 10), lost_after
            status = await peer.status()
            assert all(info.pid != server.pid for info in status.peers)


async def test_an_idle_peer_notices_a_frozen_hub_at_the_silence_deadline(hub: dict) -> None:
    """An idle peer's housekeeping sleeps until its next duty (about once a second, not every
    0.1 s), and the hub's silence deadline is one: it is noticed as soon as the scan did."""
    async with connect(hub["endpoint"], name="idle") as peer:
        await peer.status()  # the last word from the hub; nothing in flight from here
        hub["proc"].signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            await until(lambda: peer.state is PeerState.RECONNECTING, 15,
                        "the peer to notice the frozen hub")
            elapsed = time.monotonic() - t0
            # liveness 3 x 1 s heartbeat after the status reply (tight: the old scan's 0.1 s
            # plus scheduling slack, on a quiet machine)
            assert 2.9 <= elapsed < (3.4 if tight_timing() else 10), elapsed
        finally:
            hub["proc"].signal(signal.SIGCONT)


async def test_deadline_enforced_by_the_client_when_the_hub_is_frozen(hub: dict) -> None:
    async with connect(hub["endpoint"], name="requester") as peer:
        await peer.status()
        hub["proc"].signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(errors.DeadlineExceeded):
                await peer.request("anything", b"", timeout=0.3)
            elapsed = time.monotonic() - t0
            # deadline + REPLY_GRACE, checked every 0.1 s; the frozen hub never answers, so
            # without the client's own deadline this would wait for the test's timeout
            assert 1.2 <= elapsed < (2.0 if tight_timing() else 10), elapsed
            assert peer.requests_in_flight == 0
        finally:
            hub["proc"].signal(signal.SIGCONT)


async def test_prefer_keeps_requests_on_one_server_and_replies_say_who_served(hub: dict) -> None:
    """`prefer` over a real hub: sequential requests that name one of two idle servers all go
    to it (without it ties rotate between both), and each reply's `served_by` names it."""
    async with connect(hub["endpoint"], name="one") as one, \
            connect(hub["endpoint"], name="two") as two, \
            connect(hub["endpoint"], name="requester") as peer:
        for server in (one, two):
            async def handler(req, name: str = server.name) -> bytes:  # type: ignore[no-untyped-def]
                return name.encode()
            await server.serve("pick", handler)

        async def ask(prefer: str) -> tuple[bytes, str]:
            async with peer.stream("pick", b"", timeout=10, prefer=prefer) as replies:
                bodies = [body async for body in replies]
            return bodies[-1], replies.served_by

        rotated = {await ask("") for _ in range(4)}
        assert rotated == {(b"one", one.peer_id), (b"two", two.peer_id)}
        for target in (two, one):
            assert {await ask(target.peer_id) for _ in range(4)} == {
                (target.name.encode(), target.peer_id)}
        assert await peer.request("pick", b"", prefer="not a peer") in (b"one", b"two")
