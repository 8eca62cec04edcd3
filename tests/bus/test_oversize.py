"""An oversized request is refused with an error reply, not left to time out."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import pytest

from agent_bus.bus.client import connect
from agent_bus.bus.errors import RemoteError
from tests.bus.helpers import limited_hub

pytestmark = pytest.mark.anyio


async def test_oversized_request_gets_a_prompt_error(tmp_path: Path) -> None:
    with limited_hub(tmp_path / "hub", 4096) as ready:
        async with connect(ready["endpoint"], name="big") as peer:
            async def echo(req) -> bytes:  # type: ignore[no-untyped-def]
                return req.body

            await peer.serve("echo", echo)
            started = time.monotonic()
            with pytest.raises(RemoteError, match="over the hub's limit of 4096"):
                await peer.request("echo", b"x" * 8192, timeout=30)
            assert time.monotonic() - started < 2
            with anyio.fail_after(5):
                assert await peer.request("echo", b"small") == b"small"
            assert (await peer.status()).counters["oversize"] == 1


async def test_an_oversized_answer_partial_or_event_is_never_sent(tmp_path: Path) -> None:
    """Issue 28 item 4, at the peer: an answer, partial or event over `max_message_bytes` would
    make the hub drop the sender's connection (and every call on it); each is refused alone."""
    with limited_hub(tmp_path / "hub", 65536) as ready:
        async with connect(ready["endpoint"], name="server") as server, \
                connect(ready["endpoint"], name="client") as client:
            async def big(req) -> bytes:  # type: ignore[no-untyped-def]
                if req.body == b"partial":
                    await req.partial(b"p" * 70_000)
                if req.body == b"partials":  # one loop iteration: held as one message, but
                    for i in range(10):      # never past the limit (10 x 10 KB > 64 KiB)
                        await req.partial(bytes([i]) * 10_000)
                return b"x" * 70_000 if req.body == b"answer" else b"small"

            await server.serve("big", big)
            welcome = server.welcome
            for what, text in ((b"answer", "the answer of `big` is 70000 bytes"),
                               (b"partial", "a partial answer of `big` is 70000 bytes")):
                with pytest.raises(RemoteError, match="over the hub's message limit of 65536") as e:
                    await client.request("big", what, timeout=10)
                assert e.value.code == "too_large" and text in str(e.value)
            async with client.stream("big", b"partials", timeout=10) as replies:
                got = [body async for body in replies]
            assert got == [bytes([i]) * 10_000 for i in range(10)] + [b"small"]
            await server.publish_raw("topic_message", b"e" * 70_000)
            assert server.counters["events_too_large"] == 1
            with anyio.fail_after(5):  # the same connection serves on
                assert await client.request("big", b"", timeout=5) == b"small"
            assert server.welcome is welcome
            counters = (await client.status()).counters
            assert counters.get("oversize", 0) == 0 and counters.get("malformed", 0) == 0
