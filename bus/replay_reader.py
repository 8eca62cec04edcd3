"""`hub.replay`'s reader: reads batches of logged events with its own SQLite connection, off the
hub's routing loop, and hands each finished batch back to it.

For a log on disk the reader is a child process (`python -m agent_bus.bus.replay_reader`): reading and
encoding a batch is Python work, and in a thread of the hub it would hold the GIL the routing loop
needs (measured: a busy thread in the hub process took request p50 from 0.46 to 16 ms). The child
dies with the hub, and is restarted if it dies. An in-memory log can only be read from inside the
hub's process, so there the reader is a thread (tests and demos).

Priority. A low nice value is not enough: Linux's scheduler (EEVDF) lets a running task finish its
slice (~1.5 ms on 2 cores) before a waking one runs, so each hop of a request could wait for the
reader; request p99 beside a full replay was ~4x idle at nice 10. The reader runs as SCHED_IDLE
instead ("idle" class), which any other task preempts at once (measured: 1.4-1.5x). An idle-class
task only gets CPU nobody else wants, so on a saturated machine it could starve: when a job has
waited STARVED_AFTER seconds, the hub replaces the reader with one at nice 10 ("low" class) and
hands it the jobs again; once that one has had nothing to do for CALM_AFTER seconds it is retired,
and the next replay starts an idle-class reader again.

Pacing. Even as SCHED_IDLE the reader can keep a runnable request off a core: EEVDF picks by
eligibility within the hub's task group, and a normal task that has run ahead of its share (lag
below zero) waits while the reader runs until the reader blocks (traced with `perf sched`: the
reader ran 3.4 ms while the requester's I/O thread was runnable on that core; a batch of ~1,800
small events is ~3.9 ms of reader CPU). So the reader blocks for a moment (`PACE_SLEEP`) after
every PACE_SECONDS of reading: the longest stretch a waiting task can lose to it is bounded by
that instead of by a whole batch.

The hub talks to either over one ZeroMQ DEALER socket it polls: it sends `_Job`s without blocking
and later receives `[job number, code, body]` (code `b""`: body is a `ReplayBatch`). Every job
gets exactly one answer: the reader answers read errors itself, and the jobs of a reader that
died are answered `handler_error` by `ReplayReader.check`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq

from agent_bus import bus
from agent_bus.bus import protocol as p

# the limits and pacing of a batch read are the store readers' (re-exported for the tests)
from agent_bus.bus.store import REPLAY_LIMIT as REPLAY_LIMIT
from agent_bus.bus.store import StoreError, StoreReader, open_reader, reader_in_process
from agent_bus.bus.store.sqlite import PACE_SECONDS as PACE_SECONDS

log = logging.getLogger("bus.hub")

REPLAY_QUEUE = 256  # replays waiting for the reader; one more is answered `overloaded`
# ...of them, from one peer: its share, so that a peer asking replays without end cannot take the
# whole queue and starve the others (one more from it is answered `overloaded`; our clients ask
# one batch at a time). Another peer's replay waits behind at most this many of a flooder's
# batches (tests/fault/test_replay_per_peer.py: 0.9-2.1x its time on a quiet hub; 8 gave up to 23x).
PEER_REPLAY_QUEUE = 4
REPLIES_PER_PASS = 16  # finished replays forwarded per loop pass (each <= replay_bytes + 1 event)
READER_NICE = 10  # the reader's nice value, below the routing loop (both classes)
IDLE, LOW = "idle", "low"  # the reader process's scheduling class (see the module docstring)
REPLAY_PRIORITIES = (IDLE, LOW)
STARVED_AFTER = 1.0  # seconds a job may wait for an idle-class reader before it is replaced
CALM_AFTER = 30.0  # seconds without a job before a low-class reader is retired
RESTART_GAP = 1.0  # seconds between starts of a reader process that keeps dying
PARENT_CHECK = 1.0  # seconds: how often the child checks that the hub is still there

_encode = msgspec.msgpack.Encoder().encode


class _Job(msgspec.Struct, array_like=True):
    """A replay handed to the reader: its number (answers carry it back), the log head it may
    read up to, and the request."""

    number: int
    head: int
    request: p.ReplayRequest


def answer(reader: StoreReader, uri: str, job: _Job, budget: int) -> list[bytes]:
    """`[code, body]` for one job: always an answer, even when the read fails."""
    try:
        return [b"", _encode(reader.read_batch(job.request, job.head, budget))]
    except StoreError as exc:  # answered: the requester must not wait its deadline
        log.warning("hub.replay: event log read failed: %s", exc)
        return [p.HANDLER_ERROR.encode(), f"`hub.replay` could not read the event log "
                f"({uri}): {exc}".encode()]
    except Exception:  # a bug: the reader must live on and every replay be answered
        log.exception("hub.replay: reader failed on %r", job.request)
        return [p.HANDLER_ERROR.encode(), b"`hub.replay` failed inside the hub (a bug; "
                b"see the hub's log)"]


def serve_jobs(sock: zmq.Socket[Any], uri: str, budget: int,
               alive: Any = lambda: True) -> None:
    """The reader's loop (thread or process): answer jobs until an empty message (stop) or
    until `alive()` turns false (checked every PARENT_CHECK seconds without a job)."""
    decode = msgspec.msgpack.Decoder(_Job).decode
    reader = open_reader(uri)
    try:
        while True:
            if not sock.poll(int(PARENT_CHECK * 1000)):
                if not alive():
                    return
                continue
            message = sock.recv()
            if not message:
                return
            job = decode(message)
            # copy=False: the batch (up to `budget` and one event past it) is handed over
            # without another copy
            sock.send_multipart([b"%d" % job.number, *answer(reader, uri, job, budget)], copy=False)
    finally:
        reader.close()


@dataclasses.dataclass(slots=True)
class _Held:
    """A job handed to the reader and not answered yet."""

    ident: bytes  # the requester's routing id
    req_id: str
    job: bytes  # the encoded `_Job`, to hand to a replacement reader
    sent: float  # monotonic: when it was (last) handed over


class ReplayReader:
    """The routing loop's end of the reader: submit jobs, collect answers, keep it alive.

    `sock` is what the hub polls. Jobs are numbered; `outstanding` maps each number to the
    requester (routing id, request id), so an answer is forwarded once and the jobs of a reader
    that died are answered by `check`."""

    def __init__(self, ctx: zmq.Context[Any], log_uri: str, budget: int,
                 priority: str = IDLE) -> None:
        self._ctx = ctx
        self._uri = log_uri
        self._budget = budget
        self._priority = priority  # the class a new reader starts in (config `replay_priority`)
        self._numbers = 0
        self.outstanding: dict[int, _Held] = {}
        self._in_process = reader_in_process(log_uri) or not zmq.has("ipc")
        self._dir = "" if self._in_process else tempfile.mkdtemp(prefix="bus-replay-")
        self._proc: subprocess.Popen[bytes] | None = None
        self._address = ""  # the running reader's socket (each reader process has its own)
        self._starts = 0
        self._reaping: list[tuple[float, subprocess.Popen[bytes]]] = []  # (kill after, process)
        self._class = priority  # the running reader's class
        self._thread: threading.Thread | None = None
        self._started = 0.0
        self._last_active = 0.0  # monotonic: the last job handed over or answered
        self.restarts = 0  # readers started again after one died
        self.starved = 0  # idle-class readers replaced because a job waited STARVED_AFTER
        self.calm_after = CALM_AFTER
        # DEALER, not PAIR: it reconnects to a restarted reader like any other socket.
        self.sock = ctx.socket(zmq.DEALER)  # the loop's end
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, REPLAY_QUEUE * 2)
        if self._in_process:
            address = f"inproc://bus-replay-{id(self):x}"
            self.sock.bind(address)
            self._start_thread(address)
        # Otherwise the reader process is started by the first replay that needs it: most hubs
        # never read their log, and a hub's start should not wait for (or pay) a second
        # interpreter (see `_start_process`).

    @property
    def pending(self) -> int:
        return len(self.outstanding)

    def submit(self, ident: bytes, req_id: str, head: int, request: p.ReplayRequest) -> bool:
        """Hand a job over; False when REPLAY_QUEUE replays are already waiting."""
        if len(self.outstanding) >= REPLAY_QUEUE:
            return False
        if not self._in_process and self._proc is None:
            self._start_process(self._priority)
        self._numbers += 1
        job = _encode(_Job(self._numbers, head, request))
        try:
            self.sock.send(job, zmq.NOBLOCK)
        except zmq.Again:
            return False
        self._last_active = time.monotonic()
        self.outstanding[self._numbers] = _Held(ident, req_id, job, self._last_active)
        return True

    def answers(self) -> list[tuple[bytes, str, bytes, Any]]:
        """At most REPLIES_PER_PASS finished answers `(ident, req_id, code, body)`, without
        blocking; `body` is a `zmq.Frame` (forwarded without a copy)."""
        out = []
        for _ in range(REPLIES_PER_PASS):
            try:
                number, code, body = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            except ValueError:  # not three frames: not from our reader
                continue
            held = self.outstanding.pop(int(number.bytes), None)
            if held is not None:  # None: answered already (a job handed over twice, see check)
                out.append((held.ident, held.req_id, code.bytes, body))
        if out:
            self._last_active = time.monotonic()
        return out

    def check(self, now: float) -> list[tuple[bytes, str, bytes, Any]]:
        """Called every tick, keeps the reader process serving; returns answers for the routing
        loop to send (for the jobs of a reader that died).

        - died: its jobs are answered `handler_error` (a job may be what killed it: it is not
          handed to the next reader), and another is started (at most once per RESTART_GAP);
        - idle class, a job waiting STARVED_AFTER: replaced by a low-class reader, which gets
          every held job again (an answer that comes twice is forwarded once);
        - low class (the hub's setting being idle), no job for `calm_after`: retired; the next
          job starts an idle-class reader."""
        if self._reaping:
            self._reap(now)
        proc = self._proc
        if proc is None:
            return []
        if proc.poll() is not None:
            return self._died(proc, now)
        if self._class == IDLE and self.outstanding:
            oldest = min(held.sent for held in self.outstanding.values())
            if now - oldest >= STARVED_AFTER:
                self._replace_starved(proc)
        elif (self._class == LOW and self._priority == IDLE and not self.outstanding
              and now - self._last_active >= self.calm_after):
            self._retire(proc)
        return []

    def _died(self, proc: subprocess.Popen[bytes], now: float) -> list[tuple[bytes, str, bytes, Any]]:
        if now - self._started < RESTART_GAP:
            return []
        log.error("hub.replay: the reader process (pid %d) exited with %s; restarting it",
                  proc.pid, proc.returncode)
        failed = [(held.ident, held.req_id, p.HANDLER_ERROR.encode(),
                   b"`hub.replay`: the hub's log reader process died while reading; retry")
                  for held in self.outstanding.values()]
        self.outstanding.clear()
        self.restarts += 1
        self._start_process(self._class)
        return failed

    def _replace_starved(self, proc: subprocess.Popen[bytes]) -> None:
        self.starved += 1
        log.warning("hub.replay: the idle-class reader got no CPU for %.1f s (the machine is "
                    "busy); replacing it with one at nice %d", STARVED_AFTER, READER_NICE)
        proc.kill()  # it may not get the CPU to stop by itself; reaped later, never waited for
        self._reaping.append((0.0, proc))
        self._start_process(LOW)
        self._last_active = now = time.monotonic()
        for held in self.outstanding.values():  # to the new reader's socket alone
            held.sent = now
            with contextlib.suppress(zmq.Again):  # the queue holds REPLAY_QUEUE * 2
                self.sock.send(held.job, zmq.NOBLOCK)

    def _retire(self, proc: subprocess.Popen[bytes]) -> None:
        with contextlib.suppress(zmq.Again):
            self.sock.send(b"", zmq.NOBLOCK)  # the stop job: it exits once it reads it
        self._reaping.append((time.monotonic() + RESTART_GAP, proc))
        self._proc = None

    def _reap(self, now: float) -> None:
        """Collect readers that were stopped or killed (the routing loop never waits for one);
        one that has not left RESTART_GAP after its stop job is killed."""
        left = []
        for kill_after, proc in self._reaping:
            if proc.poll() is not None:
                continue
            if now >= kill_after:
                proc.kill()
            left.append((kill_after, proc))
        self._reaping = left

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.sock.send(b"", zmq.NOBLOCK)  # the stop job
        if self._thread is not None:
            self._thread.join(5)
        if self._proc is not None:
            try:
                self._proc.wait(2)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        for _, proc in self._reaping:
            proc.kill()
            proc.wait()
        self.sock.close(0)
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)

    def _start_thread(self, address: str) -> None:
        their = self._ctx.socket(zmq.DEALER)
        their.setsockopt(zmq.LINGER, 0)
        their.connect(address)

        def run() -> None:
            # Linux: a thread has its own nice value, so a big replay takes the cores the
            # requests do not need (it still shares the GIL: see the module docstring).
            with contextlib.suppress(OSError, AttributeError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), READER_NICE)
            try:
                serve_jobs(their, self._uri, self._budget)
            finally:
                their.close(0)

        self._thread = threading.Thread(target=run, name="bus-replay", daemon=True)
        self._thread.start()

    def _start_process(self, priority: str) -> None:
        """Start a reader on a socket of its own: the DEALER leaves the previous reader's (what
        was queued for it is dropped: answered or handed over again by the caller) and connects
        to the new one first, so jobs sent before the child has bound wait in the queue. The
        directory is 0700: only this user reaches the socket."""
        if self._address:
            with contextlib.suppress(zmq.ZMQError):
                self.sock.disconnect(self._address)
        self._starts += 1
        self._address = f"ipc://{self._dir}/reader-{self._starts}"
        self.sock.connect(self._address)
        # The child imports this package from where the hub did, whatever its cwd or PYTHONPATH.
        root = str(Path(bus.__file__).resolve().parent.parent)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH", "")]))
        argv = [sys.executable, "-m", "agent_bus.bus.replay_reader", "--uri", self._uri, "--endpoint",
                self._address, "--budget", str(self._budget), "--parent", str(os.getpid()),
                "--priority", priority]
        self._class = priority
        self._started = time.monotonic()
        # A process group of its own: a signal to the hub's group (Ctrl-C on a terminal, `busctl
        # down`) stops the hub, which stops its reader (the stop job; the kernel, on Linux, if
        # the hub dies) — it must not kill the reader first and be logged as a crash.
        self._proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, process_group=0)


def lower_priority(priority: str) -> None:
    """Nice READER_NICE, and SCHED_IDLE for the idle class (where the OS has it). Both are
    allowed without privileges, and neither can be undone without them."""
    with contextlib.suppress(OSError):
        os.nice(READER_NICE)
    if priority == IDLE and hasattr(os, "SCHED_IDLE"):
        with contextlib.suppress(OSError):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def _child(uri: str, endpoint: str, budget: int, parent: int, priority: str) -> None:
    from agent_bus.bus.procsec import die_with_parent, make_undumpable

    die_with_parent(parent)  # Linux: the kernel ends us with the hub, even on SIGKILL
    make_undumpable()  # like the hub: no other process of the user reads our memory
    lower_priority(priority)  # before zmq starts its I/O thread, which inherits it
    ctx = zmq.Context(1)
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)  # the last answers still reach the hub on a stop
    path = endpoint.removeprefix("ipc://")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # a socket file left by a reader that died
    sock.bind(endpoint)
    try:
        serve_jobs(sock, uri, budget, alive=lambda: os.getppid() == parent)
    finally:
        sock.close()
        ctx.term()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m agent_bus.bus.replay_reader",
                                     description="The hub's replay reader (started by the hub).")
    parser.add_argument("--uri", required=True, help="the event store's reader URI")
    parser.add_argument("--endpoint", required=True, help="ipc:// address to bind")
    parser.add_argument("--budget", type=int, required=True, help="replay_bytes per batch")
    parser.add_argument("--parent", type=int, required=True, help="the hub's pid")
    parser.add_argument("--priority", choices=[IDLE, LOW], default=IDLE,
                        help="scheduling class (see the module's docstring)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s replay-reader %(levelname)s %(message)s")
    with contextlib.suppress(KeyboardInterrupt):
        _child(args.uri, args.endpoint, args.budget, args.parent, args.priority)


if __name__ == "__main__":
    main()
