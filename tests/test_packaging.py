"""A new user's install: `pip install .` into a fresh venv gives a working `busctl`."""

from __future__ import annotations

import shutil
import subprocess
import sys
import venv
from pathlib import Path

from tests.support import ROOT


def _commands(help_text: str) -> set[str]:
    """The command names listed in a click group's `--help` (the "Commands:" section)."""
    section = help_text.split("\nCommands:\n", 1)[1]
    return {line.split()[0] for line in section.splitlines() if line.startswith("  ")}


def test_plain_install_into_a_fresh_venv(tmp_path: Path) -> None:
    """Build agent-bus's wheel from a copy of this checkout and install it into a fresh venv, with
    no package index: the dependencies come from the test environment (a .pth file)."""
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "tests", "__pycache__", "*.egg-info", "build", ".pytest_cache"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-index", "--no-deps",
                            "--no-build-isolation", "-w", str(tmp_path / "wheels"), str(source)],
                           capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert build.returncode == 0, build.stderr[-2000:]
    wheel = next((tmp_path / "wheels").glob("agent_bus-*.whl"))
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    purelib = subprocess.run([str(python), "-c", where], capture_output=True, text=True,
                             check=True).stdout.strip()
    deps = [p for p in sys.path if p.endswith("site-packages")]
    Path(purelib, "test-deps.pth").write_text("\n".join(deps) + "\n")
    install = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                              str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr[-2000:]
    busctl = env_dir / "bin" / "busctl"
    help_ = subprocess.run([str(busctl), "--help"], capture_output=True, text=True, timeout=30,
                           cwd=tmp_path)
    assert help_.returncode == 0, help_.stderr
    assert {"up", "run", "watch", "worker", "hub", "status", "down"} <= _commands(help_.stdout)
    # The installed package (not this checkout) carries the demo model's script.
    probe = "import agents.gateway.fakellm as f, agents; print(len(f.demo_script().rules), agents.__file__)"
    out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=30,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    count, location = out.stdout.split()
    assert int(count) >= 2 and str(env_dir) in location
