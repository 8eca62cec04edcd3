"""The raw-pyzmq baseline every benchmark compares against, measured in the same run.

A blocking DEALER -> ROUTER broker -> DEALER worker echo, with no framing beyond a kind frame:
the physical limit of one broker hop on this machine. `raw_round_trip` times one request at a
time; `raw_throughput` keeps many in flight over several workers (taken in turn), the ceiling
for requests per second through one Python broker here. `RawTurns` sends the hops of agent turns
(a model round trip, then the turn's tool calls at once) through the same broker to as many
workers: the floor of any topology of separate processes that talks through a broker.
`raw_forwarded_rate` is the same for events: a raw publisher, a Python forwarder that publishes
each body it gets as its own message and does nothing else, a raw subscriber
(`raw_subscribed_rate`, which also times a raw publisher and subscriber through the hub).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import resource
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/PID/stat utime, stime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_s(pid: int) -> float:
    """`cpu_s` of a process and all its live descendants: a sandboxed worker's Python runs as
    a child of `bwrap`, whose own CPU is nil."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # exited while we looked
        children.setdefault(ppid, []).append(int(stat.parent.name))
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        try:
            total += cpu_s(current)
        except OSError:
            continue
        todo += children.get(current, [])
    return total


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _raw_broker(endpoint: str) -> None:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    router.sndhwm = router.rcvhwm = 0  # a ROUTER drops at the HWM: thousands may be in flight
    router.bind(endpoint)
    workers: list[bytes] = []
    turn = 0
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    while True:
        poller.poll()
        while True:
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            ident, kind = frames[0], frames[1]
            if kind == b"ready":
                workers.append(ident)
            elif kind == b"req" and workers:  # [client, req, body] -> the next worker in turn
                turn = (turn + 1) % len(workers)
                router.send_multipart([workers[turn], b"req", ident, *frames[2:]])
            elif kind == b"rep":  # [worker, rep, client, body] -> client
                router.send_multipart([frames[2], b"rep", *frames[3:]])
            elif kind == b"stop":
                return


def _raw_worker(endpoint: str) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.sndhwm = sock.rcvhwm = 0
    sock.connect(endpoint)
    sock.send_multipart([b"ready"])
    while True:
        frames = sock.recv_multipart()
        sock.send_multipart([b"rep", *frames[1:]])


def _ready_now(sock: zmq.Socket) -> list[list[bytes]]:  # type: ignore[type-arg]
    """Every message waiting on `sock` (a blocking socket sharing an asyncio one's, see
    `_AsyncioEnd`), without waiting."""
    waiting = []
    while True:
        try:
            waiting.append(sock.recv_multipart(zmq.NOBLOCK))
        except zmq.Again:
            return waiting


class _AsyncioEnd:
    """A DEALER used as the least an asyncio program can do with pyzmq: it waits on the event
    loop (`zmq.asyncio`), then takes every message already there and sends without a future
    (a blocking socket sharing the same libzmq socket; its HWM of 0 never blocks a send)."""

    def __init__(self, endpoint: str) -> None:
        import zmq.asyncio

        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.sndhwm = self.sock.rcvhwm = 0
        self.sock.connect(endpoint)
        self.now = zmq.Socket.shadow(self.sock.underlying)

    async def receive(self) -> list[list[bytes]]:
        """Wait for a message; it and all those behind it."""
        return [await self.sock.recv_multipart(), *_ready_now(self.now)]

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def _asyncio_worker(endpoint: str) -> None:
    """`_raw_worker` as an asyncio program with pyzmq's own asyncio sockets (`_AsyncioEnd`) and
    nothing else: what answering costs any asyncio program on this machine."""

    async def main() -> None:
        end = _AsyncioEnd(endpoint)
        end.now.send_multipart([b"ready"])
        while True:
            for frames in await end.receive():
                end.now.send_multipart([b"rep", *frames[1:]])

    asyncio.run(main())


def _worker_for(ends: str) -> Any:
    """The echo worker of `ends`: "blocking" (`_raw_worker`) or "asyncio" (`_asyncio_worker`)."""
    workers = {"blocking": _raw_worker, "asyncio": _asyncio_worker}
    if ends not in workers:
        raise ValueError(f"ends: expected blocking or asyncio, got {ends!r}")
    return workers[ends]


