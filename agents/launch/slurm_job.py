"""`busctl submit`: the batch script that runs a topology (or an experiment on it) in a Slurm job.

The script is written into `<state>/slurm/jobs/` (0600) and given to `sbatch`. It holds paths,
options and names only: the models' keys, if the topology needs any, go into
`<state>/slurm/model-env.json` (0600), which the job's `up` reads into its memory for the gateway
(slurm_engine.load_model_env). The job gets the environment names `busctl up` passes to its own
children (`--export=NAME,…`: the values of this shell, never a secret) and Slurm's own.

For a topology the job is `busctl up --engine slurm` until it is cancelled or its time ends. For
an experiment spec it brings the topology up detached, runs `busctl experiment run` against it
(`--name E`, or `--resume E`: only the cells E has not finished), writes the report as JSON
beside the script, and stops the topology. The experiment's journal is the hub's event log in
the state folder: a job that is preempted, cancelled or out of time loses only the cells in
flight, which `busctl submit SPEC --resume E` (a new job) runs again.
"""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

import msgspec

from agent_bus.agents.launch.slurm_engine import (
    MODEL_ENV,
    PUBLISHED,
    SLURM_DIR,
    STATE_ENV,
    Published,
    SlurmError,
    SlurmUsage,
    job_state,
    run_tool,
)
from agent_bus.agents.launch.topology import Topology
from agent_bus.bus.paths import ensure_state_dir, write_private


class JobRequest(msgspec.Struct):
    topology: str  # absolute path of the topology file ("": the embedded default)
    cwd: str  # where the job runs (relative paths of the topology and the spec)
    nodes: int = 2
    spec: str = ""  # absolute path of an experiment spec ("": run the topology only)
    experiment: str = ""
    resume: bool = False
    time_limit: str = ""
    partition: str = ""
    job_name: str = "agent-bus"
    sbatch: list[str] = msgspec.field(default_factory=list)  # more `#SBATCH` options, as given


def exported_names(topo: Topology) -> list[str]:
    """What the job may see of this environment: what `busctl up` hands its children, Slurm's
    client settings, and the models' settings that are not secrets."""
    from agent_bus.agents.launch.supervisor import minimal_environ
    from agent_bus.agents.launch.up import model_env

    _, settings = model_env(topo)
    names = [*minimal_environ(["SLURM_CONF", STATE_ENV]), *settings]
    return sorted(set(names))


def script(request: JobRequest, topo: Topology, state: Path) -> str:
    """The batch script (bash): options first, then the commands; nothing secret."""
    jobs = state / SLURM_DIR / "jobs"
    options = [f"--job-name={request.job_name}", f"--nodes={request.nodes}",
               "--ntasks-per-node=1", f"--output={jobs}/%x-%j.out", f"--chdir={request.cwd}",
               f"--export={','.join(exported_names(topo))}",
               *([f"--time={request.time_limit}"] if request.time_limit else []),
               *([f"--partition={request.partition}"] if request.partition else []),
               *request.sbatch]
    lines = ["#!/bin/bash", *(f"#SBATCH {option}" for option in options),
             "# Written by `busctl submit` (agent-bus); keys are files in the state folder.",
             f"export {STATE_ENV}={shlex.quote(str(state))}",
             f"busctl() {{ {shlex.quote(sys.executable)} -P -m agent_bus.cli \"$@\"; }}"]
    config = ["-c", request.topology] if request.topology else []
    up = shlex.join(["busctl", "up", "--engine", "slurm", *config])
    if not request.spec:  # the topology, until scancel or the time limit
        return "\n".join([*lines, up, ""])
    run = ["busctl", "experiment", "run", "--engine", "slurm", request.spec,
           "--resume" if request.resume else "--name", request.experiment]
    report = shlex.join(["busctl", "experiment", "report", "--engine", "slurm",
                         request.experiment, "--json"])
    return "\n".join([
        *lines,
        f"{up} -d || exit 1",
        "code=0",
        f"{shlex.join(run)} || code=$?",
        f"{report} > {shlex.quote(str(jobs / (request.experiment + '.report.json')))}",
        shlex.join(["busctl", "down", "--engine", "slurm", *config]),
        "exit $code", ""])


def refuse_running(state: Path) -> None:
    """One job per state folder: its hub, event log and keys are the state folder's."""
    path = state / SLURM_DIR / PUBLISHED
    try:
        info = msgspec.json.decode(path.read_bytes(), type=Published)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return
    if job_state(info.job_id):
        raise SlurmUsage(f"Slurm job {info.job_id} still runs the topology of {state}: stop it "
                         "with `busctl down --engine slurm` (or wait for it), or give this "
                         "topology its own state folder ([hub] state_dir)")


def submit(request: JobRequest, topo: Topology) -> tuple[str, Path, Path]:
    """Write the script and the models' keys, `sbatch` it; (job id, script, output file)."""
    from agent_bus.agents.launch.up import model_env

    state = ensure_state_dir(topo.state_path())
    refuse_running(state)
    jobs = state / SLURM_DIR / "jobs"
    jobs.mkdir(mode=0o700, parents=True, exist_ok=True)
    secrets, _ = model_env(topo)
    write_private(state / SLURM_DIR / MODEL_ENV, msgspec.json.encode({"secrets": secrets}).decode())
    path = jobs / f"{request.experiment or request.job_name}-{time.strftime('%Y%m%d-%H%M%S')}.sbatch"
    write_private(path, script(request, topo, state))
    out = run_tool(["sbatch", "--parsable", str(path)]).strip()
    job_id = out.split(";")[0]
    if not job_id.isdigit():
        raise SlurmError(f"sbatch answered {out!r}, not a job id (script: {path})")
    return job_id, path, jobs / f"{request.job_name}-{job_id}.out"
