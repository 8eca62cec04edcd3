"""`busctl submit` and `busctl up --engine slurm` on a real two-node Slurm (tests/slurm/conftest.py):
the example experiment across both nodes, compared cell by cell with the same spec run locally;
`scancel` mid-experiment, then `--resume` in a new job; nothing left on any node afterwards."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.slurm.conftest import SlurmCluster, carrying
from tests.support import busctl, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(240)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "experiment"
CELLS = 120  # 20 samples x 2 variants x 3 repeats


def _project(root: Path, name: str, *, hub: str, delay: float, slurm: bool) -> Path:
    """The example experiment in a folder of its own (its own state folder): the scripted
    model slowed by `delay` seconds a reply, on a free port; on Slurm a tool-worker group
    pinned to the second node."""
    folder = root / name
    folder.mkdir()
    for file in ("spec.toml", "samples.jsonl"):
        shutil.copy(EXAMPLE / file, folder / file)
    script = json.loads((EXAMPLE / "fake_model.json").read_text())
    for rule in script["rules"]:
        rule["delay"] = delay
    (folder / "fake_model.json").write_text(json.dumps(script))
    port = _free_port()
    text = (EXAMPLE / "topology.toml").read_text()
    text = text.replace('endpoint = "tcp://127.0.0.1:7400"', f'endpoint = "{hub}"')
    text = text.replace("7483", str(port)).replace("examples/experiment/fake_model.json",
                                                   "fake_model.json")
    if slurm:
        text = text.replace("workers = []", "")
        text += '\n[[workers]]\nname = "tools"\ncount = 1\n\n[placement.tools]\nnode = "2"\n'
    (folder / "topology.toml").write_text(text)
    return folder


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _busctl(cluster: SlurmCluster, folder: Path, *args: str, timeout: float = 60,
            check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(busctl(*args), cwd=folder, env=cluster.env(
        BUSCTL_STATE_HOME=str(_state_home(folder))), capture_output=True, text=True,
        timeout=timeout, check=False)
    if check and done.returncode != 0:
        raise AssertionError(f"busctl {' '.join(args)} exited {done.returncode}:\n{done.stderr}")
    return done


def _state_home(folder: Path) -> Path:
    """Outside the project (a worker's workspace must not hold the bus's state)."""
    return folder.parent / f"{folder.name}.state"


def _submit(cluster: SlurmCluster, folder: Path, *args: str) -> str:
    out = _busctl(cluster, folder, "submit", "spec.toml", "-c", "topology.toml", "--json", *args)
    return str(json.loads(out.stdout)["job_id"])


def _ended(cluster: SlurmCluster, job: str) -> bool:
    """Slurm lists the job no more (a heterogeneous job is listed as J+0, J+1, …)."""
    return not any(j == job or j.startswith(f"{job}+") for j in cluster.jobs())


def _nothing_left(cluster: SlurmCluster) -> None:
    """No process of a topology on any node (every node is this machine): Slurm kills a job's
    processes within KillWait (5 s here) of its end."""
    try:
        wait_for(lambda: not cluster.processes("agent_bus"), 20, "no topology process left")
    except TimeoutError:
        assert cluster.processes("agent_bus") == []


def _cells(folder: Path, experiment: str) -> dict[tuple[str, str, int], tuple[str, float]]:
    rows = [json.loads(line) for line in (folder / "results" / f"{experiment}.jsonl")
            .read_text().splitlines()]
    cells = {(r["variant"], r["sample"], r["repeat"]): (r["answer"], r["score"]) for r in rows}
    assert len(cells) == len(rows), "a cell appears more than once in the results"
    return cells


def _scores(report: dict[str, Any]) -> dict[str, Any]:
    """What a report says of the outcome (not of wall time)."""
    return {v["name"]: {k: v[k] for k in ("n", "score", "scores", "errors", "tokens", "failed")}
            for v in report["variants"]}


@pytest.fixture(scope="module")
def local_run(tmp_path_factory: pytest.TempPathFactory,
              slurm: SlurmCluster) -> tuple[Path, dict[str, Any]]:
    """The example experiment run by the local engine: what the Slurm runs must equal."""
    folder = _project(tmp_path_factory.mktemp("local"), "local", hub="tcp://127.0.0.1:0",
                      delay=0.0, slurm=False)
    _busctl(slurm, folder, "up", "-c", "topology.toml", "-d")
    try:
        _busctl(slurm, folder, "experiment", "run", "spec.toml", "--name", "here", timeout=120)
        report = json.loads(_busctl(slurm, folder, "experiment", "report", "here",
                                    "--json").stdout)
    finally:
        _busctl(slurm, folder, "down", "-c", "topology.toml", check=False)
    return folder, report


def test_submit_runs_the_experiment_across_both_nodes_as_locally(
        slurm: SlurmCluster, tmp_path: Path, local_run: tuple[Path, dict[str, Any]]) -> None:
    folder = _project(tmp_path, "hpc", hub="tcp://0.0.0.0:0", delay=0.1, slurm=True)
    started = time.monotonic()
    job = _submit(slurm, folder, "--name", "hpc")

    def placed() -> dict[str, str]:
        done = _busctl(slurm, folder, "ps", "--engine", "slurm", "--json", check=False)
        rows = [json.loads(line) for line in done.stdout.splitlines()] if done.returncode == 0 \
            else []
        return {row["name"]: row["node"] for row in rows if row["state"] in ("ready", "-")}

    nodes = wait_for(lambda: len(placed()) >= 5 and placed(), 60, "the job's topology in ps")
    assert nodes["hub"] == "n1" and nodes["tools-1"] == "n2", nodes  # on different nodes
    wait_for(lambda: _ended(slurm, job), 120, f"job {job} to finish the experiment")
    assert _cells(folder, "hpc") == _cells(local_run[0], "here")
    report = json.loads(next(_state_home(folder).glob("*/slurm/jobs/hpc.report.json")).read_text())
    assert _scores(report) == _scores(local_run[1])
    _nothing_left(slurm)  # the job's end left nothing on any node
    print(f"submit → report across 2 nodes: {time.monotonic() - started:.1f}s")


def test_scancel_mid_experiment_then_resume_runs_each_cell_once(
        slurm: SlurmCluster, tmp_path: Path, local_run: tuple[Path, dict[str, Any]]) -> None:
    folder = _project(tmp_path, "preempted", hub="tcp://0.0.0.0:0", delay=0.4, slurm=True)
    job = _submit(slurm, folder, "--name", "cut")

    def done_cells() -> int:
        out = _busctl(slurm, folder, "experiment", "report", "cut", "--engine", "slurm",
                      "--json", check=False)
        return int(json.loads(out.stdout)["done"]) if out.returncode == 0 else 0

    wait_for(lambda: done_cells() >= 10, 90, "some cells of the first job finished")
    slurm.tool("scancel", job)
    wait_for(lambda: _ended(slurm, job), 60, f"job {job} to end after scancel")
    _nothing_left(slurm)
    assert not (folder / "results" / "cut.jsonl").exists()  # it was cut short
    second = _submit(slurm, folder, "--resume", "cut")
    wait_for(lambda: _ended(slurm, second), 150, f"job {second} to finish the rest")
    cells = _cells(folder, "cut")
    assert len(cells) == CELLS
    assert cells == _cells(local_run[0], "here")
    report = json.loads(next(_state_home(folder).glob("*/slurm/jobs/cut.report.json")).read_text())
    assert report["done"] == CELLS and not report["duplicates"]  # every cell exactly once
    assert _scores(report) == _scores(local_run[1])
    _nothing_left(slurm)


SECRET = "sk-slurm-test-never-shown-0123456789"


def test_down_from_the_login_node_cancels_the_job_and_no_secret_shows(
        slurm: SlurmCluster, tmp_path: Path) -> None:
    folder = _project(tmp_path, "svc", hub="tcp://0.0.0.0:0", delay=0.0, slurm=True)
    out = subprocess.run(busctl("submit", "topology.toml", "--json"), cwd=folder, text=True,
                         capture_output=True, timeout=60, check=True, env=slurm.env(
                             BUSCTL_STATE_HOME=str(_state_home(folder)), OPENAI_API_KEY=SECRET))
    job = str(json.loads(out.stdout)["job_id"])
    wait_for(lambda: _busctl(slurm, folder, "status", "--engine", "slurm",
                             check=False).returncode == 0, 60, "the topology's hub to answer")
    _no_secret_shown(slurm, folder, job)
    _restarts_in_place(slurm, folder)
    print(_busctl(slurm, folder, "down", "--engine", "slurm").stdout)
    assert _ended(slurm, job)
    _nothing_left(slurm)
    gone = _busctl(slurm, folder, "ps", "--engine", "slurm", check=False)
    assert gone.returncode == 1, gone.stdout
    assert "has ended" in gone.stderr or "no topology" in gone.stderr, gone.stderr


def _no_secret_shown(cluster: SlurmCluster, folder: Path, job: str) -> None:
    """The model's key went to the job by a 0600 file: not in the script, not in what Slurm
    shows of the job, not in any process's environment; the keys are 0600 in 0700 folders."""
    state = next(_state_home(folder).glob("*/slurm"))
    assert SECRET not in cluster.tool("scontrol", "show", "job", "-dd", job)
    for script in (state / "jobs").glob("*.sbatch"):
        assert SECRET not in script.read_text()
    assert cluster.processes()  # the job's processes are there to look at
    assert [p for p in carrying(f"OPENAI_API_KEY={SECRET}".encode())] == []
    assert (state / "model-env.json").stat().st_mode & 0o777 == 0o600
    for path in (state / "keys").rglob("*"):
        assert path.stat().st_mode & 0o777 == (0o700 if path.is_dir() else 0o600), path
    _another_user_reads_nothing(cluster, folder, state)


