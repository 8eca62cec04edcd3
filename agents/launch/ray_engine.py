"""`busctl up --engine ray`: a topology placed and restarted by a Ray cluster (the driver's side).

Ray decides *where* each process runs and brings it back when its node dies; ZeroMQ with CURVE
still carries every bus message (nothing of the bus goes through Ray's object store). `up`:

1. connects to the cluster (`[engine] address`, `--address`; "auto": the one this machine is in);
2. reserves a soft placement group per `[placement.X]` entry with a `strategy` (its processes'
   bundles spread over nodes or packed), detached so that it outlives `up`;
3. starts the hub's keeper (on the node of `[placement.hub]`, by default this machine's node:
   the event log lives there), then the topology's holder actor beside it (`<name>:topology`,
   ray_actors.TopologyHolder, which makes every CURVE key pair in its own memory; with a standby
   hub, on the Ray head instead, and the standby's keeper on any node but the primary's), waits
   for the hubs' ready lines, then starts every gateway, worker and coordinator keeper (given
   "primary,standby"), and returns once all are ready: the topology then belongs to Ray, and
   `busctl ps/status/run/watch/logs/scale/restart/down --engine ray` reach it from any node by
   its name.

Ray is imported here only (and in ray_actors' methods), lazily: the local engine never loads it.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, TextIO

import msgspec

from agent_bus.agents.launch.ray_actors import (
    NAMESPACE,
    STANDBY,
    TOPOLOGY_SUFFIX,
    ProcessInfo,
    ProcessKeeper,
    TopologyHolder,
    process_actor_name,
    topology_actor_name,
)
from agent_bus.agents.launch.supervisor import ChildSpec
from agent_bus.agents.launch.topology import Placement, Topology, placement_key, process_names
from agent_bus.agents.launch.up import model_env
from agent_bus.bus.errors import AgentBusError, ConfigError, UnknownName
from agent_bus.bus.security import CurveClient

RAY_EXTRA = "pip install 'agent-bus[ray]'"
STOP_RANK = {"coordinator": 1, "worker": 2, "gateway": 3, "hub": 5}
# Ray refuses an empty bundle: a placement without resources reserves a thousandth of a CPU,
# which also keeps its processes off nodes that offer none (a head started with --num-cpus=0).
TOKEN_BUNDLE = {"CPU": 0.001}
NODE_ID_LABEL = "ray.io/node-id"  # every Ray node's own label: the standby's anti-affinity
HEAD_RESOURCE = "node:__internal_head__"  # Ray's resource of the head node (1 of it)
KEEPER_CONCURRENCY = 8  # wait_ready, info, logs and stop may arrive together
STANDBY_PLACE_TIMEOUT = 20.0  # seconds for Ray to find the standby a node (else `up` says why)


class RayUnavailable(ConfigError):
    """Ray is not installed: `--engine ray` exits 2 naming the extra."""


class RayEngineError(AgentBusError):
    pass


class RayUnknownName(RayEngineError, UnknownName):
    """A process, worker group or topology name the Ray cluster does not have (exits 2)."""


def require_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise RayUnavailable(f"--engine ray needs Ray, which is not installed here: {RAY_EXTRA}"
                             ) from None
    return ray


def topology_name(topo: Topology, config_file: str | None) -> str:
    """`[engine] name`, else the topology file's stem, else `agent-bus`."""
    return topo.engine.name or (Path(config_file).stem if config_file else "agent-bus")


def connect(address: str) -> Any:
    """Join the cluster at `address` as a driver (quietly: its workers' output stays in logs)."""
    ray = require_ray()
    if ray.is_initialized():
        return ray
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False,
                 logging_level=logging.WARNING, configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise RayEngineError(f"cannot reach a Ray cluster at {address!r} ({exc}); start one "
                             "(`ray start --head`) or give its head with --address HOST:PORT "
                             "([engine] address)") from None
    # Ray warns that a restartable detached actor in a placement group dies with the group:
    # ours are removed together, by `down`, which is what we want.
    logging.getLogger("ray.actor").setLevel(logging.ERROR)
    return ray


