"""`busctl up`: bring a whole topology up as supervised child processes, and take it down.

Order: hub → (demo model server) → gateways, workers and coordinators in parallel → extra
processes. Each child is a `busctl <piece>` process that prints a JSON ready line once it has
registered with the hub. Stop order is the reverse, so agents finish before their tools and model
go away and the hub is last. SIGINT, SIGTERM and SIGHUP (a closed terminal) all stop in that order.

Run files in the state directory: `up.pid` (the supervisor), `up.json` (every child's pid, see
`agents.launch.supervisor.RunFile`), `up.ready` (a detached `up` is ready) and `control.sock`. The control
socket (a Unix socket, mode 0600, one JSON request line and one reply line) is how `busctl ps`,
`restart` and `scale` reach the running supervisor; a stopped topology removes them all.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any, Protocol, TextIO

import anyio
import anyio.abc
import msgspec

from agent_bus.agents.gateway.wire import ModelConfig
from agent_bus.agents.launch import credentials, curve_keys
from agent_bus.agents.launch.supervisor import (
    Child,
    ChildFailed,
    ChildRecord,
    ChildSpec,
    RunFile,
    Supervisor,
    python_argv,
    read_run_file,
    same_process,
)
from agent_bus.agents.launch.topology import Topology, WorkerGroup
from agent_bus.bus import events as ev
from agent_bus.bus.client import Peer, connect
from agent_bus.bus.paths import (
    ensure_state_dir,
    ipc_listening,
    local_hub_endpoint,
    loopback_port,
    remove_tcp_alias,
    set_tcp_alias,
    state_home,
    tcp_alias,
    topology_runtime_dir,
)
from agent_bus.bus.security import CurveClient, is_loopback_endpoint
from agent_bus.tools.sandbox import SandboxInfo, describe, required_problem

log = logging.getLogger("agents.launch.up")

DEMO_MODEL = "demo"
RUN_FILES = ("up.pid", "up.json", "up.ready", "control.sock")
MAX_CONTROL_LINE = 64 * 1024


class Placed(Protocol):
    """Another engine's hand in `up` (slurm_engine.SlurmPlacer): where each child runs, and
    what it publishes once the topology is ready."""

    stop_signal: int  # what asks a child to stop

    def launch(self, spec: ChildSpec) -> tuple[list[str], list[str]]: ...

    def announce(self, endpoint: str, events: str, sup: Supervisor) -> None: ...


class UpOptions(msgspec.Struct):
    demo: bool = False
    extra_tools: list[str] = msgspec.field(default_factory=list)
    workers: int | None = None
    hub: str | None = None
    detach_ready_file: str = ""  # where a detached `up` reports readiness [default: up.ready]
    ready_json: bool = False  # `up --json`: the ready line on stdout too, for a script to read
    model_file: str = ""  # a GGUF file: the default model, served by the gateway (llama.cpp)
    topology_file: str = ""  # the `-c` file: read-only for the tools (a model must not rewrite it)


LOCAL_MODEL = "local"  # the alias `--model-file` gives its model
LOCAL_MODEL_READY_TIMEOUT = 300.0  # seconds: a gateway hosting a model loads it before its ready line


def resolve(topology: Topology, options: UpOptions) -> Topology:
    """Apply command-line overrides to a topology (a copy)."""
    topo = msgspec.convert(msgspec.to_builtins(topology), Topology)
    if options.hub:
        topo.hub.endpoint = options.hub
    if options.extra_tools and topo.workers:
        topo.workers[0].tools = [*topo.workers[0].tools, *options.extra_tools]
    if options.workers is not None and topo.workers:
        topo.workers[0].count = options.workers
    for group in topo.workers:  # absolute: the worker resolves nothing against its own cwd
        group.read_only = [str(Path(p).expanduser().resolve()) for p in
                           [*group.read_only, *([options.topology_file] * bool(options.topology_file))]]
    if options.model_file:
        # Added, not replacing: agents that name another `[models.x]` keep it.
        topo.models[LOCAL_MODEL] = ModelConfig(
            provider="llamacpp", gguf=str(Path(options.model_file).expanduser().resolve()))
        topo.gateways.default_model = LOCAL_MODEL
    return topo


def state_dir(topology: Topology) -> Path:
    return topology.state_path()


def hub_argv(topo: Topology, standby_events: str | None = None) -> list[str]:
    """The hub's command; with `standby_events` (its events address, "" for the default) the
    standby's, at `[hub] standby`, with a state dir of its own."""
    hub = topo.hub
    standby = standby_events is not None
    endpoint, events = (hub.standby, standby_events or "") if standby else (hub.endpoint,
                                                                            hub.events)
    argv = python_argv("hub", "--hub", endpoint,
                       "--state-dir", str(state_dir(topo) / ("hub-standby" if standby else "hub")),
                       "--heartbeat-interval", str(hub.heartbeat_interval),
                       "--liveness", str(hub.liveness),
                       "--max-message-bytes", str(hub.max_message_bytes))
    if events:
        argv += ["--events", events]
    if hub.store:
        argv += ["--store", hub.store]
    if hub.lease_ttl:
        argv += ["--lease-ttl", str(hub.lease_ttl)]
    if standby:
        argv.append("--standby")
    if hub.curve_secret:  # the user's authorised keys, then those `up` made for its processes
        argv += ["--curve-secret", hub.curve_secret, "--curve-authorized", hub.curve_authorized,
                 "--curve-authorized", str(curve_keys.folder_of(topo, state_dir(topo)))]
    if hub.insecure:
        argv.append("--insecure")
    if credentials.enabled(topo, state_dir(topo)):
        argv += ["--credentials", str(state_dir(topo) / "hub" / "credentials.json")]
    return argv


