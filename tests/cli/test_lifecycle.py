"""The topology's lifecycle as a user lives it: whatever kills `busctl up`, nothing survives it;
`down` stops what a dead supervisor left; a busy port fails fast; logs, restart, scale and ps."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent_bus.bus.paths import default_state_dir, ipc_listening
from tests.cli.conftest import json_lines, pid_alive, start_up
from tests.support import Proc, busctl, wait_for

NO_MODEL = {"OPENAI_API_KEY": "", "OPENAI_BASE_URL": "", "ANTHROPIC_API_KEY": "",
            "ANTHROPIC_BASE_URL": ""}

# A topology process that ignores SIGTERM: only `down`'s SIGKILL stops it.
STUBBORN = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print('{"ready": "stubborn"}', flush=True)
time.sleep(600)
"""
TOPOLOGY = """
[[processes]]
name = "stubborn"
command = ["%s", "stubborn.py"]
"""


def cli(*args: str, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(busctl(*args), capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, **NO_MODEL})


def port_free(endpoint: str) -> bool:
    if endpoint.startswith("ipc://"):  # a local topology's hub (bus/paths.py): nothing listens
        return not ipc_listening(endpoint[len("ipc://"):])
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, int(port)))
        except OSError:
            return False
    return True


def children_of(proc: Proc) -> dict[str, int]:
    import re

    line = proc.wait_line(lambda s: s.startswith("processes"), 5)
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"(\S+)\[(\d+)\]", line)}


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM, signal.SIGINT, signal.SIGKILL],
                         ids=lambda s: signal.Signals(s).name)
def test_whatever_kills_up_its_children_and_port_go_with_it(tmp_path: Path, sig: int) -> None:
    proc, ready = start_up(tmp_path, env=NO_MODEL)
    pids = children_of(proc)
    try:
        assert {"hub", "gateway-1", "tools-1", "coordinator-1"} <= set(pids)
        os.kill(proc.pid, sig)  # the supervisor alone, as a closed terminal or `kill` would
        wait_for(lambda: not any(pid_alive(p) for p in [proc.pid, *pids.values()]), 5,
                 f"every process gone after {signal.Signals(sig).name}")
        assert port_free(ready["endpoint"]) and port_free(ready["events"])
        if sig != signal.SIGKILL:
            assert any("stopped." in line for line in proc.lines), proc.output()
    finally:
        proc.stop()
        kill_all(list(pids.values()))


def test_down_after_a_killed_detached_supervisor_stops_what_is_left(tmp_path: Path) -> None:
    (tmp_path / "stubborn.py").write_text(STUBBORN)
    (tmp_path / "t.toml").write_text(TOPOLOGY % sys.executable)
    up = cli("up", "-d", "-c", "t.toml", "--hub", "tcp://127.0.0.1:0", cwd=tmp_path)
    assert up.returncode == 0, up.stderr
    state = default_state_dir(tmp_path)
    supervisor = int((state / "up.pid").read_text())
    stubborn = next(int(p) for name, p in _run_children(tmp_path) if name == "stubborn")
    try:
        os.kill(supervisor, signal.SIGKILL)
        wait_for(lambda: not pid_alive(supervisor), 5, "the supervisor to die")
        # The others die with their supervisor; the stubborn one ignores the SIGTERM it gets.
        start = time.monotonic()
        down = cli("down", "-c", "t.toml", "--timeout", "1", cwd=tmp_path)
        took = time.monotonic() - start
        assert down.returncode == 0, down.stderr
        assert "was already gone" in down.stdout and "stubborn" in down.stdout, down.stdout
        assert not pid_alive(stubborn)
        assert took < 8, took  # 1 s of --timeout, then SIGKILL
        assert not any((state / name).exists() for name in ("up.pid", "up.json", "up.ready",
                                                          "control.sock"))
        again = cli("down", "-c", "t.toml", cwd=tmp_path)
        assert again.returncode == 1 and "nothing is up here" in again.stderr
    finally:
        kill_all([supervisor, stubborn])


