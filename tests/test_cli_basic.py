"""busctl hub/status/watch driven as a user would: real subprocesses."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

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

    from agent_bus.agents.launch.topology import TopologyError
    from agent_bus.bus.errors import AgentBusError, ConfigError, HubUnreachable
    from agent_bus.commands.base import HubUnreachableExit, _exit_for
    from agent_bus.tools import ToolError

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


def test_a_closed_pipe_exits_quietly(hub: dict, tmp_path: Path) -> None:
    """Issue 31 item 3: `busctl status | head`, `busctl watch --json --since 0 | head`: a reader
    that closed the pipe is normal, not "a bug in busctl" (a real pipe, its reader closed)."""
    env = {**os.environ, "BUSCTL_STATE_HOME": str(tmp_path)}
    for args in (("status",), ("watch", "--json", "--since", "0")):  # buffered / flushed per line
        read, write = os.pipe()
        os.close(read)
        try:
            result = subprocess.run(busctl(*args, "--hub", hub["endpoint"]), stdout=write,
                                    stderr=subprocess.PIPE, text=True, timeout=20, env=env)
        finally:
            os.close(write)
        assert (result.returncode, result.stderr) == (1, ""), args
    assert not (tmp_path / "busctl-crash.log").exists()


def _bug(message: str) -> str:
    """The crash log's path as `_exit_for` names it for an unexpected error."""
    from agent_bus.commands.base import _exit_for

    try:
        raise ValueError(message)
    except ValueError as exc:
        bug = _exit_for(exc)
    return str(bug.message).split("the traceback is in ", 1)[1].rstrip(")")


def test_the_crash_log_is_the_users_own_0600_without_secrets(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 35 item 6: not a fixed name in the shared /tmp, 0600, no secrets from the command."""
    home = tmp_path / "state"
    monkeypatch.setenv("BUSCTL_STATE_HOME", str(home))
    monkeypatch.setattr(sys, "argv", [
        "busctl", "worker", "--mcp-url", "https://x.example/mcp",
        "--mcp-header", "Authorization=Bearer hunter2-secret-value",
        "--header=X-Api-Token=tok-0123456789abcdef", "--token", "ui-token-123456789",
        "--note", "sk-proj-abcdefghijklmnop1234"])
    log = Path(_bug("failed with hunter2-secret-value in it"))
    assert log == home / "busctl-crash.log" and not str(log).startswith(tempfile.gettempdir() + "/busctl")
    assert stat.S_IMODE(log.stat().st_mode) == 0o600 and stat.S_IMODE(home.stat().st_mode) == 0o700
    text = log.read_text()
    assert "--mcp-header Authorization=***" in text and "--header=X-Api-Token=***" in text
    assert "--token ***" in text and "raise ValueError(message)" in text
    for secret in ("hunter2-secret-value", "tok-0123456789abcdef", "ui-token-123456789",
                   "sk-proj-abcdefghijklmnop1234"):
        assert secret not in text, secret


def test_the_crash_log_never_follows_a_symlink(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "state"
    home.mkdir(mode=0o700)
    target = tmp_path / "victim"
    target.write_text("keep me\n")
    (home / "busctl-crash.log").symlink_to(target)
    monkeypatch.setenv("BUSCTL_STATE_HOME", str(home))
    assert _bug("boom") == "(no log: could not write one; run with -v"
    assert target.read_text() == "keep me\n"


def test_a_huge_count_on_the_command_line_exits_2_naming_the_option() -> None:
    """Issue 35 item 5: a number past the wire's ints was an OverflowError ("a bug", exit 1)."""
    huge = str(10**30)
    for args, option in ((("replay", "--experiment", "e", "--live-from", huge), "--live-from"),
                         (("run", "--max-turns", huge, "hi"), "--max-turns")):
        result = run(*args, "--hub", "tcp://127.0.0.1:1")
        assert result.returncode == 2, result.stderr
        assert f"Invalid value for '{option}'" in result.stderr and "2147483647" in result.stderr
