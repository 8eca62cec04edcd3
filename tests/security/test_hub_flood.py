"""The hub's own services fall under per-peer budgets (issue #28 item 3): a raw peer that floods
`hub.status` and never reads its answers keeps the hub under its documented bound (400 MB RSS,
docs/reliability.md), and the memory comes back when it leaves."""

from __future__ import annotations

import uuid
from typing import Any

import msgspec
import zmq

from tests.bus.test_raw_contracts import raw_peers
from tests.support import wait_for

SIG = b"AGB/1"
BOUND = 400 * 1024 * 1024  # docs/reliability.md, "Memory budgets"
FLOOD = 20_000


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        line = next(s for s in f if s.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def test_a_status_flood_from_a_peer_that_never_reads_stays_bounded(hub: dict) -> None:
    pid = hub["proc"].pid
    with raw_peers(hub["endpoint"], "big", "watcher") as (big, watcher):
        # many services with some meta: every status answer is ~40 KB (200 x 20,000 on old code:
        # 800 MB queued for the flooder)
        big.send({"kind": "register", "id": "reg"}, {"services": [
            {"name": f"svc.{i}", "capacity": 1, "meta": {"pad": "x" * 180}} for i in range(200)]})
        big.sync()
        size = len(msgspec.msgpack.encode(watcher.status()))
        assert size > 30_000, size
        baseline = rss(pid)
        ctx: zmq.Context[Any] = zmq.Context()
        flooder = ctx.socket(zmq.DEALER)
        try:
            flooder.linger = 0
            flooder.sndhwm = 0
            flooder.rcvhwm = 10  # reads nothing: the answers back up into the hub
            flooder.connect(hub["endpoint"])
            flooder.send_multipart([SIG, msgspec.msgpack.encode({"kind": "hello", "id": "h"}),
                                    msgspec.msgpack.encode({"name": "flood",
                                                            "session": uuid.uuid4().hex[:12]})])
            for i in range(FLOOD):
                flooder.send_multipart([SIG, msgspec.msgpack.encode(
                    {"kind": "request", "id": f"s{i}", "service": "hub.status"}), b""])

            def handled() -> bool:  # (the watcher heartbeats the group while it waits)
                return watcher.status()["counters"].get("requests", 0) >= FLOOD

            wait_for(handled, 60, "the hub to handle the flood")
            peak = rss(pid)
            counters = watcher.status()["counters"]
            assert peak <= BOUND, (peak, baseline)
            assert counters.get("overloaded_service_bytes", 0) > FLOOD // 2, counters
        finally:
            flooder.close(0)
            ctx.term()
        # memory comes back once the flooder is gone
        wait_for(lambda: rss(pid) < baseline + 64 * 1024 * 1024 or watcher.sync(), 15,
                 f"the hub's memory back near {baseline} bytes (now {rss(pid)})")
        assert rss(pid) < baseline + 64 * 1024 * 1024, (rss(pid), baseline)
