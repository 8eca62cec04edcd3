"""`pip install .` (the README's first command): one top-level package, `agent_bus`, that works
beside another distribution's `agents` (openai-agents), and a checkout left as it was."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.conftest import start_up
from tests.support import ROOT


def _pip(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """agent-bus installed from this checkout into a folder of its own (--target), with no
    package index: setuptools comes from the test environment."""
    tmp = tmp_path_factory.mktemp("install")
    leftovers = ("build", "agent_bus.egg-info")
    before = {name for name in leftovers if (ROOT / name).exists()}
    install = _pip("install", "-q", "--no-index", "--no-deps", "--no-build-isolation",
                   "--target", str(tmp / "site"), str(ROOT), cwd=tmp)
    assert install.returncode == 0, install.stderr[-2000:]
    # the build ran on a copy of the tree (build_backend.py): nothing left in the checkout
    assert {name for name in leftovers if (ROOT / name).exists()} == before
    return tmp / "site"


def test_the_wheel_installs_one_top_level_package(site: Path) -> None:
    top = {p.name for p in site.iterdir()} - {"bin"}
    assert {t for t in top if not t.endswith(".dist-info")} == {"agent_bus"}, top
    package = site / "agent_bus"
    for path in ("bus/hub.py", "agents/loop/run.py", "tools/builtin/__init__.py", "cli.py",
                 "__main__.py", "bus/ui/static/index.html", "agents/demo/fakellm_demo.json"):
        assert (package / path).is_file() and not (package / path).is_symlink(), path
    assert not (site / "build_backend.py").exists()  # a build tool, not installed


def _env(*paths: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, paths))}


def test_both_command_names_print_the_same_commands(site: Path, tmp_path: Path) -> None:
    helps = [subprocess.run([str(site / "bin" / name), "--help"], capture_output=True, text=True,
                            env=_env(site), cwd=tmp_path, timeout=60)
             for name in ("agent-bus", "busctl")]
    assert all(h.returncode == 0 for h in helps), [h.stderr for h in helps]
    commands = [h.stdout.split("Commands:")[1] for h in helps]
    assert commands[0] == commands[1] and "  up " in commands[0]


@pytest.fixture(scope="module")
def openai_agents(site: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real openai-agents from PyPI (import name `agents`), in a folder of its own that is put
    before ours on the path; skipped when the package index is not reachable."""
    tmp = tmp_path_factory.mktemp("openai-agents")
    got = _pip("install", "-q", "--no-deps", "--target", str(tmp), "openai-agents", cwd=tmp)
    if got.returncode != 0:
        pytest.skip(f"openai-agents could not be installed (no package index?): {got.stderr[-300:]}")
    assert (tmp / "agents" / "__init__.py").is_file()
    return tmp


def test_openai_agents_beside_us_breaks_nothing(site: Path, openai_agents: Path,
                                                tmp_path: Path) -> None:
    """Its `agents` package first on the path: our imports and a whole run still work."""
    env = _env(openai_agents, site)
    probe = ("import importlib.util, agent_bus; from agent_bus import connect, tool\n"
             "print(agent_bus.__file__); print(importlib.util.find_spec('agents').origin)")
    out = subprocess.run([sys.executable, "-P", "-c", probe], capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    ours, theirs = out.stdout.split()
    assert ours.startswith(str(site)) and theirs.startswith(str(openai_agents))
    proc, ready = start_up(tmp_path, "--demo", env={"PYTHONPATH": env["PYTHONPATH"]})
    try:
        answer = subprocess.run([str(site / "bin" / "agent-bus"), "run", "--hub", ready["endpoint"],
                                 "what is in this folder?"], capture_output=True, text=True,
                                env=env, cwd=tmp_path, timeout=60)
        assert answer.returncode == 0 and answer.stdout.strip(), answer.stderr[-2000:]
    finally:
        proc.stop(timeout=8)