# --- placement ---------------------------------------------------------------------------------


def _bundle(placement: Placement) -> dict[str, float]:
    return {k: v for k, v in placement.resources.items() if v} or dict(TOKEN_BUNDLE)


def _resource_options(resources: dict[str, float]) -> dict[str, Any]:
    rest = dict(resources)
    return {"num_cpus": rest.pop("CPU", 0), "num_gpus": rest.pop("GPU", 0), "resources": rest}


def _node_options(ray: Any, key: str, node: str) -> dict[str, Any]:
    """`node = "IP" | "node id" | "label=value"`: a hard requirement."""
    if "=" in node:
        label, _, value = node.partition("=")
        return {"label_selector": {label.strip(): value.strip()}}
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    alive = [n for n in ray.nodes() if n.get("Alive")]
    ids = [n["NodeID"] for n in alive if node in (n["NodeID"], n["NodeManagerAddress"])]
    if not ids:
        known = ", ".join(sorted({n["NodeManagerAddress"] for n in alive}))
        raise RayEngineError(f"placement.{key}.node: no live node {node!r} in the cluster (its "
                             f"nodes: {known}); give a node's IP, its id or a label key=value")
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(ids[0], soft=False)}


class Placer:
    """Each process's Ray options: its placement group's bundle, its node, or Ray's default."""

    def __init__(self, ray: Any, topo: Topology, name: str) -> None:
        self.ray, self.topo, self.name = ray, topo, name
        self.groups: dict[str, tuple[Any, list[str]]] = {}  # key -> (group, its processes)

    def reserve(self, roles: dict[str, str], timeout: float = 60.0) -> None:
        """One soft placement group per entry with a strategy, sized for its processes."""
        from ray.util.placement_group import placement_group

        members: dict[str, list[str]] = {}
        for proc, role in roles.items():
            key = placement_key(self.topo, proc, role)
            if key and self.topo.placement[key].strategy:
                members.setdefault(key, []).append(proc)
        for key, procs in members.items():
            entry = self.topo.placement[key]
            bundle = _bundle(entry)
            group = placement_group([dict(bundle) for _ in procs], name=f"{self.name}:{key}",
                                    strategy="SPREAD" if entry.strategy == "spread" else "PACK",
                                    lifetime="detached")
            self.groups[key] = (group, procs)
            try:
                self.ray.get(group.ready(), timeout=timeout)
            except self.ray.exceptions.GetTimeoutError:
                raise RayEngineError(
                    f"placement.{key}: Ray could not reserve {len(procs)} x {bundle} within "
                    f"{timeout:g}s: no node offers these resources (see `ray status`; start "
                    "nodes with `ray start --resources=...`)") from None

    def options(self, proc: str, role: str) -> dict[str, Any]:
        key = placement_key(self.topo, proc, role)
        if not key:
            return self._default(role)
        entry = self.topo.placement[key]
        if key in self.groups and proc in self.groups[key][1]:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            group, procs = self.groups[key]
            return {**_resource_options(_bundle(entry)),
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(
                        group, placement_group_bundle_index=procs.index(proc))}
        if entry.node:
            return {**_resource_options(entry.resources), **_node_options(self.ray, key, entry.node)}
        if not entry.strategy:
            return _resource_options(entry.resources)
        # scaled past its group's placement group: the same share of a node, without a bundle
        return {**_resource_options(_bundle(entry)),
                "scheduling_strategy": "SPREAD" if entry.strategy == "spread" else "DEFAULT"}

    def standby_options(self, primary_node: str) -> dict[str, Any]:
        """The standby hub: `[placement.hub]`'s resources and label, on any node but the
        primary's (a label selector on Ray's own node-id label). A `node` naming one IP or id,
        or a `strategy`, cannot hold a pair apart: the standby keeps only the resources."""
        entry = self.topo.placement.get("hub")
        options: dict[str, Any] = {"num_cpus": 0}
        selector = {NODE_ID_LABEL: f"!{primary_node}"}
        if entry is not None:
            options = _resource_options(entry.resources) if entry.resources else options
            if "=" in entry.node:
                label, _, value = entry.node.partition("=")
                selector[label.strip()] = value.strip()
        return {**options, "label_selector": selector}

    def _default(self, role: str) -> dict[str, Any]:
        if role != "hub":
            return {"num_cpus": 0}
        # The hub's default node is this machine's (where `up` runs): its event log is there.
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = self.ray.get_runtime_context().get_node_id()
        return {"num_cpus": 0,
                "scheduling_strategy": NodeAffinitySchedulingStrategy(here, soft=True)}


