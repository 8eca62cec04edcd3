"""Partial replies sent in one event-loop iteration travel as one `partial` message with a body
frame each (docs/protocol.md §4), through a real hub process; the Python client yields each body
in order, then the final reply."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import zmq

from agent_bus.bus.client import IncomingRequest, connect
from tests.bus.test_raw_contracts import RawPeer

pytestmark = pytest.mark.anyio


async def _burst_server(endpoint: str, release: anyio.Event, stop: anyio.Event,
                        ready: anyio.Event) -> None:
    """Serve `burst`: five partials back to back, then (once `release` is set) two more and
    the reply in the same iteration."""

    async def burst(req: IncomingRequest) -> bytes:
        for i in range(5):
            await req.partial(str(i).encode())
        await release.wait()
        await req.partial(b"5")
        await req.partial(b"6")
        return b"end"

    async with connect(endpoint, name="burst-server") as server:
        await server.serve("burst", burst)
        ready.set()
        await stop.wait()


async def test_a_burst_of_partials_is_one_message_and_the_client_yields_each(hub: dict) -> None:
    release, stop, ready = anyio.Event(), anyio.Event(), anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(_burst_server, hub["endpoint"], release, stop, ready)
        with anyio.fail_after(20):
            await ready.wait()
            async with connect(hub["endpoint"], name="requester") as peer:
                got: list[bytes] = []
                async with peer.stream("burst", b"", timeout=10) as replies:
                    async for body in replies:
                        got.append(body)
                        if len(got) == 5:
                            release.set()
        assert got == [b"0", b"1", b"2", b"3", b"4", b"5", b"6", b"end"]
        stop.set()


def _raw_request(endpoint: str, release: anyio.Event) -> list[tuple[str, list[bytes]]]:
    """A requester written from the protocol doc: the messages of one `burst` request."""
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        raw = RawPeer(ctx, endpoint, "raw-requester", [])
        raw.send({"kind": "request", "id": "b1", "service": "burst"}, b"")
        header, body = raw.expect(lambda h: h["kind"] == "partial" and h.get("id") == "b1")
        messages = [(header["kind"], body)]
        anyio.from_thread.run_sync(release.set)
        while messages[-1][0] == "partial":
            header, body = raw.expect(lambda h: h.get("id") == "b1")
            messages.append((header["kind"], body))
        raw.sock.close()
        return messages
    finally:
        ctx.term()


async def test_the_wire_carries_the_partials_of_one_iteration_in_one_message(hub: dict) -> None:
    release, stop, ready = anyio.Event(), anyio.Event(), anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(_burst_server, hub["endpoint"], release, stop, ready)
        with anyio.fail_after(20):
            await ready.wait()
            messages = await anyio.to_thread.run_sync(_raw_request, hub["endpoint"], release)
        stop.set()
    # The five partials of the first iteration: one message; then the last two partials and
    # the reply, sent in one iteration: the partials (one message) before the reply.
    assert messages == [("partial", [b"0", b"1", b"2", b"3", b"4"]),
                        ("partial", [b"5", b"6"]), ("reply", [b"end"])]
