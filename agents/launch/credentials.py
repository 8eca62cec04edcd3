"""Roles of a topology's own processes: a credential per process kind, made by `busctl up`.

Each credential is a random token in a 0600 file in the topology's private runtime folder
(`bus.paths.topology_runtime_dir`), named to its process by `$BUSCTL_CREDENTIAL_FILE` (the
variable holds the path, never the secret); the client library presents it in its hello. The hub
gets the table (SHA-256 of each token -> the services it may serve) as a 0600 file in its state
directory (`--credentials`). The owner's credential (`owner.cred`, full rights) lies beside the
hub's sockets: every `busctl` command and `connect()` of the topology's user finds it there; a
tool worker in a sandbox that shows it only the sockets does not. See docs/protocol.md section 8,
"Roles".
"""

from __future__ import annotations

import hashlib
import secrets
from pathlib import Path

import msgspec

from agent_bus.agents.launch.supervisor import ChildSpec
from agent_bus.agents.launch.topology import Topology
from agent_bus.bus.paths import CREDENTIAL_ENV, OWNER_CREDENTIAL, topology_runtime_dir, write_private

FULL = ["*"]


def kinds(topo: Topology) -> dict[str, list[str]]:
    """Each credential's name and the services its holders may serve."""
    # "worker": what a `busctl worker` attached by hand presents (its sandbox hides the rest)
    out: dict[str, list[str]] = {"owner": FULL, "gateway": ["llm", "llm.*", "gateway.*"],
                                 "worker": ["tool.*"]}
    for group in topo.workers:
        out[f"worker-{group.name}"] = ["tool.*"]
    count = topo.coordinators
    for i in range(count):
        name = f"coordinator-{i + 1}"
        out[name] = [f"replay@{name}"]
        for agent in topo.agents[i::count]:
            out[name] += [f"agent.{agent.name}", f"agent.{agent.name}@*"]
    return out


def enabled(topo: Topology, state: Path) -> bool:
    """Whether the topology's hub is a local one (ipc:// in its runtime folder, see
    `agents.launch.up.make_local`): only its clients can present the credentials beside it.
    Elsewhere (CURVE, `insecure`, an ipc:// address of the user's) roles come from the keys."""
    endpoint = topo.hub.endpoint
    return (endpoint.startswith("ipc://")
            and Path(endpoint[6:]).parent == topology_runtime_dir(state))


def make(topo: Topology, state: Path) -> Path:
    """Write every credential file and the hub's table; returns the table's path. New tokens at
    every `up`: a credential of an earlier run is worth nothing."""
    folder = topology_runtime_dir(state)
    table: dict[str, dict[str, object]] = {}
    for name, roles in kinds(topo).items():
        token = secrets.token_urlsafe(32)
        write_private(folder / f"{name}.cred" if name != "owner" else folder / OWNER_CREDENTIAL,
                       token)
        table[hashlib.sha256(token.encode()).hexdigest()] = {"name": name, "roles": roles}
    path = state / "hub" / "credentials.json"
    path.parent.mkdir(mode=0o700, exist_ok=True)
    write_private(path, msgspec.json.encode(table).decode())
    return path


def attach(spec: ChildSpec, topo: Topology, state: Path) -> ChildSpec:
    """Name its credential file to a child of `up` (by what it is), for a local hub."""
    if not enabled(topo, state):
        return spec
    name = kind_of(spec)
    file = OWNER_CREDENTIAL if name == "owner" else f"{name}.cred"
    spec.env = {**spec.env, CREDENTIAL_ENV: str(topology_runtime_dir(state) / file)}
    return spec


def kind_of(spec: ChildSpec) -> str:
    """The process kind of a child of `up` (a name of `kinds`): what its identity is."""
    if spec.role == "gateway":
        return "gateway"
    if spec.role == "coordinator":
        return spec.name
    if spec.role == "worker":
        return f"worker-{spec.name.rpartition('-')[0]}"
    return "owner"  # the topology's extra processes are its owner's own programs


def remove(state: Path) -> None:
    """The credential files of a topology that stopped (its hub's table goes with its state)."""
    folder = topology_runtime_dir(state)
    for path in folder.glob("*.cred"):
        path.unlink(missing_ok=True)