# --- up ----------------------------------------------------------------------------------------


def roles_of(topo: Topology) -> dict[str, str]:
    """Every process `up` starts on Ray, by name, with its role, in start order."""
    names = process_names(topo)
    roles = {"hub": "hub"}
    if topo.hub.standby:
        roles[STANDBY] = "hub"
    roles.update({n: "gateway" for n in names["gateways"]})
    roles.update({n: "worker" for n in names["workers"]})
    roles.update({n: "coordinator" for n in names["coordinators"]})
    return roles


def prepare(topo: Topology) -> list[str]:
    """Make a resolved topology one Ray can run; returns notes for the user."""
    notes = []
    hub = topo.hub
    if hub.curve_secret:
        notes.append("hub.curve_*: not used on Ray: `up` makes the hub's and every process's "
                     "keys itself (busctl --engine ray finds the owner's key on the cluster)")
    hub.curve_secret = hub.curve_authorized = hub.curve_server_key = hub.curve_client_key = ""
    if not hub.endpoint.startswith("tcp://"):
        raise RayEngineError(f"hub.endpoint: {hub.endpoint!r}: on Ray the hub listens on TCP "
                             "(with CURVE) on its node; give tcp://0.0.0.0:PORT (0: any port)")
    if topo.processes or topo.ui is not None or topo.otel is not None:
        notes.append("processes / [ui] / [otel]: not started on Ray yet; run them beside it "
                     "with `busctl ui|otel --engine ray`")
        topo.processes, topo.ui, topo.otel = [], None, None
    if hub.standby and not hub.standby.startswith("tcp://"):
        raise RayEngineError(f"hub.standby: {hub.standby!r}: on Ray the standby hub listens on "
                             "TCP (with CURVE) on another node than the hub; give "
                             "tcp://0.0.0.0:PORT (0: any port)")
    if hub.standby and not hub.store:
        raise RayEngineError("hub.standby: a standby hub needs a replicated event store both "
                             "hubs reach: give hub.store = \"nats://HOST:4222,...\"")
    topo.hub.state_dir = str(topo.state_path())  # every node uses the same path
    return notes


def _cause(ray: Any, exc: BaseException) -> str:
    if isinstance(exc, ray.exceptions.RayTaskError) and exc.cause is not None:
        return str(exc.cause)
    return str(exc)


