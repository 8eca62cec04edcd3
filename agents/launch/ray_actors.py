"""The two Ray actors of a topology placed by Ray (`busctl up --engine ray`, ray_engine.py).

`TopologyHolder` (one per topology, named `<topology>:topology`): the topology as `up` resolved
it, the hub's address once it is up, the processes' names, and every CURVE key pair, made in
its own memory when it starts (`zmq.curve_keypair`). No key is an argument of an actor's
constructor (Ray's actor listings and dashboard can show those): the other actors and `busctl`
*ask* for keys with a method call, whose return value Ray shows nowhere. The one secret that is
an argument is the models' API keys, `up` -> `set_model_env` once (Ray's task events record a
method's name, not its arguments). Who may ask is whoever may reach the Ray cluster: on Ray, the
cluster's membership is the trust boundary (docs/architecture.md, "Ray engine").

`ProcessKeeper` (one per bus process, named `<topology>:<process>`, detached, restarted by Ray
on another node when its node dies): runs the unchanged `busctl hub|gateway|worker|coordinator`
command as its child, with `busctl up`'s supervision rules (`agents.launch.supervisor`: backoff
0.5 … 8 s, giving up after 5 restarts in 60 s), and reports pid, node and state. Its child gets
its CURVE keys through a pipe (`bus.security.HANDED_KEYS_ENV` names the descriptor, never a key),
the gateway its model keys on stdin, as under `busctl up`.

Ray is imported only inside the methods: these classes are made actors by ray_engine.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import msgspec

from agent_bus.agents.launch import credentials, curve_keys
from agent_bus.agents.launch.supervisor import (
    CRASH_LOOP_RESTARTS,
    CRASH_LOOP_WINDOW,
    STOP_TIMEOUT,
    ChildFailed,
    ChildSpec,
    minimal_environ,
    ready_line,
    restart_delay,
    sandbox_cell,
    signal_name,
)
from agent_bus.agents.launch.topology import Topology
from agent_bus.bus import events as ev
from agent_bus.bus.paths import ensure_state_dir, write_private
from agent_bus.bus.security import HANDED_KEYS_ENV, ROLES_FILE, CurveClient

NAMESPACE = "agent-bus"  # every topology's actors live in this Ray namespace
STANDBY = "hub-standby"  # the standby hub's process name (`[hub] standby`), as under `busctl up`
TOPOLOGY_SUFFIX = ":topology"
KeyTriple = tuple[bytes, bytes, bytes]  # (hub public, client public, client secret), Z85


def _ray() -> Any:
    """Ray, loaded in an actor's process only (its types are not this module's concern)."""
    import ray

    return ray


def topology_actor_name(topology: str) -> str:
    return f"{topology}{TOPOLOGY_SUFFIX}"


def process_actor_name(topology: str, process: str) -> str:
    return f"{topology}:{process}"


class TopologyHolder:
    """The topology's shared state, in one actor's memory (see the module's docstring)."""

    def __init__(self, name: str, topology_json: bytes) -> None:
        import zmq

        self.name = name
        self.topology_json = topology_json
        topo = msgspec.json.decode(topology_json, type=Topology)
        # every kind but the owner's (its pair is `self.owner`); `worker` and `gateway` are also
        # what a `busctl worker|gateway --engine ray` attached by hand presents
        self.roles = {kind: patterns for kind, patterns in credentials.kinds(topo).items()
                      if kind != "owner"}
        self.hub = zmq.curve_keypair()
        self.owner = zmq.curve_keypair()
        self.pairs = {kind: zmq.curve_keypair() for kind in self.roles}
        self.endpoint = ""
        self.events = ""
        self.has_standby = bool(topo.hub.standby)
        self.standby_endpoint = ""
        self.processes: dict[str, str] = {}  # name -> role, in start order
        self.model_secrets: dict[str, str] = {}
        self.gateway_env: dict[str, str] = {}

    # --- what every keeper reads ---
    def where(self) -> str:
        """This actor's node id (with a standby hub: the head's, see ray_engine.up)."""
        return str(_ray().get_runtime_context().get_node_id())

    def topology(self) -> bytes:
        return self.topology_json

    def hub_address(self) -> tuple[str, str]:
        """The hub's address; with a standby, the pair's "primary,standby" once both are up
        ("" before: every process gets both, and a client moves to the one that leads)."""
        if self.has_standby and not (self.endpoint and self.standby_endpoint):
            return "", self.events
        return ",".join(e for e in (self.endpoint, self.standby_endpoint) if e), self.events

    def set_hub_address(self, endpoint: str, events: str, standby: bool = False) -> None:
        """A hub's keeper, at each ready line (a hub Ray brought back on another node has
        another address: processes started from then on get it)."""
        if standby:
            self.standby_endpoint = endpoint
        else:
            self.endpoint, self.events = endpoint, events

    # --- keys: returned by method calls only (never arguments) ---
    def hub_keys(self) -> tuple[bytes, bytes]:
        """The hub's pair: for the hub's keeper, which writes it on its own node (0600)."""
        return self.hub

    def authorized(self) -> tuple[dict[str, bytes], str, bytes]:
        """The processes' public keys by kind, their roles.toml, and the owner's public key."""
        lines = [f"{json.dumps(kind)} = {json.dumps(patterns)}" for kind, patterns in self.roles.items()]
        return ({kind: pair[0] for kind, pair in self.pairs.items()},
                "[roles]\n" + "\n".join(lines) + "\n", self.owner[0])

    def client_keys(self, kind: str) -> KeyTriple:
        """A process kind's keys (`credentials.kind_of`): only its own role on the hub."""
        public, secret = self.pairs[kind]
        return self.hub[0], public, secret

    def owner_keys(self) -> KeyTriple:
        """The owner's keys (every right): what `busctl run/status/watch --engine ray` present."""
        return self.hub[0], self.owner[0], self.owner[1]

    def set_model_env(self, secrets: dict[str, str], env: dict[str, str]) -> None:
        """The models' keys and the OPENAI_*/ANTHROPIC_* settings of `up`'s environment."""
        self.model_secrets, self.gateway_env = secrets, env

    def model_env(self) -> tuple[dict[str, str], dict[str, str]]:
        return self.model_secrets, self.gateway_env

    # --- what `busctl ps/down/scale` read ---
    def add_process(self, name: str, role: str) -> None:
        self.processes[name] = role

    def remove_process(self, name: str) -> None:
        self.processes.pop(name, None)

    def process_table(self) -> dict[str, str]:
        return dict(self.processes)



class ProcessInfo(msgspec.Struct):
    """What `busctl ps` shows of one process."""
    name: str
    role: str
    node: str  # the node's IP address
    node_id: str  # Ray's node id (hex)
    pid: int
    state: str  # starting, ready, exited, gave up, stopped
    uptime: float
    restarts: int
    last_exit: str
    sandbox: str
    ready: dict[str, Any] = {}


class ProcessKeeper:
    """One bus process, kept running on whatever node Ray put this actor (see the module)."""

    def __init__(self, topology: str, name: str, role: str) -> None:
        ray = _ray()
        self.topology = topology
        self.name = name
        self.role = role
        self.node: str = ray.util.get_node_ip_address()
        self.node_id: str = ray.get_runtime_context().get_node_id()
        self.holder: Any = None  # found by the keeping thread: `up` makes it after the hub's keeper
        self.process: subprocess.Popen[bytes] | None = None
        self.ready: dict[str, Any] | None = None
        self.ready_event = threading.Event()
        self.started_at = 0.0
        self.restarts = 0
        self.restart_times: list[float] = []
        self.last_exit: int | None = None
        self.gave_up = False
        self.stopping = False
        self.failure = ""  # why the process could not be started at all
        # Ray brought this actor back (its node died): the first start is a restart too
        self.moved = bool(ray.get_runtime_context().was_current_actor_reconstructed)
        self.log_path = Path()
        self.state = Path()
        # One thread starts every child: the kernel's parent-death signal (bus/procsec.py)
        # follows the thread that forked, so it must live as long as the children do.
        self.thread = threading.Thread(target=self._keep, name=f"keep-{name}", daemon=True)
        self.thread.start()

    # --- methods ---
    def where(self) -> str:
        """This actor's node id: `up` puts the topology's holder beside the hub."""
        return self.node_id

    def info(self) -> ProcessInfo:
        alive = self.process is not None and self.process.poll() is None
        state = ("stopped" if self.stopping else "gave up" if self.gave_up
                 else "failed" if self.failure else "ready" if alive and self.ready
                 else "starting" if alive or self.process is None else "exited")
        ready = self.ready or {}
        return ProcessInfo(
            name=self.name, role=self._lease_role(), node=self.node, node_id=self.node_id,
            pid=self.process.pid if self.process else 0, state=state,
            uptime=round(time.time() - self.started_at, 1) if alive else 0.0,
            restarts=self.restarts, last_exit=signal_name(self.last_exit),
            sandbox=sandbox_cell(ready) if self.role == "worker" else "-", ready=ready)

    def _lease_role(self) -> str:
        """A hub of a pair: its lease role and epoch ("hub primary e3"), from the role file it
        writes in its state dir on this node at every change (as `busctl ps` shows locally)."""
        from agent_bus.bus.hub import ROLE_FILE

        if self.role != "hub" or self.process is None:
            return self.role
        try:
            role = msgspec.json.decode((self.state / self.name / ROLE_FILE).read_bytes())
        except (OSError, msgspec.DecodeError):
            return self.role  # no lease (one hub), or not written yet
        if not isinstance(role, dict) or role.get("pid") != self.process.pid:
            return self.role
        return f"hub {role.get('role', '?')} e{role.get('epoch', 0)}"

    def wait_ready(self, timeout: float) -> ProcessInfo:
        """This process's info once it is ready; raise ChildFailed (with its log's tail) if not."""
        deadline = time.monotonic() + timeout
        while not self.ready_event.wait(0.1):
            if self.failure or self.gave_up or time.monotonic() > deadline:
                why = self.failure or f"did not become ready within {timeout:g}s"
                raise ChildFailed(f"`{self.name}` on node {self.node}: {why} "
                                  f"(log: {self.log_path}){self.tail(15)}")
        return self.info()

    def tail(self, lines: int) -> str:
        return "".join(f"\n  {self.name} | {line}" for line in self.log_lines(lines))

    def log_lines(self, lines: int | None = None) -> list[str]:
        """The last `lines` lines of this process's log on its node (all: None)."""
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return []
        return text if lines is None else text[max(0, len(text) - lines):]

    def log_from(self, offset: int) -> tuple[int, list[str]]:
        """The whole lines of this process's log after byte `offset`, and the offset after them
        (from 0 again when the log is shorter: another node's, after a move)."""
        try:
            with self.log_path.open("rb") as f:
                if f.seek(0, os.SEEK_END) < offset:
                    offset = 0
                f.seek(offset)
                data = f.read()
        except OSError:
            return offset, []
        *lines, rest = data.split(b"\n")
        return offset + len(data) - len(rest), [line.decode(errors="replace") for line in lines]

    def stop(self) -> str:
        """Stop the child for good (SIGTERM to its group, SIGKILL after STOP_TIMEOUT)."""
        self.stopping = True
        process = self.process
        if process is not None and process.poll() is None:
            _killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                _killpg(process.pid, signal.SIGKILL)
                process.wait(2)
        return signal_name(process.returncode if process else None)

    def restart(self) -> ProcessInfo:
        """`busctl restart`: stop the child; the keeping thread starts it again at once."""
        process = self.process
        self.ready_event.clear()
        if process is not None and process.poll() is None:
            self.restart_times.clear()  # asked for: not a crash
            _killpg(process.pid, signal.SIGTERM)
        return self.wait_ready(30.0)

    # --- the keeping thread ---
    def _keep(self) -> None:
        ray = _ray()
        try:
            self.holder = _find_holder(ray, self.topology)
            topo = msgspec.json.decode(ray.get(self.holder.topology.remote()), type=Topology)
            state = ensure_state_dir(topo.state_path())
            (state / "logs").mkdir(mode=0o700, exist_ok=True)
            self.log_path = state / "logs" / f"{self.name}.log"
            self.state = state
            spec, keys = self._spec(topo, state)
        except Exception as exc:  # noqa: BLE001 - reported by info()/wait_ready, not lost in a thread
            self.failure = f"{type(exc).__name__}: {exc}"
            return
        try:
            self._restarting(topo, state, spec, keys)
        except Exception as exc:  # noqa: BLE001 - as above: `busctl ps` shows it as `failed`
            self.failure = f"{type(exc).__name__}: {exc}"
            self._log(f"stopped keeping the process: {self.failure}")

    def _restarting(self, topo: Topology, state: Path, spec: ChildSpec,
                    keys: KeyTriple | None) -> None:
        """Run the child, and again after it exits (`busctl up`'s backoff and crash loop)."""
        while not self.stopping:
            code = self._run_once(spec, keys)
            self.last_exit = code
            if self.stopping:
                return
            now = time.monotonic()
            self.restart_times = [t for t in self.restart_times if now - t < CRASH_LOOP_WINDOW]
            if len(self.restart_times) >= CRASH_LOOP_RESTARTS:
                self.gave_up = True
                self._log(f"crash-looping ({signal_name(code)}, {self.restarts} restarts); giving up")
                self._announce(ev.ProcessGaveUp(process=self.name, exit_code=code,
                                                restarts=self.restarts))
                return
            delay = restart_delay(len(self.restart_times))
            self._log(f"exited with {signal_name(code)}; restarting in {delay:g}s")
            time.sleep(delay)
            self.restart_times.append(time.monotonic())
            self.restarts += 1
            if self.role == "hub":  # come back where the peers reconnect: the bound ports
                spec = self._pinned_hub(topo, state)

    def _spec(self, topo: Topology, state: Path) -> tuple[ChildSpec, KeyTriple | None]:
        from agent_bus.agents.launch.up import hub_argv, process_spec

        ray = _ray()

        if self.role == "hub":  # the standby: the same keys, its own address and state dir
            self._write_hub_keys(topo, state)
            if self.name == STANDBY:
                topo.hub.standby = _on_node(topo.hub.standby, self.node)
                return ChildSpec(STANDBY, hub_argv(topo, ""), role="hub"), None
            topo.hub.endpoint = _on_node(topo.hub.endpoint, self.node)
            return ChildSpec("hub", hub_argv(topo), role="hub"), None
        endpoint = ""
        while not endpoint:  # the hub's keeper publishes it once its hub is ready
            endpoint, _ = ray.get(self.holder.hub_address.remote())
            if not endpoint:
                time.sleep(0.2)
        spec = process_spec(topo, endpoint, self.name)
        keys: KeyTriple = ray.get(self.holder.client_keys.remote(credentials.kind_of(spec)))
        if spec.secrets_on_stdin:  # the gateway: the models' keys from `up`, not this node
            secrets, env = ray.get(self.holder.model_env.remote())
            spec.stdin_data = json.dumps(secrets).encode() + b"\n" + spec.stdin_data
            spec.env = {**env, **spec.env}
        return spec, keys

    def _write_hub_keys(self, topo: Topology, state: Path) -> None:
        """The hub reads its keys from files: written here, on its own node, in its state
        directory (0700, hidden from every worker's sandbox, refused by the tools), and the
        authorised public keys beside: the owner's (every right) and the processes' with their
        roles, in the folder `hub_argv` names (`curve_keys.folder`)."""
        ray = _ray()
        folder = state / "hub" / "curve"
        owner_dir = folder / "owner"
        processes_dir = curve_keys.folder(state)
        for path in (folder, owner_dir, processes_dir):
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        public, secret = ray.get(self.holder.hub_keys.remote())
        _write_cert(folder / "hub.key", public)
        _write_cert(folder / "hub.key_secret", public, secret)
        publics, roles, owner = ray.get(self.holder.authorized.remote())
        _write_cert(owner_dir / "owner.key", owner)
        for kind, key in publics.items():
            _write_cert(processes_dir / f"{kind}.key", key)
        (processes_dir / ROLES_FILE).write_text(roles)
        hub = topo.hub
        hub.curve_secret, hub.curve_authorized = str(folder / "hub.key_secret"), str(owner_dir)
        hub.curve_server_key, hub.insecure = str(folder / "hub.key"), False

    def _pinned_hub(self, topo: Topology, state: Path) -> ChildSpec:
        from agent_bus.agents.launch.up import hub_argv

        self._write_hub_keys(topo, state)
        if self.name == STANDBY:
            if self.ready:
                topo.hub.standby = self.ready["endpoint"]
            return ChildSpec(STANDBY, hub_argv(topo, (self.ready or {}).get("events", "")),
                             role="hub")
        if self.ready:
            topo.hub.endpoint, topo.hub.events = self.ready["endpoint"], self.ready["events"]
        return ChildSpec("hub", hub_argv(topo), role="hub")

    def _run_once(self, spec: ChildSpec, keys: KeyTriple | None) -> int | None:
        env = {**minimal_environ(spec.pass_env), "PYTHONUNBUFFERED": "1", **spec.env}
        fds: tuple[int, ...] = ()
        if keys is not None:
            read, write = os.pipe()  # ~130 bytes: far below a pipe's buffer
            with os.fdopen(write, "wb") as out:
                out.write(b"\n".join(keys))
            fds, env[HANDED_KEYS_ENV] = (read,), str(read)
        argv = [sys.executable, "-P", "-m", "agent_bus.bus.procsec", str(os.getpid()), *spec.argv]
        self.ready, self.ready_event = None, threading.Event()
        with self.log_path.open("a", buffering=1) as log:
            try:
                process = subprocess.Popen(
                    argv, stdin=subprocess.PIPE if spec.stdin_data else subprocess.DEVNULL,
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                    start_new_session=True, pass_fds=fds)
            except OSError as exc:
                log.write(f"failed to start: {exc}\n")
                return None
            finally:
                for fd in fds:
                    os.close(fd)
            self.process, self.started_at = process, time.time()
            if process.stdin is not None:
                threading.Thread(target=_hand_over, args=(process.stdin, spec.stdin_data),
                                 daemon=True).start()
            assert process.stdout is not None
            for raw in process.stdout:
                line = raw.decode(errors="replace").rstrip("\n")
                log.write(line + "\n")
                if self.ready is None and (ready := ready_line(line)) is not None:
                    self.ready = ready
                    self._on_ready()
            return process.wait()

    def _on_ready(self) -> None:
        ray = _ray()
        if self.role == "hub" and self.ready is not None:
            ray.get(self.holder.set_hub_address.remote(self.ready["endpoint"], self.ready["events"],
                                                       self.name == STANDBY))
        self.ready_event.set()
        if self.restarts or self.moved:  # off the pump's thread: the child's output keeps flowing
            threading.Thread(target=self._announce, args=(ev.ProcessRestarted(
                process=self.name, exit_code=self.last_exit, restarts=self.restarts + self.moved),),
                daemon=True).start()

    def _announce(self, event: ev.Event) -> None:
        """Publish `event` (process_restarted, process_gave_up) as `busctl up`'s supervisor does,
        with the owner's key: held in this actor's memory only, never given to its child."""
        from agent_bus.bus.client import connect

        ray = _ray()

        async def send() -> None:
            endpoint, _ = ray.get(self.holder.hub_address.remote())
            curve = CurveClient.held(*ray.get(self.holder.owner_keys.remote()))
            with anyio.fail_after(20):
                async with connect(endpoint, name=f"keeper-{self.name}", role="supervisor",
                                   curve=curve) as peer:
                    await peer.publish(event)

        try:
            anyio.run(send)
        except Exception as exc:  # noqa: BLE001 - a lost notice must not stop the keeping
            self._log(f"could not publish {type(event).__name__}: {exc}")

    def _log(self, line: str) -> None:
        try:
            with self.log_path.open("a") as log:
                log.write(f"[keeper] {line}\n")
        except OSError:
            pass


def _find_holder(ray: Any, topology: str, timeout: float = 60.0) -> Any:
    """The topology's holder; `up` makes it once the hub's keeper has a node, so wait a little."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return ray.get_actor(topology_actor_name(topology), namespace=NAMESPACE)
        except ValueError:
            if time.monotonic() > deadline:
                raise ChildFailed(f"no holder actor for topology {topology!r} after {timeout:g}s "
                                  "(was `busctl up --engine ray` stopped?)") from None
            time.sleep(0.2)


def _on_node(endpoint: str, node_ip: str) -> str:
    """The hub's address on its node: the topology's port, this node's IP (a wildcard or
    loopback host in the file means "this node" under Ray: peers on other nodes connect)."""
    scheme, _, rest = endpoint.partition("://")
    if scheme != "tcp":
        raise ChildFailed(f"hub.endpoint: {endpoint!r}: on Ray the hub listens on TCP (with "
                          "CURVE) on its node; give tcp://0.0.0.0:PORT (0: any free port)")
    host, _, port = rest.rpartition(":")
    if host.strip("[]") in ("*", "0.0.0.0", "127.0.0.1", "localhost", "::", "::1", ""):
        host = node_ip
    return f"tcp://{host}:{port}"


def _write_cert(path: Path, public: bytes, secret: bytes | None = None) -> None:
    """A key file in pyzmq's certificate format (`zmq.auth.load_certificate` reads it), 0600."""
    text = "metadata\ncurve\n" + f'    public-key = "{public.decode()}"\n'
    if secret is not None:
        text += f'    secret-key = "{secret.decode()}"\n'
    write_private(path, text)


def _hand_over(stdin: Any, data: bytes) -> None:
    try:
        stdin.write(data)
        stdin.close()
    except OSError:
        pass  # a child that died first just does not get it


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