def model_env(topo: Topology) -> tuple[dict[str, str], dict[str, str]]:
    """The models' keys (their `api_key_env`) and the OPENAI_*/ANTHROPIC_* settings a gateway
    without [models] is configured from, taken from this environment: what an engine that
    starts the gateway elsewhere hands it (Ray: in an actor's memory; Slurm: a 0600 file)."""
    from agent_bus.agents.launch.supervisor import SECRET_NAME_RE

    names = {m.api_key_env for m in topo.models.values() if m.api_key_env}
    provider = {k: v for k, v in os.environ.items() if k.startswith(("OPENAI_", "ANTHROPIC_"))}
    secrets = {k: v for k, v in os.environ.items() if k in names}
    secrets.update({k: v for k, v in provider.items() if SECRET_NAME_RE.search(k)})
    return secrets, {k: v for k, v in provider.items() if k not in secrets}


def client_curve(topo: Topology) -> CurveClient | None:
    """`up`'s own identity on a CURVE hub: the owner's key (its processes have their own,
    `curve_keys`)."""
    hub = topo.hub
    if not hub.curve_secret:
        return None
    return CurveClient(server_public_key_file=hub.curve_server_key,
                       secret_key_file=hub.curve_client_key)


def child_specs(topo: Topology, endpoint: str) -> list[ChildSpec]:
    """Gateways, workers and coordinators (started in parallel once the hub is up).

    Gateways and coordinators read the topology from stdin (`--topology -`): the supervisor hands
    it over from memory at every restart, so no file a tool might reach can redirect them.
    """
    state = state_dir(topo)
    specs = [_identify(spec, topo, state) for spec in _piece_specs(topo, endpoint)]
    for proc in topo.all_processes():  # with the [ui] and [otel] children
        argv = proc.command
        if argv and argv[0] == "busctl":  # this installation's busctl, whatever PATH says
            argv = python_argv(*argv[1:])
        env = {"BUSCTL_HUB": endpoint, **proc.env}
        specs.append(credentials.attach(
            ChildSpec(proc.name, argv, env=env, restart=proc.restart, role="process",
                      pass_env=proc.pass_env, ready_timeout=proc.ready_timeout,
                      ready_when="port" if proc.ready_port else proc.ready,
                      ready_port=proc.ready_port), topo, state))
    return specs


def process_spec(topo: Topology, endpoint: str, name: str) -> ChildSpec:
    """The spec of one gateway, worker or coordinator by its name, as `child_specs` makes it (a
    worker of a group scaled past its `count` too): what another engine runs (ray_engine.py)."""
    state = state_dir(topo)
    for spec in _piece_specs(topo, endpoint):
        if spec.name == name:
            return _identify(spec, topo, state)
    group_name, _, index = name.rpartition("-")
    for group in topo.workers:
        if group.name == group_name and index.isdigit():
            return _identify(worker_spec(group, int(index), endpoint, _hidden(topo, group)),
                             topo, state)
    raise ChildFailed(f"no process `{name}` in this topology")


def _identify(spec: ChildSpec, topo: Topology, state: Path) -> ChildSpec:
    """A child's own identity: its credential (a local hub) or its CURVE key (a CURVE hub)."""
    return credentials.attach(curve_keys.attach(spec, topo, state), topo, state)