def _start(workers: int, endpoint: str = "",
           worker: Any = _raw_worker) -> tuple[str, list[mp.process.BaseProcess]]:
    """A raw broker and `workers` raw workers (`worker`: `_raw_worker` or `_asyncio_worker`),
    each its own process (on TCP by default)."""
    endpoint = endpoint or f"tcp://127.0.0.1:{free_port()}"
    spawn = mp.get_context("spawn")
    procs = [spawn.Process(target=_raw_broker, args=(endpoint,), daemon=True)]
    procs += [spawn.Process(target=worker, args=(endpoint,), daemon=True)
              for _ in range(workers)]
    for proc in procs:
        proc.start()
    return endpoint, procs


def _stop(sock: zmq.Socket, ctx: zmq.Context, procs: list[mp.process.BaseProcess]) -> None:  # type: ignore[type-arg]
    sock.close()
    ctx.term()
    for proc in procs:
        proc.kill()
        proc.join()


def _requester(endpoint: str, body: bytes, workers: int) -> tuple[zmq.Context, zmq.Socket]:  # type: ignore[type-arg]
    """A DEALER that has had one answer from each of `workers` (so all have registered)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.sndhwm = sock.rcvhwm = 0
    sock.connect(endpoint)
    answered = 0
    while answered < workers * 2:  # two turns of the rotation: every worker answers
        sock.send_multipart([b"req", body])
        if sock.poll(200):
            sock.recv_multipart()
            answered += 1
    while sock.poll(200):  # answers to tries that timed out above
        sock.recv_multipart()
    return ctx, sock


def _drain(sock: zmq.Socket) -> int:  # type: ignore[type-arg]
    """Wait for one message, then take every one already there: how many."""
    sock.recv_multipart()
    count = 1
    while True:
        try:
            sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return count
        count += 1


def raw_throughput(seconds: float, workers: int = 4, inflight: int = 256,
                   body: bytes = b"x" * 64, ends: str = "blocking") -> float:
    """Requests/s with `inflight` requests outstanding from one blocking requester, through
    the raw broker to `workers` raw workers: what `bench_bus`'s hub throughput is set against.
    With `ends="asyncio"` the workers and the requester are asyncio programs that do the least
    pyzmq allows (`_AsyncioEnd`; the requester on an event loop in a thread here): the asyncio
    floor."""
    endpoint, procs = _start(workers, worker=_worker_for(ends))
    ctx, sock = _requester(endpoint, body, workers)
    try:
        if ends == "asyncio":
            rates: list[float] = []
            thread = threading.Thread(target=lambda: rates.append(asyncio.run(
                _asyncio_throughput(endpoint, seconds, inflight, body))))
            thread.start()
            thread.join()
            return rates[0]
        return windowed_rate(sock, seconds, inflight, body)
    finally:
        _stop(sock, ctx, procs)


def windowed_rate(sock: zmq.Socket, seconds: float, inflight: int = 256,  # type: ignore[type-arg]
                  body: bytes = b"x" * 64) -> float:
    """Answers/s over `seconds` from a raw broker's requester `sock` keeping `inflight` requests
    out (one out for each one in); the answers still out at the end are taken before it returns,
    so the socket can measure again (`bench_bus.throughput_slices`)."""
    for _ in range(inflight):
        sock.send_multipart([b"req", body])
    done = 0
    started = time.perf_counter()
    stop = started + seconds
    while time.perf_counter() < stop:
        answers = _drain(sock)
        for _ in range(answers):
            sock.send_multipart([b"req", body])
        done += answers
    rate = done / (time.perf_counter() - started)
    out = inflight
    while out > 0:
        out -= _drain(sock)
    return rate


async def _asyncio_throughput(endpoint: str, seconds: float, inflight: int, body: bytes) -> float:
    """`raw_throughput`'s requester as an asyncio program (`_AsyncioEnd`): one request out for
    each answer."""
    end = _AsyncioEnd(endpoint)
    try:
        for _ in range(inflight):
            end.now.send_multipart([b"req", body])
        done = 0
        started = time.perf_counter()
        stop = started + seconds
        while time.perf_counter() < stop:
            for _ in await end.receive():
                end.now.send_multipart([b"req", body])
                done += 1
        return done / (time.perf_counter() - started)
    finally:
        end.close()


def raw_round_trip(n: int, body: bytes = b"x" * 64) -> tuple[float, float]:
    endpoint, procs = _start(1)
    ctx, sock = _requester(endpoint, body, 1)
    try:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            sock.send_multipart([b"req", body])
            sock.recv_multipart()
            times.append(time.perf_counter() - t0)
        return pct(times, 0.5), pct(times, 0.99)
    finally:
        _stop(sock, ctx, procs)


def own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class _Sessions:
    """The requester's side of `RawTurns.run`: which request each answer calls for."""

    def __init__(self, sessions: int, turns: int, calls: int, body: bytes) -> None:
        self.tools_left = [0] * sessions
        self.turns_left = [turns] * sessions
        self.calls = calls
        self.active = sessions
        self.first = [s.to_bytes(4, "little") + body for s in range(sessions)]

    def answered(self, answer: bytes) -> int:
        """How many requests to send next, each with `answer` as its body."""
        s = int.from_bytes(answer[:4], "little")
        if self.tools_left[s]:  # a tool call's answer
            self.tools_left[s] -= 1
            return 0 if self.tools_left[s] else 1  # the batch is done: the next model call
        if not self.turns_left[s]:  # the final answer
            self.active -= 1
            return 0
        self.turns_left[s] -= 1
        self.tools_left[s] = self.calls
        return self.calls


