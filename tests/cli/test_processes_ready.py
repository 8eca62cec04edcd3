"""`[[processes]]` readiness (issue 49, item 2): ready once started unless the entry asks for a
ready line or a port; a process that is not ready in time fails `busctl up` with an error that
names what it waited for; `busctl config show` documents the entry."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.cli.conftest import pid_alive, running_up
from tests.cli.test_newcomer import free_port
from tests.support import busctl

NO_MODEL = {"OPENAI_API_KEY": "", "OPENAI_BASE_URL": "", "ANTHROPIC_API_KEY": "",
            "ANTHROPIC_BASE_URL": ""}

# A program that never prints a ready line: it listens on argv[1] (if given) after a moment.
SERVER = """
import socket, sys, time
time.sleep(0.5)
if len(sys.argv) > 1:
    listener = socket.create_server(("127.0.0.1", int(sys.argv[1])))
time.sleep(600)
"""


def entry(name: str, *args: str, **keys: object) -> str:
    command = json.dumps([sys.executable, "server.py", *args])
    lines = [f"{k} = {json.dumps(v)}" for k, v in keys.items()]
    return "\n".join(["[[processes]]", f'name = "{name}"', f"command = {command}", *lines, ""])


def up_fails(cwd: Path, topology: str) -> str:
    (cwd / "team.toml").write_text(topology)
    result = subprocess.run(busctl("up", "-c", "team.toml", "--hub", "tcp://127.0.0.1:0"),
                            capture_output=True, text=True, timeout=90, cwd=cwd,
                            env={**os.environ, **NO_MODEL})
    assert result.returncode == 1, result.stdout + result.stderr
    return result.stderr


def test_ready_when_started_or_on_its_port(tmp_path: Path) -> None:
    (tmp_path / "server.py").write_text(SERVER)
    port = free_port()
    (tmp_path / "team.toml").write_text(entry("quiet") + entry("web", str(port), ready_port=port))
    with running_up(tmp_path, "-c", "team.toml", env=NO_MODEL) as topo:
        pids = topo.child_pids()
        assert {"quiet", "web"} <= set(pids) and pid_alive(pids["web"])
        ps = subprocess.run(busctl("ps", "--json"), capture_output=True, text=True, timeout=30,
                            cwd=tmp_path)
        states = {row["name"]: row["state"] for row in map(json.loads, ps.stdout.splitlines())}
        assert states["quiet"] == states["web"] == "ready", ps.stdout + ps.stderr


def test_not_ready_in_time_names_what_it_waited_for(tmp_path: Path) -> None:
    (tmp_path / "server.py").write_text(SERVER)
    err = up_fails(tmp_path, entry("silent", ready="line", ready_timeout=1.0))
    assert "`silent` did not become ready within 1s" in err, err
    assert 'a {"ready": ...} JSON line on its stdout (ready = "line"' in err, err
    port = free_port()
    err = up_fails(tmp_path, entry("closed", ready_port=port, ready_timeout=1.0))
    assert f"waited for a connection to 127.0.0.1:{port} to be accepted (ready_port)" in err, err


def test_config_show_documents_processes(tmp_path: Path) -> None:
    shown = subprocess.run(busctl("config", "show"), capture_output=True, text=True, timeout=30,
                           cwd=tmp_path)
    assert shown.returncode == 0
    for key in ("[[processes]]", "command = ", 'ready = "started"', "ready_port", "ready_timeout"):
        assert key in shown.stdout, key