OTHER = ["setpriv", "--reuid", "12345", "--regid", "12345", "--clear-groups"]


def _another_user_reads_nothing(cluster: SlurmCluster, folder: Path, state: Path) -> None:
    """What a login node publishes (`hub.json`: the job, the hub's address, each process's node)
    and the keys beside it are the owner's alone: another user can read neither, and a `busctl`
    of theirs pointed at the same state folder is refused with the reason, holding no key."""
    published = state / "hub.json"
    assert published.stat().st_mode & 0o777 == 0o600
    if os.getuid() != 0 or not shutil.which("setpriv"):
        return  # (a second user needs root and setpriv; the modes above still hold)
    for path in (published, state / "model-env.json", *(state / "keys").rglob("*")):
        if path.is_file():
            read = subprocess.run([*OTHER, "cat", str(path)], capture_output=True, timeout=10)
            assert read.returncode != 0 and not read.stdout, path
    home = _state_home(folder)
    as_other = subprocess.run([*OTHER, *busctl("status", "--engine", "slurm")], cwd=folder,
                              env=cluster.env(BUSCTL_STATE_HOME=str(home), HOME="/"),
                              capture_output=True, text=True, timeout=60)
    assert as_other.returncode != 0, as_other.stdout
    assert "Traceback" not in as_other.stderr, as_other.stderr
    assert SECRET not in as_other.stdout + as_other.stderr
    assert "hub.json: cannot read it" in as_other.stderr, as_other.stderr  # (permission denied)


