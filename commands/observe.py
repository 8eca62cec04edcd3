"""Watch a running bus: status, watch, otel, ui."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import msgspec

from agent_bus.bus.client import connect
from agent_bus.bus.security import CurveClient
from agent_bus.commands.base import hub_options, run_async, use_color

if TYPE_CHECKING:  # loaded by `status` only
    from agent_bus.agents.client.status import AgentSummary, TopologyStatus
    from agent_bus.agents.gateway.wire import EngineStats, ModelStats
    from agent_bus.bus.protocol import PeerInfo, Status

# --- busctl status ------------------------------------------------------------------------


@click.command()
@hub_options
@click.option("--json", "as_json", is_flag=True, help="Print the raw status as one JSON object.")
def status(hub: str, curve: CurveClient | None, as_json: bool) -> None:
    """Show live peers, services (capacity and load), queues, counters and the event seq.

    \b
    Example:
      busctl status --json | jq '.services[].name'
    """

    from agent_bus.agents.client.status import topology_status

    async def fetch() -> TopologyStatus:
        async with connect(hub, name="busctl-status", role="cli", curve=curve) as peer:
            return await topology_status(peer)

    st = run_async(fetch)
    if as_json:
        click.echo(msgspec.json.encode(st.report).decode())
        return
    _print_hub(st.hub)
    for name, agent in st.agents.items():
        _print_agent(name, agent)
    for name, stats in st.gateways.items():
        _print_gateway(name, stats)
    if st.hub.counters:
        click.echo("counters: " + ", ".join(f"{k}={v}" for k, v in sorted(st.hub.counters.items())))
    for name, sub in st.subscribers.items():
        extra = "".join(f"  {k.replace('_', ' ')} {v}" for k, v in sorted(sub.extra.items()))
        click.echo(f"subscriber {name:<17} seq {sub.seq}  fell behind, refilled from the "
                   f"log {sub.refilled}  lost {sub.lost}{extra}")
    d = st.dropped
    click.echo(f"dropped events: {d.total} in total (slow subscribers {d.subscribers}, "
               f"oversized {d.oversize_events}, refused {d.events_refused})")


def _print_hub(st: Status) -> None:
    # with a leader lease (a hub pair on a replicated store): which one this is, and its term
    lease = f"  {st.role}, epoch {st.epoch}" if st.role else ""
    click.echo(f"hub {st.endpoint}  events {st.events}  seq {st.seq}  up {st.uptime:.0f}s{lease}")
    if st.log_error:  # the hub refuses every event until the log can be written again
        click.echo(f"EVENTS REFUSED: {st.log_error} (retried by itself; free space or fix "
                   f"the state directory {st.state_dir})")
    click.echo("peers:")
    meta = {s.name: s.meta for s in st.services}
    for peer in st.peers:
        services = ", ".join(f"{s.name} {s.load}/{s.capacity}" for s in peer.services)
        jail = _sandbox_of(peer, meta)
        click.echo(f"  {peer.name:<20} {peer.role or '-':<11} pid {peer.pid}"
                   f"@{peer.host}  {services}{f'  sandbox {jail}' if jail else ''}")
    click.echo("services:")
    for svc in st.services:
        click.echo(f"  {svc.name:<28} peers {svc.peers}  load {svc.load}/{svc.capacity}"
                   f"  queued {svc.queued}")


def _print_agent(name: str, agent: AgentSummary) -> None:
    click.echo(f"agent {name:<22} live {agent.live} (queued {agent.queued})  idle {agent.idle}  "
               f"stored {agent.stored}  on {', '.join(agent.coordinators)}")
    for info in agent.sessions:
        if info.state != "idle":
            click.echo(f"  {info.state:<8} run {info.run_id or '-'}  session "
                       f"{info.session}  messages {info.message_count}")


def _print_gateway(name: str, stats: EngineStats) -> None:
    for alias, model in stats.models.items():
        click.echo(f"gateway {name}: {alias} in flight {model.in_flight} queued "
                   f"{model.queued} requests {model.requests} tokens "
                   f"{model.usage.total} cost {_cost_text(model)} aborted {model.aborted}")
        # which model answers and how big its window is, and where each fact came from
        click.echo(f"  model {model.model or '?'} ({model.model_from or 'configured'}), "
                   f"context window {model.context_window or '?'} "
                   f"({model.context_window_from or 'configured'})")


def _sandbox_of(peer: PeerInfo, meta: dict[str, dict[str, Any]]) -> str | None:
    """A tool worker's sandbox (tools/sandbox.py), from its own registrations' metadata (a hub
    that predates per-peer metadata gives only the service's, the latest registration's)."""
    if peer.role != "worker":
        return None
    return next((found for s in peer.services
                 if (found := (s.meta or meta.get(s.name, {})).get("sandbox"))), None)


def _cost_text(model: ModelStats) -> str:
    """A model's cost so far, or "no price known" (a 0 would pretend); `price` says why."""
    if model.priced:
        return f"${model.usage.cost:.4f}"
    return f"unknown ({model.price or 'no price known'})"