def up(topo: Topology, name: str, address: str, out: TextIO, ready_out: TextIO | None = None) -> int:
    """Place the topology on the cluster and return once every process is ready (the summary
    on `out`, the JSON ready line on `ready_out`)."""
    ray = connect(address)
    try:
        ray.get_actor(topology_actor_name(name), namespace=NAMESPACE)
    except ValueError:
        pass
    else:
        raise RayEngineError(f"a topology named {name!r} is already up on this Ray cluster; stop "
                             f"it with `busctl down --engine ray --topology-name {name}`, or give "
                             "this one another name ([engine] name, --topology-name)")
    for note in prepare(topo):
        out.write(f"note: {note}\n")
    roles = roles_of(topo)
    started = time.monotonic()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    placer = Placer(ray, topo, name)
    try:
        placer.reserve({p: r for p, r in roles.items() if p != STANDBY})
        hub = start_keeper(ray, placer, name, "hub", "hub")
        hub_node = ray.get(hub.where.remote())
        if topo.hub.standby:
            # With a standby the holder must outlive the primary's node: it goes to the head,
            # whose loss takes Ray's control store (and so every actor) with it anyway. Not
            # beside the standby: after a takeover that node is the one left holding the log's
            # leader, and its loss would then take the keys with it. Not restarted by Ray
            # either: its keys live in its memory only, and new ones would lock every peer out.
            where: dict[str, Any] = {"resources": {HEAD_RESOURCE: 0.001}}
        else:
            # The holder lives beside the hub: losing that node loses the topology either way,
            # and no other node's loss takes the keys and the address with it.
            where = {"scheduling_strategy": NodeAffinitySchedulingStrategy(hub_node, soft=False)}
        holder = ray.remote(TopologyHolder).options(
            name=topology_actor_name(name), namespace=NAMESPACE, lifetime="detached", num_cpus=0,
            **where,
        ).remote(name, msgspec.json.encode(topo))
        ray.get([holder.set_model_env.remote(*model_env(topo)),
                 *[holder.add_process.remote(proc, role) for proc, role in roles.items()]])
        hubs = [hub]
        if topo.hub.standby:
            hubs.append(_placed_standby(ray, placer, name, hub_node))
        hub_infos: list[ProcessInfo] = ray.get([h.wait_ready.remote(ChildSpec.ready_timeout + 10)
                                                for h in hubs])
        hub_info = hub_infos[0]
        keepers = {proc: start_keeper(ray, placer, name, proc, role)
                   for proc, role in roles.items() if role != "hub"}
        timeout = _ready_timeout(topo)
        infos = [*hub_infos, *ray.get([k.wait_ready.remote(timeout) for k in keepers.values()])]
    except (ray.exceptions.RayError, AgentBusError) as exc:
        why = _cause(ray, exc)
        remove(ray, name)
        raise RayEngineError(f"`busctl up --engine ray` failed, and what it started is stopped: "
                             f"{why}") from None
    endpoint, events = hub_info.ready["endpoint"], hub_info.ready["events"]
    if topo.hub.standby:  # what every process got: both hubs (a client follows the leader)
        endpoint = f"{endpoint},{hub_infos[1].ready['endpoint']}"
    if ready_out is not None:  # `up --json`: one line for scripts
        ready_out.write(msgspec.json.encode({"ready": "up", "engine": "ray", "name": name,
                                             "endpoint": endpoint, "events": events}).decode() + "\n")
        ready_out.flush()
    if topo.hub.standby:
        standby = hub_infos[1]
        out.write(f"hub        {hub_info.ready['endpoint']}  (events {events}; on node "
                  f"{hub_info.node}/{hub_info.node_id[:8]}; its event log in {topo.hub.store})\n")
        out.write(f"standby    {standby.ready['endpoint']}  (on node {standby.node}/"
                  f"{standby.node_id[:8]}; takes over when the hub's lease lapses)\n")
    else:
        out.write(f"hub        {endpoint}  (events {events}; its event log on node "
                  f"{hub_info.node})\n")
    out.write("processes  " + "  ".join(f"{i.name}@{i.node}/{i.node_id[:8]}[{i.pid}]"
                                        for i in infos) + "\n")
    for line in _sandbox_lines(infos):
        out.write(line + "\n")
    out.write(f"ready in   {time.monotonic() - started:.1f}s on Ray (topology {name!r})\n")
    out.write("try        busctl run --engine ray \"hello\"   ·   busctl ps --engine ray   ·   "
              "busctl down --engine ray\n")
    out.flush()
    return 0


def _placed_standby(ray: Any, placer: Placer, name: str, hub_node: str) -> Any:
    """The standby's keeper, once Ray has found it a node: a cluster with no other node fitting
    `[placement.hub]` would leave it pending (and `up` waiting) for ever."""
    keeper = start_keeper(ray, placer, name, STANDBY, "hub", hub_node)
    try:
        ray.get(keeper.where.remote(), timeout=STANDBY_PLACE_TIMEOUT)
    except ray.exceptions.GetTimeoutError:
        raise RayEngineError(
            f"hub.standby: Ray found no node but the hub's ({hub_node[:8]}) fitting "
            f"[placement.hub] within {STANDBY_PLACE_TIMEOUT:g}s: a hub pair needs two such nodes "
            "(see `ray status`; loosen [placement.hub], or add a node)") from None
    return keeper


