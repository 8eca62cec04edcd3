"""`busctl submit`: a topology, or an experiment on it, as a Slurm batch job (slurm_job.py)."""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Any

import click
import msgspec

from agent_bus.commands.base import ConfigExit, load_topology_or_exit


def _is_spec(path: str) -> bool:
    """An experiment spec has [dataset] and [[variants]]; a topology has neither."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise click.BadParameter(f"cannot read {path}: {exc.strerror}",
                                 param_hint="SPEC|TOPOLOGY") from None
    except tomllib.TOMLDecodeError as exc:
        raise click.BadParameter(f"{path} is not TOML: {exc}", param_hint="SPEC|TOPOLOGY") from None
    return "dataset" in data or "variants" in data


@click.command()
@click.argument("target", metavar="SPEC|TOPOLOGY", type=click.Path(dir_okay=False))
@click.option("--slurm", is_flag=True, default=True, help="Submit to Slurm (sbatch) [the "
              "default and, for now, the only scheduler].")
@click.option("-c", "--config", "config_file", type=click.Path(dir_okay=False), default=None,
              help="With a SPEC: the topology it runs on [default: the embedded default].")
@click.option("--name", default="", metavar="E", help="With a SPEC: the experiment's id "
              "[default: the spec's name plus -<12 random hex>].")
@click.option("--resume", default="", metavar="E", help="With a SPEC: run only the cells "
              "experiment E (an earlier job's, cut short) has not finished.")
@click.option("--nodes", "-N", type=click.IntRange(1, 4096), default=2, show_default=True,
              help="Nodes to allocate: the hub on the first, workers spread over the others.")
@click.option("--time", "time_limit", default="", metavar="T",
              help="The job's time limit (sbatch --time: MM, HH:MM:SS, D-HH) [default: the "
                   "partition's].")
@click.option("--partition", "-p", default="", help="The partition [default: the cluster's].")
@click.option("--sbatch", "sbatch_options", multiple=True, metavar="OPT",
              help="Another sbatch option, as `#SBATCH OPT` (e.g. --sbatch=--account=proj, "
                   "--sbatch=--gres=gpu:1; `hetjob` starts a heterogeneous job's next "
                   "component: --sbatch=hetjob --sbatch=--nodes=1). Repeatable.")
@click.option("--dry-run", is_flag=True, help="Print the batch script; submit nothing.")
@click.option("--json", "as_json", is_flag=True,
              help='One JSON line: {"job_id", "experiment", "script", "output"}.')
def submit(target: str, slurm: bool, config_file: str | None, name: str, resume: str,
           nodes: int, time_limit: str, partition: str, sbatch_options: tuple[str, ...],
           dry_run: bool, as_json: bool) -> None:
    """Submit a batch job that runs TOPOLOGY (`busctl up --engine slurm` until cancelled or out
    of time), or runs experiment SPEC on the -c topology; print the job id.

    While the job runs, `busctl ps|status|watch|experiment report --engine slurm` reach its hub
    from this folder (the login node): the job publishes it in the state folder, which must be
    on a filesystem the nodes share. Preempted, cancelled or out of time: `busctl submit SPEC
    --resume E` runs only the cells E has not finished.

    \b
    Examples:
      busctl submit team.toml --nodes 4 --time 2:00:00
      busctl submit examples/experiment/spec.toml -c examples/experiment/topology.toml
      busctl submit examples/experiment/spec.toml -c examples/experiment/topology.toml --resume arith-1
      busctl submit team.toml --sbatch=--account=myproj --sbatch=--gres=gpu:1 --dry-run
    """
    from agent_bus.agents.launch import slurm_job

    spec = _is_spec(target)
    request = slurm_job.JobRequest(topology="", cwd=os.getcwd(), nodes=nodes,
                                   time_limit=time_limit, partition=partition,
                                   sbatch=_checked_options(sbatch_options))
    topology_file = _experiment(request, target, config_file, name, resume) if spec \
        else _topology_only(target, config_file, name, resume)
    topo = load_topology_or_exit(topology_file)
    _check(topo, topology_file, nodes)
    request.topology = str(Path(topology_file).resolve()) if topology_file else ""
    if dry_run:
        click.echo(slurm_job.script(request, topo, topo.state_path()), nl=False)
        return
    job_id, script, output = _submit(request, topo)
    if as_json:
        click.echo(msgspec.json.encode({"job_id": job_id, "experiment": request.experiment,
                                        "script": str(script), "output": str(output)}).decode())
        return
    what = f"experiment {request.experiment}" if spec else "topology"
    click.echo(f"submitted Slurm job {job_id}: {what} on {nodes} nodes\n"
               f"  script  {script}\n  output  {output}\n"
               f"  then    busctl ps --engine slurm   ·   busctl down --engine slurm")


def _submit(request: Any, topo: Any) -> tuple[str, Path, Path]:
    """`sbatch` the job; no Slurm client here: exit 2 saying what to install."""
    from agent_bus.agents.launch import slurm_job
    from agent_bus.agents.launch.slurm_engine import SlurmUsage

    try:
        return slurm_job.submit(request, topo)
    except SlurmUsage as exc:
        raise ConfigExit(str(exc)) from None


def _experiment(request: Any, spec: str, config_file: str | None, name: str,
                resume: str) -> str | None:
    """Fill in the experiment of `request`; returns the topology file."""
    import uuid

    from agent_bus.agents.experiment.spec import NAME, SpecError, load_spec

    if name and resume:
        raise click.UsageError("--name starts an experiment, --resume finishes one: give one")
    try:
        loaded = load_spec(spec)
    except SpecError as exc:
        raise ConfigExit(str(exc)) from None
    experiment = resume or name or f"{loaded.spec.name}-{uuid.uuid4().hex[:12]}"
    if not re.fullmatch(NAME, experiment):
        raise click.BadParameter(f"{experiment!r}: letters, digits, _ or -",
                                 param_hint="--resume" if resume else "--name")
    request.spec, request.experiment = str(Path(spec).resolve()), experiment
    request.resume, request.job_name = bool(resume), f"bus-{experiment}"[:64]
    return config_file


def _topology_only(target: str, config_file: str | None, name: str, resume: str) -> str:
    for flag, value in (("-c", config_file), ("--name", name), ("--resume", resume)):
        if value:
            raise click.UsageError(f"{flag} goes with an experiment SPEC; {target} is a topology "
                                   "(its own file is the topology)")
    return target


def _check(topo: Any, topology_file: str | None, nodes: int) -> None:
    """The topology as the job will run it: valid, and its nodes named by position within
    --nodes (a node named by its name is checked by the job, which knows the names)."""
    from agent_bus.agents.launch.topology import check_topology

    where = topology_file or "embedded default"
    problems = check_topology(topo)
    if problems:
        raise ConfigExit(f"{where}: {problems[0]}")
    for key, entry in topo.placement.items():
        if entry.node.isdigit() and not 1 <= int(entry.node) <= nodes:
            raise ConfigExit(f"{where}: placement.{key}.node = {entry.node!r}: the job has "
                             f"--nodes {nodes}; give a position 1..{nodes}, or more --nodes")


def _checked_options(options: tuple[str, ...]) -> list[str]:
    """`--sbatch` values become `#SBATCH` lines: one option each, no line breaks."""
    for option in options:
        if option == "hetjob":  # the next component of a heterogeneous job
            continue
        if not option.startswith("-") or "\n" in option or "\r" in option:
            raise click.BadParameter(f"{option!r}: give one sbatch option, like "
                                     "--sbatch=--account=proj", param_hint="--sbatch")
    return list(options)
