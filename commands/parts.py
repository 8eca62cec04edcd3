"""One part of a topology run in this process (what `busctl up` starts): hub, worker, gateway,
coordinator and the fake model server."""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import msgspec

from agent_bus.bus.client import DEFAULT_HUB, HUB_ENV
from agent_bus.bus.gcpolicy import tune_gc
from agent_bus.bus.paths import HUB_FORMS
from agent_bus.bus.security import CurveClient, CurveServer, InsecureBindError, check_bind
from agent_bus.commands.base import (
    budget_options,
    hub_address_option,
    hub_options,
    load_topology_or_exit,
    run_async,
    state_dir_for,
)
from agent_bus.commands.mcp import mcp_json_specs, mcp_specs, mcp_url_specs, require_mcp_sdk

if TYPE_CHECKING:  # the worker's own modules load in `worker` only
    from agent_bus.tools.sandbox import SandboxInfo

# --- busctl hub ---------------------------------------------------------------------------


_EVENT_LOG_OPTIONS = [
    click.option("--retain-days", type=click.FloatRange(0), default=7.0, show_default=True,
                 help="Prune logged events older than this many days (0: keep them)."),
    click.option("--retain-bytes", type=click.IntRange(0), default=0, show_default=True,
                 help="Prune the oldest logged events while the log holds more (0: no bound)."),
    click.option("--retain-deltas-until-end", is_flag=True,
                 help="Drop a run's streamed deltas (`message_update`) from the log once its "
                      "`message_end` (which holds the whole message) is logged."),
    click.option("--replay-priority", type=click.Choice(["idle", "low"]), default="idle",
                 show_default=True,
                 help="CPU priority of the log reader that serves replays: `idle` runs it only on "
                      "CPU nothing else wants (at nice 10 while the machine starves it), `low` at "
                      "nice 10 always (docs/reliability.md)."),
    click.option("--replay-pace-bytes", type=click.IntRange(0), default=4 * 1024 * 1024,
                 show_default=True,
                 help="Bytes a second of replay answers while requests are being routed, so a "
                      "replay of big events does not slow live requests; on an idle bus replays "
                      "go at full speed. 0: never paced (docs/reliability.md)."),
]


# Who may connect to the hub, and with which rights.
_ACCESS_OPTIONS = [
    click.option("--curve-secret", type=click.Path(exists=True, dir_okay=False), default=None,
                 help="The hub's secret key file: turns on CURVE encryption."),
    click.option("--curve-authorized", type=click.Path(exists=True, file_okay=False), multiple=True,
                 help="Directory of authorised client public keys (reloaded on change); "
                      "repeatable, each with its own roles.toml (`busctl up` adds the keys it "
                      "makes for its own processes this way)."),
    click.option("--insecure", is_flag=True,
                 help="Allow a non-loopback bind without CURVE (anyone who reaches it is let in)."),
    click.option("--credentials", type=click.Path(exists=True, dir_okay=False), default=None,
                 help="Roles of credentials presented in hellos (JSON; `busctl up` writes it): "
                      "peers without a known one serve nothing (docs/protocol.md section 8)."),
]


def _event_log_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`busctl hub`'s options of its event log: retention, and how replays of it are served."""
    return _stacked(_EVENT_LOG_OPTIONS, fn)


