"""Issue 44, break 1: a CURVE topology gives each process kind an identity of its own.

As the attacker ran it: `busctl up` with `[hub] curve_*` keys started the gateway, coordinators and
workers with the topology's one client key (which had to be `*` in roles.toml); a `run_shell` with
the network read that key and registered `llm` and `agent.assistant` with it. Here the scripted
model's `run_shell` searches every folder it can for key files and tries each against the hub
(fixtures/steal_keys.py); nothing it finds may serve `llm` or an agent, and the topology's own
keys (the owner's, the hub's, every process kind's) must not be among what it finds. Each process
kind's key, taken by the owner from `up`'s private runtime folder, serves its own role only.

Issue 44, break 9 (last part): a stopped topology leaves no runtime folder behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq.auth

from agent_bus.agents.gateway.fakellm import FakeLLMServer
from agent_bus.bus.paths import default_state_dir
from tests.cli.conftest import Topology, pid_alive, running_up, start_up
from tests.multihost.conftest import generate
from tests.support import Proc, busctl

FIXTURES = Path(__file__).parent / "fixtures"
STEAL = FIXTURES / "steal_keys.py"
FORGE = FIXTURES / "forge_run.py"


def _runtime_folder(cwd: Path) -> Path:
    """Where `busctl up` from `cwd` keeps its sockets, credentials and keys (bus/paths.py),
    computed without creating it."""
    state = default_state_dir(cwd)
    digest = hashlib.sha256(str(state.resolve()).encode()).hexdigest()[:12]
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(xdg) / "agent-bus" if xdg else Path("/tmp") / f"agent-bus-{os.getuid()}"
    return base / digest


def _script(command: str) -> dict:
    return {"rules": [
        {"contains": ["steal"], "tool_result": False, "reply": {
            "text": "Looking.", "tool_calls": [{"name": "run_shell", "arguments": {"command": command}}]}},
        {"contains": [], "tool_result": True, "reply": {"text": "FOUND {tool_results_full}"}},
    ], "echo": True}


def _write_topology(tmp_path: Path) -> Path:
    keys = tmp_path / "keys"
    generate(keys, "owner", "remote")
    # the owner's key: full rights, as the user's own key should have; `remote`: a worker that
    # the user attaches by hand
    (keys / "authorized" / "roles.toml").write_text('[roles]\nowner = ["*"]\nremote = ["tool.*"]\n')
    (tmp_path / "ws").mkdir()
    config = tmp_path / "topology.toml"
    config.write_text(f"""
[hub]
curve_secret = "{keys}/hub.key_secret"
curve_authorized = "{keys}/authorized"
curve_server_key = "{keys}/hub.key"
curve_client_key = "{keys}/owner.key_secret"