def _piece_specs(topo: Topology, endpoint: str) -> list[ChildSpec]:
    config = msgspec.json.encode(topo)
    specs: list[ChildSpec] = []
    for i in range(topo.gateways.count):
        # keys on stdin (a JSON line before the topology), never in its environment block
        specs.append(ChildSpec(f"gateway-{i + 1}", python_argv(
            "gateway", "--hub", endpoint, "--secrets-on-stdin", "--topology", "-",
            "--name", f"gateway-{i + 1}"),
            role="gateway", inherit_env=True, stdin_data=config, secrets_on_stdin=True,
            secret_names=[m.api_key_env for m in topo.models.values() if m.api_key_env],
            ready_timeout=_gateway_ready_timeout(topo)))
    for group in topo.workers:
        specs += [worker_spec(group, i + 1, endpoint, _hidden(topo, group))
                  for i in range(group.count)]
    count = topo.coordinators
    for i in range(count):
        mine = [a.name for a in topo.agents[i::count]] if count else []
        if not mine:
            continue
        argv = python_argv("coordinator", "--hub", endpoint, "--topology", "-",
                           "--state-dir", str(state_dir(topo) / "agents"),
                           "--name", f"coordinator-{i + 1}")
        for agent in mine:
            argv += ["--agent", agent]
        specs.append(ChildSpec(f"coordinator-{i + 1}", argv, role="coordinator",
                               stdin_data=config))
    return specs


def _gateway_ready_timeout(topo: Topology) -> float:
    hosts_a_model = any(m.provider == "llamacpp" for m in topo.models.values())
    return LOCAL_MODEL_READY_TIMEOUT if hosts_a_model else ChildSpec.ready_timeout


def _hidden(topo: Topology, group: WorkerGroup) -> list[str]:
    """What a worker's sandbox hides: the state directory and the user's CURVE key folders."""
    return [str(state_dir(topo)), *curve_keys.hidden_from(group, topo)]


def worker_spec(group: WorkerGroup, index: int, endpoint: str,
                hide: list[str] | None = None) -> ChildSpec:
    """A worker of `group`; `hide`: what its sandbox hides (`_hidden`)."""
    name = f"{group.name}-{index}"
    argv = python_argv("worker", "--hub", endpoint, "--concurrency", str(group.concurrency),
                       "--workspace", group.workspace, "--name", name)
    for module in group.tools:
        argv += ["--tools", module]
    if group.shell:
        argv.append("--shell")
    for path in group.read_only:
        argv += ["--read-only", path]
    if group.network:
        argv.append("--shell-network")
    argv += ["--sandbox", group.sandbox, *[a for path in hide or [] for a in ("--hide", path)]]
    if not group.mcp:
        return ChildSpec(name, argv, role="worker", pass_env=group.pass_env)
    # on stdin, not argv: an MCP server's `env` may hold secrets that `ps` would show
    return ChildSpec(name, [*argv, "--mcp-servers", "-"], role="worker", pass_env=group.pass_env,
                     stdin_data=msgspec.json.encode(group.mcp))


async def _start_all(sup: Supervisor, specs: list[ChildSpec]) -> None:
    async with anyio.create_task_group() as tg:
        for spec in specs:
            tg.start_soon(sup.start, spec)


async def _publisher(peer: Peer) -> Any:
    async def notify(what: str, child: Child, code: int | None) -> None:
        event: ev.Event
        if what == "restarted":
            event = ev.ProcessRestarted(process=child.spec.name, exit_code=code,
                                        restarts=child.restarts)
        else:
            event = ev.ProcessGaveUp(process=child.spec.name, exit_code=code,
                                     restarts=child.restarts)
        await peer.publish(event)

    return notify


def summary(topo: Topology, sup: Supervisor, endpoint: str, events: str,
            tools: list[str], port: int | None = None) -> list[str]:
    state = state_dir(topo)
    lines = [f"hub        {endpoint}  (events {events})"]
    if topo.hub.standby:  # (its lease's TTL bounds a takeover: docs/reliability.md)
        lines.append(f"standby    {topo.hub.standby}  (takes over when the hub's lease lapses)")
    procs = "  ".join(f"{name}[{child.pid}]" for name, child in sup.children.items())
    lines.append(f"processes  {procs}")
    lines.append(f"agents     {', '.join(a.name for a in topo.agents)}")
    lines.append(f"tools      {', '.join(tools) or '(none)'}")
    lines += sandbox_lines(sup)
    lines.append(f"state      {state}  (logs in {state / 'logs'})")
    ui = sup.children.get("ui")
    if ui is not None and ui.ready and ui.spec.role == "process":
        lines.append(f"ui         {ui.ready.get('url', '?')}")
    hub = hub_flag(endpoint, port)
    agent = next((f" --agent {a.name}" for a in topo.agents[:1] if a.name != DEFAULT_AGENT), "")
    tries = [f"busctl run{hub}{agent} \"hello\""] if topo.agents else []
    lines.append("try        " + "   ·   ".join([*tries, f"busctl watch{hub}", f"busctl status{hub}"]))
    return lines