def _access_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`busctl hub`'s options of who may connect: CURVE keys and the peers' credentials."""
    return _stacked(_ACCESS_OPTIONS, fn)


def _stacked(options: list[Callable[[Any], Any]], fn: Callable[..., Any]) -> Callable[..., Any]:
    # applied last to first, as stacked decorators are: --help lists them in the list's order
    for option in reversed(options):
        fn = option(fn)
    return fn


def hub_command() -> click.Command:
    """`busctl hub`, built when used (or listed by --help): its budget options read
    bus.hub's defaults, and only the hub process needs that module."""

    @click.command(name="hub")
    @click.option("--hub", "endpoint", envvar=HUB_ENV, default=DEFAULT_HUB, show_default=True,
                  callback=hub_address_option,
                  help=f"Address to bind the request socket to: {HUB_FORMS}.")
    @click.option("--events", default="", callback=hub_address_option,
                  help="Address for the event socket [default: port + 1].")
    @click.option("--state-dir", type=click.Path(file_okay=False), default=None,
                  help="Where the event log (events.db) lives [default: <state home>/<project>/hub, "
                       "outside the current folder so no tool can reach it].")
    @click.option("--store", default="", metavar="URL",
                  help="The event log in a replicated store instead of the state dir's SQLite: "
                       "nats://HOST:PORT[,HOST:PORT...][?stream=S&replicas=3&timeout=1] (a NATS "
                       "JetStream cluster; the `nats` extra). See README, \"Choosing the event "
                       "store\".")
    @click.option("--standby", is_flag=True,
                  help="Start as the standby of a hub pair on the same --store: answer "
                       "`not_leader` (naming the primary), follow the log, and take over once "
                       "the primary's lease lapses. Needs a nats:// --store.")
    @click.option("--lease-ttl", type=float, default=0.0, metavar="SECONDS",
                  help="Seconds the leader lease lives unrenewed (with a nats:// --store): the "
                       "standby takes over within about this much after the primary is lost "
                       "[default: 5].")
    @click.option("--heartbeat-interval", type=click.FloatRange(0.05, 60), default=1.0,
                  show_default=True, help="Seconds between heartbeats.")
    @click.option("--liveness", type=click.IntRange(1, 100), default=3, show_default=True,
                  help="Missed heartbeats before a peer is declared dead.")
    @click.option("--max-message-bytes", type=click.IntRange(1024), default=16 * 1024 * 1024,
                  show_default=True, help="Largest accepted message; larger ones are dropped.")
    @budget_options
    @_event_log_options
    @_access_options
    @click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error", "critical"],
                                                   case_sensitive=False),
                  default="info", show_default=True, help="What the hub logs to stderr.")
    def hub(endpoint: str, events: str, state_dir: str | None, store: str, standby: bool,
            lease_ttl: float, heartbeat_interval: float,
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
        from agent_bus.bus.hub import HubConfig, HubConfigError, check_config, serve

        curve = hub_curve(endpoint, curve_secret, curve_authorized, insecure, events)
        config = HubConfig(endpoint=endpoint, events=events,
                           state_dir=str(state_dir_for(state_dir, "hub")), store=store,
                           standby=standby, lease_ttl=lease_ttl,
                           heartbeat_interval=heartbeat_interval, liveness=liveness,
                           max_message_bytes=max_message_bytes, retain_days=retain_days,
                           retain_bytes=retain_bytes, retain_deltas_until_end=retain_deltas_until_end,
                           replay_priority=replay_priority, replay_pace_bytes=replay_pace_bytes,
                           curve=curve, insecure=insecure, credentials=credentials or "",
                           **budgets)
        logging.getLogger().setLevel(log_level.upper())
        tune_gc()
        try:
            check_config(config)
        except HubConfigError as exc:  # it names the key; the flag has the same name
            raise click.UsageError(str(exc)) from None
        try:
            serve(config)
        except Exception as exc:  # a bind failure is the usual cause; say which address
            raise click.ClickException(f"hub on {endpoint} failed: {exc}") from None

    return hub


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


# --- busctl worker ------------------------------------------------------------------------


@click.command()
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
    from agent_bus.bus.procsec import drop_root_powers
    from agent_bus.tools import ToolLoadError
    from agent_bus.tools.sandbox import hub_folders
    from agent_bus.tools.worker import WorkerSettings, run_worker

    jail, hub = _enter_sandbox(hub, curve, sandbox, workspace, hide, read_only)
    drop_root_powers()  # tools run untrusted arguments: as root they could read every secret
    servers = (mcp_specs(mcp_commands, mcp_prefix) + mcp_url_specs(mcp_urls, mcp_headers, mcp_prefix)
               + mcp_json_specs(mcp_json))
    if servers:
        require_mcp_sdk("--mcp")
    modules = list(tool_modules) or ([] if servers else ["agent_bus.tools.builtin"])
    settings = WorkerSettings(hub=hub, tool_modules=modules, concurrency=concurrency,
                              # the pid outside the sandbox (inside, every worker is pid 1)
                              workspace=workspace, name=name or f"worker-{jail.pid or os.getpid()}",
                              allow_shell=allow_shell, curve=curve, mcp=servers,
                              read_only=list(read_only), sandbox=jail,
                              # how its run_shell calls are contained (its `SandboxPolicy`)
                              sandbox_mode=sandbox, shell_network=shell_network,  # type: ignore[arg-type]
                              shell_hide=list(hub_folders(hub)))
    tune_gc()
    try:
        run_async(run_worker, settings)
    except ToolLoadError as exc:
        raise click.ClickException(str(exc)) from None
    except KeyboardInterrupt:
        pass


def _enter_sandbox(hub: str, curve: CurveClient | None, sandbox: str, workspace: str,
                   hide: tuple[str, ...], read_only: tuple[str, ...]) -> tuple[SandboxInfo, str]:
    """First: re-run this command under bubblewrap where it can (tools/sandbox.py), its keys
    handed over in memory. Returns the sandbox and the hub's address to use in there."""
    from agent_bus.bus.paths import claim_worker_credential, local_alias
    from agent_bus.bus.security import take_back
    from agent_bus.tools.sandbox import SandboxUnavailable, enter

    if curve is None:  # `--hub 7400`: the local topology's socket, which the sandbox exposes
        hub = ",".join(local_alias(one) for one in hub.split(","))  # each of a list's
        claim_worker_credential(hub.split(",")[0])  # a worker's rights, not its owner's
    handed, hide = _hand_over_keys(curve, workspace, hide)
    try:
        jail = enter(sandbox, workspace, hub, hide, read_only)  # type: ignore[arg-type]  # a click.Choice
    except SandboxUnavailable as exc:
        raise click.BadParameter(str(exc), param_hint="--sandbox") from None
    finally:  # still here outside a sandbox: the keys stay where they were
        if handed is not None:
            take_back(handed)
    _hold_keys(curve)
    return jail, jail.hub or hub


def _hand_over_keys(curve: CurveClient | None, workspace: str,
                    hide: tuple[str, ...]) -> tuple[int | None, tuple[str, ...]]:
    """Before the sandbox: the worker's CURVE keys go to its re-executed self in a pipe, and its
    key files (with the secrets beside them) are hidden in there, so no tool, shell or MCP server
    reads them. Returns the pipe's read end (None: no keys) and the paths to hide. Keys that
    came in memory (a Ray keeper hands them over so, `agents/launch/ray_actors.py`) go on the
    same way: there is no file to hide."""
    from agent_bus.bus.security import HELD, hand_over, key_hiding

    if curve is None:
        return None, hide
    if curve.secret_key_file == HELD:
        return hand_over(curve), hide
    return hand_over(curve), (*hide, *key_hiding([curve.secret_key_file], Path(workspace)))


def _hold_keys(curve: CurveClient | None) -> None:
    """Inside the sandbox, holding keys in memory: no tool's child process (an MCP server, a
    shell) may read this process's memory."""
    from agent_bus.bus.procsec import make_undumpable
    from agent_bus.bus.security import HELD

    if curve is not None and curve.secret_key_file == HELD:
        make_undumpable()


# --- busctl gateway / coordinator / fake-llm --------------------------------------------


def _read_secrets_line() -> dict[str, str]:
    """`--secrets-on-stdin`: the first stdin line, a JSON object of variable names to values."""
    line = sys.stdin.buffer.readline()
    try:
        return msgspec.json.decode(line, type=dict[str, str])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise click.BadParameter(f"the first stdin line must be a JSON object of secret "
                                 f"variables ({exc})", param_hint="--secrets-on-stdin") from None


@click.command()
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
    topology = load_topology_or_exit(topology_file)
    settings = GatewaySettings(hub=hub, models=topology.model_configs(),
                               default_model=topology.gateways.default_model,
                               name=name or f"gateway-{os.getpid()}", curve=curve)
    try:
        tune_gc()
        run_async(functools.partial(run_gateway, settings, secrets=secrets))
    except KeyboardInterrupt:
        pass


@click.command()
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

    topology = load_topology_or_exit(topology_file)
    agents = _hosted_agents(topology, agent_names)
    settings = CoordinatorSettings(hub=hub, agents=agents,
                                   state_dir=str(state_dir_for(state_dir, "agents")),
                                   name=name or f"coordinator-{os.getpid()}", curve=curve,
                                   models=topology.model_configs())
    tune_gc()
    try:
        run_async(run_coordinator, settings)
    except CoordinatorError as exc:
        raise click.ClickException(str(exc)) from None
    except KeyboardInterrupt:
        pass


def _hosted_agents(topology: Any, agent_names: tuple[str, ...]) -> list[Any]:
    """`--agent`'s agents of the topology (all without it); a name it lacks is a usage error."""
    known = {a.name for a in topology.agents}
    unknown = [n for n in agent_names if n not in known]
    if unknown:
        raise click.BadParameter(f"{', '.join(unknown)} not in the topology "
                                 f"(agents: {', '.join(sorted(known))})", param_hint="--agent")
    return [a for a in topology.agents if not agent_names or a.name in agent_names]


FAKE_LLM_EXAMPLES = """

\b
Examples:
  busctl fake-llm --port 8081       # then OPENAI_BASE_URL=http://127.0.0.1:8081/v1
  busctl fake-llm --script rules.json --port 0   # the first line names the URL (JSON)
"""


def fake_llm_command() -> click.Command:
    from agent_bus.agents.gateway.fakellm import fake_llm_command

    # The examples name busctl, so they are added where busctl mounts the command.
    if "Examples:" not in (fake_llm_command.help or ""):
        fake_llm_command.help = (fake_llm_command.help or "").rstrip() + FAKE_LLM_EXAMPLES
    return fake_llm_command
