"""Replay of big events next to requests (issue 12 §5): request p99 idle vs during a replay, and
replay throughput.

    python bench/bench_replay.py [--rounds 5] [--events 200] [--event-kib 512] [--seconds 3]
                                 [--replay-pace-bytes N] [--reference RATE]

One hub (`busctl hub`, its log in a temporary state dir) holds `events` x `event-kib` events. Then:
- throughput: this process replays the whole log back to back for `seconds` (`hub.replay` batches
  of the hub's `replay_bytes`), nothing else running; prints MiB/s and batches/s;
- latency: `rounds` times, the test's replayer (tests/fault/test_budgets.py, nice 19, a whole-log
  replay in a loop) is stopped/continued while 1,000 `echo` requests are timed in each state
  (alternating 250 at a time, as the test does); prints p99 idle, p99 busy and the ratio per round.
- with `--reference RATE`: the same rounds again with no replay at all, a copier in its place: a
  process in the idle scheduling class (SCHED_IDLE, below nice 19) that only copies a 512 KiB
  buffer RATE times a second, talking to nobody. It shows what any background memory traffic
  costs the requests' p99 on this machine, whatever the hub does (bench/results/2026-12-01.md).
Not run by pytest. Every process is stopped at the end, even on error.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agent_bus.bus import protocol as p  # noqa: E402
from tests.bus.helpers import serving_peers  # noqa: E402
from tests.fault import test_budgets as tb  # noqa: E402
from tests.fault.test_fuzz import RawPeer  # noqa: E402
from tests.support import Proc, py  # noqa: E402

MiB = 1024 * 1024


class _Cursor(msgspec.Struct):
    upto: int
    head: int


def throughput(peer: RawPeer, seconds: float) -> tuple[float, float]:
    """Replay the whole log again and again for `seconds`: (MiB/s, batches/s) of reply bodies."""
    upto = batches = size = 0
    started = time.perf_counter()
    while (took := time.perf_counter() - started) < seconds:
        header, frames = peer.request(p.HUB_REPLAY, p.encode(p.ReplayRequest(since=upto)),
                                      timeout=30)
        assert header.kind == p.REPLY, header
        batch = msgspec.msgpack.decode(frames[0], type=_Cursor)
        upto = 0 if batch.upto >= batch.head else batch.upto
        batches += 1
        size += len(frames[0])
    return size / MiB / took, batches / took


def copier(rate: float) -> None:
    """The `--reference` load: copy a 512 KiB buffer `rate` times a second, at the lowest
    priority the OS has, and nothing else."""
    os.nice(19)
    if hasattr(os, "SCHED_IDLE"):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    source = os.urandom(512 * 1024)
    print('{"ready": "copier"}', flush=True)
    started = time.perf_counter()
    copies = 0
    while True:
        bytes(bytearray(source))  # two copies, as a forwarded batch is copied in and out
        copies += 1
        ahead = copies / rate - (time.perf_counter() - started)
        if ahead > 0:
            time.sleep(ahead)  # the pace: `rate` copies a second


def rounds(requester: RawPeer, load: Proc, count: int, what: str) -> list[float]:
    """`count` latency rounds beside `load`: the p99 ratios, each printed."""
    ratios: list[float] = []
    load.wait_ready(20)
    for n in range(count):
        idle, busy = latency_round(requester, load)
        ratios.append(busy / idle)
        print(f"round {n + 1}: request p99 idle {idle * 1e3:.2f} ms, during {what} "
              f"{busy * 1e3:.2f} ms ({busy / idle:.2f}x)", flush=True)
    print(f"{what}: ratio median {statistics.median(ratios):.2f}x, max {max(ratios):.2f}x",
          flush=True)
    return ratios


def latency_round(requester: RawPeer, replaying: Proc) -> tuple[float, float]:
    idle: list[float] = []
    busy: list[float] = []
    for _ in range(4):
        replaying.signal(signal.SIGSTOP)
        idle += tb.request_times(requester, 250)
        replaying.signal(signal.SIGCONT)
        busy += tb.request_times(requester, 250)
    return tb.p99(idle), tb.p99(busy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--events", type=int, default=200)
    parser.add_argument("--event-kib", type=int, default=512)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--reference", type=float, default=0.0, metavar="RATE",
                        help="then the same rounds beside a hub-free idle-class copier of RATE "
                             "512 KiB copies a second instead of the replay")
    parser.add_argument("--replay-pace-bytes", type=int, default=None, metavar="N",
                        help="the hub's `--replay-pace-bytes` (default: the hub's own; 0: none)")
    args = parser.parse_args()
    flags = ([] if args.replay_pace_bytes is None
             else ["--replay-pace-bytes", str(args.replay_pace_bytes)])
    with tempfile.TemporaryDirectory() as tmp:
        hub = tb.start_hub(Path(tmp), *flags)
        ctx = zmq.Context()
        endpoint = hub.ready["endpoint"]  # type: ignore[attr-defined]
        requester = RawPeer(ctx, endpoint, "requester")
        replaying: Proc | None = None
        try:
            requester.hello()
            body = tb.event_body("custom", args.event_kib * 1024)
            for i in range(args.events):
                requester.send([p.SIGNATURE, msgspec.msgpack.encode(
                    {"kind": p.EVENT, "id": f"e{i}", "type": "custom"}), body])
            tb.status(requester)
            mibs, rate = throughput(requester, args.seconds)
            print(f"replay throughput: {mibs:.0f} MiB/s, {rate:.0f} batches/s "
                  f"({args.events} x {args.event_kib} KiB events, {args.seconds:g} s)", flush=True)
            if not args.rounds:
                return
            with serving_peers(endpoint, 1, "--capacity", "4"):
                tb.request_times(requester, 100)  # warm up
                replaying = Proc(py(str(ROOT / "tests/fault/test_budgets.py"), "replay", endpoint))
                rounds(requester, replaying, args.rounds, "replay")
                replaying.stop()
                if args.reference:
                    replaying = Proc(py(__file__, "--copier", str(args.reference)))
                    rounds(requester, replaying, args.rounds,
                           f"a hub-free idle-class copier, {args.reference:g} x 512 KiB/s")
        finally:
            if replaying is not None:
                replaying.stop()
            requester.close()
            ctx.term()
            hub.stop()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--copier"]:
        copier(float(sys.argv[2]))
    else:
        main()
