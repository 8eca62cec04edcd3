"""Handlers of both forms through a real hub: an `async def` one runs in its request's task, a
plain function at once in the peer's reader; each request gets exactly one answer either way."""

from __future__ import annotations

import asyncio
from pathlib import Path

import anyio
import pytest

from agent_bus.bus.client import IncomingRequest, connect
from agent_bus.bus.errors import RequestError
from tests.bus.helpers import limited_hub

pytestmark = pytest.mark.anyio


def answer(req: IncomingRequest) -> bytes:
    """What both forms answer: the body echoed, or the failure the body names."""
    if req.body == b"refuse":
        raise RequestError("not this one", "bad_request")
    if req.body == b"raise":
        raise ValueError("boom")
    if req.body == b"text":
        return "not bytes"  # type: ignore[return-value]
    if req.body == b"big":
        return b"x" * 70_000
    return req.body


async def async_answer(req: IncomingRequest) -> bytes:
    await anyio.lowlevel.checkpoint()  # it runs in a task: it may wait
    return answer(req)


def plain_answer(req: IncomingRequest) -> bytes:
    assert asyncio.current_task() is None  # called in the reader, not in a task of its own
    return answer(req)


class Wrapped:
    """A callable object around an `async def` handler: what it returns is awaited in a task."""

    async def __call__(self, req: IncomingRequest) -> bytes:
        return await async_answer(req)


@pytest.mark.parametrize("form", ["async", "plain", "awaitable"])
async def test_both_handler_forms_answer_and_fail_alike(tmp_path: Path, form: str) -> None:
    handler = {"async": async_answer, "plain": plain_answer, "awaitable": Wrapped()}[form]
    with limited_hub(tmp_path / "hub", 65536) as ready:
        async with connect(ready["endpoint"], name="server") as server, \
                connect(ready["endpoint"], name="client") as client:
            await server.serve("svc", handler, capacity=64)
            with anyio.fail_after(20):
                replies = await _all(client, [str(i).encode() for i in range(200)])
                assert replies == [str(i).encode() for i in range(200)]
                for body, code, text in (
                        (b"refuse", "bad_request", "not this one"),
                        (b"raise", "handler_error", "ValueError: boom"),
                        (b"text", "handler_error", "the handler returned str, expected bytes"),
                        (b"big", "too_large", "the answer of `svc` is 70000 bytes")):
                    with pytest.raises(RequestError, match=text) as info:
                        await client.request("svc", body, timeout=10)
                    assert info.value.code == code
                assert await client.request("svc", b"still here", timeout=10) == b"still here"
            assert server.counters.get("answers_too_large") == 1
            assert not server._serving.in_service  # every request ended: none left behind


async def _all(client, bodies: list[bytes]) -> list[bytes]:  # type: ignore[no-untyped-def]
    """Request every body at once (concurrently); the replies in the bodies' order."""
    replies: list[bytes] = [b""] * len(bodies)

    async def one(i: int) -> None:
        replies[i] = await client.request("svc", bodies[i], timeout=10)

    async with anyio.create_task_group() as tg:
        for i in range(len(bodies)):
            tg.start_soon(one, i)
    return replies
