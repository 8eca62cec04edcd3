"""The console's hint leads where it says (issue 49, item 3): `busctl up` on another port than
7400, with an agent that is not `assistant`, prints a `try` line whose commands work as printed
from any folder; in the topology's own folder the commands find it without flags; after its
supervisor was SIGKILLed, `busctl ps` finds the topology there as `busctl down` does."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
from pathlib import Path

from tests.cli.conftest import pid_alive
from tests.cli.test_newcomer import free_port
from tests.support import Proc, busctl, wait_for

TOPOLOGY = """
[[agents]]
name = "solver"
tools = ["*"]
"""


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "BUSCTL_HUB"}  # nothing names the hub
    return subprocess.run(busctl(*args), capture_output=True, text=True, timeout=60, cwd=cwd,
                          env=env)


def test_the_hint_carries_its_flags_and_the_folder_finds_its_topology(tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "team.toml").write_text(TOPOLOGY)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    port = free_port()
    assert port != 7400
    env = {k: v for k, v in os.environ.items() if k != "BUSCTL_HUB"}
    up = Proc(busctl("up", "--json", "--demo", "-c", "team.toml", "--hub", str(port)),
              cwd=project, env=env)
    try:
        up.wait_ready(timeout=40)
        hint = up.wait_line(lambda s: s.startswith("try "), 5)
        commands = [shlex.split(c)[1:] for c in re.split(r"\s+·\s+", hint[4:].strip())]
        assert commands[0] == ["run", "--hub", str(port), "--agent", "solver", "hello"], hint
        assert commands[1:] == [["watch", "--hub", str(port)], ["status", "--hub", str(port)]]
        # as printed, from another folder: it reaches this topology and its agent
        run = cli(*commands[0], cwd=elsewhere)
        assert run.returncode == 0, run.stderr
        status = cli(*commands[2], cwd=elsewhere)
        assert status.returncode == 0 and "solver" in status.stdout, status.stderr
        # in the topology's folder no flag is needed for the hub (the run file names it)
        here = cli("run", "--agent", "solver", "hello", cwd=project)
        assert here.returncode == 0, here.stderr
        assert cli("status", cwd=project).returncode == 0

        pids = {m.group(1): int(m.group(2)) for m in re.finditer(
            r"(\S+)\[(\d+)\]", up.wait_line(lambda s: s.startswith("processes"), 5))}
        os.kill(up.pid, signal.SIGKILL)  # the supervisor alone; its children follow it
        wait_for(lambda: not any(pid_alive(pid) for pid in pids.values()), 20,
                 "the children to die with their supervisor")
        ps = cli("ps", cwd=project)
        assert ps.returncode == 0, ps.stderr
        assert "is gone" in ps.stderr and "busctl down" in ps.stderr, ps.stderr
        assert "cannot reach" not in ps.stderr and "7400" not in ps.stderr
        rows = {line.split()[0]: line.split() for line in ps.stdout.splitlines()[1:]}
        assert {"hub", "gateway-1", "coordinator-1"} <= set(rows), ps.stdout
        assert all("gone" in row for row in rows.values()), ps.stdout
        down = cli("down", cwd=project)
        assert down.returncode == 0 and "nothing was running" in down.stdout, down
    finally:
        up.stop(timeout=8)
