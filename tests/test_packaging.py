"""A new user's install: `pip install .` into a fresh venv gives a working `busctl`, with no package
index (the wheel is built here, the dependencies come from the test environment)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

from tests.support import ROOT, running

# The fresh venv's commands see only what it installed (and the .pth of test dependencies), not a
# PYTHONPATH that could point at this checkout.
VENV_ENV = {**os.environ, "PYTHONPATH": ""}


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
                              str(wheel)], capture_output=True, text=True, timeout=300, env=VENV_ENV)
    assert install.returncode == 0, install.stderr[-2000:]
    busctl = env_dir / "bin" / "busctl"
    help_ = subprocess.run([str(busctl), "--help"], capture_output=True, text=True, timeout=30,
                           cwd=tmp_path, env=VENV_ENV)
    assert help_.returncode == 0, help_.stderr
    assert {"up", "run", "watch", "worker", "hub", "status", "down"} <= _commands(help_.stdout)
    # `agent-bus` is the command the README gives (`busctl` is also systemd's D-Bus tool); the
    # alias `busctl` is the same program.
    agent_bus = subprocess.run([str(env_dir / "bin" / "agent-bus"), "--help"], capture_output=True,
                               text=True, timeout=30, cwd=tmp_path, env=VENV_ENV)
    assert agent_bus.returncode == 0, agent_bus.stderr
    assert _commands(agent_bus.stdout) == _commands(help_.stdout)
    assert agent_bus.stdout.startswith("Usage: agent-bus "), agent_bus.stdout[:200]
    version = subprocess.run([str(busctl), "--version"], capture_output=True, text=True,
                             timeout=30, cwd=tmp_path, env=VENV_ENV)
    expected = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert version.stdout.split() == ["busctl,", "version", expected], version.stdout
    # The installed package (not this checkout) carries the demo model's script.
    probe = ("import agent_bus.agents as a, agent_bus.bus as b, agent_bus.tools as t\n"
             "print(a.__file__, b.__file__, t.__file__)")
    out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=30,
                         cwd=tmp_path, env=VENV_ENV)
    assert out.returncode == 0, out.stderr
    assert all(path.startswith(purelib) for path in out.stdout.split()), out.stdout
    # one top-level name: nothing generic that another distribution (openai-agents) also installs
    generic = ("import importlib.util\n"
               "print([n for n in ('agents', 'bus', 'tools', 'cli', 'commands') if importlib.util.find_spec(n)])")
    out = subprocess.run([str(python), "-c", generic], capture_output=True, text=True, timeout=30,
                         cwd=tmp_path, env=VENV_ENV)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
    _demo_runs(env_dir / "bin", tmp_path / "project")


def _demo_runs(bin_dir: Path, project: Path) -> None:
    """The README's first command, from the installed package: `busctl up --demo` gets ready and
    a run in the project folder lists it with the demo model's parallel tool calls."""
    project.mkdir()
    (project / "README.md").write_text("# a user's project\nTODO: something\n")
    (project / "only-here.txt").write_text("x")
    with running([str(bin_dir / "busctl"), "up", "--json", "--demo", "--hub", "tcp://127.0.0.1:0"],
                 cwd=project, env=VENV_ENV) as up:
        ready = up.wait_ready(timeout=60)
        run = subprocess.run([str(bin_dir / "busctl"), "run", "--hub", ready["endpoint"],
                              "what is in this folder?"], capture_output=True, text=True,
                             timeout=60, cwd=project, env=VENV_ENV)
        assert run.returncode == 0, run.stdout + run.stderr
        assert "only-here.txt" in run.stdout and "Summary:" in run.stdout, run.stdout
