"""busctl — start, attach to, drive and watch an agent-bus topology.

Every command that talks to a hub takes `--hub ADDR` (or `BUSCTL_HUB`). Bus errors become click
errors here and nowhere else: exit 2 when the hub cannot be reached or a flag is wrong, exit 1
when a request fails.
"""

# ruff: noqa: E402  (the SIGINT handler below must be in place before the slow imports)
from __future__ import annotations

import signal
import sys


def _exit_130(signum: int, frame: object) -> None:
    raise SystemExit(130)


# Ctrl-C while busctl is still loading (its imports take a second or more on a busy machine)
# exits 130 like a Ctrl-C later, not with a traceback. `BusctlGroup.main` puts Python's own
# handler back before any command runs: asyncio turns SIGINT into a clean cancel only when it
# finds that handler. An ignored SIGINT (a background job) stays ignored, and a program that
# only imports this module (a test, a script) keeps its own.
_RUN_AS_BUSCTL = __name__ == "__main__" or sys.argv[0].rpartition("/")[2] == "busctl"
if _RUN_AS_BUSCTL and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, _exit_130)

import functools
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio
import click
import msgspec

from agent_bus.bus import protocol as p
from agent_bus.bus.client import DEFAULT_HUB, HUB_ENV, connect
from agent_bus.bus.errors import AgentBusError, HubUnreachable
from agent_bus.bus.gcpolicy import tune_gc
from agent_bus.bus.paths import HUB_FORMS, parse_hub_address
from agent_bus.bus.security import CurveClient, CurveServer, InsecureBindError, check_bind

T = TypeVar("T")
# A turn count on the command line: the topology file's bound (agents/launch/topology.py,
# TurnBound); a bigger number does not fit the wire (msgpack) and ended in an OverflowError.
_COUNT = click.IntRange(min=1, max=2**31 - 1)


class HubUnreachableExit(click.ClickException):
    exit_code = 2


def run_async(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """Run a coroutine (errors are mapped to exits by `BusctlGroup`)."""
    return anyio.run(fn, *args)


class BusctlGroup(click.Group):
    """The one place where errors become exits: an `AgentBusError` is one line on stderr (exit 2
    when the hub cannot be reached, else 1), Ctrl-C exits 130, and anything unexpected is one
    line naming the log that holds its traceback — never a bare traceback, never a guess."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Commands whose module is imported only when the command is used (or listed by
        # --help): every process `busctl up` starts runs busctl, so each import here is paid
        # at every start (the fake model server's alone was a quarter of busctl's import time).
        self.lazy_commands: dict[str, Callable[[], click.Command]] = {}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *self.lazy_commands])

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        load = self.lazy_commands.pop(cmd_name, None)
        if load is not None:
            self.add_command(load(), cmd_name)
        return super().get_command(ctx, cmd_name)

    def main(self, *args: Any, **kwargs: Any) -> Any:
        if signal.getsignal(signal.SIGINT) is _exit_130:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            return super().main(*args, **kwargs)
        finally:
            _flush_or_hush()

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort,
                BrokenPipeError):  # a closed pipe: click exits 1 quietly (`busctl watch | head`)
            raise
        except KeyboardInterrupt:
            raise click.exceptions.Exit(130) from None
        except BaseExceptionGroup as group:  # raised inside a task group
            leaf = _first_leaf(group)
            if isinstance(leaf, BrokenPipeError):
                raise leaf from None
            raise _exit_for(leaf) from None
        except Exception as exc:
            raise _exit_for(exc) from None


def _flush_or_hush() -> None:
    """Output still buffered when the reader has gone (`busctl status | head`): exit 1 quietly,
    as click does for a closed pipe met earlier, not with Python's message at exit."""
    if sys.stdout is None:  # started with stdout closed
        return
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        # Python flushes once more at exit: let that go to /dev/null
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(1) from None


def _first_leaf(group: BaseExceptionGroup[Any]) -> BaseException:
    """The error a task group is reporting: its first agent-bus error, else its first leaf."""
    match, _ = group.split(AgentBusError)
    leaf: BaseException = match if match is not None else group
    while isinstance(leaf, BaseExceptionGroup):
        leaf = leaf.exceptions[0]
    return leaf


def _exit_for(exc: BaseException) -> click.exceptions.ClickException | click.exceptions.Exit:
    if isinstance(exc, KeyboardInterrupt):
        return click.exceptions.Exit(130)
    if isinstance(exc, HubUnreachable):
        return HubUnreachableExit(str(exc))
    if isinstance(exc, AgentBusError):
        return click.ClickException(str(exc))
    return click.ClickException(f"unexpected {type(exc).__name__}: {exc} (a bug in busctl; "
                                f"the traceback is in {_crash_log(exc)})")


CRASH_LOG = "busctl-crash.log"
#: Options whose values are secrets (`K=V` headers, tokens): never written to the crash log.
_SECRET_OPTIONS = ("--header", "--mcp-header", "--token")


def _crash_log(exc: BaseException) -> str:
    """Append the traceback of an unexpected error to the user's own crash log; return its path.

    The log is in the user's state folder (`bus.paths.state_home`, made 0700), not the shared
    temporary folder; created 0600 and opened without following a symlink (a link planted there
    is refused, not written through); secrets from the command line are redacted."""
    import traceback

    from agent_bus.bus.paths import state_home
    from agent_bus.bus.redact import Redactor

    shown, secrets = _redacted_argv(sys.argv[1:])
    redact = Redactor(secrets)
    text = redact(f"--- busctl {shown}\n") + redact("".join(traceback.format_exception(exc)))
    try:
        folder = state_home()
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = folder / CRASH_LOG
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        with os.fdopen(fd, "a") as log:
            os.fchmod(fd, 0o600)  # one made by an older busctl was 0644
            log.write(text)
    except OSError:
        return "(no log: could not write one; run with -v)"
    return str(path)


def _redacted_argv(argv: list[str]) -> tuple[str, list[str]]:
    """The command line with the values of `_SECRET_OPTIONS` masked (`K=***` for a header),
    and those values (for redacting them from the traceback too)."""
    from agent_bus.bus.redact import MARK

    shown: list[str] = []
    secrets: list[str] = []
    pending = False
    for arg in argv:
        name, eq, value = arg.partition("=")
        if pending or (eq and name in _SECRET_OPTIONS):
            value = arg if pending else value
            key, sep, secret = value.partition("=")
            secret = secret if sep else value
            secrets.append(secret)
            masked = f"{key}={MARK}" if sep else MARK
            shown.append(masked if pending else f"{name}={masked}")
            pending = False
            continue
        pending = arg in _SECRET_OPTIONS
        shown.append(arg)
    return " ".join(shown), secrets


def use_color(stream: Any = None) -> bool:
    from agent_bus.bus.render import color_wanted

    return color_wanted(stream or sys.stdout)


def curve_client(server_key: str | None, key: str | None) -> CurveClient | None:
    from agent_bus.bus.security import handed_keys

    try:  # a sandboxed worker's keys came in memory: its key files are masked in here
        handed = handed_keys()
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if handed is not None:
        return handed
    if not server_key and not key:
        return None
    if not (server_key and key):
        raise click.UsageError("--curve-server-key and --curve-key go together (CURVE needs both)")
    try:
        return CurveClient(server_public_key_file=server_key, secret_key_file=key)
    except ValueError as exc:  # e.g. the public `.key` given where the `.key_secret` belongs
        flag = "--curve-server-key" if "hub public key" in str(exc) else "--curve-key"
        raise click.BadParameter(str(exc), param_hint=flag) from None


def hub_address(value: str | None) -> str | None:
    """`--hub`/`BUSCTL_HUB` read by the one parser `connect()` uses too (bus.paths)."""
    try:
        return parse_hub_address(value) if value else value
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _hub_address_option(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    return hub_address(value)


def hub_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`--hub` plus the CURVE client keys, passed on as `hub` and `curve`."""

    @click.option("--hub", "hub", envvar=HUB_ENV, default=DEFAULT_HUB, show_default=True,
                  callback=_hub_address_option,
                  help=f"Hub address to connect to: {HUB_FORMS} (env {HUB_ENV}).")
    # not `exists=True`: in a worker's sandbox the files are hidden (its keys came in memory);
    # elsewhere a missing file is named by `curve_client`
    @click.option("--curve-server-key", envvar="BUSCTL_CURVE_SERVER_KEY", default=None,
                  type=click.Path(dir_okay=False),
                  help="The hub's public key file (`busctl keys generate`), for a CURVE hub.")
    @click.option("--curve-key", envvar="BUSCTL_CURVE_KEY", default=None,
                  type=click.Path(dir_okay=False),
                  help="This client's secret key file, for a CURVE hub.")
    @functools.wraps(fn)
    def wrapper(*args: Any, curve_server_key: str | None, curve_key: str | None,
                **kwargs: Any) -> Any:
        return fn(*args, curve=curve_client(curve_server_key, curve_key), **kwargs)

    return wrapper


def budget_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """One `--NAME` option per hub memory budget (bus.hub.BUDGETS), passed on as `budgets`."""
    from agent_bus.bus.hub import BUDGETS, HubConfig

    defaults = HubConfig()
    names = list(BUDGETS)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        budgets = {name: kwargs.pop(name) for name in names}
        return fn(*args, budgets=budgets, **kwargs)

    for name in reversed(names):
        wrapper = click.option(f"--{name.replace('_', '-')}", name, type=click.IntRange(0),
                               default=getattr(defaults, name), show_default=True,
                               help="Memory budget (docs/reliability.md, \"Memory budgets\")."
                               )(wrapper)
    return wrapper


@click.group(cls=BusctlGroup,
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("-v", "--verbose", is_flag=True, help="Log debug output to stderr.")
@click.version_option(package_name="agent-bus")
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


def _hub_command() -> click.Command:
    """`busctl hub`, built when used (or listed by --help): its budget options read
    bus.hub's defaults, and only the hub process needs that module."""

    @click.command(name="hub")
    @click.option("--hub", "endpoint", envvar=HUB_ENV, default=DEFAULT_HUB, show_default=True,
                  callback=_hub_address_option,
                  help=f"Address to bind the request socket to: {HUB_FORMS}.")
    @click.option("--events", default="", callback=_hub_address_option,
                  help="Address for the event socket [default: port + 1].")
    @click.option("--state-dir", type=click.Path(file_okay=False), default=None,
                  help="Where the event log (events.db) lives [default: <state home>/<project>/hub, "
                       "outside the current folder so no tool can reach it].")
    @click.option("--heartbeat-interval", type=click.FloatRange(0.05, 60), default=1.0,
                  show_default=True, help="Seconds between heartbeats.")
    @click.option("--liveness", type=click.IntRange(1, 100), default=3, show_default=True,
                  help="Missed heartbeats before a peer is declared dead.")
    @click.option("--max-message-bytes", type=click.IntRange(1024), default=16 * 1024 * 1024,
                  show_default=True, help="Largest accepted message; larger ones are dropped.")
    @budget_options
    @click.option("--retain-days", type=click.FloatRange(0), default=7.0, show_default=True,
                  help="Prune logged events older than this many days (0: keep them).")
    @click.option("--retain-bytes", type=click.IntRange(0), default=0, show_default=True,
                  help="Prune the oldest logged events while the log holds more (0: no bound).")
    @click.option("--retain-deltas-until-end", is_flag=True,
                  help="Drop a run's streamed deltas (`message_update`) from the log once its "
                       "`message_end` (which holds the whole message) is logged.")
    @click.option("--replay-priority", type=click.Choice(["idle", "low"]), default="idle",
                  show_default=True,
                  help="CPU priority of the log reader that serves replays: `idle` runs it only on "
                       "CPU nothing else wants (at nice 10 while the machine starves it), `low` at "
                       "nice 10 always (docs/reliability.md).")
    @click.option("--replay-pace-bytes", type=click.IntRange(0), default=4 * 1024 * 1024,
                  show_default=True,
                  help="Bytes a second of replay answers while requests are being routed, so a "
                       "replay of big events does not slow live requests; on an idle bus replays "
                       "go at full speed. 0: never paced (docs/reliability.md).")
    @click.option("--curve-secret", type=click.Path(exists=True, dir_okay=False), default=None,
                  help="The hub's secret key file: turns on CURVE encryption.")
    @click.option("--curve-authorized", type=click.Path(exists=True, file_okay=False), multiple=True,
                  help="Directory of authorised client public keys (reloaded on change); "
                       "repeatable, each with its own roles.toml (`busctl up` adds the keys it "
                       "makes for its own processes this way).")
    @click.option("--insecure", is_flag=True,
                  help="Allow a non-loopback bind without CURVE (anyone who reaches it is let in).")
    @click.option("--credentials", type=click.Path(exists=True, dir_okay=False), default=None,
                  help="Roles of credentials presented in hellos (JSON; `busctl up` writes it): "
                       "peers without a known one serve nothing (docs/protocol.md section 8).")
    @click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error", "critical"],
                                                   case_sensitive=False),
                  default="info", show_default=True, help="What the hub logs to stderr.")
    def hub(endpoint: str, events: str, state_dir: str | None, heartbeat_interval: float,
            liveness: int, max_message_bytes: int, budgets: dict[str, int],
            retain_days: float, retain_bytes: int, retain_deltas_until_end: bool,
            replay_priority: str, replay_pace_bytes: int, curve_secret: str | None,
            curve_authorized: tuple[str, ...], insecure: bool, credentials: str | None,
            log_level: str) -> None:
        """Run the hub: request routing, liveness, and the event log and stream.

        \b
        Example:
          busctl hub --hub tcp://127.0.0.1:7400 --state-dir /var/lib/agent-bus/hub
        """
        from agent_bus.bus.hub import HubConfig, serve

        curve = hub_curve(endpoint, curve_secret, curve_authorized, insecure, events)
        config = HubConfig(endpoint=endpoint, events=events,
                           state_dir=str(_state_dir(state_dir, "hub")),
                           heartbeat_interval=heartbeat_interval, liveness=liveness,
                           max_message_bytes=max_message_bytes, retain_days=retain_days,
                           retain_bytes=retain_bytes, retain_deltas_until_end=retain_deltas_until_end,
                           replay_priority=replay_priority, replay_pace_bytes=replay_pace_bytes,
                           curve=curve, insecure=insecure, credentials=credentials or "",
                           **budgets)
        logging.getLogger().setLevel(log_level.upper())
        tune_gc()
        try:
            serve(config)
        except Exception as exc:  # a bind failure is the usual cause; say which address
            raise click.ClickException(f"hub on {endpoint} failed: {exc}") from None

    return hub


