"""Round-trip latency and throughput: raw pyzmq baselines, then the same through the hub + client.

    python bench/bench_bus.py [--quick | --smoke] [--rounds 3] [--transports tcp,ipc] [--no-replay]

Prints each figure and its ratio to the raw baseline measured in the same round (the raw
baseline, then the hub on TCP and on ipc://, alternated; the ratios are medians over the
rounds, as issue 32 asks). The round-trip ratios come from a finer alternation
(`round_trips`): every system stays up, and slices of lone round trips take turns between the raw
broker, the hub with the `bus` client at both ends, the hub between raw peers and the raw broker
between pyzmq's own asyncio sockets (the asyncio floor), on each transport, so each ratio
compares slices measured within a second of each other; a ratio is the median over the slice
groups of each group's ratio.

Requests/s are measured twice: in those rounds (with CPU per request), and interleaved finer
(`throughput_slices`): every system stays up and slices of a second or two take turns between
the raw broker, the raw broker between asyncio ends and the hub with `bus` peers answering with a
plain function (as the raw workers answer) and with an `async def` handler, so each ratio
compares slices measured seconds apart, not tens of seconds.

Under each throughput ratio, the hub's own share: the same load through the hub between raw
blocking pyzmq peers written from docs/protocol.md (a requester keeping 256 requests out and 4
raw serving peers; a publisher sending 256 event bodies per message, as the `bus` client
coalesces them, and a SUB socket), so what the `bus` client at the ends adds shows apart; and
for events, the floor: the same publisher through a raw Python forwarder that publishes each
body as its own message, frame by frame as the hub does, and does nothing else
(bench/baseline.py `raw_forwarded_rate`). Events/s through the `bus` client is measured as the
raw baseline is, its publisher never more than WINDOW events ahead of its subscriber (which sends
CREDIT back each time it has read that many), and again unpaced: a publisher that outruns its
subscriber, whose PUB queue at the hub may then drop what the subscriber fills from the log (from
the hub's `recent` window when the gap is recent, else by its idle-class replay reader, which
waits for a free core). Not run by pytest.
Processes are started with the `spawn` method; every one is stopped at the end, even on error.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.baseline import (  # noqa: E402
    CREDIT,
    WINDOW,
    _asyncio_throughput,
    _asyncio_worker,
    _requester,
    _start,
    _stop,
    cpu_s,
    free_port,
    pct,
    raw_forwarded_rate,
    raw_round_trip,
    raw_sub,
    raw_subscribed_rate,
    raw_throughput,
    windowed_rate,
)
from bench.headline import Headlines  # noqa: E402


def _raw_publisher(endpoint: str, n: int) -> None:
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.sndhwm = 0
    pub.bind(endpoint)
    while True:  # send a marker until the subscriber answers by... we just wait for a sub
        pub.send_multipart([b"hello", b"", b"", b""])
        time.sleep(0.01)
        if os.path.exists(endpoint.replace("tcp://127.0.0.1:", "/tmp/rawpub.")):
            break
    header, body = b"h" * 60, b"b" * 80
    for _ in range(n):
        pub.send_multipart([b"agent/a/r/message_update", b"AGB/1", header, body])
    pub.send_multipart([b"end", b"", b"", b""])
    time.sleep(1)


def raw_pubsub(n: int) -> float:
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    flag = f"/tmp/rawpub.{port}"
    spawn = mp.get_context("spawn")
    proc = spawn.Process(target=_raw_publisher, args=(endpoint, n), daemon=True)
    proc.start()
    ctx = zmq.Context()
    sub = raw_sub(ctx, endpoint)
    try:
        while sub.recv_multipart()[0] != b"hello":
            pass
        Path(flag).touch()
        count = 0
        t0 = None
        while True:
            frames = sub.recv_multipart()
            if frames[0] == b"hello":
                continue
            if t0 is None:
                t0 = time.perf_counter()
            if frames[0] == b"end":
                break
            count += 1
        return count / (time.perf_counter() - t0)
    finally:
        Path(flag).unlink(missing_ok=True)
        sub.close()
        ctx.term()
        proc.kill()
        proc.join()


# --- through the hub ---------------------------------------------------------------------------


def _serving_peer(endpoint: str, capacity: int, ready: mp.Queue[int], keys: str = "") -> None:
    """A `bus` peer serving `echo` with a plain function, as the raw workers answer (at once,
    in the peer's reader), and `echo-async` with an `async def` handler (a task and a cancel
    scope per request, so that a `cancel` reaches it: what a handler that waits needs). With
    `keys` (a `busctl keys generate` folder), over CURVE as its `bench` client."""
    import anyio

    from agent_bus.bus.client import connect

    async def main() -> None:
        async with connect(endpoint, name=f"bench-echo-{os.getpid()}",
                           curve=curve_client(keys)) as peer:
            def echo(req):  # type: ignore[no-untyped-def]
                return req.body

            async def echo_async(req):  # type: ignore[no-untyped-def]
                return req.body

            await peer.serve("echo", echo, capacity=capacity)
            await peer.serve("echo-async", echo_async, capacity=capacity)
            await peer.status()
            ready.put(os.getpid())
            await anyio.sleep_forever()

    anyio.run(main)


def _publisher(endpoint: str, n: int, start: mp.Event, ready: mp.Event, credits: str = "") -> None:
    """`n` events from the `bus` client as fast as it publishes them; with `credits`, at most
    WINDOW events ahead of the subscriber, as the raw publisher of the baseline is (it sends
    CREDIT back on `credits` each time it has read that many)."""
    import anyio
    import zmq.asyncio

    from agent_bus.bus.client import connect

    async def main() -> None:
        async with connect(endpoint, name="bench-pub") as peer:
            from agent_bus.bus import events as ev

            body = ev.encode_event(ev.TopicMessage(topic="t", text="x" * 40))
            ctx = zmq.asyncio.Context()
            credit = ctx.socket(zmq.PULL)  # unpaced: never read, the window covers all n
            credit.linger = 0
            if credits:
                credit.connect(credits)
            window = WINDOW if credits else n
            ready.set()
            start.wait()
            try:
                for _ in range(n):
                    while window < 1:  # awaited: the loop sends the held events meanwhile
                        await credit.recv()
                        window += CREDIT
                    await peer.publish_raw("topic_message", body, agent="a", run="r")
                    window -= 1
                await peer.status(timeout=60)  # flush: the hub has handled everything before
            finally:
                credit.close()
                ctx.term()

    anyio.run(main)


def _raw_echo_peer(endpoint: str, capacity: int = 4, ready: Any = None) -> None:
    """A serving peer written from docs/protocol.md with plain blocking pyzmq (no `bus` client):
    says hello, registers `echo-raw`, answers each request with its body, each heartbeat too.
    With `ready`, sets it once the hub has taken the register (a `hub.status` answered after it:
    the hub handles a peer's messages in order)."""
    from agent_bus.bus import protocol as p

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.sndhwm = sock.rcvhwm = 0
    sock.connect(endpoint)
    sock.send_multipart([p.SIGNATURE, p.encode(p.Header(kind=p.HELLO, id="h")),
                         p.encode(p.Hello(name="bench-raw-echo", session="raw"))])
    sock.recv_multipart()  # welcome
    sock.send_multipart([p.SIGNATURE, p.encode(p.Header(kind=p.REGISTER, id="r")),
                         p.encode(p.Register([p.ServiceSpec("echo-raw", capacity=capacity)]))])
    sock.send_multipart([p.SIGNATURE, p.encode(p.Header(kind=p.REQUEST, id="s",
                                                        service=p.HUB_STATUS))])
    while True:
        frames = sock.recv_multipart()
        header = p.decode_header(frames[1])
        if header.kind == p.REQUEST:
            sock.send_multipart([p.SIGNATURE, p.encode(p.Header(kind=p.REPLY, id=header.id)),
                                 *frames[2:3]])
        elif header.kind == p.HEARTBEAT:
            sock.send_multipart([p.SIGNATURE, p.encode(p.Header(kind=p.HEARTBEAT))])
        elif header.id == "s" and ready is not None:
            ready.set()


def raw_peers_throughput(endpoint: str, seconds: float, inflight: int = 256) -> float:
    """Requests/s through the hub to the `echo-raw` servers (`_raw_echo_peer`) from a raw
    blocking requester keeping `inflight` requests out, as `raw_throughput` does through the raw
    broker: the hub's own requests/s, without the `bus` client at either end."""
    from agent_bus.bus import protocol as p

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.sndhwm = sock.rcvhwm = 0
    sock.connect(endpoint)
    body = b"x" * 64
    sent = 0

    def send() -> None:  # ids unique among the requests out, as docs/protocol.md asks
        nonlocal sent
        sent += 1
        sock.send_multipart([p.SIGNATURE, p.encode(p.Header(kind=p.REQUEST, id=str(sent),
                                                            service="echo-raw")), body])

    try:
        sock.send_multipart([p.SIGNATURE, p.encode(p.Header(kind=p.HELLO, id="h")),
                             p.encode(p.Hello(name="bench-raw-requester", session="raw"))])
        sock.recv_multipart()  # welcome
        for _ in range(inflight):
            send()
        done = 0
        started = time.perf_counter()
        stop = started + seconds
        while time.perf_counter() < stop:
            frames = [sock.recv_multipart()]
            while True:
                try:
                    frames.append(sock.recv_multipart(zmq.NOBLOCK))
                except zmq.Again:
                    break
            for message in frames:
                kind = p.decode_header(message[1]).kind
                if kind == p.ERROR:
                    raise RuntimeError(f"the hub refused a request: {message[1]!r}")
                if kind == p.REPLY:  # one out for each one in
                    send()
                    done += 1
        return done / (time.perf_counter() - started)
    finally:
        sock.close()
        ctx.term()


def raw_peers_round_trip(endpoint: str, n: int) -> tuple[float, float]:
    """(p50, p99) of lone round trips through the hub between raw blocking pyzmq peers at both
    ends (`_raw_echo_peer` and a requester here): the hub's own share of the bus round trip,
    without the `bus` client's asyncio wake-ups at either end."""
    from agent_bus.bus import protocol as p

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(endpoint)
    try:
        sock.send_multipart([p.SIGNATURE, p.encode(p.Header(kind=p.HELLO, id="h")),
                             p.encode(p.Hello(name="bench-raw-requester", session="raw"))])
        sock.recv_multipart()  # welcome
        times = []
        for i in range(n + 200):  # the first 200 warm up (and wait for the registration)
            started = time.perf_counter()
            sock.send_multipart([p.SIGNATURE, p.encode(p.Header(kind=p.REQUEST, id=str(i),
                                                                service="echo-raw")), b"x" * 64])
            while p.decode_header(sock.recv_multipart()[1]).kind not in (p.REPLY, p.ERROR):
                pass  # a heartbeat
            if i >= 200:
                times.append(time.perf_counter() - started)
        return pct(times, 0.5), pct(times, 0.99)
    finally:
        sock.close()
        ctx.term()


class _RawHubRequester:
    """A requester written from docs/protocol.md with blocking pyzmq: lone round trips through
    the hub to `_raw_echo_peer` (`echo-raw`)."""

    def __init__(self, endpoint: str) -> None:
        from agent_bus.bus import protocol as p

        self.p = p
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.connect(endpoint)
        self.sock.send_multipart([p.SIGNATURE, p.encode(p.Header(kind=p.HELLO, id="h")),
                                  p.encode(p.Hello(name="bench-raw-requester", session="raw"))])
        self.sock.recv_multipart()  # welcome
        self.n = 0

    def one(self) -> bool:
        """One round trip; False when the hub answered with an error (no `echo-raw` yet)."""
        p = self.p
        self.n += 1
        self.sock.send_multipart([p.SIGNATURE, p.encode(p.Header(
            kind=p.REQUEST, id=str(self.n), service="echo-raw")), b"x" * 64])
        while True:
            kind = p.decode_header(self.sock.recv_multipart()[1]).kind
            if kind in (p.REPLY, p.ERROR):
                return kind == p.REPLY

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def round_trips(transports: list[str], groups: int, per_slice: int,
                keys: str = "") -> dict[str, list[float]]:
    """p50 of each slice of `per_slice` lone round trips, per system: `raw T` (the raw
    blocking broker and worker of bench/baseline.py on transport T), `hub T` (the hub, the
    `bus` client at both ends), `raw peers T` (the hub between raw blocking peers) and `asyncio
    T` (the raw broker between pyzmq's own asyncio sockets, a requester here and
    `_asyncio_worker`: what asyncio at both ends costs without any bus code), and `hub async
    T` (as `hub T`, to the `async def` handler, `echo-async`); with `keys` and tcp, `hub curve
    tcp` (a second hub on TCP with CURVE on, the `bus` client at both ends). All stay up;
    `groups` times, one slice of each in turn (the order rotated every group)."""
    import anyio
    import zmq.asyncio

    from agent_bus.bus.client import connect

    spawn = mp.get_context("spawn")
    body = b"x" * 64
    procs: list = []
    raws: dict[str, tuple] = {}
    hubs: list[subprocess.Popen[str]] = []
    requesters: dict[str, _RawHubRequester] = {}
    endpoints: dict[str, str] = {}
    asyncio_endpoints: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for t in transports:
                raw_endpoint = (f"ipc://{tmp}/raw-{t}" if t == "ipc"
                                else f"tcp://127.0.0.1:{free_port()}")
                _, raw_procs = _start(1, raw_endpoint)
                ctx, sock = _requester(raw_endpoint, body, 1)
                raws[t] = (ctx, sock, raw_procs)
                os.makedirs(f"{tmp}/hub-{t}")
                hub, info = start_hub(f"{tmp}/hub-{t}", t)
                hubs.append(hub)
                endpoints[t] = info["endpoint"]
                ready = spawn.Queue()
                procs.append(spawn.Process(target=_serving_peer, args=(endpoints[t], 4, ready),
                                           daemon=True))
                procs.append(spawn.Process(target=_raw_echo_peer, args=(endpoints[t],),
                                           daemon=True))
                procs[-2].start()
                procs[-1].start()
                ready.get(timeout=20)
                requesters[t] = _RawHubRequester(endpoints[t])
                asyncio_endpoints[t] = (f"ipc://{tmp}/asyncio-{t}" if t == "ipc"
                                        else f"tcp://127.0.0.1:{free_port()}")
                _, asyncio_procs = _start(0, asyncio_endpoints[t])
                procs += asyncio_procs
                procs.append(spawn.Process(target=_asyncio_worker, args=(asyncio_endpoints[t],),
                                           daemon=True))
                procs[-1].start()
            curve = bool(keys) and "tcp" in transports
            if curve:
                os.makedirs(f"{tmp}/hub-curve")
                hub, info = start_hub(f"{tmp}/hub-curve", "tcp", keys)
                hubs.append(hub)
                endpoints["curve"] = info["endpoint"]
                ready = spawn.Queue()
                procs.append(spawn.Process(target=_serving_peer,
                                           args=(endpoints["curve"], 4, ready, keys), daemon=True))
                procs[-1].start()
                ready.get(timeout=20)
            slices: dict[str, list[float]] = {}

            async def main() -> None:
                async with contextlib.AsyncExitStack() as stack:
                    peers = {t: await stack.enter_async_context(connect(
                        endpoints[t], name="bench-client",
                        curve=curve_client(keys if t == "curve" else "")))
                        for t in endpoints}

                    def raw_one(t: str) -> None:
                        sock = raws[t][1]
                        sock.send_multipart([b"req", body])
                        sock.recv_multipart()

                    actx = zmq.asyncio.Context()
                    stack.callback(actx.term)
                    asocks = {t: actx.socket(zmq.DEALER) for t in transports}
                    for t, asock in asocks.items():
                        stack.callback(asock.close, 0)
                        asock.connect(asyncio_endpoints[t])

                    async def asyncio_one(t: str) -> None:
                        await asocks[t].send_multipart([b"req", body])
                        await asocks[t].recv_multipart()

                    for t in transports:  # warm up; `echo-raw` may not be registered yet
                        for _ in range(200):
                            await peers[t].request("echo", body)
                            raw_one(t)
                        deadline = time.monotonic() + 20
                        while not requesters[t].one():
                            assert time.monotonic() < deadline, "echo-raw never registered"
                        while True:  # the broker drops requests until the worker said ready
                            await asocks[t].send_multipart([b"req", body])
                            if await asocks[t].poll(200):
                                break
                            assert time.monotonic() < deadline, "the asyncio worker never came"
                        while await asocks[t].poll(200):  # answers to the tries above
                            await asocks[t].recv_multipart()
                    if curve:
                        for _ in range(200):
                            await peers["curve"].request("echo", body)
                    systems = [(kind, t) for t in transports
                               for kind in ("raw", "hub", "hub async", "raw peers", "asyncio")]
                    if curve:
                        systems.append(("hub curve", "tcp"))
                    for g in range(groups):
                        k = g % len(systems)
                        for kind, t in systems[k:] + systems[:k]:
                            times = []
                            for _ in range(per_slice):
                                t0 = time.perf_counter()
                                if kind == "hub":
                                    await peers[t].request("echo", body)
                                elif kind == "hub curve":
                                    await peers["curve"].request("echo", body)
                                elif kind == "hub async":
                                    await peers[t].request("echo-async", body)
                                elif kind == "raw":
                                    raw_one(t)
                                elif kind == "asyncio":
                                    await asyncio_one(t)
                                else:
                                    requesters[t].one()
                                times.append(time.perf_counter() - t0)
                            slices.setdefault(f"{kind} {t}", []).append(pct(times, 0.5))

            anyio.run(main)
            return slices
        finally:
            for requester in requesters.values():
                requester.close()
            for ctx, sock, raw_procs in raws.values():
                _stop(sock, ctx, raw_procs)
            _kill(procs, hubs)


def _kill(procs: list[Any], hubs: list[subprocess.Popen[str]]) -> None:
    """Stop the bench's processes and hubs (SIGKILL: nothing of theirs is read after)."""
    for proc in procs:
        proc.kill()
        proc.join()
    for hub in hubs:
        hub.kill()
        hub.wait()


Slices = dict[str, list[float]]
#: per system, per slice: CPU µs per request of its broker (or hub), its 4 serving processes, and
#: this process (the requester)
SliceCpu = dict[str, list[tuple[float, float, float]]]


def throughput_slices(transports: list[str], groups: int, seconds: float,
                      keys: str = "") -> tuple[Slices, SliceCpu]:
    """Requests/s of each slice of `seconds`, 256 requests kept out, per system: `raw` (the raw
    broker and 4 raw workers on TCP, a blocking requester: `raw_throughput`'s), `asyncio` (the
    same broker between asyncio ends: its asyncio floor), and on each transport T `hub T` (the
    hub, a `bus` requester, 4 `bus` serving peers answering with a plain function) and `hub
    async T` (the same peers' `async def` handler); with `keys` and tcp, `hub curve tcp` (a second
    hub on TCP with CURVE on, its 4 serving peers and the requester over CURVE). All stay up;
    `groups` times, one slice of each in turn (the order rotated every group), so each group's
    ratios share the machine's speed of a few seconds, where `one_round`'s figures are tens of
    seconds apart. Also each slice's CPU per request at each end: the requester's is this
    process's (the other systems' ends in it are idle meanwhile)."""
    import anyio

    from agent_bus.bus.client import connect

    spawn = mp.get_context("spawn")
    body = b"x" * 64
    procs: list = []
    hubs: list[subprocess.Popen[str]] = []
    endpoints: dict[str, str] = {}
    raw_endpoint, raw_procs = _start(4)
    ctx, sock = _requester(raw_endpoint, body, 4)
    asyncio_endpoint, asyncio_procs = _start(4, worker=_asyncio_worker)
    actx, asock = _requester(asyncio_endpoint, body, 4)  # (all 4 have registered)
    # system -> (its broker's or hub's pid, its serving processes' pids)
    ends: dict[str, tuple[int, list[int]]] = {
        name: (int(ps[0].pid or 0), [int(w.pid or 0) for w in ps[1:]])
        for name, ps in (("raw", raw_procs), ("asyncio", asyncio_procs))}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            curve = bool(keys) and "tcp" in transports
            for t in transports + (["curve"] if curve else []):
                os.makedirs(f"{tmp}/hub-{t}")
                hub_keys = keys if t == "curve" else ""
                hub, info = start_hub(f"{tmp}/hub-{t}", "tcp" if t == "curve" else t, hub_keys)
                hubs.append(hub)
                endpoints[t] = info["endpoint"]
                ready = spawn.Queue()
                for _ in range(4):
                    procs.append(spawn.Process(target=_serving_peer,
                                               args=(endpoints[t], 64, ready, hub_keys),
                                               daemon=True))
                    procs[-1].start()
                servers = [ready.get(timeout=20) for _ in range(4)]
                if t == "curve":
                    ends["hub curve tcp"] = (hub.pid, servers)
                else:
                    ends[f"hub {t}"] = ends[f"hub async {t}"] = (hub.pid, servers)
            slices: Slices = {}
            cpu: SliceCpu = {}

            async def bus_rate(peer: Any, service: str) -> float:
                done, took = await bus_window(peer, service, seconds)
                return done / took

            def asyncio_rate() -> float:
                return asyncio.run(_asyncio_throughput(asyncio_endpoint, seconds, 256, body))

            async def main() -> None:
                async with contextlib.AsyncExitStack() as stack:
                    peers = {t: await stack.enter_async_context(connect(
                        endpoints[t], name="bench-client",
                        curve=curve_client(keys if t == "curve" else "")))
                        for t in endpoints}
                    systems = ["raw", "asyncio"] + [f"{kind} {t}" for t in transports
                                                    for kind in ("hub", "hub async")]
                    if curve:
                        systems.append("hub curve tcp")
                    for t in endpoints:  # warm up
                        for service in ("echo", "echo-async"):
                            for _ in range(200):
                                await peers[t].request(service, body)
                    for g in range(groups):
                        k = g % len(systems)
                        for system in systems[k:] + systems[:k]:
                            broker, servers = ends[system]
                            before = _cpu(broker, servers)
                            started = time.perf_counter()
                            # (the raw ends block: in a thread, so the bus peers keep beating)
                            if system == "raw":
                                rate = await anyio.to_thread.run_sync(windowed_rate, sock, seconds)
                            elif system == "asyncio":
                                rate = await anyio.to_thread.run_sync(asyncio_rate)
                            elif system == "hub curve tcp":
                                rate = await bus_rate(peers["curve"], "echo")
                            else:
                                kind, _, t = system.rpartition(" ")
                                rate = await bus_rate(peers[t], "echo" if kind == "hub"
                                                      else "echo-async")
                            slices.setdefault(system, []).append(rate)
                            answered = rate * (time.perf_counter() - started)
                            cpu.setdefault(system, []).append(tuple(  # type: ignore[arg-type]
                                x * 1e6 for x in _cpu_per(before, _cpu(broker, servers),
                                                          int(answered))))

            anyio.run(main)
            return slices, cpu
        finally:
            _stop(sock, ctx, raw_procs)
            _stop(asock, actx, asyncio_procs)
            _kill(procs, hubs)


def report_throughput_slices(slices: Slices, cpu: SliceCpu, transports: list[str],
                             hl: Headlines) -> None:
    groups = len(slices["raw"])
    print(f"requests/s, interleaved ({groups} groups of one slice per system; each ratio the "
          "median of the groups' ratios):")
    raw = slices["raw"]
    per = [x / r for x, r in zip(slices["asyncio"], raw, strict=True)]
    print(f"  raw {median(raw):,.0f}/s; the asyncio floor, the raw broker between asyncio ends / "
          f"raw broker: {median(per):.2f}x (groups {min(per):.2f}-{max(per):.2f})")
    for t in transports:
        cells = []
        for kind, label, target in (
                ("hub", "4 serving peers / raw broker with 4 raw workers", True),
                ("hub async", "with `async def` handlers / raw broker", False)):
            per = [x / r for x, r in zip(slices[f"{kind} {t}"], raw, strict=True)]
            m = median(per)
            verdict = f"target >= 0.95x: {'met' if m >= 0.95 else 'NOT met'}; " if target else ""
            cells.append(f"{label} {m:.2f}x ({verdict}groups {min(per):.2f}-{max(per):.2f})")
            if target:
                hl.add(f"requests_per_s_{t}_interleaved", per, ">=", 0.95)
        print(f"  {t}: hub {median(slices[f'hub {t}']):,.0f}/s, async def "
              f"{median(slices[f'hub async {t}']):,.0f}/s; " + "; ".join(cells), flush=True)
    if "hub curve tcp" in slices:
        per = [c / x for x, c in zip(slices["hub tcp"], slices["hub curve tcp"], strict=True)]
        print(f"  CURVE: hub with CURVE on tcp {median(slices['hub curve tcp']):,.0f}/s; / the "
              f"same hub plain tcp {median(per):.2f}x (groups {min(per):.2f}-{max(per):.2f})")
        hl.add("curve_requests_per_s", per, ">=", 0.9)

    def ends(system: str) -> str:
        broker, servers, requester = (median([c[i] for c in cpu[system]]) for i in range(3))
        return f"{system} {broker:.0f} + {servers:.0f} + {requester:.0f} = " \
               f"{broker + servers + requester:.0f}"

    print("  CPU per request, the slices' medians (us; broker or hub + 4 serving processes + "
          "requester): " + "; ".join(ends(system) for system in cpu), flush=True)


def report_round_trips(slices: dict[str, list[float]], transports: list[str],
                       hl: Headlines) -> None:
    us = 1e6
    groups = len(slices[f"raw {transports[0]}"])
    print(f"round trip p50, interleaved ({groups} groups of one slice per system; each ratio the "
          "median of the groups' ratios, each group's slices within a second or so):")
    for t in transports:
        raw = slices[f"raw {t}"]
        cells = []
        for kind, label, target in (
                ("hub", "hub / raw blocking broker", True),
                ("hub async", "the same with an `async def` handler / raw broker", False),
                ("raw peers", "the hub alone between raw peers / raw broker", True),
                ("asyncio", "the raw broker between zmq.asyncio sockets (asyncio at both ends, "
                 "no bus code) / raw broker", False)):
            per = [x / r for x, r in zip(slices[f"{kind} {t}"], raw, strict=True)]
            m = median(per)
            verdict = f"target <= 1.15x: {'met' if m <= 1.15 else 'NOT met'}; " if target else ""
            cells.append(f"{label} {m:.2f}x ({verdict}groups {min(per):.2f}-{max(per):.2f})")
            if kind == "hub":
                hl.add(f"roundtrip_p50_{t}", per, "<=", 1.15)
        print(f"  {t}: p50 raw {median(raw) * us:.0f} us, hub {median(slices[f'hub {t}']) * us:.0f}"
              f" us, raw peers {median(slices[f'raw peers {t}']) * us:.0f} us, asyncio "
              f"{median(slices[f'asyncio {t}']) * us:.0f} us; " + "; ".join(cells))
    if len(transports) == 2:
        a, b = transports
        per = [y / x for x, y in zip(slices[f"hub {a}"], slices[f"hub {b}"], strict=True)]
        print(f"  hub {b} / hub {a}: {median(per):.2f}x", flush=True)
    if "hub curve tcp" in slices:
        per = [c / x for x, c in zip(slices["hub tcp"], slices["hub curve tcp"], strict=True)]
        print(f"  CURVE: p50 hub with CURVE on tcp {median(slices['hub curve tcp']) * us:.0f} us; "
              f"/ the same hub plain tcp {median(per):.2f}x (groups {min(per):.2f}-{max(per):.2f})",
              flush=True)
        hl.add("curve_roundtrip_p50", per, "<=", 1.15)


def start_hub(state: str, transport: str = "", keys: str = "") -> tuple[subprocess.Popen[str], dict]:
    # ipc (or BENCH_HUB=ipc): the hub on an ipc:// socket, as a local topology's (`busctl up`)
    # listens; tcp: on loopback TCP, as a multi-host one does. With `keys` (a `busctl keys
    # generate` folder): CURVE on, with the flags `busctl up` passes its hub (issue 51 item 5)
    transport = transport or os.environ.get("BENCH_HUB", "tcp")
    address = f"ipc://{state}/hub" if transport == "ipc" else "tcp://127.0.0.1:0"
    argv = [sys.executable, "-m", "agent_bus.cli", "hub", "--hub", address, "--state-dir", state]
    if keys:
        argv += ["--curve-secret", f"{keys}/hub.key_secret", "--curve-authorized",
                 f"{keys}/authorized"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
    assert proc.stdout is not None
    info = json.loads(proc.stdout.readline())
    return proc, info


def make_keys(folder: str) -> str:
    """A hub key pair and a `bench` client's, made by `busctl keys generate` as a user would."""
    keys = f"{folder}/keys"
    subprocess.run([sys.executable, "-m", "agent_bus.cli", "keys", "generate", keys, "--client",
                    "bench"], check=True, cwd=ROOT, capture_output=True)
    return keys


def curve_client(keys: str) -> Any:
    """The `bench` client's CURVE settings for `connect(curve=...)`, or None without `keys`."""
    if not keys:
        return None
    from agent_bus.bus.security import CurveClient

    return CurveClient(server_public_key_file=f"{keys}/hub.key",
                       secret_key_file=f"{keys}/bench.key_secret")


async def bus_window(peer: Any, service: str, seconds: float, inflight: int = 256,
                     body: bytes = b"x" * 64) -> tuple[int, float]:
    """`peer`'s answers from `service` over about `seconds`, `inflight` requests kept out (a
    task each), and the seconds they took (the last requests' answers included)."""
    import anyio

    done = 0
    stop = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < stop:
            await peer.request(service, body)
            done += 1

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(inflight):
            tg.start_soon(worker)
    return done, time.perf_counter() - started


def _cpu(hub: int, servers: list[int]) -> tuple[float, float, float]:
    """CPU seconds (user + system, all threads) used so far by the hub, the serving peers
    together, and this process (the requester): per-request CPU, unlike wall time, does not
    move with what else the shared machine runs."""
    return cpu_s(hub), sum(cpu_s(pid) for pid in servers), time.process_time()


def _cpu_per(before: tuple[float, ...], after: tuple[float, ...], n: int) -> tuple[float, ...]:
    return tuple((b - a) / max(n, 1) for a, b in zip(before, after, strict=True))


def hub_figures(n_rtt: int, seconds: float, n_events: int,
                transport: str = "") -> dict[str, float]:
    import anyio

    from agent_bus.bus.client import connect

    spawn = mp.get_context("spawn")
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as state:
        hub, info = start_hub(state, transport)
        procs: list = []
        try:
            endpoint = info["endpoint"]
            ready = spawn.Queue()
            procs.append(spawn.Process(target=_serving_peer, args=(endpoint, 64, ready), daemon=True))
            procs[-1].start()
            servers = [ready.get(timeout=20)]

            async def rtt() -> None:
                async with connect(endpoint, name="bench-client") as peer:
                    body = b"x" * 64
                    for _ in range(200):
                        await peer.request("echo", body)
                    times = []
                    cpu0 = _cpu(hub.pid, servers)
                    for _ in range(n_rtt):
                        t0 = time.perf_counter()
                        await peer.request("echo", body)
                        times.append(time.perf_counter() - t0)
                    cpu = _cpu_per(cpu0, _cpu(hub.pid, servers), n_rtt)
                    # Best of two runs, as for the raw baseline (main()): the machine is shared.
                    if pct(times, 0.5) < out.get("rtt_p50", float("inf")):
                        out["rtt_p50"] = pct(times, 0.5)
                        out["rtt_p99"] = pct(times, 0.99)
                        out["rtt_cpu_hub"], out["rtt_cpu_servers"], out["rtt_cpu_client"] = cpu

            anyio.run(rtt)
            anyio.run(rtt)
            raw_echo = spawn.Process(target=_raw_echo_peer, args=(endpoint,), daemon=True)
            procs.append(raw_echo)
            raw_echo.start()
            out["raw_peers_p50"], out["raw_peers_p99"] = raw_peers_round_trip(endpoint, n_rtt)
            raw_echo.kill()  # the raw servers of the throughput below take its place
            raw_echo.join()
            for _ in range(3):
                procs.append(spawn.Process(target=_serving_peer, args=(endpoint, 64, ready),
                                           daemon=True))
                procs[-1].start()
            for _ in range(3):
                servers.append(ready.get(timeout=20))

            async def throughput(service: str, suffix: str) -> None:
                async with connect(endpoint, name="bench-client") as peer:
                    cpu0 = _cpu(hub.pid, servers)
                    done, took = await bus_window(peer, service, seconds)
                    out[f"req_per_s{suffix}"] = done / took
                    (out[f"thr_cpu_hub{suffix}"], out[f"thr_cpu_servers{suffix}"],
                     out[f"thr_cpu_client{suffix}"]) = _cpu_per(cpu0, _cpu(hub.pid, servers), done)

            anyio.run(throughput, "echo", "")
            anyio.run(throughput, "echo-async", "_async")
            raw_ready = [spawn.Event() for _ in range(4)]
            for event in raw_ready:
                procs.append(spawn.Process(target=_raw_echo_peer, args=(endpoint, 64, event),
                                           daemon=True))
                procs[-1].start()
            for event in raw_ready:
                assert event.wait(20), "a raw echo server did not register"
            out["raw_peers_req_per_s"] = raw_peers_throughput(endpoint, seconds)
            for proc in procs:
                proc.kill()
                proc.join()
            procs = []

            async def events(paced: bool) -> None:
                """The `bus` client's events/s, publisher to subscriber through the hub;
                `paced`: the publisher stays WINDOW events ahead at most, as the raw one of
                the baseline does. Unpaced it may outrun the subscriber, whose PUB queue then
                drops what the subscriber fills from the log (by the idle-class reader)."""
                async with connect(endpoint, name="bench-sub") as peer:
                    # Unfiltered: a subscriber that falls behind the hub (PUB drops past its
                    # HWM) sees the seq jump and fills it from the log; with a topic filter the
                    # loss would be silent and the count never reached.
                    async with peer.subscribe() as sub:
                        ctx = zmq.Context()
                        credit = ctx.socket(zmq.PUSH)
                        credit.linger = 0
                        port = credit.bind_to_random_port("tcp://127.0.0.1")
                        start, ready = spawn.Event(), spawn.Event()
                        pub = spawn.Process(target=_publisher, daemon=True, args=(
                            endpoint, n_events, start, ready,
                            f"tcp://127.0.0.1:{port}" if paced else ""))
                        procs.append(pub)
                        pub.start()
                        assert pub.pid is not None
                        await anyio.to_thread.run_sync(ready.wait, 30)
                        cpu0 = _cpu(hub.pid, [pub.pid])
                        start.set()
                        count = 0
                        t0 = 0.0
                        try:
                            with anyio.fail_after(120):
                                async for env in sub:
                                    if env.header.type != "topic_message":
                                        continue
                                    if count == 0:
                                        t0 = time.perf_counter()
                                    count += 1
                                    if paced and count % CREDIT == 0:
                                        with contextlib.suppress(zmq.Again):  # it has ended
                                            credit.send(b"", zmq.NOBLOCK)
                                    if count == n_events:
                                        break
                        finally:
                            credit.close()
                            ctx.term()
                        key = "events_per_s" if paced else "events_per_s_unpaced"
                        out[key] = (count - 1) / (time.perf_counter() - t0)
                        if paced:
                            out["events_filled"] = sub.filled
                            out["ev_cpu_hub"], out["ev_cpu_pub"], out["ev_cpu_sub"] = _cpu_per(
                                cpu0, _cpu(hub.pid, [pub.pid]), count)
                        else:
                            out["events_filled_unpaced"] = sub.filled

            anyio.run(events, True)
            anyio.run(events, False)
            out["raw_peers_events_per_s"], out["raw_peers_events_lost"], _ = raw_subscribed_rate(
                endpoint, info["events"], n_events, to_hub=True)
        finally:
            for proc in procs:
                proc.kill()
                proc.join()
            hub.kill()
            hub.wait()
    return out


def write_log(state: str, n: int) -> None:
    """A log of `n` small events written straight into SQLite (as the hub would stamp them)."""
    from agent_bus.bus import events as ev
    from agent_bus.bus import protocol as p
    from agent_bus.bus.store.sqlite import SqliteStore

    log = SqliteStore(Path(state) / "events.db")
    body = ev.encode_event(ev.TopicMessage(topic="t", text="x" * 40))
    encode = msgspec.msgpack.Encoder().encode
    ts = time.time()
    try:
        for start in range(1, n + 1, 20_000):
            rows = []
            for seq in range(start, min(n, start + 19_999) + 1):
                header = p.Header(kind=p.EVENT, id=f"e{seq}", type="topic_message", agent="a",
                                  run="r", seq=seq, ts=ts)
                rows.append((seq, ts, "topic_message", "a", "r", "", encode(header), body))
            log.append(rows)
    finally:
        log.close()


class _Cursor(msgspec.Struct):  # the part of a ReplayBatch the replayer reads
    upto: int
    head: int


def _replayer(endpoint: str, report: mp.Queue[tuple[int, float]], decode: bool = False) -> None:
    """Replay the whole log from 0 again and again; report each full pass (events, seconds).
    By default it reads only each batch's cursor; with `decode`, every event as `busctl watch`
    does (the batch, then each header and body: ~1.5-3 ms per batch of ~1,800 small events
    against ~50 us, on this CPU, beside the requests)."""
    import anyio

    from agent_bus.bus import events as ev
    from agent_bus.bus import protocol as p
    from agent_bus.bus.client import connect

    async def main() -> None:
        async with connect(endpoint, name="bench-replayer") as peer:
            while True:
                since, t0 = 0, time.perf_counter()
                while True:
                    reply = await peer.request(p.HUB_REPLAY, p.encode(p.ReplayRequest(
                        since=since, limit=10_000)), timeout=60)
                    batch = msgspec.msgpack.decode(reply, type=_Cursor)
                    if decode:
                        for header, body in p.decode(reply, p.ReplayBatch).events:
                            p.decode_header(header)
                            ev.decode_event(body)
                    since = batch.upto
                    if batch.upto >= batch.head:
                        break
                report.put((since, time.perf_counter() - t0))

    anyio.run(main)


def replay_figures(n_log: int, n_rtt: int, decode: bool = False) -> dict[str, float]:
    """Request p99 with and without a concurrent full replay of an `n_log`-event log. The two
    are measured alternately (the replayer is paused with SIGSTOP), so the machine's other load
    falls on both alike."""
    import signal

    import anyio

    from agent_bus.bus.client import connect

    spawn = mp.get_context("spawn")
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as state:
        write_log(state, n_log)
        hub, info = start_hub(state)
        procs: list = []
        try:
            endpoint = info["endpoint"]
            ready = spawn.Queue()
            procs.append(spawn.Process(target=_serving_peer, args=(endpoint, 64, ready), daemon=True))
            procs[-1].start()
            ready.get(timeout=20)
            report = spawn.Queue()
            replayer = spawn.Process(target=_replayer, args=(endpoint, report, decode),
                                     daemon=True)
            procs.append(replayer)

            async def times(peer, n: int) -> list[float]:  # type: ignore[no-untyped-def]
                out_times = []
                for _ in range(n):
                    t = time.perf_counter()
                    await peer.request("echo", b"x" * 64)
                    out_times.append(time.perf_counter() - t)
                return out_times

            async def measure() -> None:
                async with connect(endpoint, name="bench-client") as peer:
                    await times(peer, 500)  # warm up
                    replayer.start()
                    await anyio.sleep(1.0)  # let the replay get going
                    idle: list[float] = []
                    busy: list[float] = []
                    for _ in range(5):
                        os.kill(replayer.pid, signal.SIGSTOP)
                        idle += await times(peer, n_rtt // 5)
                        os.kill(replayer.pid, signal.SIGCONT)
                        busy += await times(peer, n_rtt // 5)
                    for name, values in (("idle", idle), ("busy", busy)):
                        out[f"{name}_p99"] = pct(values, 0.99)
                        out[f"{name}_p50"] = pct(values, 0.5)

            anyio.run(measure)
            out["replay_events"], out["replay_s"] = report.get(timeout=600)  # one full pass
        finally:
            for proc in procs:
                if proc.pid is not None:
                    proc.kill()
                    proc.join()
            hub.kill()
            hub.wait()
    return out


def median(values: list[float]) -> float:
    # the middle value, or the mean of the middle two (as the headlines, bench/headline.py)
    return statistics.median(values)


class Size(NamedTuple):
    """How much each figure measures: the full bench, `--quick`, or `--smoke` (the least that
    still prints every line, for tests/bench/test_smoke.py: its figures mean nothing)."""

    n_rtt: int  # lone round trips per measurement
    n_pub: int  # events a raw publisher sends
    seconds: float  # of each requests/s measurement
    n_events: int  # events through the hub
    slice_groups: int  # `throughput_slices`
    slice_s: float
    rtt_groups: int  # `round_trips`
    rtt_per_slice: int
    replay_log: int  # events in the replayed log
    replay_rtt: int  # round trips idle, then beside the replay
    rounds: int  # of `one_round`, unless --rounds


SIZES = {
    "full": Size(10_000, 300_000, 8, 200_000, 15, 2.0, 40, 100, 1_000_000, 5000, 3),
    # --quick: every headline in <= 90 s (issue 51 item 6); the slices, alternated finest, carry
    # the most groups, the rounds (each a dozen process starts) the fewest
    "quick": Size(1000, 30_000, 0.7, 20_000, 8, 0.5, 15, 100, 100_000, 2000, 2),
    "smoke": Size(200, 5000, 0.5, 3000, 1, 0.3, 2, 20, 5000, 300, 1),
}


def one_round(size: Size, transports: list[str]) -> dict[str, dict[str, float]]:
    """The raw baselines, then the hub on each transport, one after the other within seconds:
    the ratios of one round share the machine's speed of those seconds."""
    raw: dict[str, float] = {}
    raw["rtt_p50"], raw["rtt_p99"] = raw_round_trip(size.n_rtt)
    raw["events_per_s"] = raw_pubsub(size.n_pub)
    raw["req_per_s"] = raw_throughput(size.seconds)
    raw["req_per_s_asyncio"] = raw_throughput(size.seconds, ends="asyncio")
    out = {"raw": raw}
    for transport in transports:
        raw[f"forwarded_{transport}"] = raw_forwarded_rate(size.n_pub, transport)
        out[transport] = hub_figures(n_rtt=size.n_rtt, seconds=size.seconds,
                                     n_events=size.n_events, transport=transport)
    return out


# (figure, key, the raw baseline's key ("" for the transport's raw forwarder, "raw:K" for the
# round's raw figure K, measured on tcp only), issue 32's target for the ratio (None: what the
# target is set against), higher is better); the round trip's are `round_trips`'s, interleaved
# finer than rounds. The targets are issue 51's.
RATIOS = [
    ("requests/s, 4 serving peers / raw broker with 4 raw workers", "req_per_s", "req_per_s",
     0.95),
    ("  with `async def` handlers (a task and a cancel scope per request) / raw broker",
     "req_per_s_async", "req_per_s", None),
    ("  the hub alone, a raw requester and 4 raw serving peers / raw broker", "raw_peers_req_per_s",
     "req_per_s", None),
    ("  the asyncio floor: the raw broker between asyncio ends (tcp) / raw broker",
     "raw:req_per_s_asyncio", "req_per_s", None),
    ("events/s logged + published / raw PUB->SUB (the publisher paced as the raw one)",
     "events_per_s", "events_per_s", 1.0),
    ("  unpaced: a publisher that outruns its subscriber, which fills from the log",
     "events_per_s_unpaced", "events_per_s", 0.85),
    ("  the hub alone, a raw publisher and subscriber / raw PUB->SUB", "raw_peers_events_per_s",
     "events_per_s", None),
    ("  the floor: a raw Python forwarder that passes each body on / raw PUB->SUB", "",
     "events_per_s", None),
]


def _figure(result: dict[str, dict[str, float]], key: str, transport: str) -> float:
    """A RATIOS row's figure in one round's `result` (see RATIOS for `key`)."""
    if not key:
        return result["raw"][f"forwarded_{transport}"]
    if key.startswith("raw:"):
        return result["raw"][key[4:]]
    return result[transport][key]


# a RATIOS key with a target -> its headline's name ({t}: the transport)
HEADLINE_NAMES = {"req_per_s": "requests_per_s_{t}_rounds", "events_per_s": "events_per_s_paced_{t}",
                  "events_per_s_unpaced": "events_per_s_unpaced_{t}"}


def report_rounds(rounds: list[dict[str, dict[str, float]]], transports: list[str],
                  hl: Headlines) -> None:
    us = 1e6
    for i, r in enumerate(rounds, 1):
        raw = r["raw"]
        print(f"round {i}: raw p50 {raw['rtt_p50'] * us:.0f} us, {raw['req_per_s']:,.0f} req/s "
              f"(asyncio ends {raw['req_per_s_asyncio']:,.0f}), "
              f"{raw['events_per_s']:,.0f} events/s (forwarded " + ", ".join(
                  f"{t} {raw[f'forwarded_{t}']:,.0f}" for t in transports) + ") | " + " | ".join(
                  f"{t}: p50 {r[t]['rtt_p50'] * us:.0f} us (raw peers "
                  f"{r[t]['raw_peers_p50'] * us:.0f}), {r[t]['req_per_s']:,.0f} req/s (async def "
                  f"{r[t]['req_per_s_async']:,.0f}, raw peers "
                  f"{r[t]['raw_peers_req_per_s']:,.0f}), {r[t]['events_per_s']:,.0f} events/s "
                  f"(raw peers {r[t]['raw_peers_events_per_s']:,.0f}, lost "
                  f"{r[t]['raw_peers_events_lost']:.0f})" for t in transports), flush=True)
    print(f"ratios, median of {len(rounds)} alternated rounds (each round's hub over the same "
          "round's raw baseline; per round in brackets):")
    for label, key, raw_key, target in RATIOS:
        cells = []
        for t in transports if not key.startswith("raw:") else ["tcp"]:
            per = [_figure(r, key, t) / r["raw"][raw_key] for r in rounds]
            m = median(per)
            verdict = "" if target is None else " met" if m >= target else " NOT met"
            if target is not None:
                hl.add(HEADLINE_NAMES[key].format(t=t), per, ">=", target, "rounds")
            cells.append(f"{t} {m:.2f}x [{', '.join(f'{x:.2f}' for x in per)}]{verdict}")
        goal = "" if target is None else f" (target >= {target}x)"
        print(f"  {label}{goal}: " + "; ".join(cells))
    if len(transports) == 2:
        a, b = transports
        for label, key, _, target in RATIOS:
            if target is None:
                continue
            per = [r[b][key] / r[a][key] for r in rounds]
            print(f"  {b} / {a}, {label.split(',')[0].strip()}: {median(per):.2f}x "
                  f"[{', '.join(f'{x:.2f}' for x in per)}]")
    cpu = [r[t] for r in rounds for t in transports]

    def mid(key: str) -> float:
        return median([c[key] for c in cpu]) * us

    print("CPU per request (us; user + system, all threads; /proc, 10 ms ticks; median over rounds "
          f"and transports): round trip hub {mid('rtt_cpu_hub'):.0f}, server "
          f"{mid('rtt_cpu_servers'):.0f}, requester {mid('rtt_cpu_client'):.0f}; 256 concurrent: "
          f"hub {mid('thr_cpu_hub'):.1f}, 4 servers {mid('thr_cpu_servers'):.1f} (async def "
          f"{mid('thr_cpu_servers_async'):.1f}), requester {mid('thr_cpu_client'):.1f}", flush=True)
    print(f"CPU per event (us, as above): hub "
          f"{mid('ev_cpu_hub'):.1f}, publisher {mid('ev_cpu_pub'):.1f}, subscriber "
          f"{mid('ev_cpu_sub'):.1f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true",
                        help="the least that prints every line (a test that the bench runs; its "
                             "figures mean nothing)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="alternated rounds of raw baseline then hub(s); ratios are medians "
                             "(default 3; 2 with --quick)")
    parser.add_argument("--no-curve", action="store_true",
                        help="skip the CURVE hub (on tcp) of the interleaved figures")
    parser.add_argument("--transports", default="tcp,ipc",
                        help="the hub's transports, each measured in every round (default tcp,ipc)")
    parser.add_argument("--no-replay", action="store_true", help="skip the replay figure")
    parser.add_argument("--replay-only", action="store_true",
                        help="only the replay-beside-traffic figure")
    parser.add_argument("--replayer-decodes", action="store_true",
                        help="the replayer decodes every event, as `busctl watch` does")
    args = parser.parse_args()
    size = SIZES["smoke" if args.smoke else "quick" if args.quick else "full"]
    if args.replay_only:
        print_replay(size, args.replayer_decodes)
        return
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    if not transports or any(t not in ("tcp", "ipc") for t in transports):
        parser.error(f"--transports: expected tcp, ipc or tcp,ipc, got {args.transports!r}")
    if args.rounds is not None and args.rounds < 1:
        parser.error(f"--rounds: expected 1 or more, got {args.rounds}")
    hl = Headlines()
    rounds = []
    n_rounds = args.rounds if args.rounds is not None else size.rounds
    began = time.monotonic()
    for i in range(n_rounds):
        # alternate the hubs' order too, so neither transport always follows the raw baseline
        rounds.append(one_round(size, transports if i % 2 == 0 else transports[::-1]))
    report_rounds(rounds, transports, hl)
    print(f"(rounds took {time.monotonic() - began:.0f} s)", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as folder:
        keys = "" if args.no_curve else make_keys(folder)
        report_throughput_slices(*throughput_slices(transports, size.slice_groups, size.slice_s,
                                                    keys), transports, hl)
        print(f"(+ slices: {time.monotonic() - began:.0f} s)", file=sys.stderr, flush=True)
        report_round_trips(round_trips(transports, size.rtt_groups, size.rtt_per_slice, keys),
                           transports, hl)
        print(f"(+ round trips: {time.monotonic() - began:.0f} s)", file=sys.stderr, flush=True)
    if not (args.no_replay or args.quick):  # --quick: the replay is --replay-only --quick's
        print_replay(size, args.replayer_decodes)
    hl.print()


def print_replay(size: Size, decode: bool = False) -> None:
    r = replay_figures(n_log=size.replay_log, n_rtt=size.replay_rtt, decode=decode)
    print(f"request p99 beside a full replay of a {r['replay_events']:,.0f}-event log "
          f"(one pass {r['replay_s']:.1f} s, {r['replay_events'] / r['replay_s']:,.0f} events/s): "
          f"{r['busy_p99'] * 1e6:.0f} us, without {r['idle_p99'] * 1e6:.0f} us "
          f"({r['busy_p99'] / r['idle_p99']:.2f}x; target <= 1.5x); p50 {r['busy_p50'] * 1e6:.0f} "
          f"vs {r['idle_p50'] * 1e6:.0f} us", flush=True)


if __name__ == "__main__":
    main()
