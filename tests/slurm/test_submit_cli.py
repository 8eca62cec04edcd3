"""`busctl submit` and `--engine slurm` without a cluster: the batch script it writes (`--dry-run`)
and the errors that name what to fix. No Slurm needed: these run everywhere."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support import busctl

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "experiment"
SECRET = "sk-dry-run-never-in-a-script-42"


@pytest.fixture
def project(tmp_path: Path) -> Path:
    folder = tmp_path / "proj"
    folder.mkdir()
    for file in ("spec.toml", "samples.jsonl", "topology.toml", "fake_model.json"):
        shutil.copy(EXAMPLE / file, folder / file)
    return folder


def _run(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(BUSCTL_STATE_HOME=str(folder.parent / "state"), OPENAI_API_KEY=SECRET)
    return subprocess.run(busctl(*args), cwd=folder, env=env, capture_output=True, text=True,
                          timeout=60, check=False)


def test_the_script_runs_the_experiment_and_holds_no_secret(project: Path) -> None:
    done = _run(project, "submit", "spec.toml", "-c", "topology.toml", "--name", "arith-9",
                "--nodes", "3", "--time", "30", "--sbatch=--account=proj", "--dry-run")
    assert done.returncode == 0, done.stderr
    script = done.stdout
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    for option in ("--nodes=3", "--time=30", "--account=proj", "--job-name=bus-arith-9"):
        assert f"#SBATCH {option}" in lines, option
    export = next(line for line in lines if line.startswith("#SBATCH --export="))
    assert "=" not in export.split("--export=", 1)[1]  # names only: values stay in this shell
    assert "OPENAI_API_KEY" not in script and SECRET not in script
    assert any("experiment run --engine slurm" in line and "--name arith-9" in line
               for line in lines)
    assert any("busctl down --engine slurm" in line for line in lines)


def test_resume_runs_the_rest_of_an_experiment(project: Path) -> None:
    done = _run(project, "submit", "spec.toml", "-c", "topology.toml", "--resume", "arith-9",
                "--dry-run")
    assert done.returncode == 0, done.stderr
    assert "--resume arith-9" in done.stdout


def test_a_topology_runs_until_cancelled(project: Path) -> None:
    done = _run(project, "submit", "topology.toml", "--dry-run")
    assert done.returncode == 0, done.stderr
    assert done.stdout.rstrip().splitlines()[-1].endswith("up --engine slurm -c " +
                                                          str(project / "topology.toml"))


@pytest.mark.parametrize(("args", "names"), [
    (["submit", "spec.toml", "--sbatch=oops", "--dry-run"], "--sbatch"),
    (["submit", "topology.toml", "--name", "x", "--dry-run"], "--name"),
    (["submit", "spec.toml", "--name", "a", "--resume", "b", "--dry-run"], "--resume"),
    (["submit", "nosuch.toml"], "SPEC|TOPOLOGY"),
    (["up", "--engine", "slurm", "-c", "topology.toml"], "busctl submit"),
])
def test_usage_errors_exit_2_naming_the_fix(project: Path, args: list[str], names: str) -> None:
    done = _run(project, *args)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert names in done.stderr and "Traceback" not in done.stderr


def test_a_node_position_past_the_allocation_is_named(project: Path) -> None:
    with (project / "topology.toml").open("a") as f:
        f.write('\n[placement.gateways]\nnode = "3"\n')
    done = _run(project, "submit", "spec.toml", "-c", "topology.toml", "--dry-run")
    assert done.returncode == 2
    assert "placement.gateways.node" in done.stderr and "--nodes 2" in done.stderr


def test_nothing_published_exits_1_saying_how_to_start(project: Path) -> None:
    done = _run(project, "ps", "--engine", "slurm")
    assert done.returncode == 1
    assert "busctl submit" in done.stderr and "Traceback" not in done.stderr
