"""Shared pieces of the bus acceptance tests: serving peers in subprocesses, polling with deadlines."""

from __future__ import annotations

import contextlib
import json
import random
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from agent_bus.bus.backoff import Backoff
from tests.support import Proc, busctl, py, wait_for

PEER = str(Path(__file__).with_name("peer_proc.py"))


@contextlib.contextmanager
def serving_peers(endpoint: str, n: int = 1, *args: str) -> Iterator[list[Proc]]:
    """Start `n` peer_proc.py processes and wait for their ready lines; stop them all after."""
    procs: list[Proc] = []
    try:
        for _ in range(n):
            procs.append(Proc(py(PEER, endpoint, *args)))
        for proc in procs:
            proc.ready = proc.wait_ready(20)  # type: ignore[attr-defined]
        yield procs
    finally:
        for proc in procs:
            proc.stop()


@contextlib.contextmanager
def limited_hub(state: Path, max_message_bytes: int) -> Iterator[dict]:
    """A hub on a free loopback port taking messages of at most `max_message_bytes`; yields its
    ready line (endpoint, events, pid) and stops it after."""
    proc = Proc(busctl("hub", "--hub", "tcp://127.0.0.1:0", "--state-dir", str(state),
                       "--max-message-bytes", str(max_message_bytes)))
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def restartable_ports(n: int = 2) -> list[int]:
    """`n` free loopback ports below the ephemeral range, for a hub restarted on the same
    endpoint: while it is down, no outgoing connection on the machine can take one of them as
    its local port (as it can a port from `free_port()`)."""
    low, _ = _ephemeral_range()
    rng = random.Random()
    ports: list[int] = []
    while len(ports) < n:
        port = rng.randrange(10_000, max(low, 10_001))
        if port not in ports and port_bindable(port):
            ports.append(port)
    return ports


def port_bindable(port: int) -> bool:
    """Whether a listener could bind `port` now, as the hub does (SO_REUSEADDR, like libzmq)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def start_hub(port: int, events: int, state: Path, *extra: str, timeout: float = 20.0) -> Proc:
    """A hub on fixed request and event ports, for tests that restart it on the same endpoint.

    Both ports are given: the default event port (request port + 1) is reserved by nobody, and
    any connection on the machine may hold it as its local port. A port the OS still holds when
    the hub binds (a reconnecting client's ephemeral port, or the killed hub's not yet
    released) makes the hub exit at once with "Address already in use": that start is retried
    until `timeout`; any other failure is raised at once. The returned hub is ready."""
    args = busctl("hub", "--hub", f"tcp://127.0.0.1:{port}", "--events",
                  f"tcp://127.0.0.1:{events}", "--state-dir", str(state), *extra)
    delays = Backoff(first=0.05, cap=0.5).delays(deadline=time.monotonic() + timeout)
    while True:
        proc = Proc(args)
        try:
            proc.wait_ready(timeout)
            return proc
        except TimeoutError:
            proc.stop()
            delay = next(delays, None)
            if "Address already in use" not in proc.output() or delay is None:
                raise
        time.sleep(delay)  # a retry interval inside the deadline, not a wait for a condition


def kill_hub(proc: Proc, port: int, events: int, timeout: float = 10.0) -> None:
    """SIGKILL a hub, wait (bounded) for it to exit, then for its ports to be bindable again."""
    proc.signal(signal.SIGKILL)
    proc.popen.wait(timeout)
    wait_for(lambda: port_bindable(port) and port_bindable(events), timeout,
             f"ports {port} and {events} of the killed hub to be released")


def started_line(proc: Proc, timeout: float = 10) -> dict:
    return json.loads(proc.wait_line(lambda s: s.startswith('{"started"'), timeout))
