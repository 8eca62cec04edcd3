"""busctl — start, attach to, drive and watch an agent-bus topology.

Every command that talks to a hub takes `--hub ADDR` (or `BUSCTL_HUB`). Bus errors become click
errors here and nowhere else: exit 2 when the hub cannot be reached or a flag is wrong, exit 1
when a request fails.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio
import click
import msgspec

from bus import protocol as p
from bus.client import DEFAULT_HUB, HUB_ENV, connect
from bus.errors import BusError, HubUnreachable
from bus.security import CurveClient, CurveServer, is_loopback_endpoint

T = TypeVar("T")


class HubUnreachableExit(click.ClickException):
    exit_code = 2


def run_async(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """Run a coroutine; map bus errors to CLI exits (the only place that does)."""
    try:
        return anyio.run(fn, *args)
    except HubUnreachable as exc:
        raise HubUnreachableExit(str(exc)) from None
    except BusError as exc:
        raise click.ClickException(str(exc)) from None


def use_color(stream: Any = None) -> bool:
    stream = stream or sys.stdout
    return stream.isatty() and not os.environ.get("NO_COLOR")


def curve_client(server_key: str | None, key: str | None) -> CurveClient | None:
    if not server_key and not key:
        return None
    if not (server_key and key):
        raise click.UsageError("--curve-server-key and --curve-key go together (CURVE needs both)")
    return CurveClient(server_public_key_file=server_key, secret_key_file=key)


def hub_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`--hub` plus the CURVE client keys, passed on as `hub` and `curve`."""

    @click.option("--hub", "hub", envvar=HUB_ENV, default=DEFAULT_HUB, show_default=True,
                  help=f"Hub address to connect to (env {HUB_ENV}).")
    @click.option("--curve-server-key", envvar="BUSCTL_CURVE_SERVER_KEY", default=None,
                  type=click.Path(exists=True, dir_okay=False),
                  help="The hub's public key file (`busctl keys generate`), for a CURVE hub.")
    @click.option("--curve-key", envvar="BUSCTL_CURVE_KEY", default=None,
                  type=click.Path(exists=True, dir_okay=False),
                  help="This client's secret key file, for a CURVE hub.")
    @functools.wraps(fn)
    def wrapper(*args: Any, curve_server_key: str | None, curve_key: str | None,
                **kwargs: Any) -> Any:
        return fn(*args, curve=curve_client(curve_server_key, curve_key), **kwargs)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("-v", "--verbose", is_flag=True, help="Log debug output to stderr.")
@click.version_option(package_name="agent-bus", prog_name="busctl")
def main(verbose: bool) -> None:
    """busctl — run and watch an agent-bus topology.

    \b
    Quick start:
      busctl up --demo            # whole topology, scripted model, no key needed
      busctl run "list the files" # in a second terminal
      busctl watch                # every event, live
    """
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


# --- busctl hub ---------------------------------------------------------------------------


@main.command()
@click.option("--hub", "endpoint", envvar=HUB_ENV, default=DEFAULT_HUB, show_default=True,
              help="Address to bind the request socket to (tcp://HOST:PORT or ipc://PATH).")
@click.option("--events", default="", help="Address for the event socket [default: port + 1].")
@click.option("--state-dir", type=click.Path(file_okay=False), default=".busctl/hub",
              show_default=True, help="Where the event log (events.db) lives.")
@click.option("--heartbeat-interval", type=click.FloatRange(0.05, 60), default=1.0,
              show_default=True, help="Seconds between heartbeats.")
@click.option("--liveness", type=click.IntRange(1, 100), default=3, show_default=True,
              help="Missed heartbeats before a peer is declared dead.")
@click.option("--max-message-bytes", type=click.IntRange(1024), default=16 * 1024 * 1024,
              show_default=True, help="Largest accepted message; larger ones are dropped.")
@click.option("--curve-secret", type=click.Path(exists=True, dir_okay=False), default=None,
              help="The hub's secret key file: turns on CURVE encryption.")
@click.option("--curve-authorized", type=click.Path(exists=True, file_okay=False), default=None,
              help="Directory of authorised client public keys (reloaded on change).")
@click.option("--insecure", is_flag=True,
              help="Allow a non-loopback bind without CURVE (anyone who reaches it is let in).")
def hub(endpoint: str, events: str, state_dir: str, heartbeat_interval: float, liveness: int,
        max_message_bytes: int, curve_secret: str | None, curve_authorized: str | None,
        insecure: bool) -> None:
    """Run the hub: request routing, liveness, and the event log and stream.

    \b
    Example:
      busctl hub --hub tcp://127.0.0.1:7400 --state-dir .busctl/hub
    """
    from bus.hub import HubConfig, serve

    curve = hub_curve(endpoint, curve_secret, curve_authorized, insecure)
    config = HubConfig(endpoint=endpoint, events=events, state_dir=state_dir,
                       heartbeat_interval=heartbeat_interval, liveness=liveness,
                       max_message_bytes=max_message_bytes, curve=curve)
    logging.getLogger().setLevel(logging.INFO)
    try:
        serve(config)
    except Exception as exc:  # a bind failure is the usual cause; say which address
        raise click.ClickException(f"hub failed to start on {endpoint}: {exc}") from None


