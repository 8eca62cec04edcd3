"""Fixtures of the failover tests: hubs on fixed loopback ports (a client's list names them
before they run), each stopped at the end even when a test fails."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support import Proc, busctl


def _pair_free(port: int) -> bool:
    """`port` (the hub's) and `port + 1` (its events) both free on loopback now."""
    for p in (port, port + 1):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                return False
    return True


def hub_ports(count: int) -> list[int]:
    """`count` ports whose next port is free too (a hub publishes its events on the next)."""
    ports: list[int] = []
    while len(ports) < count:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 65000 and _pair_free(port) and all(abs(port - q) > 1 for q in ports):
            ports.append(port)
    return ports


@pytest.fixture
def start_hub(tmp_path: Path) -> Iterator[Callable[[int], Proc]]:
    """Start a hub on `tcp://127.0.0.1:PORT` over the test's one state folder (one SQLite log:
    a hub started after another was killed continues its log, as a takeover looks to a
    client). Every hub started is stopped at the end."""
    procs: list[Proc] = []

    def start(port: int) -> Proc:
        proc = Proc(busctl("hub", "--hub", f"tcp://127.0.0.1:{port}",
                           "--state-dir", str(tmp_path / "state")))
        procs.append(proc)
        proc.wait_ready()
        return proc

    try:
        yield start
    finally:
        for proc in procs:
            proc.stop()


@pytest.fixture
def clients() -> Iterator[Callable[..., Proc]]:
    """Start `tests/failover/client_proc.py` processes; each stopped at the end."""
    import subprocess

    from tests.support import ROOT, py

    procs: list[Proc] = []

    def start(*args: str) -> Proc:
        proc = Proc(py(str(ROOT / "tests" / "failover" / "client_proc.py"), *args),
                     stdin=subprocess.PIPE)
        procs.append(proc)
        return proc

    try:
        yield start
    finally:
        for proc in procs:
            if proc.popen.stdin is not None and not proc.popen.stdin.closed:
                proc.popen.stdin.close()
            proc.stop()
