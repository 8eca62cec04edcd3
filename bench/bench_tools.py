"""Tool calls through the hub: round trip, throughput and parallel speedup, against raw pyzmq.

    python bench/bench_tools.py [--quick | --smoke]

Figures:
  * echo tool round trip (p50/p99) through hub + `busctl worker`, via BusToolExecutor and via a
    bare `peer.request`, against a raw blocking DEALER -> ROUTER broker -> DEALER echo in the same
    run (same host, separate processes);
  * tool calls/s with 4 workers (64 calls in flight);
  * 8 calls of a 0.5 s tool over N single-capacity workers (N = 1, 2, 4, 8): wall time, speedup.

This file is also the workers' tool module (`--tools bench/bench_tools.py`). Not run by pytest.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import anyio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agent_bus.tools import tool  # noqa: E402
from bench.baseline import raw_round_trip  # noqa: E402
from bench.common import ToolTopology, calls_per_second, tool_round_trip  # noqa: E402


@tool
async def echo(text: str) -> str:
    """Return `text`."""
    return text


@tool
def echo_sync(text: str) -> str:
    """Return `text` (from a worker thread)."""
    return text


@tool
async def nap(seconds: float = 0.5) -> str:
    """Sleep `seconds`."""
    await anyio.sleep(seconds)
    return "ok"


# --- through the hub -------------------------------------------------------------------------


async def tool_throughput(endpoint: str, seconds: float, in_flight: int) -> float:
    from agent_bus.bus.client import connect
    from agent_bus.bus.messages import ToolCallRequest
    from agent_bus.tools.executor import BusToolExecutor

    request = ToolCallRequest(call_id="c", name="echo", arguments='{"text": "hello"}')
    async with connect(endpoint, name="bench-client") as peer:
        tools = BusToolExecutor(peer)
        await tools.catalog()
        return await calls_per_second(lambda: tools.execute(request), in_flight, seconds)


async def batch_wall(endpoint: str, calls: int, seconds: float) -> float:
    from agent_bus.bus.client import connect
    from agent_bus.bus.messages import ToolCallRequest
    from agent_bus.tools.executor import BusToolExecutor

    batch = [ToolCallRequest(call_id=f"c{i}", name="nap", arguments=json.dumps({"seconds": seconds}))
             for i in range(calls)]
    async with connect(endpoint, name="bench-client") as peer:
        tools = BusToolExecutor(peer)
        await tools.catalog()
        t0 = time.perf_counter()
        results = await tools.execute_all(batch)
        wall = time.perf_counter() - t0
    assert not any(r.is_error for r in results), [r.text for r in results]
    return wall


def sandbox_cost(topo: ToolTopology, n: int, rounds: int = 3) -> None:
    """Issue 27's budget: the echo round trip through a sandboxed worker (bubblewrap, where it
    runs) <= 1.2x through an unsandboxed one, measured alternately in the same run."""
    p50: dict[str, list[float]] = {"off": [], "auto": []}
    for _ in range(rounds):
        for mode in ("off", "auto"):
            started = topo.workers(1, 8, sandbox=mode)
            p50[mode].append(anyio.run(tool_round_trip, topo.endpoint, n, "echo")["exec_p50"])
            topo.stop(started)
    off, on = min(p50["off"]), min(p50["auto"])
    print(f"tool `echo` round trip, sandboxed worker vs not (best p50 of {rounds} each): {on * 1e6:.0f} us"
          f" vs {off * 1e6:.0f} us = {on / off:.2f}x (budget 1.2x)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples, shorter runs")
    parser.add_argument("--smoke", action="store_true",
                        help="the least that prints every line (a test that the bench runs; its "
                             "figures mean nothing): 1 sandbox round, a 0.05 s tool on 1 and 2 workers")
    args = parser.parse_args()
    n = 50 if args.smoke else 1000 if args.quick else 5000
    seconds = 0.3 if args.smoke else 2.0 if args.quick else 5.0
    nap_s, spread = (0.05, (1, 2)) if args.smoke else (0.5, (1, 2, 4, 8))

    from agent_bus.bus import protocol as p
    from agent_bus.bus.messages import ToolCallRequest

    body = p.encode(ToolCallRequest(call_id="c", name="echo", arguments=json.dumps({"text": "x" * 40})))
    raw_p50, raw_p99 = raw_round_trip(n, body)
    print(f"raw pyzmq DEALER->ROUTER->DEALER echo ({len(body)} B): p50 {raw_p50 * 1e6:.0f} us, "
          f"p99 {raw_p99 * 1e6:.0f} us", flush=True)

    with tempfile.TemporaryDirectory() as state:
        topo = ToolTopology(state)
        try:
            sandbox_cost(topo, n, 1 if args.smoke else 3)
            first = topo.workers(1, 8)
            for name in ("echo", "echo_sync"):
                rt = anyio.run(tool_round_trip, topo.endpoint, n, name)
                print(f"tool `{name}` round trip via BusToolExecutor: p50 {rt['exec_p50'] * 1e6:.0f} us "
                      f"({rt['exec_p50'] / raw_p50:.1f}x raw), p99 {rt['exec_p99'] * 1e6:.0f} us "
                      f"({rt['exec_p99'] / raw_p99:.1f}x raw); bare peer.request: p50 "
                      f"{rt['req_p50'] * 1e6:.0f} us ({rt['req_p50'] / raw_p50:.1f}x raw), "
                      f"p99 {rt['req_p99'] * 1e6:.0f} us", flush=True)
            more = topo.workers(3, 8)
            rate = anyio.run(tool_throughput, topo.endpoint, seconds, 64)
            print(f"echo tool calls/s, 4 workers x concurrency 8, 64 in flight: {rate:,.0f} "
                  f"({rate * raw_p50:.2f}x one raw blocking round-trip stream)", flush=True)
            topo.stop(first + more)

            serial = 8 * nap_s
            for workers in spread:
                started = topo.workers(workers, 1)
                wall = anyio.run(batch_wall, topo.endpoint, 8, nap_s)
                ideal = serial / workers
                print(f"8 x {nap_s:g} s tool over {workers} single-capacity worker(s): {wall:.3f} s "
                      f"(ideal {ideal:.2f} s; speedup {serial / wall:.2f}x, "
                      f"efficiency {serial / wall / workers:.0%})", flush=True)
                topo.stop(started)
        finally:
            topo.stop()


if __name__ == "__main__":
    main()