class RawTurns:
    """The hops of agent turns through raw pyzmq, nothing done at either end: the floor.

    A raw broker and `workers` raw echo workers, each its own process, and a DEALER here. A
    session's turn is one round trip (the model call), then `calls` round trips at once (the
    tool calls); the broker hands requests to the workers in turn, so with `workers` =
    `calls` + 1 a turn of one session reaches every process once, as a turn through the
    topology reaches the gateway and each tool worker. What a turn costs here, any topology of
    separate processes talking through a Python broker pays on top of the loop and the model.
    With `ends="asyncio"` the workers and the requester are asyncio programs that do the least
    pyzmq allows (`_AsyncioEnd`; the requester on an event loop in a thread of this process)
    and the broker stays blocking, as the hub is: what the same hops cost any topology whose
    processes are asyncio programs (the design card's anyio), the asyncio floor.
    On `transport` tcp or ipc; `close()` stops every process.
    """

    def __init__(self, workers: int, transport: str = "tcp", body: bytes = b"x" * 256,
                 ends: str = "blocking") -> None:
        worker = _worker_for(ends)
        self._tmp = tempfile.TemporaryDirectory(prefix="raw-turns-")
        endpoint = (f"ipc://{self._tmp.name}/broker.sock" if transport == "ipc"
                    else f"tcp://127.0.0.1:{free_port()}")
        self._body = body[4:]
        self._asyncio = ends == "asyncio"
        self._endpoint, self._procs = _start(workers, endpoint, worker)
        self._ctx, self._sock = _requester(self._endpoint, body, workers)

    def run(self, sessions: int, turns: int, calls: int) -> tuple[float, float]:
        """`sessions` sessions at once, each `turns` turns of a model round trip and `calls`
        tool round trips, then a final model round trip. Returns wall seconds and CPU seconds
        (user + system of every process, this one included) per model round trip."""
        todo = _Sessions(sessions, turns, calls, self._body)
        cpu0 = sum(cpu_s(proc.pid) for proc in self._procs if proc.pid) + own_cpu_s()
        started = time.perf_counter()
        if self._asyncio:
            thread = threading.Thread(target=asyncio.run, args=(self._run_asyncio(todo),))
            thread.start()
            thread.join()
        else:
            self._run_blocking(todo)
        wall = time.perf_counter() - started
        cpu = sum(cpu_s(proc.pid) for proc in self._procs if proc.pid) + own_cpu_s() - cpu0
        model_calls = sessions * (turns + 1)
        return wall / model_calls, cpu / model_calls

    def _run_blocking(self, todo: _Sessions) -> None:
        sock = self._sock
        for body in todo.first:
            sock.send_multipart([b"req", body])
        while todo.active:
            answer = sock.recv_multipart()[1]
            for _ in range(todo.answered(answer)):
                sock.send_multipart([b"req", answer])

    async def _run_asyncio(self, todo: _Sessions) -> None:
        end = _AsyncioEnd(self._endpoint)
        try:
            for body in todo.first:
                end.now.send_multipart([b"req", body])
            while todo.active:
                for frames in await end.receive():
                    answer = frames[1]
                    for _ in range(todo.answered(answer)):
                        end.now.send_multipart([b"req", answer])
        finally:
            end.close()

    def close(self) -> None:
        _stop(self._sock, self._ctx, self._procs)
        self._tmp.cleanup()


