"""Same-run A/B of two source trees' bus client (`Peer`): one hub; each tree's requester and
4 serving peers (an echo, capacity 64 each, as bench_bus.py) run side by side, and groups of
lone round trips and of 256-in-flight requests alternate between the trees (the order reversed
every group). Each side imports `agent_bus` from its tree (PYTHONPATH, ahead of an editable
install), so a change to the client is measured against the code before it, on the same hub,
in the same minute: what bench_bus.py's per-run ratios cannot resolve at a few percent.

    python bench/ab_bus.py OLD_TREE NEW_TREE [--groups 20] [--rtt 300] [--slice 1.0]

Prints, for round trip p50 and requests/s, each tree's median and the median of the groups'
NEW/OLD ratios. Not run by pytest but at its smallest size (tests/bench/test_smoke.py); every
process is stopped at the end, even on error.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BODY = b"x" * 64
SERVERS = 4        # serving peers per tree, as bench_bus.py's requests/s figure
IN_FLIGHT = 256    # requests kept in flight by a throughput slice


# --- one side, in its own process (`--side serve|request ENDPOINT SERVICE`) -------------------

async def _serve(endpoint: str, service: str) -> None:
    import anyio

    from agent_bus.bus.client import IncomingRequest, connect

    async with connect(endpoint, name=f"ab-{service}") as peer:
        def echo(req: IncomingRequest) -> bytes:
            return req.body

        await peer.serve(service, echo, capacity=64)
        await peer.status()  # registered: the hub answered after the register
        print("ready", flush=True)
        await anyio.sleep_forever()


async def _request(endpoint: str, service: str) -> None:
    import anyio

    from agent_bus.bus.client import connect

    async with connect(endpoint, name=f"ab-req-{service}") as peer:
        for _ in range(200):  # warm: connections, caches, the hub's routing entry
            await peer.request(service, BODY)
        print("ready", flush=True)
        while line := await anyio.to_thread.run_sync(sys.stdin.readline):
            command, arg = line.split()
            if command == "rtt":
                print(await _round_trip(peer, service, int(arg)), flush=True)
            else:
                print(await _throughput(peer, service, float(arg)), flush=True)


async def _round_trip(peer: object, service: str, count: int) -> float:
    times = []
    for _ in range(count):
        started = time.perf_counter()
        await peer.request(service, BODY)  # type: ignore[attr-defined]
        times.append(time.perf_counter() - started)
    return statistics.median(times)


async def _throughput(peer: object, service: str, seconds: float) -> float:
    # bench/common.py's calls_per_second, written out: a side imports nothing but its own tree
    import anyio

    done = 0
    stop = time.perf_counter() + seconds

    async def keep_asking() -> None:
        nonlocal done
        while time.perf_counter() < stop:
            await peer.request(service, BODY)  # type: ignore[attr-defined]
            done += 1

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(IN_FLIGHT):
            tg.start_soon(keep_asking)
    return done / (time.perf_counter() - started)


# --- the driver ------------------------------------------------------------------------------

def _start(tree: Path, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.Popen([sys.executable, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env, cwd=tree)


def _ready(proc: subprocess.Popen[str]) -> subprocess.Popen[str]:
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if line != "ready":
        raise SystemExit(f"a side did not start (it printed {line!r})")
    return proc


def _ask(proc: subprocess.Popen[str], command: str) -> float:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(command + "\n")
    proc.stdin.flush()
    return float(proc.stdout.readline())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--groups", type=int, default=20)
    parser.add_argument("--rtt", type=int, default=300, help="lone round trips per group")
    parser.add_argument("--slice", type=float, default=1.0, help="seconds of requests/s per group")
    parser.add_argument("--side", nargs=3, metavar=("ROLE", "ENDPOINT", "SERVICE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        import anyio

        role, endpoint, service = args.side
        anyio.run(_serve if role == "serve" else _request, endpoint, service)
        return
    trees = {"old": args.old.resolve(), "new": args.new.resolve()}
    me = str(Path(__file__).resolve())
    procs: list[subprocess.Popen[str]] = []
    with tempfile.TemporaryDirectory() as state:
        hub = _start(trees["new"], "-m", "agent_bus.cli", "hub", "--hub", "tcp://127.0.0.1:0",
                     "--state-dir", state)
        procs.append(hub)
        try:
            assert hub.stdout is not None
            endpoint = json.loads(hub.stdout.readline())["endpoint"]
            requesters = {}
            for name, tree in trees.items():
                side = [me, ".", ".", "--side"]
                for _ in range(SERVERS):
                    procs.append(_ready(_start(tree, *side, "serve", endpoint, f"echo-{name}")))
                requesters[name] = _ready(_start(tree, *side, "request", endpoint, f"echo-{name}"))
                procs.append(requesters[name])
            _report(_alternate(requesters, args))
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()


def _alternate(requesters: dict[str, subprocess.Popen[str]],
               args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    figures: dict[str, dict[str, list[float]]] = {"rtt": {"old": [], "new": []},
                                                  "thr": {"old": [], "new": []}}
    order = ["old", "new"]
    for _ in range(args.groups):
        for name in order:
            figures["rtt"][name].append(_ask(requesters[name], f"rtt {args.rtt}"))
        for name in order[::-1]:
            figures["thr"][name].append(_ask(requesters[name], f"thr {args.slice}"))
        order.reverse()
    return figures


def _report(figures: dict[str, dict[str, list[float]]]) -> None:
    for key, label, scale, unit in (("rtt", "round trip p50", 1e6, "us"), ("thr", "requests/s", 1, "/s")):
        old, new = figures[key]["old"], figures[key]["new"]
        ratios = [n / o for n, o in zip(new, old, strict=True)]
        print(f"{label}: old median {statistics.median(old) * scale:,.1f} {unit}, new median "
              f"{statistics.median(new) * scale:,.1f} {unit}; new/old per group median "
              f"{statistics.median(ratios):.3f}x (groups {min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