def _sandbox_lines(infos: list[ProcessInfo]) -> list[str]:
    """What each worker runs in, on its node (as `busctl up` says it): a node without
    bubblewrap is named plainly."""
    from agent_bus.tools.sandbox import SandboxInfo, describe

    kinds: dict[str, list[str]] = {}
    for info in infos:
        if info.role == "worker":
            sandbox = msgspec.convert(info.ready.get("sandbox") or {"kind": "none", "reason": "?"},
                                      SandboxInfo)
            kinds.setdefault(describe(sandbox), []).append(f"{info.name}@{info.node}")
    return [f"sandbox    {'NO SANDBOX: ' if text.startswith('none') else ''}{text}  "
            f"({', '.join(names)})" for text, names in kinds.items()]


def _ready_timeout(topo: Topology) -> float:
    from agent_bus.agents.launch.up import LOCAL_MODEL_READY_TIMEOUT

    hosts = any(m.provider == "llamacpp" for m in topo.models.values())
    return (LOCAL_MODEL_READY_TIMEOUT if hosts else ChildSpec.ready_timeout) + 10


def start_keeper(ray: Any, placer: Placer, name: str, proc: str, role: str,
                 away_from: str = "") -> Any:
    """A detached keeper actor for `proc` (Ray restarts it on another node if its node dies);
    the standby hub's (`away_from`: the primary's node id) on any node but the primary's."""
    options = placer.standby_options(away_from) if proc == STANDBY else placer.options(proc, role)
    return ray.remote(ProcessKeeper).options(
        name=process_actor_name(name, proc), namespace=NAMESPACE, lifetime="detached",
        max_restarts=-1, max_task_retries=0, max_concurrency=KEEPER_CONCURRENCY, **options,
    ).remote(name, proc, role)


# --- finding a topology from anywhere ---------------------------------------------------------


def find(name: str, address: str) -> tuple[Any, Any, str]:
    """(ray, the holder, its name): by `name`, or the only topology on the cluster."""
    ray = connect(address)
    if not name:
        found = sorted(n["name"][: -len(TOPOLOGY_SUFFIX)]
                       for n in ray.util.list_named_actors(all_namespaces=True)
                       if n["namespace"] == NAMESPACE and n["name"].endswith(TOPOLOGY_SUFFIX))
        if not found:
            raise RayEngineError(f"no agent-bus topology is up on the Ray cluster at {address!r}; "
                                 "start one with `busctl up --engine ray`")
        if len(found) > 1:
            raise RayEngineError(f"several topologies are up on this Ray cluster ({', '.join(found)}); "
                                 "name one with --topology-name NAME (env BUSCTL_RAY_TOPOLOGY)")
        name = found[0]
    try:
        holder = ray.get_actor(topology_actor_name(name), namespace=NAMESPACE)
    except ValueError:
        raise RayUnknownName(f"no topology {name!r} on the Ray cluster at {address!r} (`busctl ps "
                             "--engine ray` without --topology-name finds the one that is up)") from None
    return ray, holder, name


HAND_ATTACHED = ("worker", "gateway")  # commands that get their kind's key, not the owner's


def client(name: str, address: str, command: str = "") -> tuple[str, CurveClient]:
    """The hub's address and keys held in memory (never in a file): the owner's, or for a
    `busctl worker|gateway` attached by hand, its kind's (only its role)."""
    ray, holder, name = find(name, address)
    _keepers(ray, holder, name)  # names a lost holder plainly
    endpoint, _events = ray.get(holder.hub_address.remote())
    if not endpoint:
        raise RayEngineError("the topology's hub is not ready (yet); see `busctl ps --engine ray`")
    keys = holder.client_keys.remote(command) if command in HAND_ATTACHED \
        else holder.owner_keys.remote()
    return endpoint, CurveClient.held(*ray.get(keys))


