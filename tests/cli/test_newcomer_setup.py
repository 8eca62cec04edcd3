"""A new user's setup (issue 49, item 7): a tool module written with last month's import says what
to import instead; the editable install leaves no egg-info in the checkout; the README's way to
subscribe to every event from Python works as printed."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.cli.conftest import Topology
from tests.support import ROOT, busctl

OLD = '''
from tools import tool

@tool
def hello() -> str:
    """Say hello."""
    return "hello"
'''


def test_last_months_import_says_what_to_import_instead(tmp_path: Path) -> None:
    (tmp_path / "old_tools.py").write_text(OLD)
    for spec in ("old_tools.py", "old_tools"):  # by path and by module name
        result = subprocess.run(busctl("worker", "--tools", spec, "--hub", "tcp://127.0.0.1:1",
                                       "--sandbox", "off"),
                                capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert result.returncode == 1, result.stdout + result.stderr
        assert "No module named 'tools'" in result.stderr, result.stderr
        assert "`from agent_bus import tool`" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr


def test_the_editable_build_leaves_no_egg_info(tmp_path: Path) -> None:
    """The backend's editable hooks, as pip calls them, in a copy of the checkout."""
    copy = tmp_path / "checkout"
    shutil.copytree(ROOT, copy, symlinks=True,
                    ignore=shutil.ignore_patterns(".*", "build", "dist", "*.egg-info",
                                                  "__pycache__", "tests"))
    hooks = ("import sys, build_backend as b\n"
             "meta_dir, wheel_dir = sys.argv[1:3]  # (setuptools rewrites sys.argv)\n"
             "meta = b.prepare_metadata_for_build_editable(meta_dir)\n"
             "print(b.build_editable(wheel_dir, None, meta_dir + '/' + meta))\n")
    (tmp_path / "meta").mkdir()
    (tmp_path / "wheel").mkdir()
    built = subprocess.run([sys.executable, "-c", hooks, str(tmp_path / "meta"),
                            str(tmp_path / "wheel")],
                           capture_output=True, text=True, timeout=300, cwd=copy)
    assert built.returncode == 0, built.stderr[-2000:]
    assert (tmp_path / "wheel" / built.stdout.split()[-1]).is_file()
    assert not list(copy.glob("*.egg-info")), sorted(p.name for p in copy.iterdir())


def test_the_readme_subscribes_to_every_event(up_default: Topology) -> None:
    readme = (ROOT / "README.md").read_text()
    snippet = next(block for block in re.findall(r"```python\n(.*?)```", readme, re.S)
                   if "bus.peer.subscribe(" in block)
    hub = up_default.endpoint
    ran = subprocess.run(busctl("run", "--hub", hub, "hello there"), capture_output=True,
                         text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr
    out = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "BUSCTL_HUB": hub})
    assert out.returncode == 0, out.stderr
    types = [line.split()[1] for line in out.stdout.splitlines()]
    assert types[-1] == "agent_end" and "agent_start" in types, out.stdout
    assert any(line.endswith(" assistant") for line in out.stdout.splitlines()), out.stdout
