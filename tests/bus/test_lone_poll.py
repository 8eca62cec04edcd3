"""A lone request polls for its reply (bus/rpc.py `SPIN_MAX`): only while its service usually
answers within the poll, never while a burst's other requests wait to be sent, and not again
soon after a poll in vain (its server may be on the requester's own loop, which the poll keeps
from running). Through a real hub process."""

from __future__ import annotations

import anyio
import pytest

from agent_bus.bus import protocol as p
from agent_bus.bus.client import IncomingRequest, connect
from agent_bus.bus.rpc import SPIN_MAX
from tests.bus.helpers import serving_peers

pytestmark = pytest.mark.anyio


async def _echo(req: IncomingRequest) -> bytes:
    return req.body


async def test_a_server_on_the_requesters_loop_is_answered_and_not_polled_for_again(
        hub: dict) -> None:
    async with connect(hub["endpoint"], name="server") as server, \
            connect(hub["endpoint"], name="requester") as peer:
        await server.serve("here", _echo)
        with anyio.fail_after(10):
            assert await peer.request("here", b"1") == b"1"  # the poll missed: it could not run
        estimate = peer._calls._round_trips["here"]
        assert estimate > SPIN_MAX, estimate  # the next lone requests sleep in the loop
        with anyio.fail_after(10):
            assert await peer.request("here", b"2") == b"2"
        assert peer._calls._round_trips["here"] > SPIN_MAX / 2


async def test_a_burst_does_not_wait_for_its_first_requests_poll(hub: dict) -> None:
    async with connect(hub["endpoint"], name="server") as server, \
            connect(hub["endpoint"], name="requester") as peer:
        await server.serve("here", _echo, capacity=64)
        got: list[bytes] = []

        async def one(i: int) -> None:
            got.append(await peer.request("here", str(i).encode()))

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                for i in range(32):
                    tg.start_soon(one, i)
        assert sorted(got) == sorted(str(i).encode() for i in range(32))
        # The first went out alone, but the others were sent before it could poll: it did not
        # (a poll here, with the server on this loop, would have missed and been remembered).
        assert "here" not in peer._calls._round_trips


async def test_a_slow_service_is_not_polled_for(hub: dict) -> None:
    with serving_peers(hub["endpoint"], 1):
        async with connect(hub["endpoint"], name="requester") as peer:
            for _ in range(2):
                with anyio.fail_after(10):
                    assert (await peer.request("slow", b"0.02")).startswith(b"done by")
            assert peer._calls._round_trips["slow"] > SPIN_MAX  # a 20 ms service: it sleeps


async def test_a_replay_is_never_polled_for(hub: dict) -> None:
    """`hub.replay` may be answered by the hub's idle-priority reader, which a poller would keep
    off the CPU: it waits in the loop, whatever its round trips took."""
    async with connect(hub["endpoint"], name="requester") as peer:
        with anyio.fail_after(10):
            await peer.confirm()  # a lone `hub.replay`
        peer._calls._round_trips.pop(p.HUB_REPLAY, None)  # as if never asked: a poll's case
        assert not peer._calls._polls(p.HUB_REPLAY)
        assert peer._calls._polls("anything.else")
