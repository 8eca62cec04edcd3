"""A lone requester's round trips beside a flood of events, against the same round trips idle.

    python bench/bench_flood.py [--events 400000] [--rounds 2] [--smoke]

One hub (ipc, its log on disk), one `bus` peer serving `echo`, and a publisher that sends
EVENTS small events as fast as the `bus` client publishes them (it outruns the hub). Each round
measures lone `echo` round trips with nothing else running (the baseline), then again while the
flood is logged and published: every ratio is to the idle p50 of the same round. What it shows
is how long the hub's routing loop can stop: a pass of the loop reads at most PASS_EVENTS events
(bus/hub.py), and the event log's checkpoints run on a thread of their own
(bus/store/sqlite.py `Checkpointer`); before those, the longest round trip beside 400,000
events was the length of a checkpoint, ~55 ms (~200x the idle p50). After the flood it prints
the log's WAL and database sizes: a WAL that grows with the flood means checkpoints never caught
up. Not run by pytest (but for `--smoke`); every process is stopped at the end, even on error.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import Proc, busctl  # noqa: E402

IDLE_TRIPS = 300


def _echo(endpoint: str, ready: Any) -> None:
    """A `bus` peer serving `echo`, answering in its reader."""
    import anyio

    from agent_bus.bus.client import connect

    async def main() -> None:
        async with connect(endpoint, name=f"flood-echo-{os.getpid()}") as peer:
            await peer.serve("echo", lambda req: req.body, capacity=4)
            await peer.status()
            ready.set()
            await anyio.sleep_forever()

    anyio.run(main)


def _flood(endpoint: str, n: int, start: Any, ready: Any) -> None:
    """`n` small events as fast as the `bus` client publishes them, then a `hub.status`: the
    hub has handled all of them when it answers."""
    import anyio

    from agent_bus.bus import events as ev
    from agent_bus.bus.client import connect

    async def main() -> None:
        async with connect(endpoint, name="flood-publisher") as peer:
            body = ev.encode_event(ev.TopicMessage(topic="t", text="x" * 40))
            ready.set()
            start.wait()
            for _ in range(n):
                await peer.publish_raw("topic_message", body, agent="a", run="r")
            await peer.status(timeout=120)

    anyio.run(main)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def one_round(endpoint: str, n: int) -> tuple[float, list[float]]:
    """(idle p50, the round trips beside the flood), seconds."""
    import anyio

    from agent_bus.bus.client import connect

    spawn = mp.get_context("spawn")
    start, ready = spawn.Event(), spawn.Event()
    publisher = spawn.Process(target=_flood, args=(endpoint, n, start, ready), daemon=True)
    publisher.start()
    try:
        assert ready.wait(30), "the publisher did not connect"

        async def measure() -> tuple[float, list[float]]:
            async with connect(endpoint, name="flood-requester") as peer:
                idle = []
                for _ in range(IDLE_TRIPS):
                    began = time.perf_counter()
                    await peer.request("echo", b"x")
                    idle.append(time.perf_counter() - began)
                start.set()
                beside = []
                deadline = time.monotonic() + 300
                while publisher.is_alive() and time.monotonic() < deadline:
                    began = time.perf_counter()
                    await peer.request("echo", b"x")
                    beside.append(time.perf_counter() - began)
                return statistics.median(idle), beside

        return anyio.run(measure)
    finally:
        publisher.kill()
        publisher.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--events", type=int, default=400_000, help="events a flood (default 400,000)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="the least that prints every line")
    args = ap.parse_args()
    n, rounds = (5000, 1) if args.smoke else (args.events, args.rounds)
    spawn = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as state:
        hub = Proc(busctl("hub", "--hub", f"ipc://{state}/hub", "--state-dir", state))
        echo = None
        try:
            endpoint = str(hub.ready()["endpoint"])
            ready = spawn.Event()
            echo = spawn.Process(target=_echo, args=(endpoint, ready), daemon=True)
            echo.start()
            assert ready.wait(30), "the echo server did not register"
            print(f"a lone requester's round trips beside a flood of {n:,} events, "
                  f"{rounds} round(s)")
            ratios: dict[str, list[float]] = {"p50": [], "p99": [], "p99.9": [], "max": []}
            for r in range(1, rounds + 1):
                idle, beside = one_round(endpoint, n)
                got = {"p50": pct(beside, 0.5), "p99": pct(beside, 0.99),
                       "p99.9": pct(beside, 0.999), "max": max(beside)}
                for name, value in got.items():
                    ratios[name].append(value / idle)
                print(f"round {r}: idle p50 {idle * 1e6:.0f} us; beside the flood ({len(beside)} "
                      "round trips): " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in got.items()))
            print("round trip beside the flood / idle p50 (median of rounds): " + ", ".join(
                f"{k} {statistics.median(v):.2f}x" for k, v in ratios.items()))
            wal = Path(f"{state}/events.db-wal")
            size = wal.stat().st_size if wal.exists() else 0
            print(f"event log after the floods: WAL {size / 2**20:.1f} MiB, database "
                  f"{Path(state, 'events.db').stat().st_size / 2**20:.1f} MiB")
        finally:
            if echo is not None:
                echo.kill()
                echo.join()
            hub.stop()


if __name__ == "__main__":
    main()