DEFAULT_AGENT = "assistant"  # `busctl run`'s --agent default


def hub_flag(endpoint: str, port: int | None) -> str:
    """` --hub ADDR` for a client in another folder to reach this hub ("" at the default
    address): the loopback port it was asked for (an alias of its ipc:// socket), else the
    address it is bound to."""
    from agent_bus.bus.client import DEFAULT_HUB

    if port is not None:
        return "" if f"tcp://127.0.0.1:{port}" == DEFAULT_HUB else f" --hub {port}"
    return "" if endpoint == DEFAULT_HUB else f" --hub {endpoint}"


def sandbox_lines(sup: Supervisor) -> list[str]:
    """What each worker runs in (tools/sandbox.py); workers alike share a line. Without a
    sandbox the line says so plainly: the file tools' path filter is then the only guard."""
    kinds: dict[str, list[str]] = {}
    for name, child in sup.children.items():
        if child.spec.role == "worker" and child.ready:
            info = msgspec.convert(child.ready.get("sandbox") or {"kind": "none", "reason": "?"},
                                   SandboxInfo)
            kinds.setdefault(describe(info), []).append(name)
    return [f"sandbox    {'NO SANDBOX: ' if text.startswith('none') else ''}{text}  "
            f"({', '.join(names)})" for text, names in kinds.items()]


async def _live_tools(peer: Peer) -> list[str]:
    status = await peer.status()
    return sorted(s.name[5:] for s in status.services if s.name.startswith("tool."))


async def up(topology: Topology, options: UpOptions, out: TextIO, color: bool,
             placed: Placed | None = None) -> int:
    """Run the topology until SIGINT/SIGTERM/SIGHUP. Returns the exit code. `placed`: another
    engine's placement of each child (Slurm's srun steps), and where it publishes the hub."""
    topo = resolve(topology, options)
    # Everything the topology writes (event log, conversations, logs, run files) is its user's
    # alone: files 0600 in 0700 folders; the children inherit the umask.
    os.umask(0o077)
    state = ensure_state_dir(state_dir(topo))
    topo.hub.state_dir = str(state)  # children resolve nothing relative to their own cwd
    port = make_local(topo, state)
    if credentials.enabled(topo, state):
        credentials.make(topo, state)
    if curve_keys.enabled(topo):
        curve_keys.make(topo, state)
    try:
        async with Supervisor(state / "logs", out, color, placed.launch if placed else None,
                              placed.stop_signal if placed else signal.SIGTERM) as sup:
            _claim_run_files(sup, state)
            await _run(topo, options, sup, state, out, port, placed)
    finally:
        remove_run_files(state, os.getpid())
        if port is not None:
            remove_tcp_alias(port, topo.hub.endpoint)
        remove_runtime(state)
    return 0


def remove_runtime(state: Path) -> None:
    """The topology's runtime folder (its sockets, credentials and keys), once its hub is gone:
    a stopped topology leaves nothing there. Kept while its hub's socket still answers (a hub
    that could not be stopped keeps its address)."""
    folder = topology_runtime_dir(state)
    if ipc_listening(str(folder / "hub")):
        credentials.remove(state)  # what it holds is still worth nothing after this run
        return
    shutil.rmtree(folder, ignore_errors=True)


def make_local(topo: Topology, state: Path) -> int | None:
    """A hub on loopback tcp without CURVE would answer every local user: it listens on ipc://
    sockets in a private runtime directory instead (bus/paths.py), and its tcp port becomes an
    alias of them for this user's clients. Returns that port (None: no alias; the tcp address
    is kept as given with CURVE, or `insecure`, or a non-loopback address). A standby on
    loopback listens beside it (`…/hub-standby`): it answers only this user too, and this
    user's clients present the owner's credential to either hub of the pair."""
    hub = topo.hub
    if hub.curve_secret or hub.insecure or not hub.endpoint.startswith("tcp://"):
        return None
    if not is_loopback_endpoint(hub.endpoint):
        return None
    port = loopback_port(hub.endpoint)
    hub.endpoint, hub.events = local_hub_endpoint(state), ""
    if hub.standby and is_loopback_endpoint(hub.standby):  # a pair on one machine: both private
        hub.standby = f"{hub.endpoint}-standby"
    return port


