"""`busctl run` output a script can pipe, and verbs that fail fast on an agent nobody serves."""

from __future__ import annotations

import os
import subprocess
import time

from tests.cli.conftest import Topology
from tests.support import busctl


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(busctl(*args), capture_output=True, text=True, timeout=30,
                          env={**os.environ, "NO_COLOR": "1"}, check=False)


def test_run_stdout_is_exactly_the_answer_and_the_trace_is_on_stderr(up_default: Topology) -> None:
    hub = up_default.endpoint
    result = cli("run", "--hub", hub, "explore the files")  # list_dir, then the answer
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Result: ") and result.stdout.count("Result: ") == 1, result
    assert "Looking." not in result.stdout  # the first turn's text is trace, not answer
    assert "tool_execution_start" in result.stderr and "list_dir" in result.stderr

    quiet = cli("run", "-q", "--hub", hub, "hello quietly")
    assert quiet.returncode == 0 and quiet.stdout == "echo: hello quietly\n", quiet
    assert quiet.stderr == ""


def test_verbs_on_an_unknown_agent_fail_fast_listing_the_live_ones(up_default: Topology) -> None:
    hub = up_default.endpoint
    # Baseline, measured now on this (maybe busy) machine: busctl's start, its connection and
    # one round trip, which each verb needs too (a loaded CI machine takes seconds to start it).
    start = time.monotonic()
    assert cli("status", "--hub", hub).returncode == 0
    baseline = time.monotonic() - start
    for args in (("run", "--agent", "nosuch", "hi"), ("steer", "nosuch", "x"),
                 ("abort", "nosuch")):
        start = time.monotonic()
        result = cli(*args, "--hub", hub)
        took = time.monotonic() - start
        assert took < baseline + 3, (took, baseline)  # not the prompt's 30 s wait for nobody
        assert result.returncode == 2, result  # an unknown name: README "Exit codes"
        assert "no live coordinator serves agent `nosuch`" in result.stderr, result.stderr
        assert "live agents: assistant" in result.stderr


def test_abort_takes_a_reason(up_default: Topology) -> None:
    result = cli("abort", "assistant", "because", "--hub", up_default.endpoint)
    # REASON is taken (no usage error); with no run in progress, abort fails as steer does
    assert result.returncode == 1 and "nothing to abort" in result.stderr, result
