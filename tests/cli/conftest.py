from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from agent_bus.agents.gateway.fakellm import FakeLLMServer
from tests.support import Proc, busctl, wait_for

FIXTURES = Path(__file__).parent / "fixtures"

# The scripted model for these tests: "count" calls the user's word_count tool, "slow" calls
# slow_echo, "explore" calls the built-in list_dir, anything else is echoed; after tool results it
# answers with them.
SCRIPT = {
    "rules": [
        {"contains": ["count"], "tool_result": False,
         "reply": {"text": "Counting.", "tool_calls": [
             {"name": "word_count", "arguments": {"text": "one two three four"}}]}},
        {"contains": ["slow"], "tool_result": False,
         "reply": {"text": "Waiting.", "tool_calls": [
             {"name": "slow_echo", "arguments": {"text": "late", "seconds": 30}}]}},
        {"contains": ["explore"], "tool_result": False,
         "reply": {"text": "Looking.", "tool_calls": [{"name": "list_dir", "arguments": {}}]}},
        {"contains": [], "tool_result": True, "reply": {"text": "Result: {tool_results}"}},
    ],
    "echo": True,
}


@pytest.fixture
def fake_llm() -> Iterator[FakeLLMServer]:
    with FakeLLMServer(SCRIPT) as srv:
        yield srv


class Topology:
    """A running `busctl up` in a temporary project directory."""

    def __init__(self, proc: Proc, cwd: Path, ready: dict) -> None:
        self.proc = proc
        self.cwd = cwd
        self.endpoint: str = ready["endpoint"]
        self.events: str = ready["events"]

    def child_pids(self) -> dict[str, int]:
        line = self.proc.wait_line(lambda s: s.startswith("processes"), 5)
        return {m.group(1): int(m.group(2)) for m in re.finditer(r"(\S+)\[(\d+)\]", line)}


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def start_up(cwd: Path, *args: str, env: dict[str, str] | None = None) -> tuple[Proc, dict]:
    proc = Proc(busctl("up", "--json", "--hub", "tcp://127.0.0.1:0", *args), cwd=cwd, env=env)
    try:
        ready = proc.wait_ready(timeout=40)
    except BaseException:
        proc.stop()
        raise
    return proc, ready


@contextmanager
def running_up(cwd: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[Topology]:
    """`busctl up ARGS` in `cwd`, ready; stopped on the way out, and any child it left killed."""
    proc, ready = start_up(cwd, *args, env=env)
    topo = Topology(proc, cwd, ready)
    pids = topo.child_pids()
    try:
        yield topo
    finally:
        proc.stop(timeout=8)
        for pid in pids.values():
            if pid_alive(pid):
                os.kill(pid, 9)


@pytest.fixture
def up_default(tmp_path: Path, fake_llm: FakeLLMServer) -> Iterator[Topology]:
    """`busctl up` on the embedded default, its gateway pointed at the scripted server."""
    with running_up(tmp_path, env={"OPENAI_BASE_URL": fake_llm.base_url,
                                   "OPENAI_API_KEY": ""}) as topo:
        yield topo


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


__all__ = ["FIXTURES", "Topology", "json_lines", "pid_alive", "running_up", "start_up",
           "wait_for"]