async def _run(topo: Topology, options: UpOptions, sup: Supervisor, state: Path,
               out: TextIO, port: int | None = None, placed: Placed | None = None) -> None:
    with anyio.open_signal_receiver(*STOP_SIGNALS) as signals:
        hub = await sup.start(ChildSpec("hub", hub_argv(topo), role="hub"))
        assert hub.ready is not None
        endpoint, events = hub.ready["endpoint"], hub.ready["events"]
        # A restarted hub must come back where its peers reconnect: pin the bound addresses
        # (`--hub tcp://127.0.0.1:0` would otherwise pick new ports on every restart).
        topo.hub.endpoint, topo.hub.events = endpoint, events
        hub.spec.argv = hub_argv(topo)
        if port is not None:  # `--hub tcp://127.0.0.1:PORT` leads this user's clients here
            set_tcp_alias(port, endpoint)
        sup.run_info.endpoint, sup.run_info.events = endpoint, events
        sup.save_run_file()
        hubs = await _start_standby(sup, topo, endpoint)
        if hubs != endpoint:  # commands run in this folder follow the pair too (hub_here)
            sup.run_info.endpoint = hubs
            sup.save_run_file()
        if options.demo:
            fake = await sup.start(ChildSpec("fake-llm", python_argv("fake-llm", "--port", "0"),
                                             role="fake-llm"))
            assert fake.ready is not None
            topo.models = {DEMO_MODEL: ModelConfig(provider="openai", model="demo-model",
                                                  base_url=fake.ready["base_url"])}
            topo.gateways.default_model = DEMO_MODEL
        # For people (what is running); never read back by the children, see child_specs.
        (state / "topology.json").write_bytes(msgspec.json.format(msgspec.json.encode(topo)))
        await _start_all(sup, child_specs(topo, hubs))
        async with connect(hubs, name="busctl-up", role="supervisor",
                           curve=client_curve(topo)) as peer, anyio.create_task_group() as tg:
            sup.notify = await _publisher(peer)
            await _serve_control(tg, sup, topo, state / "control.sock")
            for line in summary(topo, sup, endpoint, events, await _live_tools(peer), port):
                out.write(line + "\n")
            out.flush()
            _announce(options, state, endpoint, events)
            if placed is not None:
                placed.announce(endpoint, events, sup)
            async for signum in signals:
                out.write(f"got {signal.Signals(signum).name}\n")
                break
            tg.cancel_scope.cancel()
        await _stop(sup, out)


async def _start_standby(sup: Supervisor, topo: Topology, endpoint: str) -> str:
    """With `[hub] standby`: the standby hub (on its own address; on one machine another
    process), its bound addresses pinned for its restarts like the primary's. The hub address
    every other process is given: "primary,standby" (a client moves to the one that leads),
    or the primary's alone."""
    if not topo.hub.standby:
        return endpoint
    standby = await sup.start(ChildSpec("hub-standby", hub_argv(topo, ""), role="hub"))
    assert standby.ready is not None
    topo.hub.standby = standby.ready["endpoint"]
    standby.spec.argv = hub_argv(topo, standby.ready["events"])
    return f"{endpoint},{topo.hub.standby}"


# A closed terminal or a lost SSH session sends SIGHUP: it stops the topology like Ctrl-C.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _claim_run_files(sup: Supervisor, state: Path) -> None:
    (state / "up.pid").write_text(f"{os.getpid()}\n")
    sup.run_file = state / "up.json"
    sup.run_info.control = str(state / "control.sock")
    sup.save_run_file()


def remove_run_files(state: Path, pid: int) -> None:
    """Remove the run files of the supervisor `pid` (never those of a later `up`)."""
    info = read_run_file(state / "up.json")
    if info is not None and info.pid != pid:
        return
    for name in RUN_FILES:
        (state / name).unlink(missing_ok=True)
    (state / "up.tmp").unlink(missing_ok=True)
    (state / "up.ready.tmp").unlink(missing_ok=True)


# --- before anything starts: is this place free? -----------------------------------------------


def running_here(state: Path) -> RunFile | None:
    """The run file of a topology whose supervisor or children still run from `state`."""
    info = read_run_file(state / "up.json")
    if info is None:
        return None
    alive = same_process(ChildRecord(pid=info.pid, start_ticks=0)) or any(
        same_process(c) for c in info.children.values())
    return info if alive else None


