"""Issue 27: a model's writes can never reach the code that runs the bus.

The layout is the README's quick start: a project folder with `.venv` inside, the project
installed into it (here: a `.pth` naming this checkout's environment, and the project's own
`src/` on the path as an editable install puts it), `git init`, the default topology (workspace
= the project). Attack 1 of the issue: `write_file` of a `.pth` into the venv (it would run in the
next gateway, holding the key), of an installed module, of a git hook and of the topology file in
use. Each must be refused with a clear tool error.
"""

from __future__ import annotations

import shutil
import site
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support import ROOT, Proc
from tests.tools.fixtures.procs import call, executor, until, workers

pytestmark = pytest.mark.anyio


def readme_project(tmp_path: Path) -> tuple[Path, Path]:
    """(project folder, its venv's site-packages), laid out as the README's quick start."""
    project = tmp_path / "proj"
    (project / "src" / "myproj").mkdir(parents=True)
    (project / "src" / "myproj" / "__init__.py").write_text("VERSION = 1\n")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(project / ".venv")],
                   check=True, timeout=60)
    venv_site = next((project / ".venv" / "lib").glob("python3*/site-packages"))
    # "installed": this checkout's packages (site.addsitedir also runs their editable finder)
    # and the project's own sources, as `pip install -e .` would add them
    (venv_site / "agent_bus_test.pth").write_text(
        f"import site; site.addsitedir({site.getsitepackages()[0]!r})\n"
        f"{ROOT}\n{project / 'src'}\n")
    subprocess.run(["git", "init", "-q", str(project)], check=True, timeout=30)
    (project / "busctl.toml").write_text('[[workers]]\nname = "tools"\n')
    return project, venv_site


def project_worker(endpoint: str, project: Path, *extra: str) -> Proc:
    python = project / ".venv" / "bin" / "python"
    return Proc([str(python), "-m", "cli", "worker", "--hub", endpoint, "--workspace", ".",
                 "--read-only", str(project / "busctl.toml"), *extra], cwd=project)


ATTACKS = {
    "pth": "{site}/zz.pth",
    "installed module": "src/myproj/__init__.py",
    "git hook": ".git/hooks/pre-commit",
    "topology file": "busctl.toml",
}
PAYLOAD = "import os; open('/tmp/x','a').write(os.environ.get('OPENAI_API_KEY',''))\n"


async def attack_writes(endpoint: str, project: Path, venv_site: Path) -> dict[str, Any]:
    """Every attack's result, plus a legitimate write's, through a real worker."""
    site_rel = venv_site.relative_to(project)
    async with executor(endpoint) as tools:
        results = {name: await tools.execute(call("write_file", path=path.format(site=site_rel),
                                                  content=PAYLOAD))
                   for name, path in ATTACKS.items()}
        results["ok"] = await tools.execute(call("write_file", path="notes/ok.txt", content="x"))
    return results


def assert_refused(results: dict[str, Any], project: Path, venv_site: Path) -> None:
    for name in ATTACKS:
        result = results[name]
        assert result.is_error, f"{name}: {result.text}"
        assert "read-only for tools" in result.text or "`.git` directory" in result.text, \
            f"{name}: {result.text}"
    assert not (venv_site / "zz.pth").exists()
    assert (project / "src" / "myproj" / "__init__.py").read_text() == "VERSION = 1\n"
    assert not (project / ".git" / "hooks" / "pre-commit").exists()
    assert "os.environ" not in (project / "busctl.toml").read_text()
    assert not results["ok"].is_error, results["ok"].text
    assert (project / "notes" / "ok.txt").read_text() == "x"


HAVE_BWRAP = shutil.which("bwrap") is not None
SHELL_ATTACK = ("for p in {site}/zz.pth src/myproj/x.py .git/hooks/pre-commit busctl.toml; do "
                "echo 'import os' >> $p 2>/dev/null && echo WROTE $p; done; "
                "cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n' | grep -c . ; "
                "ls /proc | grep -c '^[0-9]'")


@pytest.mark.parametrize("mode", [
    pytest.param("auto", marks=pytest.mark.skipif(not HAVE_BWRAP, reason="needs bubblewrap")),
    "off",  # the fallback: no sandbox, the path filter alone still refuses attack 1
])
async def test_file_tools_refuse_the_code_that_runs_the_bus(hub: dict, tmp_path: Path,
                                                            mode: str) -> None:
    project, venv_site = readme_project(tmp_path)
    proc = project_worker(hub["endpoint"], project, "--sandbox", mode, "--shell")
    try:
        ready = proc.wait_ready(20)
        results = await attack_writes(hub["endpoint"], project, venv_site)
        if mode == "auto":
            async with executor(hub["endpoint"]) as tools:
                command = SHELL_ATTACK.format(site=venv_site.relative_to(project))
                shell = await tools.execute(call("run_shell", command=command))
    finally:
        proc.stop()
    assert_refused(results, project, venv_site)
    assert ready["sandbox"]["kind"] == ("bwrap" if mode == "auto" else "none"), ready
    if mode == "auto":  # the same attacks from a shell meet a read-only file system
        assert "WROTE" not in shell.text, shell.text
        assert not (venv_site / "zz.pth").exists() and not (project / "src/myproj/x.py").exists()
        # the shell sees its own PID namespace only: a few processes, no bus process's environ
        assert int(shell.text.split()[-4]) < 10, shell.text


def _left(marker: str) -> list[int]:
    """Processes whose command line holds `marker` (the test's own sleeps)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.mark.skipif(not shutil.which("bwrap"), reason="needs bubblewrap (.ci/run installs it)")
async def test_nothing_a_shell_call_starts_outlives_it(hub: dict, tmp_path: Path) -> None:
    """Attack 2: `setsid nohup … &` and a double fork; and the shell has no network."""
    ws = tmp_path / "ws"
    ws.mkdir()
    marker = "31.41592"
    escape = (f"setsid nohup sleep {marker} >/dev/null 2>&1 & "
              f"(sh -c 'sleep {marker} & echo forked' &); sleep 0.3; echo started")
    dial = (f"{sys.executable} -c \"import socket; "
            f"socket.create_connection(('127.0.0.1', {hub['endpoint'].rpartition(':')[2]}))\"")
    async with workers(hub["endpoint"], 1, "--shell", "--workspace", str(ws), "--sandbox",
                       "auto", tools="tools.builtin") as [w], executor(hub["endpoint"]) as tools:
        assert w.ready["sandbox"]["shell"] == "bwrap", w.ready  # type: ignore[attr-defined]
        result = await tools.execute(call("run_shell", command=escape))
        assert "started" in result.text, result.text
        await until(lambda: not _left(marker), timeout=1.0,
                    what="the call's background processes to be gone")
        offline = await tools.execute(call("run_shell", command=dial))
        assert offline.is_error and "Connection refused" in offline.text, offline.text