# --- events: raw publisher -> (raw forwarder | hub) -> raw subscriber ---------------------------

EVENT_TYPE = b"topic_message"
END_TYPE = b"bench_end"  # the last event of a run: the subscriber stops at it
QUIET = 3.0  # s without an event: the subscriber stops (the end marker was lost)
# Events a raw publisher may be ahead of its subscriber (credit it gets back in steps of CREDIT):
# a hub's PUB drops what a subscriber falls behind by more than its SNDHWM (8,192 messages by
# default, docs/protocol.md section 7), and a raw subscriber does not fill what it lost.
WINDOW = 4096
CREDIT = 1024


def _raw_forwarder(front: str, back: str) -> None:
    """The least a Python event broker does: each body of a message in from a publisher's DEALER
    goes out on an XPUB as its own 4-frame event (the publisher sends the topic frame too), sent
    frame by frame with pyzmq's backend `send` as the hub publishes the bodies of an event
    message, but nothing read, logged or stamped; a new subscription is answered with a
    heartbeat, as the hub answers one."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    router.rcvhwm = 0
    router.bind(front)
    xpub = ctx.socket(zmq.XPUB)
    xpub.linger = 0
    xpub.sndhwm = 0
    xpub.bind(back)
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    poller.register(xpub, zmq.POLLIN)
    send = zmq.backend.Socket.send
    while True:
        for sock, _ in poller.poll():
            if sock is xpub:
                xpub.recv_multipart()
                xpub.send_multipart([b"hb", b"", b""])
                continue
            while True:
                try:
                    frames = router.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                topic, sig, header = frames[1:4]  # each body is its own event
                for body in frames[4:]:  # frame by frame, below pyzmq's sugar, as the hub does
                    send(xpub, topic, zmq.SNDMORE)
                    send(xpub, sig, zmq.SNDMORE)
                    send(xpub, header, zmq.SNDMORE)
                    send(xpub, body, 0)


def _raw_event_publisher(endpoint: str, credits: str, n: int, to_hub: bool, ready: Any,
                         start: Any, batch: int) -> None:
    """`n` events, `batch` bodies per message (as the `bus` client coalesces a burst), from a
    blocking DEALER, then one `bench_end`: to the hub as docs/protocol.md says (hello, then
    `event` messages: signature, header, bodies), or to the raw forwarder with the topic frame
    it publishes first. It stays at most WINDOW events ahead of the subscriber, which sends
    CREDIT back on `credits` each time it has read that many."""
    from agent_bus.bus import events as ev
    from agent_bus.bus import protocol as p

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.sndhwm = 0
    sock.connect(endpoint)
    if to_hub:
        sock.send_multipart([p.SIGNATURE, p.encode(p.Header(kind=p.HELLO, id="h")),
                             p.encode(p.Hello(name="bench-raw-publisher", session="raw"))])
        sock.recv_multipart()  # welcome
    body = ev.encode_event(ev.TopicMessage(topic="t", text="x" * 40))
    end = msgspec.msgpack.encode({"type": END_TYPE.decode()})

    def message(type_: bytes, i: int, bodies: list[bytes]) -> list[bytes]:
        header = p.encode(p.Header(kind=p.EVENT, id=f"e{i}", type=type_.decode(), agent="a",
                                   run="r"))
        frames = [p.SIGNATURE, header, *bodies]
        return frames if to_hub else [b"ext/a/r/" + type_, *frames]

    full, last = divmod(n, batch)
    messages = [message(EVENT_TYPE, i, [body] * batch) for i in range(min(full, 100))]
    credit = ctx.socket(zmq.PULL)
    credit.connect(credits)
    window = WINDOW
    ready.set()
    start.wait()
    for i in range(full):
        while window < batch:
            credit.recv()
            window += CREDIT
        sock.send_multipart(messages[i % len(messages)])
        window -= batch
    if last:
        sock.send_multipart(message(EVENT_TYPE, full, [body] * last))
    sock.send_multipart(message(END_TYPE, full + 1, [end]))
    time.sleep(600)  # stopped by `raw_subscribed_rate` (a close could drop what is queued)


def raw_sub(ctx: zmq.Context, endpoint: str) -> zmq.Socket:  # type: ignore[type-arg]
    """A SUB to everything on `endpoint` that queues without bound (RCVHWM 0): it drops nothing
    on its side, whatever the publisher's pace."""
    sub = ctx.socket(zmq.SUB)
    sub.linger = 0
    sub.rcvhwm = 0
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    return sub


