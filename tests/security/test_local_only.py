"""A local topology answers only its own user (issue #28 items 1, 6 and 7): `busctl up` on a
loopback tcp address listens on ipc:// sockets in a 0700 runtime folder, its tcp address leads
only its owner's clients there, its own processes have the roles it gave them, and its state
directory is 0700 with every file 0600.

The other user is a raw peer (tests/security/fixtures/forge_run.py: plain pyzmq, nothing of ours)
run as uid 12345 with `setpriv` (CI runs as root)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from agent_bus.bus.paths import default_state_dir, tcp_alias
from tests.support import Proc, busctl

FORGE = Path(__file__).parent / "fixtures" / "forge_run.py"
OTHER = ["setpriv", "--reuid", "12345", "--regid", "12345", "--clear-groups"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(busctl(*args), capture_output=True, text=True, timeout=60, cwd=cwd)


def forge(endpoint: str, *args: str) -> dict[str, str]:
    result = subprocess.run([sys.executable, str(FORGE), endpoint, *args],
                            capture_output=True, text=True, timeout=30, env={"PATH": "/usr/bin"})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def as_other_user(endpoint: str) -> dict[str, str]:
    result = subprocess.run([*OTHER, sys.executable, str(FORGE), endpoint, "--timeout", "3"],
                            capture_output=True, text=True, timeout=30, cwd="/")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(os.getuid() != 0 or not shutil.which("setpriv"),
                    reason="needs root and setpriv to run a peer as a second user")
def test_another_local_user_gets_no_answer_and_reads_nothing(tmp_path: Path) -> None:
    port = free_port()
    proc = Proc(busctl("up", "--demo", "--json", "--hub", f"tcp://127.0.0.1:{port}"), cwd=tmp_path)
    try:
        ready = proc.wait_ready(timeout=40)
        assert ready["endpoint"].startswith("ipc://"), ready
        # the owner reaches it by every form of the tcp address, with no flag
        for form in (f"tcp://127.0.0.1:{port}", f"localhost:{port}", str(port)):
            status = cli("status", "--json", "--hub", form, cwd=tmp_path)
            assert status.returncode == 0, (form, status.stderr)
        assert cli("run", "--hub", str(port), "hello", cwd=tmp_path).returncode == 0
        # the other user: nothing at the tcp address, and the ipc socket is out of reach
        assert as_other_user(f"tcp://127.0.0.1:{port}") == {"hello": "timeout"}
        assert as_other_user(ready["endpoint"]) == {"hello": "timeout"}
        # the same user's processes get the roles `busctl up` gave them: a raw peer without a
        # credential, or with the tool worker's, cannot serve `llm`/`agent.*` nor forge a run
        runtime = Path(ready["endpoint"][len("ipc://"):]).parent
        for credential in ("", str(runtime / "worker-tools.cred")):
            answers = forge(ready["endpoint"], "--serve", "llm", "--serve", "tool.x",
                            "--credential-file", credential)
            assert answers.pop("reg0") == "forbidden", (credential, answers)
            assert answers.pop("reg1") == ("ok" if credential else "forbidden"), answers
            assert set(answers.values()) == {"forbidden"}, (credential, answers)
        state = default_state_dir(tmp_path)
        loose = [str(p) for p in [state, *state.rglob("*")]
                 if stat.S_IMODE(p.lstat().st_mode) & 0o077]
        assert not loose, loose
        assert (state / "hub" / "events.db").exists() and list((state / "agents").iterdir())
    finally:
        proc.stop(timeout=10)
    # the alias is gone with the topology: the tcp address is plain again (whoever may take
    # the freed port next, e.g. another program on a busy machine)
    assert tcp_alias(port, live=False) == ""
    assert "ipc://" not in cli("status", "--hub", str(port), cwd=tmp_path).stderr