def preflight(topo: Topology) -> str:
    """Why this topology cannot start here (empty when it can), checked before any file is
    touched: one topology per state directory, and a free hub address."""
    state = state_dir(topo)
    for i, group in enumerate(topo.workers):
        if group.sandbox == "required" and group.count:
            why = required_problem(Path(group.workspace), topo.hub.endpoint)
            if why:
                return (f"workers[{i}].sandbox: \"required\", but no sandbox can be set up here "
                        f"({why}); install bubblewrap (package `bubblewrap`) and allow user "
                        f"namespaces, or set sandbox = \"auto\" to run without one")
    other = running_here(state)
    if other is not None:
        return (f"a topology is already up from this directory (supervisor pid {other.pid}, hub "
                f"{other.endpoint or '?'}, state {state}); stop it with `busctl down`, or give "
                f"this one its own state directory (`hub.state_dir` in the topology)")
    port = loopback_port(topo.hub.endpoint)
    alias = tcp_alias(port) if port is not None else ""
    if alias:
        return (f"{topo.hub.endpoint} is already the address of another topology of yours (its "
                f"hub listens on {alias}); stop it with `busctl down` from its directory, or "
                f"choose another address with `--hub tcp://127.0.0.1:PORT`")
    events = _events_bound(topo)
    for address in (topo.hub.endpoint, events):
        what = " (the hub's events port)" if address == events else ""
        if address and not _tcp_free(address):
            return (f"{address}{what} is already in use{_owner(address)}; choose another address "
                    f"with `--hub tcp://127.0.0.1:PORT` (or `--hub tcp://127.0.0.1:0` for any "
                    f"free port)")
    return ""


def _events_bound(topo: Topology) -> str:
    """The events address the hub will bind on tcp: hub.events, or port + 1 when the hub keeps
    its tcp address (CURVE, `insecure`, not loopback; a local hub listens on ipc:// instead,
    `make_local`). A busy events port would otherwise surface as a hub restart loop."""
    hub = topo.hub
    if hub.events or not hub.endpoint.startswith("tcp://"):
        return hub.events
    if not (hub.curve_secret or hub.insecure or not is_loopback_endpoint(hub.endpoint)):
        return ""
    from agent_bus.bus.hub import default_events_endpoint

    return default_events_endpoint(hub.endpoint)


def _tcp_free(address: str) -> bool:
    """False when something listens on a tcp:// address (port 0 is always free) or an ipc://
    socket accepts a connection (a bind there would take another hub's socket file)."""
    if address.startswith("ipc://"):
        return not ipc_listening(address[6:])
    if not address.startswith("tcp://"):
        return True
    host, _, port = address[6:].rpartition(":")
    if not port.isdigit() or int(port) == 0:
        return True
    host = host.strip("[]")
    if host in ("*", ""):
        host = "0.0.0.0"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # SO_REUSEADDR as ZeroMQ sets it: only a listener makes the bind fail, not TIME_WAIT
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, int(port)))
        except OSError:
            return False
    return True


def _owner(address: str) -> str:
    """`, by the topology started from DIR (pid N)` when a run file on this machine says so."""
    try:
        run_files = list(state_home().glob("*/up.json"))
    except OSError:
        return ""
    for path in run_files:
        info = read_run_file(path)
        if (info is not None and address in (*info.endpoint.split(","), info.events)
                and running_here(path.parent)):
            return f", by the topology started from {info.cwd} (supervisor pid {info.pid})"
    return ""


# --- busctl down ------------------------------------------------------------------------------


def stop_topology(state: Path, timeout: float) -> tuple[str, list[str]]:
    """Stop every process of the topology in `state`: the supervisor first (it stops its
    children in order), then whatever it left (it may have been SIGKILLed), SIGKILL after
    `timeout`. Returns what was done and the processes that could not be stopped."""
    info = read_run_file(state / "up.json") or _legacy_run_file(state)
    if info is None:
        raise ChildFailed(f"nothing is up here (no run file in {state}); was it started from "
                          f"another directory or with another `-c` file?")
    supervisor = ChildRecord(pid=info.pid, start_ticks=0)
    was_up = same_process(supervisor)
    left = {name: rec for name, rec in info.children.items() if same_process(rec)}
    deadline = time.monotonic() + timeout
    if was_up:
        _signal_group(info.pid, signal.SIGTERM, group=False)
        _wait_gone([supervisor], deadline)
    for record in left.values():  # a no-op for those the supervisor stopped
        _signal_group(record.pid, signal.SIGTERM)
    _wait_gone([supervisor, *left.values()], deadline)
    for record in [supervisor, *left.values()]:
        if same_process(record):
            _signal_group(record.pid, signal.SIGKILL, group=record is not supervisor)
    _wait_gone([supervisor, *left.values()], time.monotonic() + 2)
    failed = [f"{name} (pid {rec.pid})" for name, rec in
              [("supervisor", supervisor), *left.items()] if same_process(rec)]
    if not failed:
        remove_run_files(state, info.pid)
        remove_runtime(state)  # a supervisor that was killed left it behind
    if was_up:
        return f"stopped (supervisor pid {info.pid}, {len(info.children)} processes)", failed
    if left:
        return (f"the supervisor (pid {info.pid}) was already gone; stopped its "
                f"{len(left)} leftover processes: {', '.join(left)}"), failed
    return f"nothing was running (supervisor pid {info.pid} had exited); removed its run files", failed


