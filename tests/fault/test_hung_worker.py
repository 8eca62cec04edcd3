"""Issue 8 §2: a hung worker (SIGSTOP) is declared lost within the liveness window; its calls fail
(non-idempotent) or are re-dispatched (idempotent); continued (SIGCONT), it re-registers and its
stale answers reach nobody (the requester gets exactly one final answer per call)."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from agent_bus.bus.client import Peer, connect
from agent_bus.bus.errors import PeerLost
from agent_bus.tools.worker import decode_reply
from tests.fault.conftest import FAULT_TOOLS
from tests.support import Proc, busctl, until

pytestmark = pytest.mark.anyio

HEARTBEAT = 0.2
LIVENESS = 3  # the hub declares a peer lost after HEARTBEAT * LIVENESS = 0.6 s of silence


@pytest.fixture
def fast_hub(tmp_path: Path) -> Iterator[str]:
    proc = Proc(busctl("hub", "--hub", "tcp://127.0.0.1:0", "--state-dir", str(tmp_path / "hub"),
                       "--heartbeat-interval", str(HEARTBEAT), "--liveness", str(LIVENESS)))
    try:
        yield proc.wait_ready()["endpoint"]
    finally:
        proc.stop()


def worker(endpoint: str, name: str) -> Proc:
    # unsandboxed: the test waits for this ready line on its event loop's thread (the sandbox's
    # start takes longer), and hangs the worker with SIGSTOP, which is about the hub, not tools
    proc = Proc(busctl("worker", "--hub", endpoint, "--tools", FAULT_TOOLS, "--name", name,
                       "--concurrency", "4", "--sandbox", "off"))
    try:
        proc.wait_ready()
    except BaseException:
        proc.stop()
        raise
    return proc


def call_body(name: str, tag: str, seconds: float) -> bytes:
    return msgspec.msgpack.encode({"call_id": f"c-{tag}", "name": name,
                                   "arguments": msgspec.json.encode({"tag": tag, "seconds": seconds}).decode()})


async def peer_named(bus: Peer, name: str) -> list:
    return [p for p in (await bus.status()).peers if p.name == name]


async def hung_worker(endpoint: str, stop_for: float) -> None:
    hung = worker(endpoint, "hung")
    healthy: Proc | None = None
    try:
        async with connect(endpoint, name="requester") as bus:
            outcome: dict[str, object] = {}

            async def call(service: str, tool: str, tag: str) -> None:
                started = time.monotonic()
                try:
                    reply = await bus.request(service, call_body(tool, tag, 1.5), timeout=30)
                    outcome[tag] = (decode_reply(reply), time.monotonic() - started)
                except Exception as exc:  # noqa: BLE001 - recorded and asserted below
                    outcome[tag] = (exc, time.monotonic() - started)

            async with anyio.create_task_group() as tg:
                tg.start_soon(call, "tool.nap", "nap", "lost")
                tg.start_soon(call, "tool.nap_again", "nap_again", "moved")
                # both calls are being served by `hung` before it hangs
                async def both_served() -> Any:
                    (h,) = await peer_named(bus, "hung")
                    return h if sum(s.load for s in h.services) == 2 else None

                h = await until(both_served, 4, "both calls to reach the worker")
                old_id = h.peer
                healthy = worker(endpoint, "healthy")  # where the idempotent call can go
                hung.signal(signal.SIGSTOP)
                stopped = time.monotonic()
                await until(lambda: "lost" in outcome, 10, "the hung worker to be declared lost")
                declared = time.monotonic() - stopped
                await until(lambda: len(outcome) == 2, 10, "both calls to end")
                left = stop_for - (time.monotonic() - stopped)
                if left > 0:
                    await anyio.sleep(left)  # the hang itself: stays stopped this long
                hung.signal(signal.SIGCONT)

            lost, _ = outcome["lost"]
            assert isinstance(lost, PeerLost), lost
            # within the liveness window (+ one 0.1 s expiry tick and scheduling slack)
            assert declared < HEARTBEAT * LIVENESS + 1.0, declared
            moved, _ = outcome["moved"]
            assert not isinstance(moved, Exception), moved
            assert moved.content[0].text == "again:moved"  # served again by `healthy`

            # Continued, it re-registers under a new connection (not as its old self)...
            async def reregistered() -> bool:
                now = await peer_named(bus, "hung")
                return bool(now) and now[0].peer != old_id and len(now[0].services) == 2

            await until(reregistered, 10, "the worker to re-register")
            # ...and serves new calls (each takes 1.5 s: by their end the old calls, resumed
            # at SIGCONT, have finished too)
            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(call, "tool.nap", "nap", f"after{i}")
            assert all(not isinstance(outcome[f"after{i}"][0], Exception) for i in range(4))
            # The old calls' answers went nowhere: the worker lost them with its old socket,
            # or the hub dropped them as stale (from a connection it no longer knows). Never
            # a second reply here.
            assert bus.counters.get("stale_replies", 0) == 0, bus.counters
    finally:
        hung.signal(signal.SIGCONT)
        hung.stop()
        if healthy is not None:
            healthy.stop()


async def test_hung_worker_short(fast_hub: str) -> None:
    await hung_worker(fast_hub, stop_for=2.0)


@pytest.mark.slow
async def test_hung_worker_ten_seconds(fast_hub: str) -> None:
    await hung_worker(fast_hub, stop_for=10.0)