def hub_curve(endpoint: str, secret: str | None, authorized: str | None,
              insecure: bool) -> CurveServer | None:
    if bool(secret) != bool(authorized):
        raise click.UsageError("--curve-secret and --curve-authorized go together")
    if secret and authorized:
        return CurveServer(secret_key_file=secret, authorized_dir=authorized)
    if not is_loopback_endpoint(endpoint):
        if not insecure:
            raise click.UsageError(
                f"refusing to bind {endpoint} without CURVE: other machines could connect. "
                "Make keys with `busctl keys generate DIR` and pass --curve-secret DIR/hub.key_secret "
                "--curve-authorized DIR/authorized, or pass --insecure on a trusted network."
            )
        click.secho(f"WARNING: hub on {endpoint} without CURVE: anyone who reaches it is let in.",
                    fg="red", err=True)
    return None


# --- busctl status ------------------------------------------------------------------------


@main.command()
@hub_options
@click.option("--json", "as_json", is_flag=True, help="Print the raw status as one JSON object.")
def status(hub: str, curve: CurveClient | None, as_json: bool) -> None:
    """Show live peers, services (capacity and load), queues, counters and the event seq.

    \b
    Example:
      busctl status --json | jq '.services[].name'
    """

    async def fetch() -> p.Status:
        async with connect(hub, name="busctl-status", role="cli", curve=curve) as peer:
            return await peer.status()

    st = run_async(fetch)
    if as_json:
        click.echo(msgspec.json.encode(st).decode())
        return
    click.echo(f"hub {st.endpoint}  events {st.events}  seq {st.seq}  up {st.uptime:.0f}s")
    click.echo("peers:")
    for peer in st.peers:
        services = ", ".join(f"{s.name} {s.load}/{s.capacity}" for s in peer.services)
        click.echo(f"  {peer.name:<20} {peer.peer}  pid {peer.pid}@{peer.host}  {services}")
    click.echo("services:")
    for svc in st.services:
        click.echo(f"  {svc.name:<28} peers {svc.peers}  load {svc.load}/{svc.capacity}  "
                   f"queued {svc.queued}")
    if st.counters:
        click.echo("counters: " + ", ".join(f"{k}={v}" for k, v in sorted(st.counters.items())))


# --- busctl watch -------------------------------------------------------------------------


@main.command()
@hub_options
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.option("--since", type=click.IntRange(0), default=None,
              help="Replay logged events after this seq first, then follow.")
@click.option("--last", type=click.IntRange(0), default=None,
              help="Replay the last N logged events first, then follow.")
@click.option("--no-follow", is_flag=True, help="Print what the log holds (from --since) and exit.")
@click.option("--type", "types", multiple=True, help="Only these event types (repeatable).")
@click.option("--agent", "agents", multiple=True, help="Only events of these agents (repeatable).")
@click.option("--run", "runs", multiple=True, help="Only events of these run ids (repeatable).")
@click.option("--experiment", "experiments", multiple=True,
              help="Only events of these experiments (repeatable).")
def watch(hub: str, curve: CurveClient | None, as_json: bool, since: int | None, last: int | None,
          no_follow: bool, types: tuple[str, ...], agents: tuple[str, ...], runs: tuple[str, ...],
          experiments: tuple[str, ...]) -> None:
    """Tail the event stream, with no hole and no duplicate.

    \b
    Examples:
      busctl watch                       # live, human-readable
      busctl watch --json --since 0      # everything in the log, then live
      busctl watch --agent assistant --type tool_execution_end
      busctl watch --no-follow --since 0 --json > events.jsonl
    """
    from bus.watch import WatchFilter, watch_events

    if since is not None and last is not None:
        raise click.UsageError("--since and --last are alternatives; give one")
    filt = WatchFilter(types=set(types), agents=set(agents), runs=set(runs),
                       experiments=set(experiments))
    try:
        run_async(watch_events, hub, curve, filt, since, last, not no_follow, as_json,
                  use_color())
    except KeyboardInterrupt:
        pass


# --- busctl worker ------------------------------------------------------------------------


@main.command()
@hub_options
@click.option("--tools", "tool_modules", multiple=True, default=("tools.builtin",),
              show_default=True, help="Dotted module or .py file with @tool functions (repeatable).")
@click.option("--concurrency", type=click.IntRange(1), default=8, show_default=True,
              help="Calls this worker runs at once.")
@click.option("--workspace", type=click.Path(file_okay=False), default=".", show_default=True,
              help="Root the file tools are confined to (and where run_shell runs).")
@click.option("--name", default="", help="Peer name shown in `busctl status` [default: worker-PID].")
@click.option("--shell", "allow_shell", is_flag=True, help="Enable the run_shell tool.")
def worker(hub: str, curve: CurveClient | None, tool_modules: tuple[str, ...], concurrency: int,
           workspace: str, name: str, allow_shell: bool) -> None:
    """Attach a tool worker: serve each tool as service `tool.<name>` until SIGINT/SIGTERM.

    \b
    Examples:
      busctl worker --tools mypkg.tools --concurrency 4
      busctl worker --hub tcp://10.0.0.5:7400 --tools ./my_tools.py --workspace /data
    """
    from tools import ToolLoadError
    from tools.worker import WorkerSettings, run_worker

    settings = WorkerSettings(hub=hub, tool_modules=list(tool_modules), concurrency=concurrency,
                              workspace=workspace, name=name or f"worker-{os.getpid()}",
                              allow_shell=allow_shell, curve=curve)
    try:
        run_async(run_worker, settings)
    except ToolLoadError as exc:
        raise click.ClickException(str(exc)) from None
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
