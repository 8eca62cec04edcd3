"""Shared pieces of the bus acceptance tests: serving peers in subprocesses, polling with deadlines."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio

from tests.support import Proc, py

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def eventually(predicate: Callable[[], Awaitable[Any]], timeout: float,
                     what: str) -> Any:
    """Poll an async condition until truthy; fail with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    delay = 0.01
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        await anyio.sleep(delay)  # a poll interval inside a deadline, not a wait
        delay = min(delay * 2, 0.2)


def started_line(proc: Proc, timeout: float = 10) -> dict:
    return json.loads(proc.wait_line(lambda s: s.startswith('{"started"'), timeout))
