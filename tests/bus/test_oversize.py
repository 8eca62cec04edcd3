"""An oversized request is refused with an error reply, not left to time out."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import pytest

from bus.client import connect
from bus.errors import RemoteError
from tests.support import Proc, busctl

pytestmark = pytest.mark.anyio


async def test_oversized_request_gets_a_prompt_error(tmp_path: Path) -> None:
    proc = Proc(busctl("hub", "--hub", "tcp://127.0.0.1:0", "--state-dir", str(tmp_path / "hub"),
                   "--max-message-bytes", "4096"))
    try:
        ready = proc.wait_ready()
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
    finally:
        proc.stop()
