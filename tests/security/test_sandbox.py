"""Issue 27: a model's writes can never reach the code that runs the bus.

The layout is the README's quick start: a project folder with `.venv` inside, the project
installed into it (here: a `.pth` naming this checkout's environment, and the project's own
`src/` on the path as an editable install puts it), `git init`, the default topology (workspace
= the project). Attack 1 of the issue: `write_file` of a `.pth` into the venv (it would run in the
next gateway, holding the key), of an installed module, of a git hook and of the topology file in
use. Each must be refused with a clear tool error.
"""

from __future__ import annotations

import site
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support import ROOT, Proc
from tests.tools.fixtures.procs import call, executor

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


async def test_file_tools_refuse_the_code_that_runs_the_bus(hub: dict, tmp_path: Path) -> None:
    project, venv_site = readme_project(tmp_path)
    proc = project_worker(hub["endpoint"], project)
    try:
        proc.wait_ready(20)
        results = await attack_writes(hub["endpoint"], project, venv_site)
    finally:
        proc.stop()
    assert_refused(results, project, venv_site)
    # reading them stays possible (a model may look at an installed module's code)
    assert "VERSION" in (project / "src" / "myproj" / "__init__.py").read_text()
