"""Issue 49 item 10: a sandboxed `busctl worker` started in the background outlives its shell.

`nohup busctl worker … &` from a shell that then exits: without a sandbox the worker goes on
serving; under bubblewrap it used to die with the shell (bwrap's `--die-with-parent` SIGKILLed
bwrap, and so the worker, when its parent, the shell, exited). Now `--die-with-parent` is only
given to a worker whose launcher asked for it (`busctl up`'s supervisor:
tests/cli/test_lifecycle.py checks a SIGKILLed supervisor still leaves no worker behind)."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT, wait_for
from tests.tools.fixtures.procs import alive, call, executor

pytestmark = [pytest.mark.anyio,
              pytest.mark.skipif(not shutil.which("bwrap"), reason="needs bubblewrap")]

# The shell a person types into: the worker in the background, its output to a file; the shell
# waits (at most 40 s) until the worker is ready, so it is still there when the worker enters
# bwrap, then exits.
LAUNCH = """
nohup {worker} > {out} 2>&1 &
echo $!
for _ in $(seq 400); do
  grep -q '^{{"ready"' {out} && exit 0
  sleep 0.1
done
exit 1
"""


def children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


async def test_a_sandboxed_worker_started_with_nohup_outlives_its_shell(
        hub: dict, tmp_path: Path) -> None:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    (workspace / "note.txt").write_text("still here\n")
    out = tmp_path / "worker.out"
    worker = shlex.join([sys.executable, "-m", "agent_bus.cli", "worker", "--hub",
                         hub["endpoint"], "--sandbox", "required", "--workspace", str(workspace)])
    shell = subprocess.run(["bash", "-c", LAUNCH.format(worker=worker, out=shlex.quote(str(out)))],
                           capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert shell.returncode == 0, (shell.stderr, out.read_text() if out.exists() else "")
    bwrap = int(shell.stdout.split()[0])  # the worker's pid: it became bwrap (exec keeps it)
    try:
        assert '"kind": "bwrap"' in out.read_text(), out.read_text()
        # the shell is gone; the worker still answers a call through the hub
        async with executor(hub["endpoint"]) as tools:
            result = await tools.execute(call("read_file", path="note.txt"))
            assert result.text == "still here\n", result.text
            assert "tool.read_file" in {s.name for s in (await tools.peer.status()).services}
        assert alive(bwrap), out.read_text()
        inside = children(bwrap)
        assert inside, "the worker inside bwrap"
        # and it still stops when told: a SIGTERM to the bwrap process (what `kill PID` does)
        # reaches the worker inside as a SIGTERM, which leaves cleanly
        os.kill(bwrap, signal.SIGTERM)
        wait_for(lambda: not alive(bwrap) and not any(alive(p) for p in inside), 20,
                 "the worker and its bwrap to stop")
    finally:
        for pid in [*children(bwrap), bwrap]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
