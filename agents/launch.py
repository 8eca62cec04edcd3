"""`busctl up`: bring a whole topology up as supervised child processes, and take it down.

Order: hub → (demo model server) → gateways, workers and coordinators in parallel → extra
processes. Each child is a `busctl <piece>` process that prints a JSON ready line once it has
registered with the hub. Stop order is the reverse, so agents finish before their tools and model
go away and the hub is last.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any, TextIO

import anyio
import msgspec

from agents.llm import ModelConfig
from agents.topology import Topology
from bus import events as ev
from bus.client import Peer, connect
from bus.paths import ensure_state_dir
from bus.security import CurveClient
from bus.supervisor import Child, ChildSpec, Supervisor, python_argv

DEMO_MODEL = "demo"


class UpOptions(msgspec.Struct):
    demo: bool = False
    extra_tools: list[str] = msgspec.field(default_factory=list)
    workers: int | None = None
    hub: str | None = None
    detach_ready_file: str = ""  # where a detached `up` reports readiness


def resolve(topology: Topology, options: UpOptions) -> Topology:
    """Apply command-line overrides to a topology (a copy)."""
    topo = msgspec.convert(msgspec.to_builtins(topology), Topology)
    if options.hub:
        topo.hub.endpoint = options.hub
    if options.extra_tools and topo.workers:
        topo.workers[0].tools = [*topo.workers[0].tools, *options.extra_tools]
    if options.workers is not None and topo.workers:
        topo.workers[0].count = options.workers
    return topo


def state_dir(topology: Topology) -> Path:
    return topology.state_path()


def hub_argv(topo: Topology) -> list[str]:
    hub = topo.hub
    argv = python_argv("hub", "--hub", hub.endpoint, "--state-dir", str(state_dir(topo) / "hub"),
                       "--heartbeat-interval", str(hub.heartbeat_interval),
                       "--liveness", str(hub.liveness),
                       "--max-message-bytes", str(hub.max_message_bytes))
    if hub.events:
        argv += ["--events", hub.events]
    if hub.curve_secret:
        argv += ["--curve-secret", hub.curve_secret, "--curve-authorized", hub.curve_authorized]
    if hub.insecure:
        argv.append("--insecure")
    return argv


def client_curve(topo: Topology) -> CurveClient | None:
    hub = topo.hub
    if not hub.curve_secret:
        return None
    return CurveClient(server_public_key_file=hub.curve_server_key,
                       secret_key_file=hub.curve_client_key)


def _curve_args(topo: Topology) -> list[str]:
    if not topo.hub.curve_secret:
        return []
    return ["--curve-server-key", topo.hub.curve_server_key,
            "--curve-key", topo.hub.curve_client_key]


def child_specs(topo: Topology, endpoint: str) -> list[ChildSpec]:
    """Gateways, workers and coordinators (started in parallel once the hub is up).

    Gateways and coordinators read the topology from stdin (`--topology -`): the supervisor hands
    it over from memory at every restart, so no file a tool might reach can redirect them.
    """
    specs = [_with_curve(spec, topo) for spec in _piece_specs(topo, endpoint)]
    for proc in topo.processes:
        argv = proc.command
        if argv and argv[0] == "busctl":  # this installation's busctl, whatever PATH says
            argv = python_argv(*argv[1:])
        env = {"BUSCTL_HUB": endpoint, **proc.env}
        specs.append(ChildSpec(proc.name, argv, env=env, restart=proc.restart, role="process",
                               pass_env=proc.pass_env))
    return specs


def _with_curve(spec: ChildSpec, topo: Topology) -> ChildSpec:
    spec.argv = [*spec.argv, *_curve_args(topo)]
    return spec


def _piece_specs(topo: Topology, endpoint: str) -> list[ChildSpec]:
    config = msgspec.json.encode(topo)
    specs: list[ChildSpec] = []
    for i in range(topo.gateways.count):
        specs.append(ChildSpec(f"gateway-{i + 1}", python_argv(
            "gateway", "--hub", endpoint, "--topology", "-", "--name", f"gateway-{i + 1}"),
            role="gateway", inherit_env=True, stdin_data=config))
    for group in topo.workers:
        for i in range(group.count):
            name = f"{group.name}-{i + 1}"
            argv = python_argv("worker", "--hub", endpoint, "--concurrency", str(group.concurrency),
                               "--workspace", group.workspace, "--name", name)
            for module in group.tools:
                argv += ["--tools", module]
            if group.shell:
                argv.append("--shell")
            specs.append(ChildSpec(name, argv, role="worker", pass_env=group.pass_env))
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
            tools: list[str]) -> list[str]:
    state = state_dir(topo)
    lines = [f"hub        {endpoint}  (events {events})"]
    procs = "  ".join(f"{name}[{child.pid}]" for name, child in sup.children.items())
    lines.append(f"processes  {procs}")
    lines.append(f"agents     {', '.join(a.name for a in topo.agents)}")
    lines.append(f"tools      {', '.join(tools) or '(none)'}")
    lines.append(f"state      {state}  (logs in {state / 'logs'})")
    lines.append("try        busctl run \"hello\"   ·   busctl watch   ·   busctl status")
    return lines


async def _live_tools(peer: Peer) -> list[str]:
    status = await peer.status()
    return sorted(s.name[5:] for s in status.services if s.name.startswith("tool."))


async def up(topology: Topology, options: UpOptions, out: TextIO, color: bool) -> int:
    """Run the topology until SIGINT/SIGTERM. Returns the exit code."""
    topo = resolve(topology, options)
    state = ensure_state_dir(state_dir(topo))
    topo.hub.state_dir = str(state)  # children resolve nothing relative to their own cwd
    async with Supervisor(state / "logs", out, color) as sup:
        hub = await sup.start(ChildSpec("hub", hub_argv(topo), role="hub"))
        assert hub.ready is not None
        endpoint, events = hub.ready["endpoint"], hub.ready["events"]
        # A restarted hub must come back where its peers reconnect: pin the bound addresses
        # (`--hub tcp://127.0.0.1:0` would otherwise pick new ports on every restart).
        topo.hub.endpoint, topo.hub.events = endpoint, events
        hub.spec.argv = hub_argv(topo)
        if options.demo:
            fake = await sup.start(ChildSpec("fake-llm", python_argv("fake-llm", "--port", "0"),
                                             role="fake-llm"))
            assert fake.ready is not None
            topo.models = {DEMO_MODEL: ModelConfig(provider="openai", model="demo-model",
                                                  base_url=fake.ready["base_url"])}
            topo.gateways.default_model = DEMO_MODEL
        # For people (what is running); never read back by the children, see child_specs.
        (state / "topology.json").write_bytes(msgspec.json.format(msgspec.json.encode(topo)))
        await _start_all(sup, child_specs(topo, endpoint))
        async with connect(endpoint, name="busctl-up", role="supervisor",
                           curve=client_curve(topo)) as peer:
            sup.notify = await _publisher(peer)
            for line in summary(topo, sup, endpoint, events, await _live_tools(peer)):
                out.write(line + "\n")
            out.flush()
            _announce(options, endpoint, events)
            await _wait_for_signal()
        await _stop(sup, out)
    return 0


STOP_RANK = {"process": 0, "coordinator": 1, "worker": 2, "gateway": 3, "fake-llm": 4, "hub": 5}


def _stop_order(sup: Supervisor) -> list[str]:
    """Extra processes, then agents, their tools, their models, and the hub last."""
    return sorted(sup.children, key=lambda name: STOP_RANK.get(sup.children[name].spec.role, 0))


def _announce(options: UpOptions, endpoint: str, events: str) -> None:
    line = msgspec.json.encode({"ready": "up", "endpoint": endpoint, "events": events,
                                "pid": os.getpid()}).decode()
    print(line, flush=True)
    if options.detach_ready_file:
        Path(options.detach_ready_file).write_text(line + "\n")


async def _stop(sup: Supervisor, out: TextIO) -> None:
    """Stop in order; further Ctrl-Cs during the stop are absorbed (it is bounded anyway)."""
    out.write("stopping…\n")
    out.flush()
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM):
        await sup.stop_all(_stop_order(sup))
    out.write("stopped.\n")
    out.flush()


async def _wait_for_signal() -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            return


def pid_file(topo: Topology) -> Path:
    return state_dir(topo) / "up.pid"


def write_pid_file(topo: Topology) -> None:
    pid_file(topo).write_text(f"{os.getpid()}\n")


def python_executable() -> str:
    return sys.executable
