"""The topology file: which hub, models, gateways, tool workers, agents and extra processes to run.

A TOML file decoded with msgspec into `Topology` (unknown keys are errors). `load_topology` turns
every problem into a `TopologyError` that names the file, the key path and what was expected, so
`busctl up` and `busctl config check` can print one clear line and exit non-zero.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from agent_bus.agents.gateway.providers.llamacpp import local_model_problems
from agent_bus.agents.gateway.wire import MaxTokens, ModelConfig, Seed, Temperature, TopP
from agent_bus.bus.errors import ConfigError
from agent_bus.bus.paths import default_state_dir, inside_state_dir, overlaps
from agent_bus.bus.store.url import StoreUrlError, parse_store_url
from agent_bus.tools.mcp import McpServerSpec

QueueMode = Literal["one-at-a-time", "all"]


class TopologyError(ConfigError):
    pass


class HubSection(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    endpoint: str = "tcp://127.0.0.1:7400"
    events: str = ""
    state_dir: str = ""  # "" = outside the project, see bus.paths.default_state_dir
    # the event store: "" = SQLite in state_dir; nats://HOST:PORT,... = a JetStream cluster
    # (busctl hub --store; bus/store/url.py)
    store: str = ""
    # A standby hub's address (a replicated `store` only): `busctl up` starts a second hub there
    # (`busctl hub --standby`), and hands every process the hub list "endpoint,standby"
    standby: str = ""
    lease_ttl: float = 0.0  # seconds the leader lease lives unrenewed; 0: the hub's default (5)
    heartbeat_interval: float = 1.0
    liveness: int = 3
    max_message_bytes: int = 16 * 1024 * 1024
    curve_secret: str = ""  # the hub's secret key file: turns CURVE on
    curve_authorized: str = ""  # directory of authorised client public keys
    curve_server_key: str = ""  # the hub's public key file, given to the processes `up` starts
    # the owner's secret key file (its public half authorised): `up` itself and its [ui], [otel]
    # children; gateways, coordinators and workers get keys of their own (curve_keys.py)
    curve_client_key: str = ""
    insecure: bool = False


class GatewaySection(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    count: int = 1
    default_model: str = ""  # alias used when an agent names none; "" = the first model


class WorkerGroup(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    name: str = "tools"
    tools: list[str] = msgspec.field(default_factory=lambda: ["agent_bus.tools.builtin"])
    count: int = 1
    concurrency: int = 8
    workspace: str = "."
    shell: bool = False
    # Names of variables passed from `busctl up`'s environment; a worker gets a minimal
    # environment otherwise (no provider keys: only the gateway holds those).
    pass_env: list[str] = msgspec.field(default_factory=list)
    # MCP servers whose tools the group's workers serve ([[workers.mcp]]: name, command, args,
    # env, cwd, prefix, allow, deny); handed to each worker on stdin, so `env` secrets stay
    # out of argv and logs.
    mcp: list[McpServerSpec] = msgspec.field(default_factory=list)
    # Paths in the workspace the tools may not write (besides the bus's own Python environment,
    # `.git` and the topology file in use, always read-only; see tools/sandbox.py).
    read_only: list[str] = msgspec.field(default_factory=list)
    network: bool = False  # whether run_shell calls have the network
    # The bubblewrap sandbox of the group's tools (tools/sandbox.py): "auto" where bwrap works,
    # "required" (`busctl up` fails without it), "off".
    sandbox: Literal["auto", "required", "off"] = "auto"


class TopicSubscription(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    topic: str
    mode: Literal["follow_up", "steer"] = "follow_up"


# An agent's sampling and turn bound, here and for `busctl replay --set` (agents/replay.py): one
# set of ranges. Finite (no inf/nan), within what providers accept (temperature 0-2 is OpenAI's,
# the widest), and small enough for the wire (msgpack carries no int past 2**64).
TurnBound = Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]


class AgentSpec(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    name: str
    model: str = ""
    system_prompt: str = "You are a helpful assistant. Use the tools available to you."
    tools: list[str] = msgspec.field(default_factory=lambda: ["*"])
    tool_execution: Literal["parallel", "sequential"] = "parallel"
    max_iterations: TurnBound = 200
    repeat_limit: int = 3  # same tool + same arguments N times in a row: a note; 2N: the run stops
    # Sampling for this agent's calls (unset: the model's `[models.x]` defaults, then the server's)
    temperature: Temperature | None = None
    top_p: TopP | None = None
    max_tokens: MaxTokens | None = None
    seed: Seed | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    require_done_tool: bool = False
    hooks: dict[str, str] = msgspec.field(default_factory=dict)
    steering_mode: QueueMode = "one-at-a-time"
    follow_up_mode: QueueMode = "one-at-a-time"
    agents: list[str] = msgspec.field(default_factory=list)  # other agents offered as tools
    subscribe: list[TopicSubscription] = msgspec.field(default_factory=list)
    experiment: str = ""
    # Sessions: runs of different sessions of this agent proceed at once, up to
    # `max_concurrent_runs` per coordinator; up to `max_queued_runs` more wait for a slot, and
    # beyond that a prompt is refused (code `agent_busy`, naming these keys).
    max_concurrent_runs: Annotated[int, msgspec.Meta(ge=1)] = 64
    max_queued_runs: Annotated[int, msgspec.Meta(ge=0)] = 256
    # `ask_<this agent's callees>`: a fresh callee session per call ("call"), or one callee
    # session per calling session, continued by its later calls ("caller").
    ask_sessions: Literal["call", "caller"] = "call"


class ProcessSpec(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """`[[processes]]`: another program `busctl up` starts, supervises and stops. Readiness (what
    `up` waits for before it says the topology is up): "started" (the default: once it runs),
    "line" (a `{"ready": ...}` JSON line on its stdout, as busctl's own commands print), or,
    with `ready_port`, something accepting connections on 127.0.0.1:ready_port."""

    name: str
    command: list[str]
    env: dict[str, str] = msgspec.field(default_factory=dict)
    pass_env: list[str] = msgspec.field(default_factory=list)  # as for workers
    restart: bool = True
    ready: Literal["started", "line"] = "started"
    ready_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0  # 0: none; else ready on connect
    ready_timeout: Annotated[float, msgspec.Meta(gt=0)] = 20.0  # seconds


class UiSection(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """`[ui]`: `busctl up` starts `busctl ui` as a supervised child (its ready line names the link
    its owner opens). Every request needs the page's token (bus/ui/access.py): one generated,
    or the file named by $BUSCTL_UI_TOKEN_FILE of `busctl up` (a path: never the token itself
    in an environment)."""

    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 7480  # 0: any free port
    bind: str = "127.0.0.1"


class OtelSection(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """`[otel]`: `busctl up` starts `busctl otel` as a supervised child. Collector headers (they
    hold keys) come from $OTEL_EXPORTER_OTLP_HEADERS of `busctl up`, never from this file."""

    endpoint: str = ""  # OTLP/HTTP base URL (`/v1/traces` is added) or the traces URL itself;
    # "": $OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT, else http://localhost:4318
    capture_content: bool = False
    max_spans: Annotated[int, msgspec.Meta(ge=1)] = 10_000


def otel_traces_url(endpoint: str) -> str:
    """`http://host:4318` -> `http://host:4318/v1/traces` (the OTLP base URL convention)."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else endpoint + "/v1/traces"


class EngineSection(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """`[engine]`: what starts and restarts the processes. "local": `busctl up`'s own supervisor
    on this machine; "ray": a Ray cluster places them (`busctl up --engine ray`,
    agents/launch/ray_engine.py; needs `pip install 'agent-bus[ray]'`); "slurm": `srun` steps
    on the nodes of the Slurm allocation `up` runs in (agents/launch/slurm_engine.py)."""

    kind: Literal["local", "ray", "slurm"] = "local"
    # The Ray cluster: "auto" = the one this machine belongs to (`ray start` ran here), or
    # HOST:PORT of its head (GCS), or ray://HOST:10001 (Ray Client).
    address: str = "auto"
    # The topology's name in the cluster: its actors are `<name>:<process>` in Ray namespace
    # `agent-bus`, and every `busctl --engine ray` command finds it by it. "": the topology
    # file's stem (`team.toml` -> `team`), `agent-bus` for the embedded default.
    name: str = ""


class Placement(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """`[placement.<what>]`: where Ray or Slurm runs a process or a group of them (ignored by the
    local engine). <what> is `hub`, `gateways`, `coordinators`, `workers` (every worker group), a worker
    group's name, or one process's name (`coordinator-2`, `tools-1`); the most specific wins."""

    # Ray resources each process reserves: custom ones a node was started with
    # (`ray start --resources='{"bus_tools": 4}'`), "GPU", "CPU" (default: none, so a
    # bus process, mostly idle, does not take a CPU from Ray's tasks).
    resources: dict[str, Annotated[float, msgspec.Meta(ge=0)]] = msgspec.field(default_factory=dict)
    # "spread": the processes of this entry on distinct nodes where possible; "pack": on as few
    # as possible (a soft Ray placement group either way, so a lost node's share comes back on
    # the nodes left). "": Ray's default.
    strategy: Literal["", "spread", "pack"] = ""
    # A node the processes must run on: its IP address, its Ray node id (hex), or a label
    # `key=value` (`ray start --labels='{"zone": "a"}'`). Hard: they wait for that node.
    # On Slurm: a node name of the allocation, its position in it (`"2"`: the second node), or
    # `"het:N"`: the nodes of a heterogeneous job's component N (round-robin over them).
    node: str = ""


PLACEMENT_GROUPS = ("hub", "gateways", "coordinators", "workers")


class Topology(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    hub: HubSection = msgspec.field(default_factory=HubSection)
    models: dict[str, ModelConfig] = msgspec.field(default_factory=dict)  # alias -> model
    gateways: GatewaySection = msgspec.field(default_factory=GatewaySection)
    workers: list[WorkerGroup] = msgspec.field(default_factory=lambda: [WorkerGroup()])
    coordinators: int = 1
    agents: list[AgentSpec] = msgspec.field(default_factory=lambda: [AgentSpec("assistant")])
    processes: list[ProcessSpec] = msgspec.field(default_factory=list)
    ui: UiSection | None = None
    otel: OtelSection | None = None
    engine: EngineSection = msgspec.field(default_factory=EngineSection)
    placement: dict[str, Placement] = msgspec.field(default_factory=dict)

    def all_processes(self) -> list[ProcessSpec]:
        """`processes` plus the `[ui]` and `[otel]` children (busctl commands like any other)."""
        extra: list[ProcessSpec] = []
        curve = {"BUSCTL_CURVE_SERVER_KEY": self.hub.curve_server_key,
                 "BUSCTL_CURVE_KEY": self.hub.curve_client_key} if self.hub.curve_secret else {}
        if self.ui is not None:
            extra.append(ProcessSpec("ui", ["busctl", "ui", "--port", str(self.ui.port),
                                            "--bind", self.ui.bind],
                                     env=curve, pass_env=["BUSCTL_UI_TOKEN_FILE"], ready="line"))
        if self.otel is not None:
            otel = self.otel
            argv = ["busctl", "otel", "--state-file", str(self.state_path() / "otel.json"),
                    "--max-spans", str(otel.max_spans)]
            if otel.endpoint:
                argv += ["--endpoint", otel_traces_url(otel.endpoint)]
            if otel.capture_content:
                argv.append("--capture-content")
            extra.append(ProcessSpec("otel", argv, env=curve, pass_env=[
                "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                "OTEL_EXPORTER_OTLP_HEADERS"], ready="line"))
        return [*self.processes, *extra]

    def model_configs(self) -> list[ModelConfig]:
        return [msgspec.structs.replace(entry, alias=alias) for alias, entry in self.models.items()]

    def state_path(self) -> Path:
        """The resolved state directory (relative paths are relative to the current directory)."""
        if self.hub.state_dir:
            return Path(self.hub.state_dir).expanduser().resolve()
        return default_state_dir()

    def agent(self, name: str) -> AgentSpec:
        for spec in self.agents:
            if spec.name == name:
                return spec
        raise KeyError(name)


HOOK_NAMES = frozenset({
    "before_tool_call", "after_tool_call", "transform_context", "convert_to_llm",
    "prepare_next_turn", "should_stop_after_turn", "get_incomplete_work_prompt",
})


def default_topology() -> Topology:
    return Topology()


def load_topology(path: Path | str) -> Topology:
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TopologyError(f"{path}: cannot read: {exc.strerror}") from None
    return parse_topology(data, str(path), as_json=path.suffix == ".json")


def parse_topology(data: bytes, source: str, *, as_json: bool) -> Topology:
    """Decode and check a topology; every problem is a TopologyError naming `source` and the key."""
    try:
        if as_json:
            topology = msgspec.json.decode(data, type=Topology)
        else:
            topology = msgspec.toml.decode(data, type=Topology)
    except msgspec.ValidationError as exc:
        raise TopologyError(f"{source}: {_keypath_message(str(exc))}") from None
    except msgspec.DecodeError as exc:
        raise TopologyError(f"{source}: not valid {'JSON' if as_json else 'TOML'}: {exc}") from None
    problems = check_topology(topology)
    if problems:
        raise TopologyError(f"{source}: {problems[0]}")
    return topology


def _keypath_message(message: str) -> str:
    """msgspec says `... - at `$.agents[0].tools``; we say `agents[0].tools: ...`."""
    match = re.match(r"(?s)(.*) - at `\$\.?(.*)`$", message)
    if not match:
        return message
    text, path = match.groups()
    unknown = re.match(r"Object contains unknown field `(.+)`", text)
    if unknown:
        key = f"{path}.{unknown.group(1)}" if path else unknown.group(1)
        return f"{key}: unknown key (check the spelling; see `busctl config show`)"
    return f"{path or '(top level)'}: {text}"


def check_topology(topology: Topology) -> list[str]:
    """Cross-field checks msgspec cannot express; each problem names its key path."""
    problems: list[str] = []
    aliases = set(topology.models)
    if topology.gateways.default_model and topology.gateways.default_model not in aliases:
        problems.append(f"gateways.default_model: unknown model alias "
                        f"{topology.gateways.default_model!r} (defined: {_names(aliases)})")
    for alias, model in topology.models.items():
        problems += local_model_problems(alias, model)
    names = [a.name for a in topology.agents]
    for i, agent in enumerate(topology.agents):
        where = f"agents[{i}]"
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", agent.name):
            problems.append(f"{where}.name: {agent.name!r} must be letters, digits, _ . or -")
        if names.count(agent.name) > 1:
            problems.append(f"{where}.name: agent {agent.name!r} is defined twice")
        if agent.model and agent.model not in aliases:
            problems.append(f"{where}.model: unknown model alias {agent.model!r} "
                            f"(defined: {_names(aliases)}; add a [models.{agent.model}] table)")
        for hook in agent.hooks:
            if hook not in HOOK_NAMES:
                problems.append(f"{where}.hooks.{hook}: unknown hook (one of {_names(HOOK_NAMES)})")
        for other in agent.agents:
            if other not in names:
                problems.append(f"{where}.agents: unknown agent {other!r}")
    for i, group in enumerate(topology.workers):
        for j, module in enumerate(group.tools):
            if not tool_module_exists(module):
                problems.append(f"workers[{i}].tools[{j}]: cannot find tool module {module!r} "
                                "(a dotted module name importable from here, or a .py file)")
        if group.count < 0 or group.concurrency < 1:
            problems.append(f"workers[{i}]: count must be >= 0 and concurrency >= 1")
    hub = topology.hub
    problems += hub_problems(hub)
    if bool(hub.curve_secret) != bool(hub.curve_authorized):
        problems.append("hub.curve_secret / hub.curve_authorized: give both to turn CURVE on")
    if hub.curve_secret and not (hub.curve_server_key and hub.curve_client_key):
        problems.append("hub.curve_server_key / hub.curve_client_key: with CURVE on, `busctl up` "
                        "needs the hub's public key and the owner's client secret key (both made "
                        "by `busctl keys generate DIR`; its processes get keys of their own)")
    problems += _events_exposure(hub)
    if topology.gateways.count < 0 or topology.coordinators < 0:
        problems.append("gateways.count / coordinators: must be >= 0")
    problems += _state_dir_problems(topology)
    problems += _watcher_problems(topology)
    problems += placement_problems(topology)
    return problems


def process_names(topology: Topology) -> dict[str, list[str]]:
    """Each placement key's processes: `hub`, `gateways`, `coordinators`, `workers`, each worker
    group, and each process by its own name (the names `busctl up` gives them)."""
    gateways = [f"gateway-{i + 1}" for i in range(topology.gateways.count)]
    count = topology.coordinators
    coordinators = [f"coordinator-{i + 1}" for i in range(count) if topology.agents[i::count]]
    groups = {g.name: [f"{g.name}-{i + 1}" for i in range(g.count)] for g in topology.workers}
    names = {"hub": ["hub"], "gateways": gateways, "coordinators": coordinators,
             "workers": [n for group in groups.values() for n in group], **groups}
    for name in [*gateways, *coordinators, *names["workers"]]:
        names.setdefault(name, [name])
    return names


def placement_key(topo: Topology, name: str, role: str) -> str:
    """The `[placement.X]` entry that governs process `name`, the most specific one ("": none)."""
    group = name.rpartition("-")[0]
    chain = {"hub": ["hub"], "gateway": [name, "gateways"], "coordinator": [name, "coordinators"],
             "worker": [name, group, "workers"]}.get(role, [])
    return next((key for key in chain if key in topo.placement), "")


def placement_problems(topology: Topology) -> list[str]:
    problems: list[str] = []
    known = process_names(topology)
    for key, entry in topology.placement.items():
        if key not in known:
            problems.append(f"placement.{key}: names no process or group (one of "
                            f"{', '.join(PLACEMENT_GROUPS)}, a worker group, or a process: "
                            f"{', '.join(n for n in known if n not in PLACEMENT_GROUPS)})")
        if entry.node and entry.strategy:
            problems.append(f"placement.{key}: `node` and `strategy` exclude each other (a node "
                            "fixes where every process runs); give one")
    engine = topology.engine
    if engine.name and not re.fullmatch(r"[A-Za-z0-9_.-]+", engine.name):
        problems.append(f"engine.name: {engine.name!r} must be letters, digits, _ . or -")
    if not engine.address.strip():
        problems.append("engine.address: give \"auto\" (the cluster this machine belongs to) or "
                        "the head's HOST:PORT")
    return problems


#: What the hub binds: a TCP port or a unix socket file (bus.security refuses an open tcp bind).
HUB_SCHEMES = ("tcp", "ipc")


def hub_problems(hub: HubSection) -> list[str]:
    """Ranges and schemes of [hub], checked before anything starts: a value the hub would
    refuse at its start (or overflow on) must be named here, not found in a restart loop."""
    problems = _address_problems("hub.endpoint", hub.endpoint, events_next=not hub.events)
    if hub.events:
        problems += _address_problems("hub.events", hub.events, events_next=False)
    if hub.store:
        try:
            parse_store_url(hub.store, "hub.store")
        except StoreUrlError as exc:
            problems.append(str(exc))
    problems += _standby_problems(hub)
    if not 0.01 <= hub.heartbeat_interval <= 3600:
        problems.append(f"hub.heartbeat_interval: {hub.heartbeat_interval} is out of range "
                        "(seconds between heartbeats, from 0.01 to 3600; default 1.0)")
    if not 1 <= hub.liveness <= 1000:
        problems.append(f"hub.liveness: {hub.liveness} is out of range (missed heartbeats before a "
                        "peer is lost, from 1 to 1000; default 3)")
    if not 1024 <= hub.max_message_bytes <= 2**31 - 1:
        problems.append(f"hub.max_message_bytes: {hub.max_message_bytes} is out of range (from 1024 "
                        f"to {2**31 - 1}; default {16 * 1024 * 1024})")
    return problems


def _standby_problems(hub: HubSection) -> list[str]:
    """[hub] standby and lease_ttl: both need a replicated store (the standby reads the log the
    primary writes, and the lease lives in that store)."""
    problems = []
    for key, given in (("standby", hub.standby), ("lease_ttl", hub.lease_ttl)):
        if given and not hub.store:
            problems.append(f"hub.{key}: a standby hub and its leader lease need a replicated "
                            "event store: set hub.store = \"nats://HOST:PORT,...\" (a NATS "
                            "JetStream cluster); the SQLite log is one machine's")
    if hub.standby:
        problems += _address_problems("hub.standby", hub.standby, events_next=True)
        if hub.standby == hub.endpoint and not hub.standby.endswith(":0"):  # (0: any port)
            problems.append(f"hub.standby: {hub.standby!r} is hub.endpoint too: give the "
                            "standby hub an address of its own (another machine's, or another "
                            "port)")
    if hub.lease_ttl and not 1.0 <= hub.lease_ttl <= 300.0:
        problems.append(f"hub.lease_ttl: {hub.lease_ttl:g} is out of range (seconds the leader "
                        "lease lives unrenewed, from 1 to 300; 0: the default, 5)")
    return problems


def _events_exposure(hub: HubSection) -> list[str]:
    """A hub on a private ipc:// socket whose events go out on tcp:// without CURVE: every local
    user could read the whole stream (the requests' socket is 0600, a tcp port has no owner)."""
    if hub.curve_secret or hub.insecure:
        return []
    if not (hub.endpoint.startswith("ipc://") and hub.events.startswith("tcp://")):
        return []
    return [f"hub.events: {hub.events!r} would publish every event (prompts, replies, tool "
            f"output) to every local user, while hub.endpoint {hub.endpoint!r} is a private "
            "socket; give an ipc:// events address (or leave hub.events unset: "
            f"{hub.endpoint}.events), turn CURVE on (hub.curve_secret / hub.curve_authorized), "
            "or set hub.insecure = true to publish on tcp anyway"]


def _address_problems(key: str, address: str, *, events_next: bool) -> list[str]:
    scheme, sep, rest = address.partition("://")
    if not sep or scheme not in HUB_SCHEMES or not rest:
        return [f"{key}: {address!r} is not an address the hub can bind: give "
                "tcp://HOST:PORT or ipc://PATH"]
    if scheme != "tcp":
        return []
    host, colon, port = rest.rpartition(":")
    if not colon or not host or not port.isdigit() or int(port) > 65535:
        return [f"{key}: {address!r} needs a host and a port from 0 to 65535 (tcp://HOST:PORT; "
                "0 picks a free port)"]
    if events_next and int(port) == 65535:
        return [f"{key}: port 65535 leaves no port for the events (port + 1): choose a lower "
                "port or set hub.events"]
    return []


def _watcher_problems(topology: Topology) -> list[str]:
    problems: list[str] = []
    if topology.ui is not None and not topology.ui.bind.strip():
        problems.append("ui.bind: give an address to listen on (e.g. \"127.0.0.1\")")
    if topology.otel is not None and topology.otel.endpoint and \
            not re.match(r"https?://[^/\s]+", topology.otel.endpoint):
        problems.append(f"otel.endpoint: {topology.otel.endpoint!r} is not an http(s) URL "
                        "(e.g. \"http://127.0.0.1:4318\")")
    names = [p.name for p in topology.processes]
    for section in ("ui", "otel"):
        if getattr(topology, section) is not None and section in names:
            problems.append(f"processes: a process is named {section!r}, as the [{section}] "
                            "section's child is; rename it")
    return problems


def _state_dir_problems(topology: Topology) -> list[str]:
    """The state directory (event log, conversations, running config) must be out of the tools'
    reach: a model that could write it could rewrite the gateway's config or corrupt the log."""
    state = topology.state_path()
    problems: list[str] = []
    for i, group in enumerate(topology.workers):
        workspace = Path(group.workspace).expanduser().resolve()
        if overlaps(state, workspace):
            problems.append(
                f"workers[{i}].workspace: {str(workspace)!r} and hub.state_dir {str(state)!r} overlap, "
                "so the model's tools could rewrite the bus's state; put the state directory "
                "outside every workspace (leave hub.state_dir unset for the default outside "
                "the project)")
        elif (marked := inside_state_dir(workspace)) is not None:
            problems.append(f"workers[{i}].workspace: {str(workspace)!r} is inside the state "
                            f"directory {str(marked)!r}; choose a workspace outside it")
    return problems


def tool_module_exists(module: str) -> bool:
    if module.endswith(".py"):
        return Path(module).is_file()
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _names(names: set[str] | frozenset[str]) -> str:
    return ", ".join(sorted(names)) or "none"


EXAMPLE = """\
# agent-bus topology. Every key is optional; this is the embedded default plus comments.
[hub]
endpoint = "tcp://127.0.0.1:7400"   # ROUTER; events bind on port + 1
# state_dir = "/path/to/state"     # event log, conversations, logs, pid file; default: outside
                                    # the project, in ~/.local/state/agent-bus/<folder>-<hash>
                                    # (must not overlap any worker's workspace)
# store = "nats://h1:4222,h2:4222,h3:4222"  # the event log in a NATS JetStream cluster (3
                                    # replicas; agent-bus[nats]) instead of SQLite in state_dir
heartbeat_interval = 1.0            # seconds
liveness = 3                        # missed beats before a peer is dead

# [models.local]                    # a model alias the agents refer to
# provider = "openai"               # "openai" (any chat-completions server), "anthropic", or
                                    # "llamacpp" (gguf = "model.gguf": served by the gateway
                                    # itself, needs agent-bus[local]; n_ctx, threads,
                                    # chat_template_file)
# base_url = "http://127.0.0.1:8080/v1"
# model = "qwen2.5-7b-instruct"
# api_key_env = "OPENAI_API_KEY"    # the NAME of the variable, never the key
# context_window = 32768
# max_concurrency = 4

[gateways]
count = 1                           # no [models]: configured from OPENAI_* / ANTHROPIC_* env

[[workers]]
name = "tools"
tools = ["agent_bus.tools.builtin"]           # dotted modules or .py files with @tool functions
count = 1
concurrency = 8
workspace = "."
shell = false                       # run_shell is offered only when true
network = false                     # run_shell calls get no network unless true
sandbox = "auto"                    # tools run under bubblewrap where it works; "required": `up`
                                    # fails without it; "off" (docs/security.md)
# read_only = ["secrets/"]          # more paths tools may not write (the venv, .git and this
                                    # file are always read-only for tools)
pass_env = []                       # variables the tools need (workers get no provider keys)

[[agents]]
name = "assistant"
tools = ["*"]                       # every live tool
tool_execution = "parallel"
max_iterations = 200

# [ui]                              # `busctl up` also serves the live web view (busctl ui)
# port = 7480                       # 0: any free port; the URL is in its ready line
# bind = "127.0.0.1"                # the page answers only you (a token, in a 0600 file; its
                                    # link is printed); 0.0.0.0: other machines with the token

# [engine]                          # who runs the processes: "local" (busctl up), "ray", "slurm"
# kind = "ray"                      # a Ray cluster places and restarts them (agent-bus[ray]);
                                    # "slurm": srun steps on the allocation's nodes
# address = "auto"                  # the cluster this machine belongs to, or HEAD:6379
# name = "team"                     # its name on the cluster [default: this file's stem]
# [placement.workers]               # where Ray runs them: hub, gateways, coordinators, workers,
# resources = { bus_tools = 1 }     # a worker group or one process; Ray resources each takes,
# strategy = "spread"               # "spread"/"pack" over nodes, or node = "IP|id|label=value"

# [[processes]]                     # another program `busctl up` starts, restarts and stops
# name = "search"
# command = ["python", "search_server.py", "--port", "8099"]
# env = { LOG_LEVEL = "info" }      # added to a minimal environment (plus pass_env's names)
# restart = true
# ready = "started"                 # when `up` counts it ready: "started" (once it runs), or
                                    # "line": a {"ready": ...} JSON line on its stdout
# ready_port = 8099                 # or: once 127.0.0.1:8099 accepts a connection
# ready_timeout = 20.0              # seconds; past it `up` fails naming what it waited for

# [otel]                            # `busctl up` also exports OpenTelemetry traces (busctl otel)
# endpoint = "http://127.0.0.1:4318"  # OTLP/HTTP; headers from $OTEL_EXPORTER_OTLP_HEADERS
# capture_content = false           # prompts, replies, tool arguments and results too
# max_spans = 10000                 # buffered while the collector is down
"""
