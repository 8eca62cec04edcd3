"""Fewer cyclic-GC passes in a long-running bus process (hub, gateway, coordinator, worker).

Each of them allocates many short-lived containers per message (headers, frames, events, futures,
partial replies), nearly all freed by reference counting, while holding many long-lived ones (its
modules, and under load thousands of sessions, calls and tasks). With CPython's default thresholds
(700, 10, 10) the collector scans the young generations every 700 net allocations, and the
long-lived objects with them until they are promoted: at 1,000 concurrent sessions
(`bench/bench_scale.py`) it took 6.6% of the gateway's CPU and about 15% of the coordinator's.
`tune_gc` freezes what the process holds after its start (the collector never scans it again) and
raises the young threshold to `YOUNG_THRESHOLD`: the cost is that up to that many more container
objects may wait for a collection. Called by each process's command (`busctl hub`, `gateway`,
`coordinator`, `worker`), not by the library: a program that embeds a peer keeps its own policy.
"""

from __future__ import annotations

import gc

#: Net allocations of container objects between young collections (CPython's default: 700).
YOUNG_THRESHOLD = 10_000


def tune_gc() -> None:
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, *gc.get_threshold()[1:])
