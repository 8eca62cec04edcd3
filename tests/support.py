"""Helpers for tests that start real processes: ready lines, deadlines, guaranteed cleanup."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def tight_timing() -> bool:
    """Whether to hold timing bounds tight. The normal run shares a small (2-core) machine with
    other work, so a bound in seconds there is generous (it still tells "late" from "never");
    the tight bound, which only holds on a quiet machine, runs with AGENT_BUS_SLOW=1 (as do the
    `slow` tests)."""
    return os.environ.get("AGENT_BUS_SLOW") == "1"


class Proc:
    """A child process in its own process group, with its stdout lines collected by a thread."""

    def __init__(self, args: list[str], *, env: dict[str, str] | None = None,
                 cwd: Path | str | None = None, stdin: int | None = subprocess.DEVNULL) -> None:
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.args = args
        self.popen = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=stdin, env=full_env,
            cwd=cwd or ROOT, start_new_session=True, text=True, bufsize=1,
        )
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_line(self, predicate: Callable[[str], bool], timeout: float = 10.0) -> str:
        deadline = time.monotonic() + timeout
        seen = 0
        with self._cond:
            while True:
                for line in self.lines[seen:]:
                    if predicate(line):
                        return line
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0 or (self.popen.poll() is not None and not self._reader.is_alive()):
                    raise TimeoutError(f"{self.args!r}: no matching line in {timeout}s; output:\n"
                                       + "\n".join(self.lines[-40:]))
                self._cond.wait(min(left, 0.2))

    def wait_ready(self, timeout: float = 15.0) -> dict[str, Any]:
        line = self.wait_line(lambda s: s.startswith('{"ready"'), timeout)
        return json.loads(line)

    def output(self) -> str:
        with self._cond:
            return "\n".join(self.lines)

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, timeout: float = 5.0) -> int | None:
        if self.popen.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.signal(signal.SIGKILL)  # whatever is left in the group
        try:
            return self.popen.wait(5)
        finally:
            if self.popen.stdin:  # a pipe the test wrote to (a ResourceWarning left open)
                with contextlib.suppress(OSError):  # (a flush into a pipe nobody reads)
                    self.popen.stdin.close()
            if self.popen.stdout:
                self._reader.join(2)
                self.popen.stdout.close()


@contextmanager
def running(args: list[str], **kwargs: Any) -> Iterator[Proc]:
    proc = Proc(args, **kwargs)
    try:
        yield proc
    finally:
        proc.stop()


def py(*args: str) -> list[str]:
    return [sys.executable, *args]


def busctl(*args: str) -> list[str]:
    return [sys.executable, "-m", "agent_bus.cli", *args]


async def until(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Await a cheap condition (sync or async) until it is truthy, or fail with `what` after
    `timeout`. The async twin of `wait_for`; the only polling loop async tests should need."""
    import anyio

    deadline = time.monotonic() + timeout
    delay = 0.01
    while True:
        value = predicate()
        if hasattr(value, "__await__"):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await anyio.sleep(delay)  # a poll interval inside the deadline, not a wait
        delay = min(delay * 2, 0.1)


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Poll a cheap condition until it is truthy, or fail with `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    delay = 0.01
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(delay)  # a poll interval inside a deadline, not a wait
        delay = min(delay * 2, 0.2)
