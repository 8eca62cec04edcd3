"""Same-run A/B of two source trees' hub (its event path: stamp -> store -> publish): one hub of
each tree, each with its own store, and one client (this tree's) publishing to both; groups of
acknowledged publishes alternate between the hubs (the order reversed every group), so a change
to the hub's event log is measured against the code before it in the same minute.

    python bench/ab_hub.py OLD_TREE NEW_TREE [--groups 20] [--events 5000] [--rtt 300] [--slice 0.5]
                           [--old-store URL] [--new-store URL]

Per group and hub: events/s (a burst of `--events` small events, then one `confirm()`: the
hub has them in its store), the hub's own CPU per event in that burst (utime + stime from /proc:
far steadier than a rate on a shared machine) and the lone acknowledged publish's p50
(`publish(confirm=True)`, one event at a time: one store append per event), and requests to an
echo the client serves through the same hub (lone round trip p50; requests/s with 256 in flight
for `--slice` seconds): requests do not touch the store. Prints each hub's
median and the median of the groups' NEW/OLD ratios. `--new-store nats://...` (or
`--old-store`) puts that hub's log in a JetStream cluster: the cost of the replicated store
against SQLite, in the same run. Every process is stopped at the end, even on error.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _start_hub(tree: Path, state: str, store: str) -> tuple[subprocess.Popen[str], str]:
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    args = [sys.executable, "-m", "agent_bus.cli", "hub", "--hub", "tcp://127.0.0.1:0",
            "--state-dir", state] + (["--store", store] if store else [])
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=env, cwd=tree)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith('{"ready"'):
        proc.kill()
        raise SystemExit(f"the hub of {tree} did not start (it printed {line!r})")
    return proc, str(json.loads(line)["endpoint"])


def _cpu(pid: int) -> float:
    """Seconds of CPU (user + system) process `pid` has used, its threads included."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _burst(peer: Any, count: int, pid: int = 0) -> tuple[float, float]:
    """(events/s, the hub's CPU microseconds per event)."""
    from agent_bus.bus import events as ev

    cpu = _cpu(pid) if pid else 0.0
    started = time.perf_counter()
    for i in range(count):
        await peer.publish(ev.TopicMessage(topic="ab", text=f"event {i}"))
    await peer.confirm()
    rate = count / (time.perf_counter() - started)
    return rate, ((_cpu(pid) - cpu) / count * 1e6 if pid else 0.0)


async def _lone(peer: Any, count: int) -> float:
    from agent_bus.bus import events as ev

    times = []
    for i in range(count):
        started = time.perf_counter()
        await peer.publish(ev.TopicMessage(topic="ab", text=f"lone {i}"), confirm=True)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


async def _requests(peer: Any, count: int, seconds: float) -> tuple[float, float]:
    """(the lone request round trip p50 in microseconds, requests/s with 256 in flight), to an
    echo served by the same peer through its hub: requests never touch the store, but the hub
    that holds a lease (issue 52) does more per pass."""
    import anyio

    body = b"x" * 64
    times = []
    for _ in range(count):
        started = time.perf_counter()
        await peer.request("ab-echo", body)
        times.append(time.perf_counter() - started)
    done = 0
    stop = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < stop:
            await peer.request("ab-echo", body)
            done += 1

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(256):
            tg.start_soon(worker)
    return statistics.median(times) * 1e6, done / (time.perf_counter() - started)


async def _run(endpoints: dict[str, str], pids: dict[str, int],
               args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    from contextlib import AsyncExitStack

    from agent_bus.bus.client import connect

    out: dict[str, dict[str, list[float]]] = {
        side: {"events_per_s": [], "hub_cpu_us_per_event": [], "lone_p50_ms": [],
               "request_p50_us": [], "requests_per_s": []}
        for side in endpoints}
    async with AsyncExitStack() as stack:
        peers = {side: await stack.enter_async_context(connect(endpoint, name=f"ab-{side}"))
                 for side, endpoint in endpoints.items()}
        for peer in peers.values():  # warm: connections, caches, the store's first pages
            await peer.serve("ab-echo", lambda req: req.body, capacity=256)
            await _burst(peer, min(1000, args.events))
        for group in range(args.groups):
            order = ["old", "new"] if group % 2 == 0 else ["new", "old"]
            for side in order:
                rate, cpu = await _burst(peers[side], args.events, pids[side])
                out[side]["events_per_s"].append(rate)
                out[side]["hub_cpu_us_per_event"].append(cpu)
                out[side]["lone_p50_ms"].append(await _lone(peers[side], args.rtt) * 1000)
                rtt, rate = await _requests(peers[side], args.rtt, args.slice)
                out[side]["request_p50_us"].append(rtt)
                out[side]["requests_per_s"].append(rate)
    return out


def _report(results: dict[str, dict[str, list[float]]]) -> None:
    for figure in ("events_per_s", "hub_cpu_us_per_event", "lone_p50_ms", "request_p50_us",
                   "requests_per_s"):
        old, new = results["old"][figure], results["new"][figure]
        # (a tiny burst can use less CPU than one clock tick on both sides: 0/0 counts as 1)
        ratios = [n / o if o else (1.0 if not n else math.inf) for o, n in zip(old, new, strict=True)]
        print(f"{figure}: old median {statistics.median(old):,.3f}, new median "
              f"{statistics.median(new):,.3f}, NEW/OLD median of groups "
              f"{statistics.median(ratios):.3f}x (groups {min(ratios):.2f}-{max(ratios):.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--groups", type=int, default=20)
    parser.add_argument("--events", type=int, default=5000, help="events per burst")
    parser.add_argument("--rtt", type=int, default=300, help="lone acknowledged publishes per group")
    parser.add_argument("--slice", type=float, default=0.5,
                        help="seconds of requests with 256 in flight per group")
    parser.add_argument("--old-store", default="", metavar="URL")
    parser.add_argument("--new-store", default="", metavar="URL")
    args = parser.parse_args()
    import anyio

    procs: list[subprocess.Popen[str]] = []
    with tempfile.TemporaryDirectory() as old_state, tempfile.TemporaryDirectory() as new_state:
        try:
            endpoints, pids = {}, {}
            for side, tree, state, store in (("old", args.old, old_state, args.old_store),
                                             ("new", args.new, new_state, args.new_store)):
                proc, endpoints[side] = _start_hub(tree.resolve(), state, store)
                procs.append(proc)
                pids[side] = proc.pid
            _report(anyio.run(_run, endpoints, pids, args))
        finally:
            for proc in procs:
                proc.terminate()
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


if __name__ == "__main__":
    main()