def _keepers(ray: Any, holder: Any, name: str) -> dict[str, tuple[str, Any]]:
    try:
        procs: dict[str, str] = ray.get(holder.process_table.remote(), timeout=30)
    except ray.exceptions.RayError as exc:
        raise RayEngineError(
            f"the holder actor of topology {name!r} is gone ({_cause(ray, exc).splitlines()[0]}): "
            "it lives on the hub's node (with a standby hub: on the Ray head), so that node was "
            "probably lost, and the hub (with the event log) with it; "
            f"`busctl down --engine ray --topology-name {name}` removes what is left") from None
    out = {}
    for proc, role in procs.items():
        try:
            out[proc] = (role, ray.get_actor(process_actor_name(name, proc), namespace=NAMESPACE))
        except ValueError:
            continue
    return out


def table(name: str, address: str, timeout: float = 10.0) -> list[dict[str, Any]]:
    """`busctl ps --engine ray`: one row per process, with its node."""
    ray, holder, name = find(name, address)
    keepers = _keepers(ray, holder, name)
    calls = {proc: keeper.info.remote() for proc, (_, keeper) in keepers.items()}
    rows = []
    for proc, call in calls.items():
        try:
            info: ProcessInfo = ray.get(call, timeout=timeout)
        except ray.exceptions.RayError:  # restarting on another node, or gone
            rows.append({"name": proc, "role": keepers[proc][0], "node": "-", "node_id": "-",
                         "pid": 0, "state": "restarting", "uptime": 0.0, "restarts": 0,
                         "last_exit": "-", "sandbox": "-"})
            continue
        row = msgspec.structs.asdict(info)
        row.pop("ready")
        row["node_id"] = info.node_id[:12]
        rows.append(row)
    return rows


def logs(name: str, address: str, names: set[str], tail: int | None, follow: bool,
         out: TextIO, prefix: str) -> None:
    """`busctl logs --engine ray`: each process's log, read on its own node by its keeper;
    with `follow`, new lines (and processes scaled up) every half second until Ctrl-C."""
    ray, holder, name = find(name, address)
    keepers = _keepers(ray, holder, name)
    unknown = sorted(names - set(keepers))
    if unknown:
        raise RayUnknownName(f"no process {', '.join(unknown)} (processes: {', '.join(keepers)})")
    offsets: dict[str, int] = {}
    first = True
    while True:
        wanted = [p for p in keepers if not names or p in names]
        calls = [keepers[p][1].log_from.remote(offsets.get(p, 0)) for p in wanted]
        for proc, call in zip(wanted, calls, strict=True):
            try:
                offsets[proc], lines = ray.get(call, timeout=30)
            except ray.exceptions.RayError:
                continue  # moving to another node: its log there, next time
            if first and tail is not None:
                lines = lines[max(0, len(lines) - tail):]
            for line in lines:
                out.write(prefix.format(proc) + line + "\n")
        out.flush()
        if not follow:
            return
        first = False
        time.sleep(0.5)
        keepers = _keepers(ray, holder, name)


def restart(name: str, address: str, proc: str) -> str:
    ray, holder, name = find(name, address)
    keepers = _keepers(ray, holder, name)
    if proc not in keepers:
        raise RayUnknownName(f"no process `{proc}` (processes: {', '.join(keepers)})")
    info: ProcessInfo = ray.get(keepers[proc][1].restart.remote(), timeout=60)
    return f"restarted {proc} (pid {info.pid} on {info.node})"