[[workers]]
name = "tools"
tools = ["agent_bus.tools.builtin"]
workspace = "{tmp_path / 'ws'}"
shell = true
network = true
""")
    return config


def _public(path: Path) -> str:
    public, _ = zmq.auth.load_certificate(path)
    return public.decode()


def _z85(path: Path) -> list[str]:
    public, secret = zmq.auth.load_certificate(path)
    return [public.decode(), (secret or b"").decode()]


@pytest.fixture
def curve_up(tmp_path: Path) -> Iterator[tuple[Topology, FakeLLMServer]]:
    config = _write_topology(tmp_path)
    # where this topology's keys are (the user's folder, `up`'s runtime folder) and its state;
    # not the whole machine: other tests' keys elsewhere in /tmp would only slow the search
    roots = [str(tmp_path), str(_runtime_folder(tmp_path).parent), os.environ["BUSCTL_STATE_HOME"]]
    # the script goes in the workspace, as a model would write it (the checkout may be in the
    # host's /tmp, which the sandbox does not show)
    (tmp_path / "ws").mkdir(exist_ok=True)
    steal = Path(shutil.copy(STEAL, tmp_path / "ws" / STEAL.name))
    command = f"{sys.executable} {steal} {tmp_path / 'ws' / 'target.json'} {' '.join(roots)}"
    with FakeLLMServer(_script(command)) as llm:
        env = {"OPENAI_BASE_URL": llm.base_url, "OPENAI_API_KEY": ""}
        with running_up(tmp_path, "-c", str(config), env=env) as topo:
            yield topo, llm


def _owner_args(tmp_path: Path) -> list[str]:
    keys = tmp_path / "keys"
    return ["--curve-server-key", str(keys / "hub.key"), "--curve-key", str(keys / "owner.key_secret")]


def _our_publics(tmp_path: Path) -> set[str]:
    """Every key of this topology: the user's folder (hub, owner) and `up`'s own folder."""
    files = [*(tmp_path / "keys").glob("*.key"), *_runtime_folder(tmp_path).glob("**/*.key")]
    return {_public(f) for f in files}


def test_a_shell_finds_no_key_of_the_topology_and_none_serves_llm_or_an_agent(
        tmp_path: Path, curve_up: tuple[Topology, FakeLLMServer]) -> None:
    topo, llm = curve_up
    (tmp_path / "ws" / "target.json").write_text(json.dumps(
        {"endpoint": topo.endpoint, "server": _public(tmp_path / "keys" / "hub.key")}))
    ours = _our_publics(tmp_path)  # read now: `up` removes its folder when it stops
    result = subprocess.run(busctl("run", "--hub", topo.endpoint, *_owner_args(tmp_path),
                                   "steal the keys"),
                            capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr + topo.proc.output()
    match = re.search(r"STOLEN (\{.*\})", result.stdout)
    assert match, result.stdout
    stolen = json.loads(match.group(1))
    assert not {k: v for k, v in stolen["served"].items() if v}, stolen  # nothing served
    assert not ours & set(stolen["found"]), stolen  # and no key of ours was readable
    assert not stolen["curve_env"], stolen  # nor named in its environment
    assert llm.requests, "the run never reached the model"


def _forge(endpoint: str, server: Path, key: Path, *services: str) -> dict[str, str]:
    curve = ",".join([_public(server), *_z85(key)])
    args = [a for s in services for a in ("--serve", s)]
    result = subprocess.run([sys.executable, str(FORGE), endpoint, f"--curve={curve}", *args],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    answers = json.loads(result.stdout.strip().splitlines()[-1])
    return {service: answers[f"reg{i}"] for i, service in enumerate(services)}


def test_each_authorised_folder_gives_roles_to_its_own_keys_only(tmp_path: Path) -> None:
    """The hub's two folders as `up` gives them: the user's, here without a roles.toml (its keys
    keep full rights, as before), and `up`'s own, whose roles.toml restricts its keys."""
    generate(tmp_path / "user", "owner")
    generate(tmp_path / "made", "worker-tools")
    made = tmp_path / "made" / "authorized"
    (made / "roles.toml").write_text('[roles]\n"worker-tools" = ["tool.*"]\n')
    hub = Proc(busctl("hub", "--hub", "tcp://127.0.0.1:0", "--state-dir", str(tmp_path / "state"),
                      "--curve-secret", str(tmp_path / "user" / "hub.key_secret"),
                      "--curve-authorized", str(tmp_path / "user" / "authorized"),
                      "--curve-authorized", str(made)))
    try:
        endpoint = hub.wait_ready()["endpoint"]
        server = tmp_path / "user" / "hub.key"
        # `made`'s pair was made against another hub key: only the client half is used here
        assert _forge(endpoint, server, tmp_path / "made" / "worker-tools.key_secret", "llm",
                      "tool.x") == {"llm": "forbidden", "tool.x": "ok"}
        assert _forge(endpoint, server, tmp_path / "user" / "owner.key_secret", "llm",
                      "tool.x") == {"llm": "ok", "tool.x": "ok"}
    finally:
        hub.stop()


def _curve_key_args(pid: int) -> str:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return argv[argv.index(b"--curve-key") + 1].decode()


def test_each_process_kind_has_its_own_key_with_its_own_role_only(
        tmp_path: Path, curve_up: tuple[Topology, FakeLLMServer]) -> None:
    topo, _ = curve_up
    pids = topo.child_pids()
    owner = str(tmp_path / "keys" / "owner.key_secret")
    keys = {name: _curve_key_args(pids[name]) for name in ("gateway-1", "coordinator-1", "tools-1")}
    assert owner not in keys.values() and len(set(keys.values())) == 3, keys
    folder = _runtime_folder(tmp_path)
    assert all(Path(k).parent.parent == folder for k in keys.values()), (keys, folder)
    server = tmp_path / "keys" / "hub.key"
    everything = ("llm", "agent.assistant", "tool.stolen")
    assert _forge(topo.endpoint, server, Path(keys["tools-1"]), *everything) == {
        "llm": "forbidden", "agent.assistant": "forbidden", "tool.stolen": "ok"}
    assert _forge(topo.endpoint, server, Path(keys["gateway-1"]), *everything) == {
        "llm": "ok", "agent.assistant": "forbidden", "tool.stolen": "forbidden"}
    assert _forge(topo.endpoint, server, Path(keys["coordinator-1"]), *everything) == {
        "llm": "forbidden", "agent.assistant": "ok", "tool.stolen": "forbidden"}


