"""The supervised processes of a running topology: ps, restart, scale, logs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
import msgspec

from agent_bus.bus import protocol as p
from agent_bus.bus.client import connect
from agent_bus.bus.security import CurveClient
from agent_bus.commands.base import (
    UsageExit,
    engine_options,
    hub_and_engine_options,
    on_ray,
    on_slurm,
    ray_target,
    run_async,
    slurm_state,
    state_of,
    topology_option,
    use_color,
)


@click.command()
@hub_and_engine_options
@topology_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object per process per line.")
def ps(hub: str, curve: CurveClient | None, config_file: str | None, as_json: bool,
       engine: str | None, address: str | None, topology_name: str) -> None:
    """List the topology's processes: state, pid, uptime, restarts and last exit.

    The processes come from the supervisor of the topology started from this directory; with
    `--hub` on the command line (or none up here), from the peers connected to that hub.
    (`BUSCTL_HUB` alone does not switch: it names where to look when nothing is up here.)
    With `--engine ray` (or a `-c` file whose [engine] kind is "ray"): from the cluster, each
    process with the node it runs on.

    \b
    Examples:
      busctl ps
      busctl ps --hub tcp://10.0.0.5:7400 --json | jq .name
      busctl ps --engine ray
      busctl ps --engine slurm            # from the login node: each process's node
    """
    target = ray_target(config_file, engine, address, topology_name)
    if target is not None:
        _print_rows(on_ray("table", target.name, target.address), as_json)
        return
    slurm = slurm_state(config_file, engine)
    if slurm is not None:  # from the job's published file and its hub, from any node
        _print_rows(on_slurm("table", slurm), as_json)
        return
    _print_rows(_rows(hub, curve, config_file), as_json)


def _print_rows(rows: list[dict[str, Any]], as_json: bool) -> None:
    if not as_json:
        _print_table(rows)
        return
    for row in rows:
        click.echo(msgspec.json.encode(row).decode())


def _rows(hub: str, curve: CurveClient | None, config_file: str | None) -> list[dict[str, Any]]:
    from click.core import ParameterSource

    explicit = click.get_current_context().get_parameter_source("hub") == ParameterSource.COMMANDLINE
    rows = None if explicit else _supervisor_table(state_of(config_file))
    return _hub_table(hub, curve) if rows is None else rows


def _supervisor_table(state: Path) -> list[dict[str, Any]] | None:
    """The supervisor's table; None when no topology was started here (no run file). A run file
    whose supervisor is gone (SIGKILLed) or silent gives the processes it recorded."""
    from agent_bus.agents.launch.supervisor import (
        ChildFailed,
        ChildRecord,
        read_run_file,
        same_process,
    )
    from agent_bus.agents.launch.up import ControlRequest, control

    info = read_run_file(state / "up.json")
    if info is None:
        return None
    alive = same_process(ChildRecord(pid=info.pid, start_ticks=0))
    if alive:
        try:
            return run_async(control, state, ControlRequest(op="ps"), 10.0).processes
        except ChildFailed:
            pass
    click.echo(f"the supervisor of the topology started here (pid {info.pid}) "
               f"{'does not answer' if alive else 'is gone'}: its processes as it last recorded "
               f"them; `busctl down` stops what is left and removes its run files", err=True)
    return [{"name": name, "role": "-", "pid": rec.pid,
             "state": "running" if same_process(rec) else "gone", "uptime": 0, "restarts": "-",
             "last_exit": "-", "sandbox": "-"} for name, rec in info.children.items()]


def _hub_table(hub: str, curve: CurveClient | None) -> list[dict[str, Any]]:
    async def fetch() -> p.Status:
        async with connect(hub, name="busctl-ps", role="cli", curve=curve) as peer:
            return await peer.status()

    rows = []
    for peer in sorted(run_async(fetch).peers, key=lambda peer: peer.name):
        if peer.role == "cli":
            continue
        services = ", ".join(f"{s.name} {s.load}/{s.capacity}" for s in peer.services)
        rows.append({"name": peer.name, "role": peer.role or "-", "pid": peer.pid,
                     "host": peer.host, "services": services})
    return rows


def _print_table(rows: list[dict[str, Any]]) -> None:
    """Aligned columns under an upper-case header; uptime in a human unit."""
    if not rows:
        click.echo("no processes")
        return
    columns = list(rows[0])
    cells = [[_cell(key, row.get(key, "")) for key in columns] for row in rows]
    widths = [max(len(key), *(len(c[i]) for c in cells)) for i, key in enumerate(columns)]
    header = [key.replace("_", " ").upper() for key in columns]
    for line in [header, *cells]:
        click.echo("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip())


def _cell(key: str, value: Any) -> str:
    if key == "uptime":
        seconds = int(value)
        return "-" if not seconds else (f"{seconds}s" if seconds < 120 else f"{seconds // 60}m"
                                        if seconds < 7200 else f"{seconds // 3600}h")
    return str(value)


@click.command()
@topology_option
@engine_options
@click.argument("names", nargs=-1, required=True)
def restart(config_file: str | None, names: tuple[str, ...], engine: str | None,
            address: str | None, topology_name: str) -> None:
    """Restart processes of the running topology by name (through its supervisor).

    Each is stopped (SIGTERM, SIGKILL after a few seconds) and started again at once; the
    command returns once it is ready again, and a `process_restarted` event is published.

    \b
    Example:
      busctl restart tools-1 gateway-1
    """
    target = ray_target(config_file, engine, address, topology_name)
    for name in names:
        if target is not None:
            click.echo(on_ray("restart", target.name, target.address, name))
            continue
        from agent_bus.agents.launch.up import ControlRequest

        click.echo(_control(config_file, ControlRequest(op="restart", name=name)))


@click.command()
@topology_option
@engine_options
@click.argument("targets", nargs=-1, required=True)
def scale(config_file: str | None, targets: tuple[str, ...], engine: str | None,
          address: str | None, topology_name: str) -> None:
    """Set the number of processes of worker groups at run time: GROUP=N (`workers`: the first).

    \b
    Examples:
      busctl scale workers=3
      busctl scale tools=2 search=0
      busctl scale --engine ray workers=6     # across the cluster's nodes
    """
    from agent_bus.agents.launch.up import ControlRequest

    ray = ray_target(config_file, engine, address, topology_name)
    for target in targets:
        group, _, count = target.partition("=")
        if not group or not count.isdigit():
            raise click.BadParameter(f"{target!r} is not GROUP=N (e.g. workers=3)",
                                     param_hint="TARGETS")
        if ray is not None:
            click.echo(on_ray("scale", ray.name, ray.address, group, int(count)))
            continue
        click.echo(_control(config_file, ControlRequest(op="scale", name=group, count=int(count))))


def _control(config_file: str | None, request: Any) -> str:
    from agent_bus.agents.launch.up import control

    reply = run_async(control, state_of(config_file), request)
    if not reply.ok:  # a wrong name is the command line's fault (2), anything else failed (1)
        raise (UsageExit if reply.unknown else click.ClickException)(reply.error)
    return reply.message


@click.command()
@topology_option
@click.option("-f", "--follow", is_flag=True, help="Keep printing new output as it is written.")
@click.option("--tail", type=click.IntRange(0), default=None,
              help="Only the last N lines of each log first [default: all].")
@engine_options
@click.argument("names", nargs=-1)
def logs(config_file: str | None, follow: bool, tail: int | None, names: tuple[str, ...],
         engine: str | None, address: str | None, topology_name: str) -> None:
    """Print the output of the topology's processes (all, or NAMES), each line prefixed.

    Read from the log files in the state directory: works while the topology runs and after it
    stopped. `up` is the supervisor's own log of a `busctl up -d`.

    \b
    Examples:
      busctl logs --tail 20
      busctl logs -f gateway-1 tools-1
      busctl logs --engine ray -f --tail 20    # read on each process's node
    """
    target = ray_target(config_file, engine, address, topology_name)
    if target is not None:
        import sys

        prefix = click.style("{:>12} | ", fg="cyan") if use_color() else "{:>12} | "
        try:
            on_ray("logs", target.name, target.address, set(names), tail, follow, sys.stdout, prefix)
        except KeyboardInterrupt:
            pass
        return
    from agent_bus.agents.launch.supervisor import LogTail

    folder = state_of(config_file) / "logs"
    known = sorted(path.stem for path in folder.glob("*.log"))
    unknown = [n for n in names if n not in known]
    if unknown:
        raise click.BadParameter(f"no log for {', '.join(unknown)} in {folder} (logs: "
                                 f"{', '.join(known) or 'none yet'})", param_hint="NAMES")
    tailer = LogTail(folder, set(names), use_color())
    try:
        tailer.print_existing(tail)
        while follow:
            tailer.follow_once()
    except KeyboardInterrupt:
        pass