def _legacy_run_file(state: Path) -> RunFile | None:
    """Only `up.pid` (a detached `up` that died before writing `up.json`)."""
    try:
        pid = int((state / "up.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return RunFile(pid=pid, cwd="")


def _signal_group(pid: int, sig: int, group: bool = True) -> None:
    try:
        os.killpg(pid, sig) if group else os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_gone(records: list[ChildRecord], deadline: float) -> None:
    while any(same_process(r) for r in records) and time.monotonic() < deadline:
        time.sleep(0.05)


# --- the control socket: ps, restart, scale -----------------------------------------------------


class ControlRequest(msgspec.Struct, forbid_unknown_fields=True):
    op: str  # "ps" | "restart" | "scale"
    name: str = ""  # restart: the child; scale: the worker group (`workers`: the first)
    count: int = 0  # scale: processes wanted


class ControlReply(msgspec.Struct):
    ok: bool
    error: str = ""
    unknown: bool = False  # the error is a name (process, group) or count the user got wrong
    message: str = ""
    processes: list[dict[str, Any]] = msgspec.field(default_factory=list)


async def _serve_control(tg: anyio.abc.TaskGroup, sup: Supervisor, topo: Topology,
                         path: Path) -> None:
    """Listen on `path` (mode 0600: only this user may restart or scale the topology)."""
    path.unlink(missing_ok=True)
    old = os.umask(0o177)
    try:
        listener = await anyio.create_unix_listener(path)
    except OSError as exc:  # e.g. a path longer than a socket address allows
        log.warning("no control socket at %s (%s): restart and scale are unavailable", path, exc)
        return
    finally:
        os.umask(old)

    async def handle(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            reply = await _answer(sup, topo, stream)
            try:
                await stream.send(msgspec.json.encode(reply) + b"\n")
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                pass  # the client went away; nothing to tell

    tg.start_soon(listener.serve, handle)


async def _answer(sup: Supervisor, topo: Topology, stream: anyio.abc.SocketStream) -> ControlReply:
    """Read one request and carry it out; every failure becomes an error reply, never a crash."""
    from anyio.streams.buffered import BufferedByteReceiveStream

    try:
        with anyio.fail_after(5):
            line = await BufferedByteReceiveStream(stream).receive_until(b"\n", MAX_CONTROL_LINE)
        request = msgspec.json.decode(line, type=ControlRequest)
    except (TimeoutError, anyio.IncompleteRead, anyio.DelimiterNotFound, anyio.EndOfStream,
            msgspec.DecodeError, msgspec.ValidationError, OSError) as exc:
        log.warning("control socket: bad request dropped: %s", exc)
        return ControlReply(ok=False, error=f"bad request: {exc}")
    try:
        return await _carry_out(sup, topo, request)
    except ChildFailed as exc:
        return ControlReply(ok=False, error=str(exc))


def _with_hub_roles(rows: list[dict[str, Any]], state: Path) -> list[dict[str, Any]]:
    """A hub of a pair shows its lease role and epoch ("hub primary e12"), from the role file
    each writes in its state dir at every change (a standby answers no `hub.status`)."""
    from agent_bus.bus.hub import ROLE_FILE

    for row in rows:
        if row["role"] != "hub":
            continue
        folder = "hub-standby" if row["name"] == "hub-standby" else "hub"
        try:
            role = msgspec.json.decode((state / folder / ROLE_FILE).read_bytes())
        except (OSError, msgspec.DecodeError):
            continue  # one machine (no lease), or not written yet
        if isinstance(role, dict) and role.get("pid") == row["pid"]:
            row["role"] = f"hub {role.get('role', '?')} e{role.get('epoch', 0)}"
    return rows


async def _carry_out(sup: Supervisor, topo: Topology, request: ControlRequest) -> ControlReply:
    if request.op == "ps":
        return ControlReply(ok=True, processes=_with_hub_roles(sup.table(), state_dir(topo)))
    if request.op == "restart":
        if request.name not in sup.children:
            return ControlReply(ok=False, unknown=True,
                                error=f"no process `{request.name}` (processes: "
                                      f"{', '.join(sup.children)})")
        child = await sup.restart(request.name)
        return ControlReply(ok=True, message=f"restarted {request.name} (pid {child.pid})")
    if request.op == "scale":
        return await _scale(sup, topo, request.name, request.count)
    return ControlReply(ok=False, error=f"unknown op {request.op!r} (ops: ps, restart, scale)")


async def _scale(sup: Supervisor, topo: Topology, name: str, count: int) -> ControlReply:
    groups = {g.name: g for g in topo.workers}
    group = topo.workers[0] if name == "workers" and topo.workers else groups.get(name)
    if group is None:
        return ControlReply(ok=False, unknown=True,
                            error=f"no worker group `{name}` (groups: "
                                  f"{', '.join(['workers', *groups])})")
    if not 0 <= count <= 64:
        return ControlReply(ok=False, unknown=True, error=f"{name}={count}: give 0 to 64 processes")
    mine = sorted((n for n, c in sup.children.items()
                   if c.spec.role == "worker" and n.rpartition("-")[0] == group.name),
                  key=lambda n: int(n.rpartition("-")[2]))
    for extra in mine[count:][::-1]:  # the newest go first
        await sup.remove(extra)
    used = {int(n.rpartition("-")[2]) for n in mine[:count]}
    free = (i for i in range(1, 10_000) if i not in used)
    specs = [_identify(worker_spec(group, next(free), topo.hub.endpoint, _hidden(topo, group)),
                       topo, state_dir(topo))
             for _ in range(count - len(mine))]
    await _start_all(sup, specs)
    group.count = count
    return ControlReply(ok=True, message=f"{group.name}: {len(mine)} → {count} processes")


async def control(state: Path, request: ControlRequest, timeout: float = 60.0) -> ControlReply:
    """Send one request to the supervisor of the topology in `state`; raise ChildFailed when
    none is listening."""
    path = state / "control.sock"
    try:
        with anyio.fail_after(timeout):
            async with await anyio.connect_unix(path) as stream:
                await stream.send(msgspec.json.encode(request) + b"\n")
                from anyio.streams.buffered import BufferedByteReceiveStream

                line = await BufferedByteReceiveStream(stream).receive_until(b"\n", 1 << 24)
    except (OSError, anyio.EndOfStream, anyio.IncompleteRead) as exc:
        raise ChildFailed(f"no topology is up from this directory (control socket {path}: "
                          f"{getattr(exc, 'strerror', None) or exc}); start one with `busctl up`"
                          ) from None
    except TimeoutError:
        raise ChildFailed(f"the supervisor did not answer within {timeout:g}s ({path})") from None
    return msgspec.json.decode(line, type=ControlReply)


STOP_RANK = {"process": 0, "coordinator": 1, "worker": 2, "gateway": 3, "fake-llm": 4, "hub": 5}


def _stop_order(sup: Supervisor) -> list[str]:
    """Extra processes, then agents, their tools, their models, and the hub last."""
    return sorted(sup.children, key=lambda name: STOP_RANK.get(sup.children[name].spec.role, 0))


def _announce(options: UpOptions, state: Path, endpoint: str, events: str) -> None:
    """Machine-readable readiness: the ready file (always; written whole, then renamed into
    place, so a reader never sees half a line) and, with `--json`, stdout. The console the
    person reads gets the summary only."""
    line = msgspec.json.encode({"ready": "up", "endpoint": endpoint, "events": events,
                                "pid": os.getpid()}).decode()
    if options.ready_json:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
    ready = Path(options.detach_ready_file or state / "up.ready")
    partial = ready.with_name(ready.name + ".tmp")
    partial.write_text(line + "\n")
    partial.replace(ready)


async def _stop(sup: Supervisor, out: TextIO) -> None:
    """Stop in order; further Ctrl-Cs during the stop are absorbed (it is bounded anyway)."""
    out.write("stopping…\n")
    out.flush()
    with anyio.open_signal_receiver(*STOP_SIGNALS):
        await sup.stop_all(_stop_order(sup))
    out.write("stopped.\n")
    out.flush()


def pid_file(topo: Topology) -> Path:
    return state_dir(topo) / "up.pid"