def _ps(cluster: SlurmCluster, folder: Path) -> dict[str, dict[str, Any]]:
    done = _busctl(cluster, folder, "ps", "--engine", "slurm", "--json", check=False)
    return {row["name"]: row for row in map(json.loads, done.stdout.splitlines())} \
        if done.returncode == 0 else {}


def _restarts_in_place(cluster: SlurmCluster, folder: Path) -> None:
    """The worker on n2 SIGKILLed: its step ends, and the supervisor starts a new one on n2."""
    before = _ps(cluster, folder)["tools-1"]
    assert before["node"] == "n2" and before["pid"]
    os.kill(before["pid"], signal.SIGKILL)

    def again() -> dict[str, Any] | None:
        row = _ps(cluster, folder).get("tools-1")
        return row if row and row["state"] == "ready" and row["pid"] != before["pid"] else None

    after = wait_for(again, 30, "tools-1 back after SIGKILL")
    assert after["node"] == "n2"
    restarted = wait_for(lambda: _ps(cluster, folder)["tools-1"]["restarts"] == 1, 10,
                         "the restart published for ps on the login node")
    assert restarted


def test_a_heterogeneous_jobs_component_takes_a_worker_group(slurm: SlurmCluster,
                                                             tmp_path: Path) -> None:
    """`#SBATCH hetjob`: the hub in component 0 (n1), the tool group pinned to component 1."""
    folder = _project(tmp_path, "het", hub="tcp://0.0.0.0:0", delay=0.0, slurm=True)
    topology = folder / "topology.toml"
    topology.write_text(topology.read_text().replace('node = "2"', 'node = "het:1"'))
    out = _busctl(slurm, folder, "submit", "topology.toml", "--nodes", "1", "--sbatch=hetjob",
                  "--sbatch=--nodes=1", "--json")
    job = str(json.loads(out.stdout)["job_id"])
    rows = wait_for(lambda: len(_ps(slurm, folder)) >= 5 and _ps(slurm, folder), 90,
                    "the heterogeneous job's topology in ps")
    assert rows["hub"]["node"] == "n1" and rows["tools-1"]["node"] == "n2", rows
    assert rows["tools-1"]["state"] == "ready"
    _busctl(slurm, folder, "down", "--engine", "slurm")
    assert _ended(slurm, job)
    _nothing_left(slurm)