# --- busctl watch -------------------------------------------------------------------------


@click.command()
@hub_options
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.option("--since", type=click.IntRange(0), default=None,
              help="Replay logged events after this seq first, then follow.")
@click.option("--last", type=click.IntRange(0), default=None,
              help="Replay the last N logged events first, then follow.")
@click.option("--no-follow", is_flag=True, help="Print what the log holds (from --since) and exit.")
@click.option("--type", "types", multiple=True, help="Only these event types (repeatable).")
@click.option("--agent", "agents", multiple=True, help="Only events of these agents (repeatable).")
@click.option("--run", "runs", multiple=True,
              help="Only events of these runs: an id or its prefix (the 8 characters watch "
                   "prints; repeatable).")
@click.option("--experiment", "experiments", multiple=True, metavar="E",
              help="Only events of these experiments (repeatable): a `busctl experiment` run's "
                   "name E covers its journal and all its cells (E.<variant>.r<N>, also those "
                   "started later), E.<variant> one variant's.")
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
      busctl watch --experiment arith-1 --type experiment_sample   # cells as they finish
    """
    from agent_bus.bus.watch import EVENT_TYPES, WatchFilter, unknown_types, watch_events

    if since is not None and last is not None:
        raise click.UsageError("--since and --last are alternatives; give one")
    unknown = unknown_types(set(types))
    if unknown:  # a typo would silently show nothing at all
        raise click.BadParameter(f"no event type {', '.join(unknown)}; the types are: "
                                 f"{', '.join(EVENT_TYPES)}", param_hint="--type")
    filt = WatchFilter(types=set(types), agents=set(agents), runs=set(runs),
                       experiments=set(experiments))
    try:
        run_async(watch_events, hub, curve, filt, since, last, not no_follow, as_json,
                  use_color())
    except KeyboardInterrupt:
        pass


# --- busctl otel --------------------------------------------------------------------------


@click.command()
@hub_options
@click.option("--endpoint", default=None,
              help="OTLP/HTTP traces URL [default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, "
                   "else $OTEL_EXPORTER_OTLP_ENDPOINT + /v1/traces, "
                   "else http://localhost:4318/v1/traces].")
@click.option("--header", "header_items", multiple=True, metavar="K=V",
              help="An HTTP header for the collector (repeatable), e.g. 'Authorization=Bearer X'.")
@click.option("--capture-content", is_flag=True,
              help="Also export prompts, replies, tool arguments and results "
                   "(off: they may be private).")
@click.option("--state-file", type=click.Path(dir_okay=False), default=None,
              help="Where the resume seq is kept [default: <state home>/otel/<hub hash>.json].")
@click.option("--since", type=click.IntRange(0), default=None,
              help="Start after this seq instead of the state file's resume point.")
@click.option("--max-spans", type=click.IntRange(1), default=10_000, show_default=True,
              help="Spans buffered while the collector is down; "
                   "older traces are dropped (counted).")
def otel(hub: str, curve: CurveClient | None, endpoint: str | None, header_items: tuple[str, ...],
         capture_content: bool, state_file: str | None, since: int | None, max_spans: int) -> None:
    """Export runs as OpenTelemetry GenAI spans over OTLP/HTTP (needs the `otel` extra).

    \b
    Examples:
      busctl otel                                   # to a collector on localhost:4318
      busctl otel --endpoint https://otel.example/v1/traces --header 'x-api-key=KEY'
    """
    import hashlib

    try:
        from agent_bus.bus import otel as bus_otel
    except ImportError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        headers = bus_otel.parse_headers(header_items)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--header") from None
    if not headers and os.environ.get("OTEL_EXPORTER_OTLP_HEADERS"):
        headers = bus_otel.parse_headers(os.environ["OTEL_EXPORTER_OTLP_HEADERS"].split(","))
    if state_file is None:
        from agent_bus.bus.paths import ensure_state_dir, state_home

        digest = hashlib.sha256(hub.encode()).hexdigest()[:12]
        state_file = str(ensure_state_dir(state_home() / "otel") / f"{digest}.json")
    if not Path(state_file).parent.is_dir():
        raise click.BadParameter(f"{state_file}: its folder does not exist (create it, or give "
                                 f"another file)", param_hint="--state-file")
    run_async(bus_otel.export_otel, hub, curve, endpoint or bus_otel.default_endpoint(), headers,
              capture_content, Path(state_file), since, max_spans)


# --- busctl ui ----------------------------------------------------------------------------


@click.command()
@hub_options
@click.option("--port", type=click.IntRange(0, 65535), default=7480, show_default=True,
              help="Port of the page (0: any free port; the URL is printed).")
@click.option("--bind", "host", default="127.0.0.1", show_default=True,
              help="Address to listen on (another than loopback: other machines too).")
@click.option("--token-file", envvar="BUSCTL_UI_TOKEN_FILE", default=None,
              type=click.Path(dir_okay=False, path_type=Path),
              help="A file (yours, mode 0600) holding the page's token (env BUSCTL_UI_TOKEN_FILE)"
                   " [default: a new token, in ui-PORT.token of your runtime folder].")
@click.option("--token", "old_token", default=None, hidden=True, expose_value=True)
@click.option("--open", "open_browser", is_flag=True,
              help="Also open the link in your browser ($BROWSER, else the system's default).")
@click.option("--since", type=click.IntRange(0), default=0, show_default=True,
              help="Show events after this seq (0: everything the hub's log holds).")
def ui(hub: str, curve: CurveClient | None, port: int, host: str, token_file: Path | None,
       old_token: str | None, open_browser: bool, since: int) -> None:
    """A live web view of the bus, for you only: open the link it prints.

    \b
    Every request needs the page's token; the printed link (`url`, a file:// page in your private
    runtime folder) gives it to your browser once, as a cookie. Other local users get 401.
    Examples:
      busctl ui                # then open the file:// link of the ready line
      busctl ui --open         # ... in your browser, by itself
      busctl ui --port 0       # any free port
      busctl ui --bind 0.0.0.0 # other machines too: http://HOST:7480/?token=TOKEN once,
                               # the token in the ready line's token_file
    """
    from agent_bus.agents.experiment.pages import ExperimentBook
    from agent_bus.bus.ui import serve_ui
    from agent_bus.bus.ui.access import read_token_file, tools_can_read

    refuse_token_outside_a_file(old_token)
    if token_file is not None and tools_can_read(token_file):
        click.echo(f"warning: --token-file {token_file}: a sandboxed tool can read it (the sandbox "
                   f"hides only your runtime and state folders): keep it in one of them", err=True)
    try:
        token = read_token_file(token_file) if token_file is not None else ""
        run_async(serve_ui, hub, curve, port, since, host, token, open_browser,
                  ExperimentBook())
    except KeyboardInterrupt:
        pass
    except OSError as exc:  # a ConfigError (the token file, the runtime folder) names its fix
        raise click.BadParameter(f"cannot listen on {host}:{port}: {exc.strerror} "
                                 f"(choose another --port, or 0 for any free one; or another "
                                 f"--bind)", param_hint="--port") from None


def refuse_token_outside_a_file(flag: str | None) -> None:
    """A token on the command line is in `ps` for every local user, one in the environment in
    every process started from there: both are refused, naming the file that replaces them."""
    fix = ("write it to a file only you can read (`chmod 600 FILE`) and give --token-file FILE "
           "(or BUSCTL_UI_TOKEN_FILE=FILE); or give neither, and open the link busctl ui prints")
    if flag is not None:
        raise click.BadParameter(f"a token on the command line is shown by `ps` to every local "
                                 f"user: {fix}", param_hint="--token")
    if os.environ.get("BUSCTL_UI_TOKEN"):
        raise click.UsageError(f"BUSCTL_UI_TOKEN is no longer read (a token in the environment "
                               f"reaches every process started from it): unset it, {fix}")
