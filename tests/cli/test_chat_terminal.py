"""`busctl chat` on a real terminal (issue 49, item 1): Ctrl-C typed on a pseudo-terminal, so the
terminal driver sends SIGINT to chat's process group as it does for a person at a keyboard."""

from __future__ import annotations

import os
import re
import select
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from tests.cli.conftest import FIXTURES, Topology
from tests.support import ROOT, busctl, running

CTRL_C = b"\x03"


class Terminal:
    """A command run as a session leader on a pseudo-terminal (its controlling terminal)."""

    def __init__(self, args: list[str]) -> None:
        import pty

        env = {**os.environ, "PYTHONUNBUFFERED": "1", "NO_COLOR": "1", "TERM": "dumb"}
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: only exec (the test's threads are not in it)
            os.chdir(ROOT)
            os.execve(sys.executable, args, env)
        self.seen = b""
        self.status: int | None = None

    def send(self, data: bytes) -> None:
        os.write(self.fd, data)

    def expect(self, pattern: str, timeout: float = 20.0, after: int = 0) -> int:
        """Wait for `pattern` (a regex) in the output after offset `after`; its end offset."""
        deadline = time.monotonic() + timeout
        while True:
            found = re.search(pattern.encode(), self.seen[after:])
            if found:
                return after + found.end()
            if not self._read(deadline - time.monotonic()):
                raise AssertionError(f"no {pattern!r} within {timeout}s; the terminal shows:\n"
                                     + self.seen.decode(errors="replace"))

    def _read(self, left: float) -> bool:
        if left <= 0:
            return False
        ready, _, _ = select.select([self.fd], [], [], min(left, 0.5))
        if ready:
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:  # EIO: the child closed the terminal (it exited)
                chunk = b""
            self.seen += chunk
            return bool(chunk) or self.exited()
        return not self.exited()

    def exited(self) -> bool:
        if self.status is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(status)
        return self.status is not None

    def wait_exit(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while not self.exited():
            if time.monotonic() > deadline:
                raise AssertionError(f"still running after {timeout}s; the terminal shows:\n"
                                     + self.seen.decode(errors="replace"))
            self._read(deadline - time.monotonic())
        assert self.status is not None
        return self.status

    def close(self) -> None:
        if not self.exited():
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        os.close(self.fd)


@contextmanager
def chat_on_a_terminal(hub: str) -> Iterator[Terminal]:
    term = Terminal(busctl("chat", "--hub", hub))
    try:
        term.expect(r"chatting with `assistant`")
        yield term
    finally:
        term.close()


@contextmanager
def slow_tools(hub: str) -> Iterator[None]:
    with running(busctl("worker", "--hub", hub, "--tools", str(FIXTURES / "my_tools.py"))) as w:
        w.wait_ready()
        yield


def test_ctrl_c_aborts_the_run_and_returns_to_the_prompt_then_quits_130(
        up_default: Topology) -> None:
    hub = up_default.endpoint
    with slow_tools(hub), chat_on_a_terminal(hub) as term:
        term.send(b"be slow\n")
        at = term.expect(r"slow_echo")  # the tool call runs (30 s)
        started = time.monotonic()
        term.send(CTRL_C)
        at = term.expect(r"aborting the run", after=at)
        at = term.expect(r"aborted[^\n]*\r?\n> ", after=at)  # the prompt is back, no Enter
        assert time.monotonic() - started < 15  # not the tool's 30 s
        assert not term.exited()
        term.send(b"hello again\n")  # the chat goes on in the same session
        at = term.expect(r"echo: hello again", after=at)
        term.expect(r"\n> ", after=at)
        started = time.monotonic()
        term.send(CTRL_C)  # at the idle prompt: quit at once
        assert term.wait_exit(10) == 130
        assert time.monotonic() - started < 5
        assert b"Traceback" not in term.seen, term.seen.decode(errors="replace")


def test_a_second_ctrl_c_during_the_abort_quits_at_once_without_a_traceback(
        up_default: Topology) -> None:
    hub = up_default.endpoint
    with slow_tools(hub), chat_on_a_terminal(hub) as term:
        term.send(b"be slow\n")
        at = term.expect(r"slow_echo")
        term.send(CTRL_C)
        term.expect(r"aborting the run", after=at)
        term.send(CTRL_C)
        assert term.wait_exit(10) == 130
        assert b"Traceback" not in term.seen, term.seen.decode(errors="replace")