def test_a_worker_attached_by_hand_keeps_its_own_key(
        tmp_path: Path, curve_up: tuple[Topology, FakeLLMServer]) -> None:
    """A remote worker's key, authorised by the user (`tool.*`), still serves tools; its key
    reaches its sandbox in memory (the worker is sandboxed, its key folder hidden there)."""
    topo, _ = curve_up
    keys = tmp_path / "keys"
    (tmp_path / "remote").mkdir()
    worker = Proc(busctl("worker", "--hub", topo.endpoint, "--curve-server-key", str(keys / "hub.key"),
                         "--curve-key", str(keys / "remote.key_secret"), "--workspace",
                         str(tmp_path / "remote"), "--name", "remote-1"), cwd=tmp_path)
    try:
        ready = worker.wait_ready(30)
        assert ready["sandbox"]["kind"] == "bwrap", ready
        status = subprocess.run(busctl("status", "--json", "--hub", topo.endpoint,
                                       *_owner_args(tmp_path)),
                                capture_output=True, text=True, timeout=30)
        peers = {p["name"]: p["peer"] for p in json.loads(status.stdout)["peers"]}
        assert peers["remote-1"].startswith("key:" + _public(keys / "remote.key")[:12]), peers
    finally:
        worker.stop()


def test_a_stopped_curve_topology_leaves_no_runtime_folder(
        tmp_path: Path, curve_up: tuple[Topology, FakeLLMServer]) -> None:
    topo, _ = curve_up
    folder = _runtime_folder(tmp_path)
    assert folder.is_dir(), "up keeps its generated keys in its runtime folder"
    assert topo.proc.stop(timeout=10) == 0, topo.proc.output()
    assert not folder.exists(), sorted(p.name for p in folder.rglob("*"))


def test_a_stopped_local_topology_leaves_no_dead_sockets(tmp_path: Path) -> None:
    proc, ready = start_up(tmp_path, "--demo")
    pids = Topology(proc, tmp_path, ready).child_pids()
    try:
        folder = Path(ready["endpoint"][len("ipc://"):]).parent
        assert folder.is_dir() and (folder / "hub").is_socket(), ready
        assert proc.stop(timeout=10) == 0, proc.output()
        assert not folder.exists(), sorted(p.name for p in folder.iterdir())
    finally:
        proc.stop()
        for pid in pids.values():
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_key_files_beside_the_workspace_are_masked_one_by_one(tmp_path: Path) -> None:
    """A key folder that holds the workspace cannot be hidden whole: each secret key in it is
    masked with /dev/null instead (and a key folder elsewhere is hidden whole)."""
    from agent_bus.bus.security import key_hiding
    from agent_bus.tools.sandbox import worker_prefix

    generate(tmp_path / "keys", "owner")
    (tmp_path / "ws").mkdir()
    for name in ("hub", "owner"):  # the workspace's own folder holds keys too
        (tmp_path / f"{name}.key_secret").write_text((tmp_path / "keys" / f"{name}.key_secret").read_text())
    files = [str(tmp_path / "owner.key_secret"), str(tmp_path / "keys" / "owner.key_secret")]
    hidden = key_hiding(files, tmp_path / "ws")
    assert sorted(hidden) == sorted([str(tmp_path / "hub.key_secret"), str(tmp_path / "owner.key_secret"),
                                     str(tmp_path / "keys")]), hidden
    args, _ = worker_prefix(tmp_path / "ws", "tcp://127.0.0.1:1", [Path(h) for h in hidden])
    text = " ".join(args)
    for name in ("hub", "owner"):
        assert f"--ro-bind /dev/null {tmp_path / f'{name}.key_secret'}" in text, text
    assert f"--tmpfs {tmp_path / 'keys'}" in text, text