main.lazy_commands["hub"] = _hub_command


def hub_curve(endpoint: str, secret: str | None, authorized: tuple[str, ...],
              insecure: bool, events: str = "") -> CurveServer | None:
    for flag, address in (("--hub", endpoint), ("--events", events)):
        if address and not address.startswith(("tcp://", "ipc://")):
            raise click.BadParameter(f"{address!r} is not a tcp://HOST:PORT or ipc://PATH address",
                                     param_hint=flag)
    if bool(secret) != bool(authorized):
        raise click.UsageError("--curve-secret and --curve-authorized go together")
    if secret and authorized:
        return CurveServer(secret_key_file=secret, authorized_dir=authorized[0],
                           also_authorized=list(authorized[1:]))
    try:
        exposed = check_bind({"--hub": endpoint, "--events": events}, curve=False, insecure=insecure,
                             fix="pass --curve-secret DIR/hub.key_secret --curve-authorized "
                                 "DIR/authorized, or pass --insecure on a trusted network.")
    except InsecureBindError as exc:
        raise click.UsageError(str(exc)) from None
    if exposed:
        click.secho(f"WARNING: hub on {exposed} without CURVE: anyone who reaches it is let in.",
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

    from agent_bus.agents.client.remote import topology_status

    async def fetch() -> dict[str, Any]:
        async with connect(hub, name="busctl-status", role="cli", curve=curve) as peer:
            report = await topology_status(peer)
            report["subscribers"] = await _subscriber_drops(peer, report)
            return report

    st = run_async(fetch)
    st["dropped"] = _drop_totals(st)
    if as_json:
        click.echo(msgspec.json.encode(st).decode())
        return
    click.echo(f"hub {st['endpoint']}  events {st['events']}  seq {st['seq']}  "
               f"up {st['uptime']:.0f}s")
    if st.get("log_error"):  # the hub refuses every event until the log can be written again
        click.echo(f"EVENTS REFUSED: {st['log_error']} (retried by itself; free space or fix "
                   f"the state directory {st.get('state_dir') or ''})")
    click.echo("peers:")
    meta = {s["name"]: s.get("meta", {}) for s in st["services"]}
    for peer in st["peers"]:
        services = ", ".join(f"{s['name']} {s['load']}/{s['capacity']}" for s in peer.get("services", []))
        jail = _sandbox_of(peer, meta)
        click.echo(f"  {peer['name']:<20} {peer.get('role', '') or '-':<11} pid {peer.get('pid', 0)}"
                   f"@{peer.get('host', '')}  {services}{f'  sandbox {jail}' if jail else ''}")
    click.echo("services:")
    for svc in st["services"]:
        click.echo(f"  {svc['name']:<28} peers {svc['peers']}  load {svc['load']}/{svc['capacity']}"
                   f"  queued {svc['queued']}")
    for name, agent in st["agents"].items():
        click.echo(f"agent {name:<22} live {agent.get('live', 0)} (queued "
                   f"{agent.get('queued', 0)})  idle {agent.get('idle', 0)}  stored "
                   f"{agent.get('stored', 0)}  on {', '.join(agent.get('coordinators', []))}")
        for info in agent.get("sessions", []):
            if info.get("state") != "idle":
                click.echo(f"  {info['state']:<8} run {info.get('run_id') or '-'}  session "
                           f"{info['session']}  messages {info.get('message_count', 0)}")
    for name, stats in st["gateways"].items():
        for alias, model in stats.get("models", {}).items():
            usage = model.get("usage", {})
            click.echo(f"gateway {name}: {alias} in flight {model.get('in_flight', 0)} queued "
                       f"{model.get('queued', 0)} requests {model.get('requests', 0)} tokens "
                       f"{usage.get('total', 0)} cost {_cost_text(model)} "
                       f"aborted {model.get('aborted', 0)}")
            # which model answers and how big its window is, and where each fact came from
            click.echo(f"  model {model.get('model') or '?'} ({model.get('model_from') or 'configured'}), "
                       f"context window {model.get('context_window') or '?'} "
                       f"({model.get('context_window_from') or 'configured'})")
    if st["counters"]:
        click.echo("counters: " + ", ".join(f"{k}={v}" for k, v in sorted(st["counters"].items())))
    for name, sub in st["subscribers"].items():
        extra = "".join(f"  {k.replace('_', ' ')} {v}" for k, v in sorted(sub.get("extra", {}).items()))
        click.echo(f"subscriber {name:<17} seq {sub.get('seq', 0)}  fell behind, refilled from the "
                   f"log {sub.get('refilled', 0)}  lost {sub.get('lost', 0)}{extra}")
    d = st["dropped"]
    click.echo(f"dropped events: {d['total']} in total (slow subscribers {d['subscribers']}, "
               f"oversized {d['oversize_events']}, refused {d['events_refused']})")


# What `busctl status` adds up as dropped events: the hub's own refusals, and what each
# subscriber that reports (`subscriber.<name>`: busctl ui, busctl otel) says its live stream lost.
# A subscriber's drops happen in libzmq's PUB queue, which counts nothing: only the subscriber
# sees the hole in the seqs (and fills it from the log).
HUB_DROP_COUNTERS = ("oversize_events", "events_refused")


async def _subscriber_drops(peer: Any, report: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for service in report["services"]:
        name = service["name"]
        if not name.startswith("subscriber.") or not service["peers"]:
            continue
        try:
            out[name[11:]] = msgspec.msgpack.decode(await peer.request(name, b"", timeout=3))
        except AgentBusError as exc:
            report.setdefault("errors", []).append(f"{name}: {exc}")
    return out


def _sandbox_of(peer: dict[str, Any], meta: dict[str, Any]) -> str | None:
    """A tool worker's sandbox (tools/sandbox.py), from its own registrations' metadata (a hub
    that predates per-peer metadata gives only the service's, the latest registration's)."""
    if peer.get("role") != "worker":
        return None
    return next((found for s in peer.get("services", [])
                 if (found := (s.get("meta") or meta.get(s["name"], {})).get("sandbox"))), None)


def _drop_totals(st: dict[str, Any]) -> dict[str, int]:
    totals = {k: st["counters"].get(k, 0) for k in HUB_DROP_COUNTERS}
    totals["subscribers"] = sum(s.get("refilled", 0) + s.get("lost", 0)
                                for s in st["subscribers"].values())
    totals["total"] = sum(totals.values())
    return totals


def _cost_text(model: dict[str, Any]) -> str:
    """A model's cost so far, or "no price known" (a 0 would pretend); `price` says why."""
    if model.get("priced", True):
        return f"${model.get('usage', {}).get('cost', 0):.4f}"
    return f"unknown ({model.get('price') or 'no price known'})"


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
@click.option("--run", "runs", multiple=True,
              help="Only events of these runs: an id or its prefix (the 8 characters watch "
                   "prints; repeatable).")
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


@main.command()
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


@main.command()
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
    from agent_bus.bus.ui import serve_ui
    from agent_bus.bus.ui.access import read_token_file, tools_can_read

    refuse_token_outside_a_file(old_token)
    if token_file is not None and tools_can_read(token_file):
        click.echo(f"warning: --token-file {token_file}: a sandboxed tool can read it (the sandbox "
                   f"hides only your runtime and state folders): keep it in one of them", err=True)
    try:
        token = read_token_file(token_file) if token_file is not None else ""
        run_async(serve_ui, hub, curve, port, since, host, token, open_browser)
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


# --- busctl worker ------------------------------------------------------------------------


@main.command()
@hub_options
@click.option("--tools", "tool_modules", multiple=True,
              help="Dotted module or .py file with @tool functions (repeatable) "
                   "[default: tools.builtin, unless --mcp is given].")
@click.option("--mcp", "mcp_commands", multiple=True, metavar='"COMMAND ARGS"',
              help="An MCP server to start (stdio) whose tools this worker serves (repeatable; "
                   "needs the `mcp` extra).")
@click.option("--mcp-url", "mcp_urls", multiple=True, metavar="URL",
              help="An MCP server over streamable HTTP whose tools this worker serves (repeatable).")
@click.option("--mcp-header", "mcp_headers", multiple=True, metavar="K=V",
              help="An HTTP header for the --mcp-url servers (repeatable; e.g. Authorization=...).")
@click.option("--mcp-prefix", default="", help="Prefix for the --mcp/--mcp-url servers' tool names.")
@click.option("--mcp-servers", "mcp_json", type=click.File("rb"), default=None, hidden=True,
              help="JSON list of MCP server specs (`-`: stdin; how `busctl up` passes them).")
@click.option("--concurrency", type=click.IntRange(1), default=8, show_default=True,
              help="Calls this worker runs at once.")
@click.option("--workspace", type=click.Path(file_okay=False), default=".", show_default=True,
              help="Root the file tools are confined to (and where run_shell runs).")
@click.option("--name", default="", help="Peer name shown in `busctl status` [default: worker-PID].")
@click.option("--shell", "allow_shell", is_flag=True, help="Enable the run_shell tool.")
@click.option("--read-only", "read_only", multiple=True, type=click.Path(), metavar="PATH",
              help="A path tools may not write (repeatable; `busctl up` passes the topology file "
                   "and the group's `read_only`). The bus's Python environment and `.git` always.")
@click.option("--shell-network", is_flag=True,
              help="run_shell calls keep the network (default: none; `network = true`).")
@click.option("--sandbox", type=click.Choice(["auto", "required", "off"]), default="auto",
              show_default=True,
              help="Run tools in a bubblewrap sandbox: `auto` where one can be set up, "
                   "`required` fails without one (topology key `sandbox`).")
@click.option("--hide", multiple=True, hidden=True, type=click.Path(),
              help="A folder the sandbox hides (`busctl up` passes its state directory).")
def worker(hub: str, curve: CurveClient | None, tool_modules: tuple[str, ...],
           mcp_commands: tuple[str, ...], mcp_urls: tuple[str, ...], mcp_headers: tuple[str, ...],
           mcp_prefix: str, mcp_json: Any, concurrency: int,
           workspace: str, name: str, allow_shell: bool, read_only: tuple[str, ...],
           shell_network: bool, sandbox: str, hide: tuple[str, ...]) -> None:
    """Attach a tool worker: serve each tool as service `tool.<name>` until SIGINT/SIGTERM.

    \b
    Examples:
      busctl worker --tools mypkg.tools --concurrency 4
      busctl worker --hub tcp://10.0.0.5:7400 --tools ./my_tools.py --workspace /data
      busctl worker --mcp "python -m mcp_server_time" --mcp "uvx mcp-server-git"
    """
    from agent_bus.bus.paths import claim_worker_credential, local_alias
    from agent_bus.bus.procsec import drop_root_powers
    from agent_bus.bus.security import take_back
    from agent_bus.tools import ToolLoadError
    from agent_bus.tools.sandbox import SandboxUnavailable, enter, hub_folders, set_shell_sandbox
    from agent_bus.tools.worker import WorkerSettings, run_worker

    if curve is None:  # `--hub 7400`: the local topology's socket, which the sandbox exposes
        hub = local_alias(hub)
        claim_worker_credential(hub)  # a worker's rights, not its owner's
    handed, hide = _hand_over_keys(curve, workspace, hide)
    try:  # first: re-runs this command under bubblewrap where it can (tools/sandbox.py)
        jail = enter(sandbox, workspace, hub, hide, read_only)  # type: ignore[arg-type]  # a click.Choice
    except SandboxUnavailable as exc:
        raise click.BadParameter(str(exc), param_hint="--sandbox") from None
    finally:  # still here outside a sandbox: the keys stay where they were
        if handed is not None:
            take_back(handed)
    _hold_keys(curve)
    hub = jail.hub or hub
    drop_root_powers()  # tools run untrusted arguments: as root they could read every secret
    set_shell_sandbox(sandbox, shell_network, hub_folders(hub))  # type: ignore[arg-type]
    servers = (_mcp_specs(mcp_commands, mcp_prefix) + _mcp_url_specs(mcp_urls, mcp_headers, mcp_prefix)
               + _mcp_json_specs(mcp_json))
    if servers:
        _require_mcp_sdk("--mcp")
    modules = list(tool_modules) or ([] if servers else ["agent_bus.tools.builtin"])
    settings = WorkerSettings(hub=hub, tool_modules=modules, concurrency=concurrency,
                              # the pid outside the sandbox (inside, every worker is pid 1)
                              workspace=workspace, name=name or f"worker-{jail.pid or os.getpid()}",
                              allow_shell=allow_shell, curve=curve, mcp=servers,
                              read_only=list(read_only), sandbox=jail)
    tune_gc()
    try:
        run_async(run_worker, settings)
    except ToolLoadError as exc:
        raise click.ClickException(str(exc)) from None
    except KeyboardInterrupt:
        pass


def _hand_over_keys(curve: CurveClient | None, workspace: str,
                    hide: tuple[str, ...]) -> tuple[int | None, tuple[str, ...]]:
    """Before the sandbox: the worker's CURVE keys go to its re-executed self in a pipe, and its
    key files (with the secrets beside them) are hidden in there, so no tool, shell or MCP server
    reads them. Returns the pipe's read end (None: no file-backed keys) and the paths to hide."""
    from agent_bus.bus.security import HELD, hand_over, key_hiding

    if curve is None or curve.secret_key_file == HELD:
        return None, hide
    return hand_over(curve), (*hide, *key_hiding([curve.secret_key_file], Path(workspace)))


def _hold_keys(curve: CurveClient | None) -> None:
    """Inside the sandbox, holding keys in memory: no tool's child process (an MCP server, a
    shell) may read this process's memory."""
    from agent_bus.bus.procsec import make_undumpable
    from agent_bus.bus.security import HELD

    if curve is not None and curve.secret_key_file == HELD:
        make_undumpable()


def _mcp_specs(commands: tuple[str, ...], prefix: str) -> list[Any]:
    """`--mcp` values as server specs; a usage error naming the flag when one is not usable."""
    if not commands:
        return []
    from agent_bus.tools.mcp import parse_mcp_command

    specs = []
    for text in commands:
        try:
            specs.append(msgspec.structs.replace(parse_mcp_command(text), prefix=prefix))
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--mcp") from None
    return specs


def _loopback_addr(addr: str) -> tuple[str, int]:
    """`--http HOST:PORT` on a loopback host: the MCP endpoint has no keys or TLS of its own."""
    host, _, port = addr.rpartition(":")
    if host not in ("127.0.0.1", "localhost", "::1", "[::1]") or not port.isdigit():
        raise click.BadParameter(f"expected a loopback HOST:PORT such as 127.0.0.1:8765, got "
                                 f"{addr!r} (this endpoint has no authentication: loopback only)",
                                 param_hint="--http")
    return host.strip("[]"), int(port)


def _mcp_url_specs(urls: tuple[str, ...], headers: tuple[str, ...], prefix: str) -> list[Any]:
    """`--mcp-url` values (with every `--mcp-header K=V`) as server specs."""
    from agent_bus.tools.mcp import McpServerSpec

    pairs = {}
    for item in headers:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise click.BadParameter(f"expected K=V, got {item.split('=')[0]!r}…",
                                     param_hint="--mcp-header")  # never echo a secret value
        pairs[key.strip()] = value
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise click.BadParameter(f"{url!r} is not an http(s) URL", param_hint="--mcp-url")
    return [McpServerSpec(url=url, headers=pairs, prefix=prefix) for url in urls]


def _require_mcp_sdk(flag: str) -> None:
    try:
        import mcp  # noqa: F401 - only to say which extra is missing
    except ImportError:
        raise click.UsageError(f"{flag} needs the MCP SDK: pip install 'agent-bus[mcp]'") from None


def _mcp_json_specs(source: Any) -> list[Any]:
    if source is None:
        return []
    from agent_bus.tools.mcp import McpServerSpec

    try:
        return msgspec.json.decode(source.read(), type=list[McpServerSpec])
    except msgspec.DecodeError as exc:
        raise click.BadParameter(f"not a JSON list of MCP servers: {exc}",
                                 param_hint="--mcp-servers") from None


# --- busctl mcp -------------------------------------------------------------------------


@main.group("mcp")
def mcp_group() -> None:
    """The bus as an MCP server (for Claude Desktop/Code, Cursor, VS Code, other agents).

    \b
    Examples:
      busctl mcp serve                        # stdio, for a client that launches it
      busctl mcp serve --http 127.0.0.1:8765  # streamable HTTP at http://127.0.0.1:8765/mcp
    """


@mcp_group.command("serve")
@hub_options
@click.option("--agent", "agents", multiple=True,
              help="Expose only this agent as `ask_<agent>` (repeatable) [default: every live one].")
@click.option("--tools", "with_tools", is_flag=True, help="Also expose every live bus tool.")
@click.option("--http", "http_addr", default="", metavar="HOST:PORT",
              help="Serve streamable HTTP at http://HOST:PORT/mcp instead of stdio (loopback only).")
def mcp_serve(hub: str, curve: CurveClient | None, agents: tuple[str, ...],
              with_tools: bool, http_addr: str) -> None:
    """Serve MCP over stdin/stdout: each agent is a tool `ask_<agent>` (prompt, session).

    \b
    An MCP client's configuration that launches it:
      {"mcpServers": {"bus": {"command": "busctl", "args": ["mcp", "serve"]}}}
    Examples:
      busctl mcp serve --agent assistant --tools
      busctl mcp serve --http 127.0.0.1:8765
    """
    _require_mcp_sdk("busctl mcp serve")
    from agent_bus.agents.client.mcp_server import serve_http, serve_stdio

    try:
        if http_addr:
            host, port = _loopback_addr(http_addr)
            run_async(serve_http, hub, curve, list(agents), with_tools, host, port)
        else:
            run_async(serve_stdio, hub, curve, list(agents), with_tools)
    except KeyboardInterrupt:
        pass


# --- busctl gateway / coordinator / fake-llm --------------------------------------------


def _state_dir(given: str | None, part: str) -> Path:
    """A process's state folder, marked so that tools refuse it (see bus.paths)."""
    from agent_bus.bus.paths import default_state_dir, ensure_state_dir

    try:
        if given:
            return ensure_state_dir(given)
        return ensure_state_dir(default_state_dir()) / part
    except OSError as exc:
        raise click.BadParameter(f"cannot use {given or default_state_dir()!s} as the state "
                                 f"directory: {exc.strerror or exc}", param_hint="--state-dir") from None


def _read_secrets_line() -> dict[str, str]:
    """`--secrets-on-stdin`: the first stdin line, a JSON object of variable names to values."""
    line = sys.stdin.buffer.readline()
    try:
        return msgspec.json.decode(line, type=dict[str, str])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise click.BadParameter(f"the first stdin line must be a JSON object of secret "
                                 f"variables ({exc})", param_hint="--secrets-on-stdin") from None


def _load_topology_or_exit(path: str | None) -> Any:
    """The topology from `path`, from stdin as JSON (`-`, how `busctl up` hands it to its
    children), or the embedded default."""
    from agent_bus.agents.launch.topology import (
        TopologyError,
        default_topology,
        load_topology,
        parse_topology,
    )

    if path is None:
        return default_topology()
    try:
        if path == "-":
            return parse_topology(sys.stdin.buffer.read(), "<stdin>", as_json=True)
        return load_topology(path)
    except TopologyError as exc:
        raise ConfigExit(str(exc)) from None


class ConfigExit(click.ClickException):
    """A topology that cannot run, named by its key: exit 2 (bad use), from `config check` and
    `up` alike (they share `check_topology`)."""

    exit_code = 2


@main.command()
@hub_options
@click.option("--topology", "topology_file",
              type=click.Path(exists=True, dir_okay=False, allow_dash=True), default=None,
              help="Topology file whose [models] to serve, or - for JSON on stdin "
                   "[default: from the environment].")
@click.option("--name", default="", help="Peer name [default: gateway-PID].")
@click.option("--secrets-on-stdin", is_flag=True, hidden=True,
              help="Stdin starts with one JSON line of secret variables (API keys), then the "
                   "topology: how `busctl up` hands keys over without an environment.")
def gateway(hub: str, curve: CurveClient | None, topology_file: str | None, name: str,
            secrets_on_stdin: bool) -> None:
    """Run an LLM gateway: serve `llm` requests by calling model providers over HTTP.

    \b
    Models come from the topology's [models] tables, or else from the environment:
    OPENAI_API_KEY / OPENAI_BASE_URL / OPENAI_MODEL, or ANTHROPIC_API_KEY / ANTHROPIC_MODEL.
    Example:
      OPENAI_BASE_URL=http://127.0.0.1:8080/v1 busctl gateway
    """
    from agent_bus.agents.gateway.process import GatewaySettings, run_gateway
    from agent_bus.bus.procsec import make_undumpable

    make_undumpable()  # before the keys are read: no same-user process reads this memory
    secrets = _read_secrets_line() if secrets_on_stdin else {}
    topology = _load_topology_or_exit(topology_file)
    settings = GatewaySettings(hub=hub, models=topology.model_configs(),
                               default_model=topology.gateways.default_model,
                               name=name or f"gateway-{os.getpid()}", curve=curve)
    try:
        tune_gc()
        run_async(functools.partial(run_gateway, settings, secrets=secrets))
    except KeyboardInterrupt:
        pass


@main.command()
@hub_options
@click.option("--topology", "topology_file",
              type=click.Path(exists=True, dir_okay=False, allow_dash=True), default=None,
              help="Topology file declaring the agents, or - for JSON on stdin "
                   "[default: one `assistant`].")
@click.option("--agent", "agent_names", multiple=True,
              help="Host only these agents of the topology (repeatable) [default: all].")
@click.option("--state-dir", type=click.Path(file_okay=False), default=None,
              help="Where conversations are stored [default: <state home>/<project>/agents].")
@click.option("--name", default="", help="Peer name [default: coordinator-PID].")
def coordinator(hub: str, curve: CurveClient | None, topology_file: str | None,
                agent_names: tuple[str, ...], state_dir: str | None, name: str) -> None:
    """Run a coordinator: host agents as services `agent.<name>` and run their loops.

    \b
    Example:
      busctl coordinator --topology team.toml --agent researcher --agent writer
    """
    from agent_bus.agents.coordinator.process import CoordinatorError, CoordinatorSettings, run_coordinator

    topology = _load_topology_or_exit(topology_file)
    known = {a.name for a in topology.agents}
    unknown = [n for n in agent_names if n not in known]
    if unknown:
        raise click.BadParameter(f"{', '.join(unknown)} not in the topology "
                                 f"(agents: {', '.join(sorted(known))})", param_hint="--agent")
    agents = [a for a in topology.agents if not agent_names or a.name in agent_names]
    settings = CoordinatorSettings(hub=hub, agents=agents,
                                   state_dir=str(_state_dir(state_dir, "agents")),
                                   name=name or f"coordinator-{os.getpid()}", curve=curve,
                                   models=topology.model_configs())
    tune_gc()
    try:
        run_async(run_coordinator, settings)
    except CoordinatorError as exc:
        raise click.ClickException(str(exc)) from None
    except KeyboardInterrupt:
        pass


FAKE_LLM_EXAMPLES = """

\b
Examples:
  busctl fake-llm --port 8081       # then OPENAI_BASE_URL=http://127.0.0.1:8081/v1
  busctl fake-llm --script rules.json --port 0   # the first line names the URL (JSON)
"""


def _fake_llm_command() -> click.Command:
    from agent_bus.agents.gateway.fakellm import fake_llm_command

    # The examples name busctl, so they are added where busctl mounts the command.
    if "Examples:" not in (fake_llm_command.help or ""):
        fake_llm_command.help = (fake_llm_command.help or "").rstrip() + FAKE_LLM_EXAMPLES
    return fake_llm_command


main.lazy_commands["fake-llm"] = _fake_llm_command


# --- busctl up / down / ps / config --------------------------------------------------------


@main.command()
@click.option("-c", "--config", "config_file", type=click.Path(dir_okay=False), default=None,
              help="Topology file (TOML) [default: the embedded default, see `busctl config show`].")
@click.option("--hub", "hub_addr", envvar=HUB_ENV, default=None, callback=_hub_address_option,
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
def up(config_file: str | None, hub_addr: str | None, extra_tools: tuple[str, ...],
       workers: int | None, demo: bool, model_file: str | None, detach: bool, as_json: bool,
       ready_file: str) -> None:
    """Start a whole topology — hub, gateways, workers, coordinators — and supervise it.

    \b
    Examples:
      busctl up --demo                 # everything, on a scripted model: no key needed
      busctl up -c team.toml -d        # a topology file, in the background
      busctl up --tools ./my_tools.py --workers 4
      busctl up --model-file ./qwen2.5-0.5b-instruct-q4_k_m.gguf   # a local model, no server
      busctl up -d --json | jq -r .endpoint    # a script: the ready line, as JSON
    Ctrl-C stops everything in order.
    """
    from agent_bus.agents.launch.up import UpOptions
    from agent_bus.agents.launch.up import up as run_up
    from agent_bus.bus.procsec import make_undumpable

    make_undumpable()  # the keys are in this process's environment: no same-user process reads it
    topology = _load_topology_or_exit(config_file)
    from agent_bus.agents.launch.supervisor import SECRET_NAME_RE, scrub_environ_block

    # The keys stay in this process's memory (os.environ); its environment block, which
    # /proc/PID/environ shows, loses them: children get theirs from the supervisor's memory.
    scrub_environ_block({n for n in os.environ if SECRET_NAME_RE.search(n)}
                        | {m.api_key_env for m in topology.models.values() if m.api_key_env})
    if demo and model_file:
        raise click.UsageError("--demo and --model-file each choose the model; give one")
    options = UpOptions(demo=demo, extra_tools=list(extra_tools), workers=workers, hub=hub_addr,
                        detach_ready_file=ready_file, model_file=model_file or "",
                        topology_file=config_file or "",
                        ready_json=as_json and not detach)
    from agent_bus.agents.launch.topology import check_topology
    from agent_bus.agents.launch.up import resolve

    problems = check_topology(resolve(topology, options))
    if problems:
        raise ConfigExit(f"{config_file or 'embedded default'}: {problems[0]}")
    _refuse_insecure_bind(resolve(topology, options))
    from agent_bus.agents.launch.up import preflight

    busy = preflight(resolve(topology, options))  # before any file of another topology is touched
    if busy:
        raise click.ClickException(busy)
    if detach:
        _detach(topology, options, as_json)
        return
    from agent_bus.agents.launch.supervisor import ChildFailed

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


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def topology_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`-c FILE`: the topology given to `busctl up`, which names its state directory."""
    return click.option("-c", "--config", "config_file", type=click.Path(dir_okay=False),
                        default=None, help="The topology file given to `busctl up` (for its "
                                           "state directory) [default: the embedded default].")(fn)


def _state_of(config_file: str | None) -> Path:
    from agent_bus.agents.launch.up import state_dir

    return state_dir(_load_topology_or_exit(config_file))


@main.command()
@topology_option
@click.option("--timeout", type=click.FloatRange(0.1), default=10.0, show_default=True,
              help="Seconds to wait for an orderly stop before killing what is left.")
def down(config_file: str | None, timeout: float) -> None:
    """Stop the topology started from this directory (with `busctl up`, `-d` or not).

    Asks the supervisor to stop everything in order; if it is gone (or too slow), stops each
    process it started itself, SIGKILLs what is left after --timeout, and exits 1 naming any
    process it could not stop.

    \b
    Example:
      busctl up -d && busctl run "hi" && busctl down
    """
    from agent_bus.agents.launch.up import stop_topology

    state = _state_of(config_file)
    report, failed = stop_topology(state, timeout)
    if failed:
        raise click.ClickException(f"{report}; could not stop: {', '.join(failed)}")
    click.echo(report)


@main.command()
@hub_options
@topology_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object per process per line.")
def ps(hub: str, curve: CurveClient | None, config_file: str | None, as_json: bool) -> None:
    """List the topology's processes: state, pid, uptime, restarts and last exit.

    The processes come from the supervisor of the topology started from this directory; with
    `--hub` on the command line (or none up here), from the peers connected to that hub.
    (`BUSCTL_HUB` alone does not switch: it names where to look when nothing is up here.)

    \b
    Examples:
      busctl ps
      busctl ps --hub tcp://10.0.0.5:7400 --json | jq .name
    """
    from click.core import ParameterSource

    explicit = click.get_current_context().get_parameter_source("hub") == ParameterSource.COMMANDLINE
    rows = None if explicit else _supervisor_table(_state_of(config_file))
    if rows is None:
        rows = _hub_table(hub, curve)
    if not as_json:
        _print_table(rows)
        return
    for row in rows:
        click.echo(msgspec.json.encode(row).decode())


def _supervisor_table(state: Path) -> list[dict[str, Any]] | None:
    from agent_bus.agents.launch.supervisor import ChildFailed
    from agent_bus.agents.launch.up import ControlRequest, control, running_here

    if running_here(state) is None:
        return None
    try:
        reply = run_async(control, state, ControlRequest(op="ps"), 10.0)
    except ChildFailed:
        return None
    return reply.processes


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


@main.command()
@topology_option
@click.argument("names", nargs=-1, required=True)
def restart(config_file: str | None, names: tuple[str, ...]) -> None:
    """Restart processes of the running topology by name (through its supervisor).

    Each is stopped (SIGTERM, SIGKILL after a few seconds) and started again at once; the
    command returns once it is ready again, and a `process_restarted` event is published.

    \b
    Example:
      busctl restart tools-1 gateway-1
    """
    from agent_bus.agents.launch.up import ControlRequest

    for name in names:
        click.echo(_control(config_file, ControlRequest(op="restart", name=name)))


@main.command()
@topology_option
@click.argument("targets", nargs=-1, required=True)
def scale(config_file: str | None, targets: tuple[str, ...]) -> None:
    """Set the number of processes of worker groups at run time: GROUP=N (`workers`: the first).

    \b
    Examples:
      busctl scale workers=3
      busctl scale tools=2 search=0
    """
    from agent_bus.agents.launch.up import ControlRequest

    for target in targets:
        group, _, count = target.partition("=")
        if not group or not count.isdigit():
            raise click.BadParameter(f"{target!r} is not GROUP=N (e.g. workers=3)",
                                     param_hint="TARGETS")
        click.echo(_control(config_file, ControlRequest(op="scale", name=group, count=int(count))))


def _control(config_file: str | None, request: Any) -> str:
    from agent_bus.agents.launch.up import control

    reply = run_async(control, _state_of(config_file), request)
    if not reply.ok:
        raise click.ClickException(reply.error)
    return reply.message


@main.command()
@topology_option
@click.option("-f", "--follow", is_flag=True, help="Keep printing new output as it is written.")
@click.option("--tail", type=click.IntRange(0), default=None,
              help="Only the last N lines of each log first [default: all].")
@click.argument("names", nargs=-1)
def logs(config_file: str | None, follow: bool, tail: int | None, names: tuple[str, ...]) -> None:
    """Print the output of the topology's processes (all, or NAMES), each line prefixed.

    Read from the log files in the state directory: works while the topology runs and after it
    stopped. `up` is the supervisor's own log of a `busctl up -d`.

    \b
    Examples:
      busctl logs --tail 20
      busctl logs -f gateway-1 tools-1
    """
    from agent_bus.agents.launch.supervisor import LogTail

    folder = _state_of(config_file) / "logs"
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


@main.group()
def config() -> None:
    """Validate and show topology files.

    \b
    Examples:
      busctl config show > team.toml    # the commented default, to edit
      busctl config check team.toml     # then: busctl up -c team.toml
    """


@config.command("check")
@click.argument("file", type=click.Path(dir_okay=False))
def config_check(file: str) -> None:
    """Validate FILE and print the resolved topology as JSON (exit 2 naming the bad key; the
    same checks `busctl up` makes before it starts anything).

    \b
    Example:
      busctl config check team.toml | jq '.agents[].name'
    """
    topology = _load_topology_or_exit(file)
    click.echo(msgspec.json.format(msgspec.json.encode(topology)).decode())


@config.command("show")
def config_show() -> None:
    """Print the embedded default topology, commented.

    \b
    Example:
      busctl config show > team.toml && busctl up -c team.toml
    """
    from agent_bus.agents.launch.topology import EXAMPLE

    click.echo(EXAMPLE, nl=False)


@main.group()
def keys() -> None:
    """CurveZMQ keys for a hub that other machines connect to.

    \b
    Example:
      busctl keys generate ./keys --client laptop --client ci
    """


@keys.command("generate")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--client", "clients", multiple=True, default=("client",), show_default=True,
              help="Name of a client key pair to make and authorise (repeatable).")
@click.option("--force", is_flag=True,
              help="Replace key files that already exist (every hub and client using them must change).")
def keys_generate(directory: str, clients: tuple[str, ...], force: bool) -> None:
    """Make a hub key pair and client key pairs in DIRECTORY (files 0600, directory 0700).

    \b
    Example:
      busctl keys generate ./keys --client laptop
    Then:
      busctl hub --hub tcp://0.0.0.0:7400 --curve-secret DIR/hub.key_secret --curve-authorized DIR/authorized
      busctl worker --hub tcp://HOST:7400 --curve-server-key DIR/hub.key --curve-key DIR/client.key_secret
    In a topology ([hub]): curve_secret, curve_authorized, curve_server_key, and curve_client_key =
    DIR/<your client>.key_secret, the owner's key; `busctl up` makes its processes' keys itself.
    """
    import shutil

    from agent_bus.bus.security import generate_keys

    root = Path(directory)
    # New keys lock out every peer holding the old ones: replacing them is asked for, never a rerun.
    existing = [p.name for n in ("hub", *clients) for p in (root / f"{n}.key", root / f"{n}.key_secret")
                if p.exists()]
    if existing and not force:
        raise click.UsageError(f"{root} already holds {', '.join(existing)}: keep them, or give --force "
                               "to replace them (clients with the old keys are then refused)")
    generate_keys(root, "hub")
    authorized = root / "authorized"
    authorized.mkdir(parents=True, exist_ok=True, mode=0o700)
    for name in clients:
        public, _ = generate_keys(root, name)
        shutil.copy(public, authorized / public.name)
        os.chmod(authorized / public.name, 0o600)
    click.echo(f"hub keys: {root / 'hub.key'} (give to clients), {root / 'hub.key_secret'} (hub only)")
    click.echo(f"clients: {', '.join(clients)}; authorised public keys in {authorized}")


@main.command()
@hub_options
@click.option("--experiment", required=True, help="The experiment id to export.")
@click.option("--format", "fmt", type=click.Choice(["jsonl", "msgpack"]), default="jsonl",
              show_default=True, help="JSON lines, or a stream of MessagePack maps.")
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True), default="-",
              help="File to write [default: stdout].")
@click.option("--state-dir", type=click.Path(exists=True, file_okay=False), default=None,
              help="Read the event log in this state directory (a topology's, or a hub's "
                   "--state-dir) instead of asking a hub; read-only, no hub needed.")
def export(hub: str, curve: CurveClient | None, experiment: str, fmt: str, output: str,
           state_dir: str | None) -> None:
    """Write every event of an experiment from the hub's log; print token/cost totals to stderr.

    With no hub running (and no --hub given) it reads the log that `busctl up` left in this
    directory's state directory; --state-dir reads another one.

    \b
    Examples:
      busctl export --experiment debate-3 -o debate-3.jsonl
      busctl export --experiment debate-3 --state-dir ~/.local/state/agent-bus/proj-1a2b3c4d5e6f
    """
    from click.core import ParameterSource

    from agent_bus.bus.paths import default_state_dir
    from agent_bus.bus.watch import log_file

    try:
        out_file = click.open_file(output, "wb")
    except OSError as exc:
        raise click.ClickException(f"cannot write {output}: {exc.strerror}") from None
    # --hub on the command line names that hub; the default or BUSCTL_HUB may fall back to disk
    explicit = click.get_current_context().get_parameter_source("hub") == ParameterSource.COMMANDLINE
    local = log_file(Path(state_dir or default_state_dir()))
    if state_dir and local is None:
        raise click.BadParameter(f"no event log (events.db or hub/events.db) in {state_dir}",
                                 param_hint="--state-dir")
    with out_file as out:
        result = _export(hub, curve, experiment, out, fmt, None if explicit and not state_dir
                         else local, bool(state_dir))
    if not result.totals.events:
        if output != "-":
            Path(output).unlink(missing_ok=True)
        known = ", ".join(result.experiments) or "none"
        raise click.ClickException(f"no experiment `{experiment}` in the event log "
                                   f"(experiments: {known})")
    click.echo(msgspec.json.encode(result.totals).decode(), err=True)


def _export(hub: str, curve: CurveClient | None, experiment: str, out: Any, fmt: str,
            local: Path | None, only_local: bool) -> Any:
    """From the hub; from the log file `local` when asked to (`only_local`), or when no hub
    answers and there is one (a stopped topology's log)."""
    import sqlite3

    from agent_bus.bus.watch import export_events, export_from_log

    if not only_local:
        try:
            return run_async(export_events, hub, curve, experiment, out, fmt)
        except (HubUnreachable, BaseExceptionGroup) as exc:
            leaf = _first_leaf(exc) if isinstance(exc, BaseExceptionGroup) else exc
            if local is None or not isinstance(leaf, HubUnreachable):
                raise
            click.echo(f"{leaf}; reading the log on disk instead: {local}", err=True)
    assert local is not None
    try:
        return export_from_log(local, experiment, out, fmt)
    except sqlite3.Error as exc:
        raise click.ClickException(f"cannot read the event log {local}: {exc}") from None


# --- busctl replay / diff (agents.replay) --------------------------------------------------


@main.command()
@hub_options
@click.option("--experiment", required=True, help="The recorded experiment to replay.")
@click.option("--as", "target", default="", metavar="E2",
              help="The replayed experiment's id [default: EXPERIMENT.replay-<hex>].")
@click.option("--live-from", type=click.IntRange(min=0, max=2**31 - 1), default=None, metavar="TURN",
              help="Fork: replay each run's first TURN turns, then call the live model (0: "
                   "every call live).")
@click.option("--live-from-seq", type=click.IntRange(min=1, max=2**63 - 1), default=None,
              metavar="SEQ",
              help="Fork at a point of the log: model calls logged before event SEQ are "
                   "replayed, the one at or after it and its run's later ones go live.")
@click.option("--model", default="", metavar="ALIAS",
              help="Fork: the model alias (of the gateway) for the live turns.")
@click.option("--system-prompt-file", type=click.Path(exists=True, dir_okay=False),
              default=None, metavar="F",
              help="Fork: the system prompt (file F) of the prompted agents' live turns.")
@click.option("--set", "settings", multiple=True, metavar="AGENT.KEY=VALUE",
              help="Fork: an [[agents]] key for AGENT's live turns: model, system_prompt, "
                   "temperature, top_p, max_tokens, seed, stop; or max_turns (alias "
                   "max_iterations) for its prompted runs. Repeatable.")
@click.option("--live-tools", is_flag=True,
              help="Run the tools again [default: their results come from the log]; the "
                   "runs of a `busctl experiment` cell (EXPERIMENT = E.<variant>.r<repeat>) "
                   "in a fresh copy of their workspace.")
@click.option("--spec", "spec_path", default="", metavar="SPEC",
              help="With --live-tools, for a `busctl experiment` cell: the spec E ran, whose "
                   "dataset has the samples' files [default: the path its plan names].")
def replay(hub: str, curve: CurveClient | None, experiment: str, target: str,
           live_from: int | None, live_from_seq: int | None, model: str,
           system_prompt_file: str | None, settings: tuple[str, ...], live_tools: bool,
           spec_path: str) -> None:
    """Re-execute every run of EXPERIMENT with the gateway serving each model reply from the
    log (no model is called) and each tool result too (unless --live-tools; `ask_<agent>`
    calls always run: the callee's run is replayed); report "identical" or the first
    divergence (exit 1).

    \b
    A fork (--live-from TURN or --live-from-seq SEQ) replays up to that point, then calls the
    live model; --model, --system-prompt-file and --set change the live part.
    Compare the two afterwards with `busctl diff EXPERIMENT E2`.
    Examples:
      busctl replay --experiment debate-3 --as debate-3-again
      busctl replay --experiment debate-3 --as debate-3-b --live-from 2 --model b
      busctl replay --experiment debate-3 --live-from-seq 1234 --set lead.temperature=0.2
    """
    import uuid

    from agent_bus.agents.client.remote import connect as connect_agents
    from agent_bus.agents.replay import Fork, ForkError, parse_setting, replay_experiment
    from agent_bus.bus.errors import ConfigError
    from agent_bus.bus.events import EventTally
    from agent_bus.bus.watch import to_stderr

    try:
        fork = Fork(live_from=live_from, live_from_seq=live_from_seq or 0, model=model,
                    system_prompt=_system_prompt(system_prompt_file),
                    settings=dict(parse_setting(s) for s in settings))
    except ForkError as exc:
        raise click.UsageError(str(exc)) from None
    target = target or f"{experiment}.replay-{uuid.uuid4().hex[:6]}"
    tally = EventTally("busctl replay", to_stderr)  # logged events that do not decode
    notes: list[str] = []  # token usage differences, reported apart from the comparison

    async def go() -> object:
        async with connect_agents(hub, name="busctl-replay", curve=curve) as bus:
            try:
                workspaces = await _cell_workspaces(bus.peer, experiment, target, spec_path) \
                    if live_tools else {}
                return await replay_experiment(bus, experiment, target, fork=fork,
                                               live_tools=live_tools, tally=tally,
                                               workspaces=workspaces, notes=notes)
            except (ValueError, ConfigError) as exc:  # ForkError too: before anything is replayed
                return exc  # raised here it would reach us inside an exception group

    divergence = run_async(go)
    if tally.bad:
        click.echo(tally.summary(), err=True)
    if isinstance(divergence, (ValueError, ConfigError)):
        raise click.UsageError(str(divergence))
    if divergence is not None:
        raise click.ClickException(f"{experiment} replayed as {target}: {divergence}")
    usage = "".join(f"\n  {note}" for note in notes)
    if usage:  # not part of the comparison: a live call's cache split is the server's state
        usage = f"\ntoken usage differs (compared apart; `busctl diff` shows it):{usage}"
    click.echo(f"{experiment} replayed as {target}: identical{usage}")


async def _cell_workspaces(peer: Any, experiment: str, target: str,
                           spec: str) -> dict[str, Any]:
    """`busctl replay --live-tools` of a `busctl experiment` cell's tag (`E.<variant>.r<N>`):
    its runs' fresh workspaces (agents.experiment.runner.cell_workspaces); none for another."""
    from agent_bus.agents.experiment.runner import cell_workspaces, read_journal

    name, dot, _ = experiment.partition(".")
    if not dot:
        return {}
    return cell_workspaces(await read_journal(peer, name), experiment, target, spec)


SYSTEM_PROMPT_LIMIT = 1 << 20  # a prompt file larger than this is a mistake (or /dev/zero)


def _system_prompt(path: str | None) -> str | None:
    """`busctl replay --system-prompt-file`: the file's text (None: not given), at most
    `SYSTEM_PROMPT_LIMIT` bytes: never read past that, whatever the file is."""
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            data = f.read(SYSTEM_PROMPT_LIMIT + 1)
        if len(data) > SYSTEM_PROMPT_LIMIT:
            raise click.UsageError(f"--system-prompt-file {path}: larger than 1 MiB; a system "
                                   f"prompt must be at most {SYSTEM_PROMPT_LIMIT} bytes")
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise click.UsageError(f"--system-prompt-file {path}: cannot read it as UTF-8 text "
                               f"({exc})") from None
    if not text.strip():
        raise click.UsageError(f"--system-prompt-file {path} is empty; give a file with the "
                               f"system prompt's text")
    return text


@main.command("diff")
@hub_options
@click.argument("first")
@click.argument("second")
@click.option("--json", "as_json", is_flag=True, help="One JSON object (for notebooks).")
def diff_experiments(hub: str, curve: CurveClient | None, first: str, second: str,
                     as_json: bool) -> None:
    """Compare experiments FIRST and SECOND run by run (in start order; the runs a run asked
    for follow it, in the order of its calls) and in total: final
    texts (a unified diff), tool calls, turns, tokens, cost, stop reasons; wall time shown;
    and where the events first differ (the comparison `busctl replay` makes).

    \b
    Examples:
      busctl diff debate-3 debate-3-again
      busctl diff debate-3 debate-3-b --json | jq .total
    """
    from agent_bus.agents.replay import diff, diff_text, load_experiment
    from agent_bus.bus.client import connect as connect_peer
    from agent_bus.bus.events import EventTally
    from agent_bus.bus.watch import to_stderr

    tally = EventTally("busctl diff", to_stderr)  # logged events that do not decode

    async def go() -> dict[str, Any]:
        async with connect_peer(hub, name="busctl-diff", role="cli", curve=curve) as peer:
            a = await load_experiment(peer, first, tally)
            b = await load_experiment(peer, second, tally)
        for name, runs in ((first, a), (second, b)):
            if not runs:
                raise click.UsageError(f"experiment `{name}` has no runs in the hub's log")
        return diff(a, b)

    result = run_async(go)
    if tally.bad:
        click.echo(tally.summary(), err=True)
    click.echo(msgspec.json.encode(result).decode() if as_json
               else diff_text(result, first, second))


# --- busctl run / chat / steer / follow-up / abort ----------------------------------------

LAST_SESSION = "\0last"  # `-c` without a value: the agent's last session


@main.command("run")
@hub_options
@click.option("--agent", default="assistant", show_default=True, help="Agent to prompt.")
@click.option("--json", "as_json", is_flag=True, help="Print the run's events as JSON lines.")
@click.option("-q", "--quiet", is_flag=True, help="Print only the answer (no trace on stderr).")
@click.option("-c", "--continue", "cont", is_flag=False, flag_value=LAST_SESSION, default=None,
              metavar="[SESSION]",
              help="Continue the agent's last session, or SESSION (the id a run printed) "
                   "[default: a fresh session].")
@click.option("--new-session", is_flag=True, hidden=True,
              help="A fresh session (the default now; kept for old scripts).")
@click.option("--experiment", default="", help="Tag the run's events with this experiment id.")
@click.option("--max-turns", type=_COUNT, default=None,
              help="End the run after this many turns (stop reason max_iterations) "
                   "[default: the agent's max_iterations].")
@click.argument("prompt", required=False)
def run_cmd(hub: str, curve: CurveClient | None, agent: str, as_json: bool, quiet: bool,
            cont: str | None, new_session: bool, experiment: str, max_turns: int | None,
            prompt: str | None) -> None:
    """Send PROMPT (or `-` for stdin) to an agent; print its answer on stdout.

    Each run starts a fresh session (conversation) and prints its id on stderr; `-c` continues
    the agent's last session, `-c SESSION` a named one.

    The trace (tool calls, thinking, retries) goes to stderr, so `busctl run "…" > answer.txt`
    captures exactly the answer; `--json` prints every event of the run on stdout instead.

    \b
    Exit status: 0 on a normal stop, 1 on error, 3 when stopped at its turn limit (--max-turns
    or the agent's max_iterations; a line on stderr says so), 130 when aborted (Ctrl-C aborts
    the run; a second Ctrl-C exits at once).
    Example:
      busctl run --agent assistant "summarise README.md"
      busctl run -q "list the files" > files.txt
      busctl run -c "and the tests?"              # continues the last session
      busctl run -c coordinator-1.3f0c9a "again"  # continues that session
    """
    from agent_bus.agents.client.drive import drive_run

    if prompt is None and cont not in (None, LAST_SESSION):
        prompt, cont = cont, LAST_SESSION  # `-c "text"`: click took the prompt for SESSION
    if prompt is None:
        raise click.BadParameter("missing the prompt (or `-` to read it from stdin)",
                                 param_hint="PROMPT")
    text = sys.stdin.read() if prompt == "-" else prompt
    if not text.strip():
        raise click.BadParameter("the prompt is empty", param_hint="PROMPT")
    session = cont if cont not in (None, LAST_SESSION) else ""
    code = run_async(drive_run, hub, curve, agent, text, as_json, False, experiment,
                     use_color(), max_turns or 0, quiet, session or "",
                     cont == LAST_SESSION)
    sys.exit(code)


@main.command()
@hub_options
@click.option("--agent", default="assistant", show_default=True, help="Agent to talk to.")
@click.option("--session", default="", help="Continue this session [default: a fresh one].")
def chat(hub: str, curve: CurveClient | None, agent: str, session: str) -> None:
    """An interactive session: each line is a prompt; while a run streams, a line steers it.

    \b
    Every prompt continues the chat's one session. `/abort` aborts the current run,
    `/follow TEXT` queues a follow-up, `/reset` starts a new session (not during a run),
    `/help` lists these, Ctrl-D quits.
    Examples:
      busctl chat
      busctl chat --agent reviewer --session coordinator-1.3f0c9a   # go on with a run's session
    """
    from agent_bus.agents.client.drive import chat as run_chat

    run_async(run_chat, hub, curve, agent, use_color(), session)


def _agent_verb(verb: str) -> Callable[..., None]:
    @hub_options
    @click.option("--run", "run_id", default="", help="The run to address (id from `busctl "
                  "status` or a run's events) [default: the agent's one live run].")
    @click.option("--session", default="", help="The session whose live run to address.")
    @click.argument("agent")
    @click.argument("text", required=verb in ("steer", "follow_up"))
    def command(hub: str, curve: CurveClient | None, run_id: str, session: str, agent: str,
                text: str | None = None) -> None:
        from agent_bus.agents.client.remote import connect as connect_agents

        async def go() -> str:
            async with connect_agents(hub, name=f"busctl-{verb}", curve=curve) as bus:
                method = getattr(bus, verb)
                detail: str = await method(agent, text or "", run=run_id, session=session)
                return detail

        detail = run_async(go)
        click.echo(f"{verb.replace('_', '-')} sent to {agent}: {detail}")

    return command


_ADDRESS = ("\n\nWith several live runs of AGENT, name one with --run or --session (the error "
            "lists them). A session without a run in progress is refused: continue it with "
            "`busctl run -c SESSION TEXT`.")


def _examples(*lines: str) -> str:
    return "\n\n\b\nExamples:\n" + "\n".join(f"  {line}" for line in lines)


main.command("steer", help="Queue a steering message for AGENT's live run (TEXT)." + _ADDRESS
             + _examples('busctl steer assistant "only look at the tests"',
                         'busctl steer assistant --run RUN_ID "skip the docs"   # one of several live runs'))(
    _agent_verb("steer"))
main.command("follow-up", help="Queue TEXT for AGENT's live run to handle when it would "
             "otherwise stop." + _ADDRESS
             + _examples('busctl follow-up assistant "then write the summary to NOTES.md"'))(
    _agent_verb("follow_up"))
main.command("abort", help="Abort AGENT's live run (model call and tool calls); TEXT, the "
             "reason, is in its agent_end error." + _ADDRESS
             + _examples("busctl abort assistant", 'busctl abort assistant "wrong folder"',
                         "busctl abort assistant --session coordinator-1.3f0c9a"))(
    _agent_verb("abort"))


# --- busctl experiment (agents.experiment) -------------------------------------------------


@main.group("experiment")
def experiment_group() -> None:
    """Experiments as a workflow: a dataset × variants × repeats, each cell one session on the
    running topology, scored, journaled in the event log, resumable, reported.

    \b
    Examples:
      busctl experiment check examples/experiment/spec.toml
      busctl experiment run examples/experiment/spec.toml --name qa-1
      busctl experiment run examples/experiment/spec.toml --resume qa-1
      busctl experiment report qa-1 --json
      busctl experiment compare qa-1 qa-2
    """


def _experiment_spec(spec: str, limit: int = 0) -> Any:
    from agent_bus.agents.experiment.spec import SpecError, load_spec

    try:
        return load_spec(spec, limit=limit)
    except SpecError as exc:
        click.echo(f"Error: {exc}", err=True)
        raise click.exceptions.Exit(2) from None


@experiment_group.command("check")
@click.argument("spec", type=click.Path(dir_okay=False))
def experiment_check(spec: str) -> None:
    """Validate SPEC and its dataset; print what a run would do as JSON (exit 2 naming the
    bad key or dataset line).

    \b
    Examples:
      busctl experiment check examples/experiment/spec.toml
    """
    import json

    from agent_bus.agents.experiment.spec import summary

    click.echo(json.dumps(summary(_experiment_spec(spec))))


@experiment_group.command("run")
@hub_options
@click.argument("spec", type=click.Path(dir_okay=False))
@click.option("--name", default="", metavar="E", help="The experiment's id (checked unused "
              "in the log) [default: the spec's name plus -<12 random hex>].")
@click.option("--resume", default="", metavar="E",
              help="Run what experiment E (started from SPEC) has not finished yet.")
@click.option("--limit", type=click.IntRange(0), default=0,
              help="Only the first N samples (0: all); a resume needs the same.")
@click.option("--results", default="", metavar="FILE",
              help="The results file (JSON Lines) [default: E.results.jsonl].")
def experiment_run(hub: str, curve: CurveClient | None, spec: str, name: str, resume: str,
                   limit: int, results: str) -> None:
    """Run every sample × variant × repeat of SPEC as a session on the running topology
    (Ctrl-C stops; `--resume E` runs the rest); then write the results file and the report.

    \b
    Examples:
      busctl experiment run examples/experiment/spec.toml --name arith-1
      busctl experiment run examples/experiment/spec.toml --resume arith-1
    """
    import re
    import uuid

    from agent_bus.agents.client.remote import connect as connect_agents
    from agent_bus.agents.experiment.report import report, report_text
    from agent_bus.agents.experiment.runner import Runner, progress_for, write_results
    from agent_bus.agents.experiment.spec import NAME, SpecError

    if name and resume:
        raise click.UsageError("--name starts an experiment, --resume finishes one: give one")
    loaded = _experiment_spec(spec, limit)
    experiment = resume or name or f"{loaded.spec.name}-{uuid.uuid4().hex[:12]}"
    if not re.fullmatch(NAME, experiment):
        raise click.UsageError(f"--name/--resume {experiment!r}: letters, digits, _ or -")
    progress = progress_for(sys.stderr, loaded.planned)

    async def go() -> Any:
        async with connect_agents(hub, name="busctl-experiment", curve=curve,
                                  resume_wait=loaded.spec.run.resume_wait) as bus:
            try:
                return await Runner(bus, loaded, experiment, progress).run(
                    resume=bool(resume), fresh=not (resume or name))
            except SpecError as exc:
                return exc

    try:
        journal = run_async(go)
    except KeyboardInterrupt:  # the runs in progress were aborted (their prompts cancelled)
        click.echo(f"\nstopped; `busctl experiment run {spec} --resume {experiment}` runs "
                   f"the rest", err=True)
        raise click.exceptions.Exit(130) from None
    if isinstance(journal, SpecError):
        raise click.UsageError(str(journal))
    path = Path(results or f"{experiment}.results.jsonl")
    rows = write_results(path, journal.results.values())
    click.echo(report_text(report(journal, experiment)))
    click.echo(f"{rows} results in {path}", err=True)


def _journals(hub: str, curve: CurveClient | None, names: tuple[str, ...]) -> list[Any]:
    from agent_bus.agents.experiment.runner import IGNORED_WHY, read_journal

    async def go() -> list[Any]:
        async with connect(hub, name="busctl-experiment", role="client", curve=curve) as peer:
            return [await read_journal(peer, name) for name in names]

    journals = run_async(go)
    for name, journal in zip(names, journals, strict=True):
        if journal.plan is None and not journal.results:
            ignored = (f"; {journal.ignored} entries of it ignored, {IGNORED_WHY}"
                       if journal.ignored else "")
            raise click.UsageError(f"no experiment `{name}` in the hub's log (`busctl experiment "
                                   f"run SPEC --name {name}` starts one){ignored}")
    return journals


@experiment_group.command("report")
@hub_options
@click.argument("experiment")
@click.option("--json", "as_json", is_flag=True, help="One JSON object (variants: [{name, n, "
              "score, ci95, ...}]).")
@click.option("--plot", "plot_dir", default="", metavar="DIR",
              help="Also write score.png, cost.png and time.png into DIR (needs matplotlib: "
                   "the `plot` extra).")
def experiment_report(hub: str, curve: CurveClient | None, experiment: str,
                      as_json: bool, plot_dir: str) -> None:
    """Per variant: n, mean score with a 95% interval (Wilson for 0/1 scores, else t), tokens,
    cost, p50/p95 wall time, stop reasons, failures; from the journal in the hub's log.

    \b
    Examples:
      busctl experiment report arith-1
      busctl experiment report arith-1 --json --plot plots/
    """
    import json

    from agent_bus.agents.experiment.report import report, report_text
    from agent_bus.agents.experiment.spec import SpecError

    journal = _journals(hub, curve, (experiment,))[0]
    data = report(journal, experiment)
    click.echo(json.dumps(data) if as_json else report_text(data))
    if plot_dir:
        from agent_bus.agents.experiment.plot import plot

        try:
            written = plot(data, journal, Path(plot_dir))
        except SpecError as exc:
            raise click.UsageError(f"--plot: {exc}") from None
        click.echo(f"wrote {', '.join(map(str, written))}", err=True)


@experiment_group.command("replay")
@hub_options
@click.argument("experiment")
@click.option("--sample", required=True, metavar="ID", help="The sample's id (dataset `id`).")
@click.option("--variant", default="", help="Its variant [default: the experiment's first].")
@click.option("--repeat", type=click.IntRange(1), default=1, show_default=True)
@click.option("--as", "target", default="", metavar="E2",
              help="The replay's experiment id [default: the cell's tag plus .replay-<hex>].")
@click.option("--live-tools", is_flag=True,
              help="Run the tools again, in a fresh copy of the cell's workspace [default: "
                   "their results come from the log].")
@click.option("--spec", "spec_path", default="", metavar="SPEC",
              help="With --live-tools: the spec the experiment ran, whose dataset has the "
                   "sample's files [default: the path its plan names].")
def experiment_replay(hub: str, curve: CurveClient | None, experiment: str, sample: str,
                      variant: str, repeat: int, target: str, live_tools: bool,
                      spec_path: str) -> None:
    """Replay one cell of EXPERIMENT (its session, and the runs it asked) from the log, as
    `busctl replay` does a whole experiment: "identical" or the first divergence (exit 1).
    With --live-tools its tools run again in a fresh folder with the sample's files (read
    again from the dataset), as the cell's own folder was when the cell started.

    \b
    Examples:
      busctl experiment replay arith-1 --sample q07 --variant team --repeat 2
      busctl experiment replay arith-1 --sample q07 --live-tools
    """
    import uuid

    from agent_bus.agents.client.remote import connect as connect_agents
    from agent_bus.agents.experiment.runner import cell_workspaces
    from agent_bus.agents.experiment.spec import SpecError
    from agent_bus.agents.replay import replay_experiment

    journal = _journals(hub, curve, (experiment,))[0]
    variant = variant or (journal.plan.variants[0] if journal.plan else "")
    cell = journal.results.get((variant, sample, repeat))
    if cell is None or not cell.run_id:
        raise click.UsageError(f"--sample {sample} --variant {variant} --repeat {repeat}: no "
                               f"finished cell of experiment `{experiment}` (`busctl experiment "
                               f"report {experiment}` lists its variants)")
    target = target or f"{cell.tag}.replay-{uuid.uuid4().hex[:6]}"
    try:
        workspaces = cell_workspaces(msgspec.structs.replace(
            journal, results={cell.key: cell}), cell.tag, target, spec_path) if live_tools else {}
    except SpecError as exc:
        raise click.UsageError(str(exc)) from None

    async def go() -> object:
        async with connect_agents(hub, name="busctl-replay", curve=curve) as bus:
            try:
                return await replay_experiment(bus, cell.tag, target, only={cell.run_id},
                                               live_tools=live_tools, workspaces=workspaces)
            except ValueError as exc:
                return exc

    divergence = run_async(go)
    if isinstance(divergence, ValueError):
        raise click.UsageError(str(divergence))
    if divergence is not None:
        raise click.ClickException(f"{experiment} {variant}/{sample}/r{repeat} (run "
                                   f"{cell.run_id}) replayed as {target}: {divergence}")
    click.echo(f"{experiment} {variant}/{sample}/r{repeat} (run {cell.run_id}) replayed as "
               f"{target}: identical")


@experiment_group.command("compare")
@hub_options
@click.argument("first")
@click.argument("second")
@click.option("--json", "as_json", is_flag=True, help="One JSON object.")
def experiment_compare(hub: str, curve: CurveClient | None, first: str, second: str,
                       as_json: bool) -> None:
    """Pair the cells (variant, sample, repeat) of FIRST and SECOND: which flipped, and an
    exact paired test (McNemar's for 0/1 scores, else the sign test).

    \b
    Examples:
      busctl experiment compare arith-1 arith-2 --json
    """
    import json

    from agent_bus.agents.experiment.report import compare, compare_text

    a, b = _journals(hub, curve, (first, second))
    data = compare(a, b, (first, second))
    click.echo(json.dumps(data) if as_json else compare_text(data))


if __name__ == "__main__":
    main(prog_name="busctl")  # `python cli.py` is busctl too: its help and completion say so
