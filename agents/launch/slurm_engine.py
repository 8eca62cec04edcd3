"""`busctl up --engine slurm`: a topology run as `srun` steps on the nodes of a Slurm allocation.

`up` runs inside the allocation (an `sbatch` script, `salloc`, or the job `busctl submit`
writes), on its first node, and is the local `busctl up` with one difference: each child is
started as `srun --jobid=J --nodes=1 --nodelist=NODE --overlap … <the same busctl command>`
(`SlurmPlacer.launch`, handed to `agents.launch.up.up`). The local supervisor's rules apply
unchanged — ready lines, restart in place (a new step on the same node) with backoff, crash-loop
give-up, stop order — because the supervisor's child *is* the `srun` that runs the step, and
`srun` forwards SIGTERM to it.

Where: the hub on the allocation's first node (`[placement.hub] node`); gateways, coordinators
and `[[processes]]` beside it; worker groups spread round-robin over the nodes after the hub's;
`[placement.X]` entries as on Ray (`node` = a node name or its position, `strategy` = spread or
pack, `resources` GPU/CPU/other -> `--gres`/`--cpus-per-task`).

Identities: every key is made at `up` into `<state>/slurm/keys` (0700 folders, 0600 files) on the
state folder, which must be on a filesystem every node and the login node see (a cluster's
home or project filesystem): the hub's pair, the owner's pair (what `busctl --engine slurm`
presents), one pair per process kind (`curve_keys`). No key is an argument, an environment
variable or a line of the job script. Every process reaches the hub over TCP with CURVE.

Published: `<state>/slurm/hub.json` (0600): the job, the hub's address, each process's node.
`busctl ps|status|watch|experiment … --engine slurm` read it (and the owner's key file) from
any machine that sees the state folder — the login node included.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from agent_bus.agents.launch.supervisor import ChildSpec
from agent_bus.agents.launch.topology import Topology, placement_key, process_names
from agent_bus.bus.errors import AgentBusError, ConfigError
from agent_bus.bus.paths import write_private
from agent_bus.bus.security import CurveClient, generate_keys

if TYPE_CHECKING:
    from agent_bus.agents.launch.supervisor import Child, Supervisor

SLURM_DIR = "slurm"  # under the state folder: keys, the published hub, job scripts and output
PUBLISHED = "hub.json"
MODEL_ENV = "model-env.json"  # the models' keys for the job's gateway (0600; `busctl submit`)
HET_PREFIX = "het:"  # `[placement.X] node = "het:1"`: a heterogeneous job's component 1
STATE_ENV = "BUSCTL_SLURM_STATE"  # the state folder `busctl --engine slurm` looks in
SLURM_CLIENT_ENV = ("SLURM_CONF",)  # what the `srun` client itself may need of our environment
WILDCARD_HOSTS = ("*", "0.0.0.0", "127.0.0.1", "localhost", "::", "::1", "")


class SlurmError(AgentBusError):
    pass


class SlurmUsage(ConfigError):
    """`--engine slurm` where it cannot run (no allocation, no Slurm tools): exit 2."""


def run_tool(argv: list[str], timeout: float = 30.0) -> str:
    """A Slurm client command's stdout; its failure named with its own message."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        raise SlurmUsage(f"`{argv[0]}` is not installed here: --engine slurm needs Slurm's "
                         "client commands (Debian: apt-get install slurm-client)") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"`{' '.join(argv)}` did not answer within {timeout:g}s "
                         "(is slurmctld up? `sinfo`)") from None
    if done.returncode != 0:
        raise SlurmError(f"`{' '.join(argv)}` failed: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


# --- the allocation ----------------------------------------------------------------------------


class Allocation(msgspec.Struct):
    job_id: str
    nodes: list[str]  # in Slurm's order: the first one runs the batch script
    addresses: dict[str, str]  # node -> NodeAddr (how the other nodes reach it)
    # a heterogeneous job (`#SBATCH hetjob`): each component's nodes, component 0 first
    het_groups: list[list[str]] = msgspec.field(default_factory=list)

    def het_group(self, node: str) -> int | None:
        return next((g for g, nodes in enumerate(self.het_groups) if node in nodes), None)


def allocation() -> Allocation:
    """The allocation this process runs in (SLURM_JOB_ID, SLURM_JOB_NODELIST; a heterogeneous
    job's components from SLURM_JOB_NODELIST_HET_GROUP_<n>)."""
    job, nodelist = os.environ.get("SLURM_JOB_ID", ""), os.environ.get("SLURM_JOB_NODELIST", "")
    if not job or not nodelist:
        raise SlurmUsage("--engine slurm runs inside a Slurm allocation (no SLURM_JOB_ID here): "
                         "call it from an sbatch script or an salloc shell, or let `busctl "
                         "submit TOPOLOGY` write and submit the job")
    size = int(os.environ.get("SLURM_HET_SIZE", "0") or 0)
    groups = [_hostnames(os.environ.get(f"SLURM_JOB_NODELIST_HET_GROUP_{g}", ""))
              for g in range(size)]
    nodes = list(dict.fromkeys(n for group in groups for n in group)) or _hostnames(nodelist)
    return Allocation(job_id=job, nodes=nodes, addresses=node_addresses(nodes), het_groups=groups)


def _hostnames(nodelist: str) -> list[str]:
    return run_tool(["scontrol", "show", "hostnames", nodelist]).split() if nodelist else []


def node_addresses(nodes: list[str]) -> dict[str, str]:
    """Each node's NodeAddr (`scontrol show node -o`): its name where it has none."""
    out = {node: node for node in nodes}
    for line in run_tool(["scontrol", "show", "node", "-o", ",".join(nodes)]).splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if fields.get("NodeName") in out and fields.get("NodeAddr"):
            out[fields["NodeName"]] = fields["NodeAddr"]
    return out


# --- placement -----------------------------------------------------------------------------------


class SlurmPlacer:
    """Each child's node (fixed at its first start: a restart comes back on the same node) and
    the `srun` that starts it there; `announce` publishes where everything is."""

    # srun ends its step at once on SIGTERM, but forwards SIGUSR1, which the step's relay
    # (slurm_step.py) turns into the SIGTERM the bus process stops cleanly on
    stop_signal = signal.SIGUSR1

    def __init__(self, topo: Topology, alloc: Allocation, state: Path) -> None:
        self.topo, self.alloc, self.state = topo, alloc, state
        self.placed: dict[str, str] = {}
        self.roles: dict[str, str] = {}
        self.turns: dict[str, int] = {}  # per spread entry: how many it placed
        self.hub_node = self._named_node("hub", topo.placement["hub"].node) \
            if "hub" in topo.placement and topo.placement["hub"].node else alloc.nodes[0]
        # the nodes after the hub's first: the hub's node is busiest
        at = alloc.nodes.index(self.hub_node)
        self.others = alloc.nodes[at + 1:] + alloc.nodes[:at + 1]

    def check(self) -> None:
        """Place every process of the topology now: a wrong `node` fails before anything runs."""
        names = process_names(self.topo)
        for role, key in (("gateway", "gateways"), ("coordinator", "coordinators"),
                          ("worker", "workers")):
            for name in names[key]:
                self.node(name, role)
        self.placed.clear()
        self.turns.clear()

    def node(self, name: str, role: str) -> str:
        if name not in self.placed:
            self.placed[name], self.roles[name] = self._choose(name, role), role
        return self.placed[name]

    def _choose(self, name: str, role: str) -> str:
        if role == "hub":
            return self.hub_node
        key = placement_key(self.topo, name, role)
        entry = self.topo.placement.get(key)
        if entry is not None and entry.node.startswith(HET_PREFIX):
            return self._spread(key, self._het_nodes(key, entry.node))
        if entry is not None and entry.node:
            return self._named_node(key, entry.node)
        strategy = entry.strategy if entry is not None else ""
        if strategy == "pack":
            return self.others[0]
        if strategy == "spread" or (not strategy and role == "worker"):
            return self._spread(key or "workers", self.others)
        return self.hub_node

    def _spread(self, key: str, nodes: list[str]) -> str:
        """The next of `nodes` for entry `key`, round-robin."""
        turn = self.turns.get(key, 0)
        self.turns[key] = turn + 1
        return nodes[turn % len(nodes)]

    def _het_nodes(self, key: str, node: str) -> list[str]:
        """`node = "het:N"`: the nodes of component N of a heterogeneous job."""
        groups = self.alloc.het_groups
        index = node[len(HET_PREFIX):]
        if not groups:
            raise SlurmUsage(f"placement.{key}.node: {node!r} names a component of a "
                             f"heterogeneous job, but job {self.alloc.job_id} is not one; submit "
                             "with `#SBATCH hetjob` components, or give a node or its position")
        if not index.isdigit() or int(index) >= len(groups):
            raise SlurmUsage(f"placement.{key}.node: {node!r}: job {self.alloc.job_id} has "
                             f"components het:0 .. het:{len(groups) - 1}")
        return groups[int(index)]

    def _named_node(self, key: str, node: str) -> str:
        nodes = self.alloc.nodes
        if node in nodes:
            return node
        if node.isdigit() and 1 <= int(node) <= len(nodes):
            return nodes[int(node) - 1]
        raise SlurmUsage(f"placement.{key}.node: {node!r} is not a node of job "
                         f"{self.alloc.job_id} (its nodes: {', '.join(nodes)}); give one of "
                         f"them, or its position 1..{len(nodes)}, or ask sbatch for more nodes")

    def launch(self, spec: ChildSpec) -> tuple[list[str], list[str]]:
        """`srun` for one step on the child's node; it shares the node's CPUs with the others
        (`--overlap`: bus processes are mostly idle) unless its placement reserves some."""
        node = self.node(spec.name, spec.role or "process")
        group = self.alloc.het_group(node)
        srun = ["srun", f"--jobid={self.alloc.job_id}", "--nodes=1", "--ntasks=1",
                *([f"--het-group={group}"] if group is not None else []),
                f"--nodelist={node}", "--overlap", "--unbuffered", "--quiet",
                f"--job-name=bus:{spec.name}", *self._resources(spec)]
        relay = [sys.executable, "-P", "-m", "agent_bus.agents.launch.slurm_step"]
        return [*srun, *relay, *spec.argv], [*spec.pass_env, *SLURM_CLIENT_ENV]

    def _resources(self, spec: ChildSpec) -> list[str]:
        entry = self.topo.placement.get(placement_key(self.topo, spec.name, spec.role))
        if entry is None:
            return []
        out = []
        for name, amount in entry.resources.items():
            if name == "CPU" and amount:
                out.append(f"--cpus-per-task={max(1, round(amount))}")
            elif amount:
                out.append(f"--gres={'gpu' if name == 'GPU' else name}:{max(1, round(amount))}")
        return out

    def announce(self, endpoint: str, events: str, sup: Supervisor) -> None:
        """Publish the topology once it is ready, and again after every restart or give-up (the
        supervisor's notice, chained: `busctl ps` on the login node shows the restarts)."""
        for name, child in sup.children.items():  # `busctl up`'s own extras (fake-llm)
            self.node(name, child.spec.role or "process")
        self._publish(endpoint, events, sup)
        earlier = sup.notify

        async def notify(what: str, child: Child, code: int | None) -> None:
            self._publish(endpoint, events, sup)
            if earlier is not None:
                await earlier(what, child, code)

        sup.notify = notify

    def _publish(self, endpoint: str, events: str, sup: Supervisor) -> None:
        rows = {row["name"]: row for row in sup.table()}
        publish(self.state, Published(
            job_id=self.alloc.job_id, endpoint=endpoint, events=events, pid=os.getpid(),
            host=socket.gethostname(), nodes=self.alloc.nodes,
            processes={n: PlacedProcess(role=self.roles[n], node=node,
                                        restarts=int(rows.get(n, {}).get("restarts", 0)),
                                        last_exit=str(rows.get(n, {}).get("last_exit", "-")),
                                        gave_up=rows.get(n, {}).get("state") == "gave up")
                       for n, node in self.placed.items() if n in sup.children}))


# --- up ------------------------------------------------------------------------------------------


def keys_dir(state: Path) -> Path:
    return state / SLURM_DIR / "keys"


def prepare(topo: Topology, alloc: Allocation) -> list[str]:
    """Make a resolved topology one `srun` steps can run: the hub's TCP address on its node, and
    fresh CURVE keys in the state folder (the owner's, the hub's; `up` adds the processes').
    Returns notes for the user."""
    notes = []
    hub = topo.hub
    if not hub.endpoint.startswith("tcp://"):
        raise SlurmUsage(f"hub.endpoint: {hub.endpoint!r}: on Slurm the hub listens on TCP (with "
                         "CURVE) on its node; give tcp://0.0.0.0:PORT (0: any free port)")
    if hub.curve_secret:
        notes.append("hub.curve_*: not used on Slurm: `up` makes the hub's and every process's "
                     "keys in the state folder (`busctl --engine slurm` presents the owner's)")
    state = topo.state_path()
    topo.engine.kind = "slurm"  # curve_keys: the processes' keys in the state folder too
    hub.state_dir = str(state)  # every node resolves the same path
    placer = SlurmPlacer(topo, alloc, state)
    address = alloc.addresses[placer.hub_node]
    hub.endpoint = on_node(hub.endpoint, address)
    if hub.events:
        hub.events = on_node(hub.events, address)
    _make_keys(topo, state)
    return notes


def on_node(endpoint: str, address: str) -> str:
    """`tcp://HOST:PORT` with a wildcard or loopback HOST made the hub node's address."""
    scheme, _, rest = endpoint.partition("://")
    host, _, port = rest.rpartition(":")
    return f"{scheme}://{address if host.strip('[]') in WILDCARD_HOSTS else host}:{port}"


def _make_keys(topo: Topology, state: Path) -> None:
    keys = keys_dir(state)
    shutil.rmtree(keys, ignore_errors=True)  # an earlier job's: worth nothing now
    for folder in (state / SLURM_DIR, keys):
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    hub_public, hub_secret = generate_keys(keys / "hub", "hub")
    owner_public, owner_secret = generate_keys(keys / "owner", "owner")
    authorized = keys / "authorized"  # public keys only: the hub reads every *.key in it
    authorized.mkdir(mode=0o700)
    write_private(authorized / "owner.key", owner_public.read_text())
    hub = topo.hub
    hub.curve_secret, hub.curve_server_key = str(hub_secret), str(hub_public)
    hub.curve_authorized, hub.curve_client_key = str(authorized), str(owner_secret)
    hub.insecure = False


def load_model_env(state: Path) -> None:
    """The models' keys `busctl submit` left for this job (0600): into this process's memory,
    where the local `up` finds them for the gateway (on its stdin, never an environment)."""
    path = state / SLURM_DIR / MODEL_ENV
    try:
        data = msgspec.json.decode(path.read_bytes(), type=dict[str, dict[str, str]])
    except FileNotFoundError:
        return
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise SlurmError(f"{path}: cannot read the models' keys `busctl submit` wrote ({exc}); "
                         "submit the job again") from None
    for values in data.values():
        os.environ.update(values)


def up(topo: Topology, options: Any, out: Any, color: bool) -> int:
    """The local `up` (agents.launch.up.up) with every child an `srun` step placed by
    `SlurmPlacer`; the published file and the keys go when it stops."""
    import anyio

    from agent_bus.agents.launch.up import up as run_up

    alloc = allocation()
    state = topo.state_path()
    for note in prepare(topo, alloc):
        out.write(f"note: {note}\n")
    placer = SlurmPlacer(topo, alloc, state)
    placer.check()
    load_model_env(state)
    out.write(f"slurm      job {alloc.job_id}: hub on {placer.hub_node}, nodes "
              f"{', '.join(alloc.nodes)}\n")
    threading.Thread(target=_end_with_job, args=(alloc.job_id,), daemon=True,
                     name="end-with-job").start()
    try:
        code: int = anyio.run(run_up, topo, options, out, color, placer)  # type: ignore[arg-type]
        return code
    finally:
        unpublish(state, os.getpid())


JOB_POLL = 2.0  # seconds between two looks at the job's state (Slurm has no "tell me")
LIVE_STATES = ("RUNNING", "CONFIGURING", "SUSPENDED")


def _end_with_job(job_id: str) -> None:
    """Stop this `up` (SIGTERM to itself: the usual stop, in order) once Slurm no longer runs
    its job. Slurm signals the processes it tracks when a job is cancelled, preempted or out of
    time; a detached `up` (`-d` in a batch script) is not among them where the process tracking
    follows parent pids (proctrack/linuxproc), and would otherwise outlive its allocation."""
    while True:
        time.sleep(JOB_POLL)
        try:
            state = _first(run_tool(["squeue", "-h", "-j", job_id, "-o", "%T"]))
        except SlurmError as exc:
            if "Invalid job id" not in str(exc):
                continue  # slurmctld busy or restarting: not a verdict on the job
            state = ""
        if state not in LIVE_STATES:
            os.kill(os.getpid(), signal.SIGTERM)
            return


# --- published: found from any machine that sees the state folder --------------------------------


class PlacedProcess(msgspec.Struct):
    role: str
    node: str
    restarts: int = 0  # as of the last publication (at ready, and at each restart)
    last_exit: str = "-"
    gave_up: bool = False


class Published(msgspec.Struct):
    """`<state>/slurm/hub.json`: where the job's topology is."""
    job_id: str
    endpoint: str
    events: str
    pid: int  # `up` on `host`
    host: str
    nodes: list[str]
    processes: dict[str, PlacedProcess]


def publish(state: Path, info: Published) -> None:
    write_private(state / SLURM_DIR / PUBLISHED, msgspec.json.encode(info).decode())


def unpublish(state: Path, pid: int) -> None:
    """Remove the published file and the keys of the `up` with `pid` (not a later job's)."""
    path = state / SLURM_DIR / PUBLISHED
    try:
        mine = msgspec.json.decode(path.read_bytes(), type=Published).pid == pid
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        mine = True
    if mine:
        path.unlink(missing_ok=True)
        shutil.rmtree(keys_dir(state), ignore_errors=True)


def job_state(job_id: str) -> str:
    """The job's state (`RUNNING`…), "" once Slurm no longer lists it."""
    try:
        return _first(run_tool(["squeue", "-h", "-j", job_id, "-o", "%T"]))
    except SlurmError:  # "Invalid job id": it ended a while ago
        return ""


def _first(lines: str) -> str:
    """squeue's first line: a heterogeneous job has one per component, component 0 first."""
    return next(iter(lines.split()), "")


def published(state: Path) -> Published:
    path = state / SLURM_DIR / PUBLISHED
    try:
        info = msgspec.json.decode(path.read_bytes(), type=Published)
    except FileNotFoundError:
        raise SlurmError(f"no topology of a Slurm job is published in {state} ({path} is "
                         "missing): start one with `busctl submit TOPOLOGY|SPEC` (or `busctl up "
                         "--engine slurm` in an allocation), from this folder or with its -c "
                         "file") from None
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise SlurmError(f"{path}: cannot read it ({exc})") from None
    if not job_state(info.job_id):
        raise SlurmError(f"Slurm job {info.job_id}, which ran the topology of {state}, has "
                         "ended; its event log stays in the state folder (`busctl submit` "
                         "starts it again, `--resume E` finishes an experiment)")
    return info


def client(state: Path) -> tuple[str, CurveClient]:
    """The hub's address and the owner's keys (files in the state folder)."""
    info = published(state)
    keys = keys_dir(state)
    return info.endpoint, CurveClient(server_public_key_file=str(keys / "hub" / "hub.key"),
                                      secret_key_file=str(keys / "owner" / "owner.key_secret"))


def table(state: Path) -> list[dict[str, Any]]:
    """`busctl ps --engine slurm`: each process with its node, as the hub sees it."""
    import anyio

    from agent_bus.bus.client import connect

    info = published(state)
    endpoint, curve = client(state)

    async def peers() -> dict[str, Any]:
        async with connect(endpoint, name="busctl-ps", role="cli", curve=curve) as peer:
            return {p.name: p for p in (await peer.status()).peers}

    seen = anyio.run(peers)
    rows = []
    for name, placed in info.processes.items():
        peer = seen.get(name)
        live = name == "hub" or peer is not None
        shown = "gave up" if placed.gave_up else "ready" if live \
            else "-" if placed.role in ("process", "fake-llm") \
            else "not connected"  # a [[processes]] program is no bus peer: the hub cannot tell
        rows.append({"name": name, "role": placed.role, "node": placed.node, "state": shown,
                     "pid": peer.pid if peer is not None else 0, "restarts": placed.restarts,
                     "last_exit": placed.last_exit, "job": info.job_id})
    return rows


def down(state: Path, timeout: float) -> str:
    """Inside the job: stop the topology as the local `down` does (its `up` runs on this
    node). Elsewhere (the login node): cancel the job, and wait until Slurm has ended it."""
    from agent_bus.agents.launch.up import stop_topology

    info = published(state)
    if os.environ.get("SLURM_JOB_ID") == info.job_id:
        report, failed = stop_topology(state, timeout)
        if failed:
            raise SlurmError(f"{report}; could not stop: {', '.join(failed)}")
        return report
    run_tool(["scancel", info.job_id])
    deadline = time.monotonic() + max(timeout, 60.0)
    while job_state(info.job_id) and time.monotonic() < deadline:
        time.sleep(0.5)  # polling Slurm: it has no "wait for end" call
    if job_state(info.job_id):
        raise SlurmError(f"cancelled job {info.job_id}, but Slurm still lists it after "
                         f"{max(timeout, 60.0):g}s (`squeue -j {info.job_id}`)")
    return f"cancelled Slurm job {info.job_id} (every step of the topology ended with it)"