def raw_subscribed_rate(publish_to: str, events: str, n: int, to_hub: bool, batch: int = 256,
                        cpu_of: list[int] | None = None) -> tuple[float, int, list[float]]:
    """Start `_raw_event_publisher` towards `publish_to`, subscribe a raw SUB here to `events`
    (after the heartbeat that answers the subscription, so none is missed), and count its
    `topic_message`s up to the `bench_end`: (events/s from the first to the end, events lost
    on the way, CPU seconds per event of each pid in `cpu_of` and of this process)."""
    spawn = mp.get_context("spawn")
    ready, start = spawn.Event(), spawn.Event()
    ctx = zmq.Context()
    credit = ctx.socket(zmq.PUSH)
    credit.linger = 0
    port = credit.bind_to_random_port("tcp://127.0.0.1")
    proc = spawn.Process(target=_raw_event_publisher, daemon=True, args=(
        publish_to, f"tcp://127.0.0.1:{port}", n, to_hub, ready, start, batch))
    proc.start()
    sub = raw_sub(ctx, events)
    try:
        while sub.recv_multipart()[0] != b"hb":
            pass
        if not ready.wait(30):
            raise RuntimeError("the raw publisher did not start")
        pids = [*(cpu_of or []), proc.pid or 0]
        cpu0 = [cpu_s(pid) for pid in pids] + [own_cpu_s()]
        start.set()
        count, first, last = 0, 0.0, time.perf_counter()
        suffix, end = b"/" + EVENT_TYPE, b"/" + END_TYPE
        # Until the end marker, or QUIET s without an event: a hub's PUB drops what a subscriber
        # does not read in time (docs/protocol.md section 7), and the marker may be among them.
        while sub.poll(QUIET * 1000) and time.perf_counter() - last < QUIET:
            topic = sub.recv_multipart()[0]  # (heartbeats too: the quiet is counted in events)
            if topic.endswith(suffix):
                count += 1
                last = time.perf_counter()
                if count == 1:
                    first = last
                if count % CREDIT == 0:
                    credit.send(b"")
            elif topic.endswith(end):
                last = time.perf_counter()
                break
        if count < 2:
            raise RuntimeError(f"the raw subscriber got {count} of {n} events")
        rate = (count - 1) / (last - first)
        cpu = [cpu_s(pid) for pid in pids] + [own_cpu_s()]
        return rate, n - count, [(b - a) / max(count, 1) for a, b in zip(cpu0, cpu, strict=True)]
    finally:
        sub.close()
        credit.close()
        ctx.term()
        proc.kill()
        proc.join()


def raw_forwarded_rate(n: int, transport: str = "tcp") -> float:
    """Events/s from a raw publisher through `_raw_forwarder` to a raw subscriber: the floor of
    `bench_bus`'s events/s through the hub, set against raw PUB->SUB."""
    with tempfile.TemporaryDirectory(prefix="raw-fwd-") as tmp:
        if transport == "ipc":
            front, back = f"ipc://{tmp}/in", f"ipc://{tmp}/out"
        else:
            front, back = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        spawn = mp.get_context("spawn")
        forwarder = spawn.Process(target=_raw_forwarder, args=(front, back), daemon=True)
        forwarder.start()
        try:
            return raw_subscribed_rate(front, back, n, to_hub=False)[0]
        finally:
            forwarder.kill()
            forwarder.join()
