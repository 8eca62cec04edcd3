"""busctl hub/status/watch driven as a user would: real subprocesses."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from tests.support import busctl, running


def run(*args: str, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    return subprocess.run(busctl(*args), capture_output=True, text=True, timeout=timeout)


def test_help_lists_commands() -> None:
    result = run("--help")
    assert result.returncode == 0
    section = result.stdout.split("\nCommands:\n", 1)[1]
    listed = {line.split()[0] for line in section.splitlines() if line.startswith("  ")}
    assert {"hub", "status", "watch", "up", "run", "worker"} <= listed, listed


def test_status_against_dead_hub_fails_fast_naming_the_address() -> None:
    started = time.monotonic()
    result = run("status", "--hub", "tcp://127.0.0.1:1")
    assert result.returncode == 2
    assert "tcp://127.0.0.1:1" in result.stderr
    assert time.monotonic() - started < 8


def test_non_loopback_bind_without_keys_is_refused() -> None:
    result = run("hub", "--hub", "tcp://0.0.0.0:7999")
    assert result.returncode == 2
    assert "busctl keys generate" in result.stderr


def test_status_and_watch_json(hub: dict) -> None:
    status = run("status", "--hub", hub["endpoint"], "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["endpoint"] == hub["endpoint"]
    watch = run("watch", "--hub", hub["endpoint"], "--no-follow", "--since", "0", "--json")
    assert watch.returncode == 0, watch.stderr
    lines = [json.loads(line) for line in watch.stdout.splitlines()]
    assert lines, "the status call above joined and left, so the log has events"
    assert [e["seq"] for e in lines] == sorted(e["seq"] for e in lines)
    for key in ("seq", "ts", "type", "agent", "run_id"):
        assert key in lines[0]


def test_watch_follows_live_events(hub: dict) -> None:
    with running(busctl("watch", "--hub", hub["endpoint"], "--json", "--since", "0")) as watcher:
        # a status call makes the hub publish peer_joined/peer_left
        status = run("status", "--hub", hub["endpoint"])
        assert status.returncode == 0, status.stderr
        line = watcher.wait_line(lambda s: '"peer_left"' in s and "busctl-status" in s, 10)
        assert json.loads(line)["type"] == "peer_left"


def test_every_error_is_mapped_in_one_place_and_a_bug_names_its_traceback_log() -> None:
    import click

    from agents.launch.topology import TopologyError
    from bus.errors import AgentBusError, ConfigError, HubUnreachable
    from cli import HubUnreachableExit, _exit_for
    from tools import ToolError

    assert issubclass(TopologyError, ConfigError) and issubclass(ToolError, AgentBusError)
    assert isinstance(_exit_for(HubUnreachable("no hub at x")), HubUnreachableExit)
    mapped = _exit_for(TopologyError("t.toml: hub.endpont: unknown key"))
    assert isinstance(mapped, click.ClickException) and mapped.message == \
        "t.toml: hub.endpont: unknown key"
    try:
        raise ValueError("boom")
    except ValueError as exc:
        bug = _exit_for(exc)
    assert isinstance(bug, click.ClickException)
    assert bug.message.startswith("unexpected ValueError: boom (a bug in busctl")
    log = bug.message.split("the traceback is in ", 1)[1].rstrip(")")
    assert "raise ValueError(\"boom\")" in Path(log).read_text()