def scale(name: str, address: str, group_name: str, count: int) -> str:
    """`busctl scale --engine ray GROUP=N`: start or stop worker keepers across nodes."""
    ray, holder, name = find(name, address)
    topo = msgspec.json.decode(ray.get(holder.topology.remote()), type=Topology)
    groups = {g.name: g for g in topo.workers}
    group = topo.workers[0] if group_name == "workers" and topo.workers else groups.get(group_name)
    if group is None:
        raise RayUnknownName(f"no worker group `{group_name}` (groups: "
                             f"{', '.join(['workers', *groups])})")
    if not 0 <= count <= 64:
        raise RayEngineError(f"{group_name}={count}: give 0 to 64 processes")
    keepers = _keepers(ray, holder, name)
    mine = sorted((p for p, (role, _) in keepers.items()
                   if role == "worker" and p.rpartition("-")[0] == group.name),
                  key=lambda p: int(p.rpartition("-")[2]))
    for extra in mine[count:][::-1]:
        _stop_and_kill(ray, holder, extra, keepers[extra][1])
    used = {int(p.rpartition("-")[2]) for p in mine[:count]}
    free = (i for i in range(1, 10_000) if i not in used)
    placer = Placer(ray, topo, name)
    names = [f"{group.name}-{next(free)}" for _ in range(count - len(mine))]
    ray.get([holder.add_process.remote(proc, "worker") for proc in names])
    new = [start_keeper(ray, placer, name, proc, "worker") for proc in names]
    try:
        ray.get([k.wait_ready.remote(_ready_timeout(topo)) for k in new])
    except ray.exceptions.RayError as exc:
        raise RayEngineError(_cause(ray, exc)) from None
    return f"{group.name}: {len(mine)} → {count} processes"


# --- down --------------------------------------------------------------------------------------


def _stop_and_kill(ray: Any, holder: Any, proc: str, keeper: Any) -> None:
    try:
        ray.get(keeper.stop.remote(), timeout=15)
    except ray.exceptions.RayError:
        pass  # restarting or gone: killing the actor ends its child too (parent-death signal)
    ray.kill(keeper, no_restart=True)
    ray.get(holder.remove_process.remote(proc))


def down(name: str, address: str) -> str:
    """Stop every process (coordinators first, the hub last), kill every actor of the topology
    and remove its placement groups; wait until Ray's tables agree. A topology whose holder was
    lost (with its hub's node) is removed all the same, by its name."""
    try:
        ray, holder, name = find(name, address)
        keepers = _keepers(ray, holder, name)
    except RayEngineError:
        ray = connect(address)
        if not name or not leftovers(ray, name):
            raise
        keepers = {}
    for rank in sorted(set(STOP_RANK.values())):
        batch = {p: k for p, (role, k) in keepers.items() if STOP_RANK.get(role, 0) == rank}
        calls = [k.stop.remote() for k in batch.values()]
        for call in calls:
            try:
                ray.get(call, timeout=15)
            except ray.exceptions.RayError:
                pass  # restarting or gone: killing its actor ends its child (parent-death signal)
    remove(ray, name)
    return f"stopped topology {name!r} on Ray ({len(keepers)} processes)"


def remove(ray: Any, name: str) -> None:
    """Kill every named actor of the topology (the holder last), remove its placement groups,
    and wait until Ray's tables agree."""
    from ray.util.placement_group import get_placement_group, remove_placement_group

    prefix, holder = f"{name}:", topology_actor_name(name)
    mine = sorted((e["name"] for e in ray.util.list_named_actors(all_namespaces=True)
                   if e["namespace"] == NAMESPACE and e["name"].startswith(prefix)),
                  key=lambda n: n == holder)
    for actor in mine:
        try:
            ray.kill(ray.get_actor(actor, namespace=NAMESPACE), no_restart=True)
        except ValueError:
            pass  # gone meanwhile
    for group_name in _groups(ray, name):
        try:
            remove_placement_group(get_placement_group(group_name))
        except ValueError:
            pass
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and leftovers(ray, name):
        time.sleep(0.1)


def _groups(ray: Any, name: str) -> list[str]:
    return [g["name"] for g in ray.util.placement_group_table().values()
            if g.get("name", "").startswith(f"{name}:") and g.get("state") != "REMOVED"]


def leftovers(ray: Any, name: str) -> list[str]:
    """The topology's named actors still alive and its placement groups not yet removed."""
    prefix = f"{name}:"
    actors = [e["name"] for e in ray.util.list_named_actors(all_namespaces=True)
              if e["namespace"] == NAMESPACE and e["name"].startswith(prefix)]
    return actors + _groups(ray, name)
