"""A topology's lifecycle: `busctl up` starts it (in the foreground or detached), `busctl down`
stops it."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import click

from agent_bus.bus.client import HUB_ENV
from agent_bus.bus.paths import HUB_FORMS
from agent_bus.bus.security import InsecureBindError, check_bind
from agent_bus.commands.base import (
    ConfigExit,
    engine_options,
    hub_address_option,
    load_topology_or_exit,
    on_ray,
    on_slurm,
    ray_target,
    slurm_state,
    state_of,
    topology_option,
    use_color,
)

if TYPE_CHECKING:  # agents.launch.up loads when `up` runs
    from agent_bus.agents.launch.up import UpOptions


@click.command()
@click.option("-c", "--config", "config_file", type=click.Path(dir_okay=False), default=None,
              help="Topology file (TOML) [default: the embedded default, see `busctl config show`].")
@click.option("--hub", "hub_addr", envvar=HUB_ENV, default=None, callback=hub_address_option,
              help=f"Hub address to bind, overriding the file: {HUB_FORMS} (env {HUB_ENV}).")
@click.option("--tools", "extra_tools", multiple=True,
              help="Extra tool module for the first worker group (repeatable).")
@click.option("--workers", type=click.IntRange(0), default=None,
              help="Number of processes in the first worker group.")
@click.option("--demo", is_flag=True,
              help="Point the gateway at the bundled scripted model (no key, no network).")
@click.option("--model-file", type=click.Path(dir_okay=False), default=None,
              help="A GGUF model file the gateway serves itself with llama.cpp (model alias "
                   "`local`, the default; needs `pip install 'agent-bus[local]'`).")
@click.option("-d", "--detach", is_flag=True, help="Run in the background; stop with `busctl down`.")
@click.option("--json", "as_json", is_flag=True,
              help="For scripts: stdout gets one JSON line once everything is ready "
                   '({"ready": "up", "endpoint": …, "events": …, "pid": …}); the console '
                   "output goes to stderr. Without it the same line is in <state>/up.ready.")
@click.option("--ready-file", default="", hidden=True)
@engine_options
def up(config_file: str | None, hub_addr: str | None, extra_tools: tuple[str, ...],
       workers: int | None, demo: bool, model_file: str | None, detach: bool, as_json: bool,
       ready_file: str, engine: str | None, address: str | None, topology_name: str) -> None:
    """Start a whole topology — hub, gateways, workers, coordinators — and supervise it.

    \b
    Examples:
      busctl up --demo                 # everything, on a scripted model: no key needed
      busctl up -c team.toml -d        # a topology file, in the background
      busctl up --tools ./my_tools.py --workers 4
      busctl up --model-file ./qwen2.5-0.5b-instruct-q4_k_m.gguf   # a local model, no server
      busctl up -d --json | jq -r .endpoint    # a script: the ready line, as JSON
      busctl up -c team.toml --engine ray --address 10.0.0.5:6379   # placed by a Ray cluster
      busctl up -c team.toml --engine slurm     # in an sbatch script: srun steps on its nodes
    Ctrl-C stops everything in order. With `--engine ray` (or `[engine] kind = "ray"`), `up`
    returns once everything is ready: the topology then belongs to the cluster (Ray restarts
    what a lost node took) until `busctl down --engine ray`.
    """
    from agent_bus.agents.launch.up import UpOptions
    from agent_bus.bus.procsec import make_undumpable

    make_undumpable()  # the keys are in this process's environment: no same-user process reads it
    topology = load_topology_or_exit(config_file)
    _scrub_secrets(topology)
    if demo and model_file:
        raise click.UsageError("--demo and --model-file each choose the model; give one")
    options = UpOptions(demo=demo, extra_tools=list(extra_tools), workers=workers, hub=hub_addr,
                        detach_ready_file=ready_file, model_file=model_file or "",
                        topology_file=config_file or "",
                        ready_json=as_json and not detach)
    if (engine or topology.engine.kind) == "ray":
        _up_on_ray(topology, options, config_file, address, topology_name, demo, as_json)
        return
    if (engine or topology.engine.kind) == "slurm":
        _up_on_slurm(topology, options, config_file, detach, as_json)
        return
    _check_before_start(topology, options, config_file)
    if detach:
        _detach(topology, options, as_json)
        return
    _run_in_foreground(topology, options, as_json)


def _up_on_ray(topology: Any, options: UpOptions, config_file: str | None, address: str | None,
               name: str, demo: bool, as_json: bool) -> None:
    from agent_bus.agents.launch.topology import check_topology
    from agent_bus.agents.launch.up import resolve

    if demo or options.model_file:
        raise click.UsageError("--demo and --model-file start a model beside the hub, which "
                               "--engine ray does not (yet): run `busctl fake-llm` or a model "
                               "server and name it in [models]")
    topo = resolve(topology, options)
    problems = check_topology(topo)
    if problems:
        raise ConfigExit(f"{config_file or 'embedded default'}: {problems[0]}")
    from agent_bus.agents.launch.ray_engine import topology_name

    console = sys.stderr if as_json else sys.stdout  # with --json, stdout is for scripts
    sys.exit(on_ray("up", topo, name or topology_name(topo, config_file),
                    address or topo.engine.address, console, sys.stdout if as_json else None))


def _up_on_slurm(topology: Any, options: UpOptions, config_file: str | None, detach: bool,
                 as_json: bool) -> None:
    """Inside a Slurm allocation: the local supervisor, each child an `srun` step on its node
    (agents/launch/slurm_engine.py). `-d` detaches as locally (the job's script goes on)."""
    from agent_bus.agents.launch.supervisor import ChildFailed
    from agent_bus.agents.launch.topology import check_topology
    from agent_bus.agents.launch.up import resolve

    problems = check_topology(resolve(topology, options))
    if problems:
        raise ConfigExit(f"{config_file or 'embedded default'}: {problems[0]}")
    if detach:
        _detach(topology, options, as_json)
        return
    console = sys.stderr if as_json else sys.stdout  # with --json, stdout is for scripts
    try:
        code = on_slurm("up", resolve(topology, options), options, console, use_color(console))
    except ChildFailed as exc:
        raise click.ClickException(str(exc)) from None
    sys.exit(code)


def _scrub_secrets(topology: Any) -> None:
    """The keys stay in this process's memory (os.environ); its environment block, which
    /proc/PID/environ shows, loses them: children get theirs from the supervisor's memory."""
    from agent_bus.agents.launch.supervisor import SECRET_NAME_RE, scrub_environ_block

    scrub_environ_block({n for n in os.environ if SECRET_NAME_RE.search(n)}
                        | {m.api_key_env for m in topology.models.values() if m.api_key_env})


def _check_before_start(topology: Any, options: UpOptions, config_file: str | None) -> None:
    """The topology as `up` would run it: valid, not open to the network without CURVE, and not
    in the way of another running topology."""
    from agent_bus.agents.launch.topology import check_topology
    from agent_bus.agents.launch.up import preflight, resolve

    problems = check_topology(resolve(topology, options))
    if problems:
        raise ConfigExit(f"{config_file or 'embedded default'}: {problems[0]}")
    _refuse_insecure_bind(resolve(topology, options))
    busy = preflight(resolve(topology, options))  # before any file of another topology is touched
    if busy:
        raise click.ClickException(busy)


def _run_in_foreground(topology: Any, options: UpOptions, as_json: bool) -> None:
    from agent_bus.agents.launch.supervisor import ChildFailed
    from agent_bus.agents.launch.up import up as run_up

    try:
        console = sys.stderr if as_json else sys.stdout  # with --json, stdout is for scripts
        code = anyio.run(run_up, topology, options, console, use_color(console))
    except ChildFailed as exc:
        raise click.ClickException(str(exc)) from None
    except KeyboardInterrupt:  # a Ctrl-C outside the stop sequence: children are stopped anyway
        code = 130
    sys.exit(code)


def _refuse_insecure_bind(topology: Any) -> None:
    hub_cfg = topology.hub
    try:
        check_bind({"hub.endpoint": hub_cfg.endpoint, "hub.events": hub_cfg.events},
                   curve=bool(hub_cfg.curve_secret), insecure=hub_cfg.insecure,
                   fix="set hub.curve_secret and hub.curve_authorized in the topology, or set "
                       "hub.insecure = true on a trusted network.")
    except InsecureBindError as exc:
        raise click.UsageError(str(exc)) from None


def _detach(topology: Any, options: Any, as_json: bool) -> None:
    import subprocess
    import time

    from agent_bus.agents.launch.up import pid_file, resolve, state_dir

    topo = resolve(topology, options)
    state = state_dir(topo)
    (state / "logs").mkdir(parents=True, exist_ok=True)
    pid_path = pid_file(topo)
    ready = state / "up.ready"
    ready.unlink(missing_ok=True)
    argv = [a for a in sys.argv[1:] if a not in ("-d", "--detach")]
    with open(state / "logs" / "up.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "agent_bus.cli", *argv, "--ready-file", str(ready)],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True,
                                env=dict(os.environ))  # the keys: the block lost them (above)
    pid_path.write_text(f"{proc.pid}\n")
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                proc.terminate()  # the children die with it (see bus.procsec)
            pid_path.unlink(missing_ok=True)
            raise click.ClickException(f"`busctl up` failed to start{_last_lines(state / 'logs' / 'up.log')}"
                                       f"\n(whole log: {state / 'logs' / 'up.log'})")
        time.sleep(0.05)
    if as_json:
        click.echo(ready.read_text().strip())
        return
    click.echo(f"up in the background (pid {proc.pid}); logs in {state / 'logs'}; "
               "stop with `busctl down`")


def _last_lines(path: Path, count: int = 5) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()[-count:]
    except OSError:
        return ""
    return "".join(f"\n  {line}" for line in lines)


@click.command()
@topology_option
@click.option("--timeout", type=click.FloatRange(0.1), default=10.0, show_default=True,
              help="Seconds to wait for an orderly stop before killing what is left.")
@engine_options
def down(config_file: str | None, timeout: float, engine: str | None, address: str | None,
         topology_name: str) -> None:
    """Stop the topology started from this directory (with `busctl up`, `-d` or not).

    Asks the supervisor to stop everything in order; if it is gone (or too slow), stops each
    process it started itself, SIGKILLs what is left after --timeout, and exits 1 naming any
    process it could not stop.

    \b
    Example:
      busctl up -d && busctl run "hi" && busctl down
    """
    target = ray_target(config_file, engine, address, topology_name)
    if target is not None:  # every actor, process and placement group of it, on every node
        click.echo(on_ray("down", target.name, target.address))
        return
    slurm = slurm_state(config_file, engine)
    if slurm is not None:  # inside the job: as locally; elsewhere: scancel
        click.echo(on_slurm("down", slurm, timeout))
        return
    from agent_bus.agents.launch.up import stop_topology

    state = state_of(config_file)
    report, failed = stop_topology(state, timeout)
    if failed:
        raise click.ClickException(f"{report}; could not stop: {', '.join(failed)}")
    click.echo(report)