def _run_children(cwd: Path) -> list[tuple[str, int]]:
    ps = cli("ps", "-c", "t.toml", "--json", cwd=cwd, timeout=20)
    assert ps.returncode == 0, ps.stderr
    return [(row["name"], row["pid"]) for row in json_lines(ps.stdout)]


def test_a_second_up_on_a_busy_port_fails_fast_and_touches_nothing(tmp_path: Path) -> None:
    first_dir, second_dir = tmp_path / "first", tmp_path / "second"
    first_dir.mkdir()
    second_dir.mkdir()
    proc, ready = start_up(first_dir, env=NO_MODEL)
    try:
        logs = default_state_dir(first_dir) / "logs"
        before = {p.name: p.stat().st_size for p in logs.iterdir()}
        # Baseline, measured now on this (maybe busy) machine: busctl's start and the topology
        # file's check, which the refusal needs too; the check of the address itself is a bind.
        start = time.monotonic()
        assert cli("config", "show", cwd=second_dir).returncode == 0
        baseline = time.monotonic() - start
        for cwd, expect in ((second_dir, f"by the topology started from {first_dir}"),
                            (first_dir, "already up from this directory")):
            start = time.monotonic()
            second = cli("up", "--hub", ready["endpoint"], cwd=cwd)
            took = time.monotonic() - start
            assert second.returncode == 1, second.stdout + second.stderr
            assert expect in second.stderr, second.stderr
            assert took < baseline + 1.0, (took, baseline)  # the bound: under a second
        assert "--hub" in second.stderr or "busctl down" in second.stderr
        assert {p.name: p.stat().st_size for p in logs.iterdir()} == before
        assert not (default_state_dir(second_dir) / "logs").exists()
    finally:
        proc.stop()


def test_logs_restart_scale_and_ps(tmp_path: Path) -> None:
    proc, ready = start_up(tmp_path, env=NO_MODEL)
    pids = children_of(proc)
    follow = Proc(busctl("logs", "-f", "--tail", "0", "tools-1"), cwd=tmp_path,
                  env={**NO_MODEL})
    try:
        old = pids["tools-1"]
        restart = cli("restart", "tools-1", cwd=tmp_path)
        assert restart.returncode == 0 and "restarted tools-1" in restart.stdout, restart.stderr
        assert not pid_alive(old)
        # the new worker's ready line reaches `logs -f` as it is written, prefixed
        follow.wait_line(lambda s: "tools-1 |" in s and '"ready": "worker"' in s, 10)
        events = cli("watch", "--hub", ready["endpoint"], "--json", "--no-follow", "--since", "0",
                     "--type", "process_restarted", cwd=tmp_path)
        assert any(e.get("process") == "tools-1" for e in json_lines(events.stdout)), events

        def workers() -> list[str]:
            rows = json_lines(cli("ps", "--json", cwd=tmp_path).stdout)
            return [r["name"] for r in rows if r["role"] == "worker" and r["state"] == "ready"]

        assert cli("scale", "workers=3", cwd=tmp_path).returncode == 0
        assert workers() == ["tools-1", "tools-2", "tools-3"]
        assert cli("scale", "tools=1", cwd=tmp_path).returncode == 0
        assert workers() == ["tools-1"]

        table = cli("ps", cwd=tmp_path).stdout.splitlines()
        assert table[0].split() == ["NAME", "ROLE", "PID", "STATE", "UPTIME", "RESTARTS", "LAST",
                                    "EXIT", "SANDBOX"]
        row = next(line.split() for line in table if line.startswith("tools-1 "))
        assert row[5] == "1", table  # one restart, asked for

        unknown = cli("restart", "nosuch", cwd=tmp_path)
        assert unknown.returncode == 2 and "no process `nosuch`" in unknown.stderr
        assert "hub" in unknown.stderr  # lists what exists
    finally:
        follow.stop()
        proc.stop(timeout=8)
        kill_all(list(pids.values()))
    after = cli("logs", "--tail", "1", "hub", cwd=tmp_path)  # the topology is down: still works
    assert after.returncode == 0 and after.stdout.startswith("         hub | "), after
