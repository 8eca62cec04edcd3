"""One CURVE identity per process kind, made by `busctl up` for a CURVE topology.

A topology with `[hub] curve_*` keys names the user's own keys: the hub's pair, the folder of
authorised client keys (with the user's `roles.toml`) and the owner's client key, which `up`
itself, `[ui]`, `[otel]` and every `busctl` command of the user present (the owner's identity).
The processes `up` starts get identities of their own, as a local topology's get credentials
(`credentials.py`): at every start a fresh key pair per process kind — `gateway`, each
`coordinator-N`, each `worker-<group>` — in `keys/` of the topology's private runtime folder
(0700, `bus.paths.topology_runtime_dir`), with a `roles.toml` there giving each only its own role.
The hub gets that folder as a second authorised folder (`busctl hub --curve-authorized` twice):
nothing is written into the user's folder, and the user's roles.toml governs the user's keys only.
The folder goes when the topology stops (a key of an earlier run is worth nothing).

A worker reads its key before it enters its sandbox and holds it in memory; the sandbox hides the
key files it was given and the user's key folders (`bus.security.key_hiding`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from agent_bus.agents.launch import credentials
from agent_bus.agents.launch.supervisor import ChildSpec
from agent_bus.agents.launch.topology import Topology, WorkerGroup
from agent_bus.bus.paths import topology_runtime_dir
from agent_bus.bus.security import ROLES_FILE, generate_keys, key_hiding

# Not made: the owner is the user's own key, and a worker attached by hand to a CURVE hub
# brings its own key (authorised by the user).
NOT_MADE = ("owner", "worker")


def enabled(topo: Topology) -> bool:
    return bool(topo.hub.curve_secret)


def folder(state: Path, shared: bool = False) -> Path:
    """Where `up` keeps the key pairs of its processes and their roles (the hub's second
    authorised folder): the private runtime folder of this machine, or with `shared` (processes
    on other nodes must read them: `--engine slurm`) the state folder, on the shared filesystem."""
    if shared:
        return state / SHARED_KEYS / "processes"
    return topology_runtime_dir(state) / "keys"


#: Under the state folder (0700): the keys of a topology whose processes run on other nodes.
SHARED_KEYS = "slurm/keys"


def folder_of(topo: Topology, state: Path) -> Path:
    return folder(state, shared=topo.engine.kind == "slurm")


def make(topo: Topology, state: Path) -> Path:
    """A fresh key pair per process kind and the roles file; returns the folder."""
    keys = folder_of(topo, state)
    shutil.rmtree(keys, ignore_errors=True)  # an earlier run's (a killed `up`): worth nothing
    roles = {name: patterns for name, patterns in credentials.kinds(topo).items()
             if name not in NOT_MADE}
    for name in roles:
        generate_keys(keys, name)
    # JSON strings and arrays are TOML basic strings and arrays
    lines = [f"{json.dumps(name)} = {json.dumps(patterns)}" for name, patterns in roles.items()]
    (keys / ROLES_FILE).write_text("[roles]\n" + "\n".join(lines) + "\n")
    return keys


def attach(spec: ChildSpec, topo: Topology, state: Path) -> ChildSpec:
    """Give a gateway, coordinator or worker of `up` its own key (the others keep theirs)."""
    if not enabled(topo) or spec.role not in ("gateway", "coordinator", "worker"):
        return spec
    key = folder_of(topo, state) / f"{credentials.kind_of(spec)}.key_secret"
    spec.argv = [*spec.argv, "--curve-server-key", topo.hub.curve_server_key,
                 "--curve-key", str(key)]
    return spec


def hidden_from(group: WorkerGroup, topo: Topology) -> list[str]:
    """What a worker's sandbox hides of the user's keys: the folders of the hub's secret, of the
    owner's key and of the authorised keys (which a tool could otherwise add a key to)."""
    if not enabled(topo):
        return []
    hub = topo.hub
    files = [hub.curve_secret, hub.curve_client_key, hub.curve_authorized]
    return key_hiding(files, Path(group.workspace))
