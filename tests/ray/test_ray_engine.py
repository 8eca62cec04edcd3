"""`busctl up --engine ray` on a real three-node Ray cluster (tests/ray/conftest.py): placement,
a run with parallel tool calls, `watch`, a node killed outright, identities, and `down`.

The tests share one topology and run in file order: each later one leans on the earlier ones'
topology (the node loss comes after the checks of where things run; `down` comes last)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest

ray = pytest.importorskip("ray")  # skipped without the `ray` extra

from agent_bus.agents.client.remote import connect as connect_agents  # noqa: E402
from agent_bus.agents.experiment.runner import Journal, read_journal  # noqa: E402
from agent_bus.agents.gateway.fakellm import FakeLLMServer, request_key  # noqa: E402
from agent_bus.bus.security import CurveClient  # noqa: E402
from tests.ray.conftest import RayCluster  # noqa: E402
from tests.support import Proc, busctl, wait_for  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

NAME = "raytest"
MODEL_KEY = "sk-raytest-0123456789abcdef"  # in `up`'s environment only
FORGE = Path(__file__).parent.parent / "security" / "fixtures" / "forge_run.py"



def _script(secret: Path) -> dict:
    """"both": two parallel list_dir calls in one turn; "steal": a shell reading the hub's
    secret key file; after tool results, the answer quotes them."""
    return {"rules": [
        {"contains": ["question"], "delay": 0.5, "reply": {"text": "answer 7"}},
        {"contains": ["both"], "tool_result": False, "reply": {"text": "Looking twice.", "tool_calls": [
            {"name": "list_dir", "arguments": {}}, {"name": "list_dir", "arguments": {"path": "."}}]}},
        {"contains": ["steal"], "tool_result": False, "reply": {"text": "Reading.", "tool_calls": [
            {"name": "run_shell", "arguments": {"command": f"cat {secret} || echo NOPE"}}]}},
        {"contains": [], "tool_result": True, "reply": {"text": "Result: {tool_results_full}"}},
    ], "echo": True}


def _hub_secret(project: Path) -> Path:
    return project / "state" / "hub" / "curve" / "hub.key_secret"


@dataclass
class RayTopology:
    file: Path
    state: Path
    workspace: Path
    endpoint: str
    env: dict[str, str]
    cluster: RayCluster
    summary: str  # what `up` printed for people

    def cli(self, *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
        """`busctl ARGS` as a user on any node: the engine and cluster from the environment,
        no endpoint and no key typed."""
        return subprocess.run(busctl(*args), capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **self.env, "BUSCTL_ENGINE": "ray",
                                   "RAY_ADDRESS": self.cluster.address})

    def ps(self) -> dict[str, dict]:
        out = self.cli("ps", "--json")
        assert out.returncode == 0, out.stderr
        return {row["name"]: row for row in map(json.loads, out.stdout.splitlines())}

    def node_of(self, row: dict) -> str:
        names = self.cluster.node_names()
        return next((n for node_id, n in names.items() if node_id.startswith(row["node_id"])), "?")


def _topology(tmp: Path, base_url: str) -> str:
    workspace = tmp / "ws"
    workspace.mkdir()
    (workspace / "hello.txt").write_text("hello\n")
    return f"""
coordinators = 2

[engine]
kind = "ray"
name = "{NAME}"

[hub]
endpoint = "tcp://127.0.0.1:0"
state_dir = "{tmp / 'state'}"

[models.demo]
provider = "openai"
base_url = "{base_url}"
model = "demo-model"
api_key_env = "RAYTEST_API_KEY"

[gateways]
default_model = "demo"

[[workers]]
name = "alpha"
workspace = "{workspace}"
shell = true

[[workers]]
name = "beta"
workspace = "{workspace}"
shell = true

[[agents]]
name = "assistant"

[[agents]]
name = "helper"

[placement.hub]
resources = {{ bus_hub = 1 }}

[placement.gateways]
node = "bus-zone=a"

[placement.workers]
strategy = "spread"

[placement.coordinators]
strategy = "spread"
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("project")


@pytest.fixture(scope="module")
def fake_model(project: Path) -> Iterator[FakeLLMServer]:
    with FakeLLMServer(_script(_hub_secret(project))) as server:
        yield server


@pytest.fixture(scope="module")
def topo(ray_cluster: RayCluster, fake_model: FakeLLMServer, project: Path) -> Iterator[RayTopology]:
    tmp = project
    file = tmp / "raytest.toml"
    file.write_text(_topology(tmp, fake_model.base_url))
    env = ray_cluster.env()
    started = time.monotonic()
    up = subprocess.run(busctl("up", "-c", str(file), "--engine", "ray", "--address",
                               ray_cluster.address, "--json"),
                        capture_output=True, text=True, timeout=240,
                        env={**os.environ, **env, "RAYTEST_API_KEY": MODEL_KEY})
    print(f"\nbusctl up --engine ray: ready in {time.monotonic() - started:.1f}s\n{up.stderr}")
    try:
        assert up.returncode == 0, up.stderr
        ready = json.loads(up.stdout.strip().splitlines()[-1])
        yield RayTopology(file, tmp / "state", tmp / "ws", ready["endpoint"], env, ray_cluster,
                          up.stderr)
    finally:
        subprocess.run(busctl("down", "-c", str(file)), capture_output=True, text=True,
                       timeout=120, env={**os.environ, **env})


def test_ps_shows_each_process_on_the_node_its_placement_asked_for(topo: RayTopology) -> None:
    rows = topo.ps()
    assert set(rows) == {"hub", "gateway-1", "alpha-1", "beta-1", "coordinator-1",
                         "coordinator-2"}, rows
    assert all(r["state"] == "ready" and r["pid"] > 0 for r in rows.values()), rows
    where = {name: topo.node_of(row) for name, row in rows.items()}
    assert where["hub"] == "head" and where["gateway-1"] == "a", where  # a resource; a label
    # spread: each pair on the two nodes that have CPUs (the head has none)
    assert {where["alpha-1"], where["beta-1"]} == {"a", "b"}, where
    assert {where["coordinator-1"], where["coordinator-2"]} == {"a", "b"}, where
    assert topo.endpoint.startswith("tcp://") and ":0" not in topo.endpoint
    bwrap = subprocess.run(["bwrap", "--ro-bind", "/", "/", "true"], capture_output=True).returncode == 0
    for name in ("alpha-1", "beta-1"):  # each node's worker in its sandbox (or `none`, said)
        assert rows[name]["sandbox"].startswith("bwrap" if bwrap else "none"), rows[name]
    sandbox = [line for line in topo.summary.splitlines() if line.startswith("sandbox ")]
    assert sandbox and "alpha-1@" in "".join(sandbox) and "beta-1@" in "".join(sandbox), topo.summary


def test_run_with_parallel_tool_calls_answers_and_watch_sees_its_events(topo: RayTopology) -> None:
    out = topo.cli("run", "-q", "look at both")
    assert out.returncode == 0, out.stderr
    assert "Result:" in out.stdout and "hello.txt" in out.stdout, out.stdout
    watch = Proc(busctl("watch", "--json", "--since", "0"),
                 env={**topo.env, "BUSCTL_ENGINE": "ray", "RAY_ADDRESS": topo.cluster.address})
    try:
        watch.wait_line(lambda s: '"agent_end"' in s, 60)
        events = [json.loads(line) for line in watch.lines if line.startswith("{")]
    finally:
        watch.stop()
    types = [e.get("type") for e in events]
    assert types.count("tool_execution_start") == 2 and types.count("tool_execution_end") == 2, types
    assert {"agent_start", "turn_start", "message_end", "agent_end"} <= set(types), types
    seqs = [e["seq"] for e in events if "seq" in e]
    assert seqs == sorted(seqs) and len(seqs) == len(set(seqs)), seqs


def test_status_and_a_second_up_find_the_topology_by_name(topo: RayTopology) -> None:
    status = topo.cli("status")
    assert status.returncode == 0 and "coordinator-2" in status.stdout, (status.stdout, status.stderr)
    again = topo.cli("up", "-c", str(topo.file))
    assert again.returncode == 1 and "already up on this Ray cluster" in again.stderr, again.stderr


def test_a_worker_attached_by_hand_gets_a_workers_key_from_the_cluster(topo: RayTopology) -> None:
    hand = Proc(busctl("worker", "--name", "by-hand", "--workspace", str(topo.workspace),
                       "--tools", "agent_bus.tools.builtin"),
                env={**topo.env, "BUSCTL_ENGINE": "ray", "RAY_ADDRESS": topo.cluster.address})
    try:
        hand.wait_ready(60)
        status = topo.cli("status", "--json")
        assert status.returncode == 0 and "by-hand" in status.stdout, status.stderr
        peer = next(p for p in json.loads(status.stdout)["peers"] if p["name"] == "by-hand")
        holder = ray.get_actor(f"{NAME}:topology", namespace="agent-bus")
        worker_public = ray.get(holder.client_keys.remote("worker"))[1].decode()
        assert peer["peer"].startswith(f"key:{worker_public[:12]}"), peer  # not the owner's
    finally:
        hand.stop()


def test_a_failed_up_names_the_key_and_leaves_nothing(topo: RayTopology) -> None:
    bad = topo.file.with_name("bad.toml")
    bad.write_text(topo.file.read_text().replace(f'name = "{NAME}"', 'name = "badtest"')
                   .replace("[placement.hub]\nresources = { bus_hub = 1 }",
                            '[placement.hub]\nnode = "10.9.9.9"'))
    out = topo.cli("up", "-c", str(bad))
    assert out.returncode == 1 and "placement.hub.node: no live node '10.9.9.9'" in out.stderr, out.stderr
    assert [e for e in ray.util.list_named_actors(all_namespaces=True)
            if e["name"].startswith("badtest:")] == []
    assert [g for g in ray.util.placement_group_table().values()
            if g.get("name", "").startswith("badtest:") and g.get("state") != "REMOVED"] == []


def test_logs_come_from_every_node(topo: RayTopology) -> None:
    out = topo.cli("logs", "--tail", "50")
    assert out.returncode == 0, out.stderr
    names = {line.split("|")[0].strip() for line in out.stdout.splitlines() if "|" in line}
    assert {"hub", "gateway-1", "alpha-1", "beta-1", "coordinator-1"} <= names, out.stdout


def test_keys_stay_out_of_reach(topo: RayTopology, fake_model: FakeLLMServer) -> None:
    """A worker's run_shell reads no key file (the hub's secret lies in the state directory on
    its node, which every worker's sandbox hides), and the worker's key may not register `llm`."""
    secret = _hub_secret(topo.state.parent)
    assert secret.is_file() and oct(secret.stat().st_mode & 0o777) == "0o600"
    out = topo.cli("run", "-q", "steal the hub's key")
    assert out.returncode == 0, out.stderr
    assert "secret-key" not in out.stdout, out.stdout
    holder = ray.get_actor(f"{NAME}:topology", namespace="agent-bus")
    server, public, key = ray.get(holder.client_keys.remote("worker-alpha"))
    curve = ",".join(k.decode() for k in (server, public, key))
    forged = subprocess.run([sys.executable, str(FORGE), topo.endpoint, f"--curve={curve}",
                             "--serve", "llm", "--serve", "tool.stolen"],
                            capture_output=True, text=True, timeout=60)
    assert forged.returncode == 0, forged.stderr
    answers = json.loads(forged.stdout.strip().splitlines()[-1])
    assert answers["reg0"] == "forbidden" and answers["reg1"] == "ok", answers
    # no secret in what Ray shows of the actors, nor in any process's environment block
    for entry in ray.util.list_named_actors(all_namespaces=True):
        assert key.decode() not in json.dumps(entry)
    owner = ray.get(holder.owner_keys.remote())[2]
    for row in topo.ps().values():
        try:
            environ = Path(f"/proc/{row['pid']}/environ").read_bytes()
        except OSError:  # a sandboxed worker: another user namespace's process
            continue
        assert key not in environ and owner not in environ, row["name"]
        assert MODEL_KEY.encode() not in environ, row["name"]
    # the model's key went from `up` to the gateway (holder, then stdin): the model saw it
    seen = {request_key(r.headers) for r in fake_model.requests}
    assert MODEL_KEY in seen, seen


def test_a_process_that_exits_is_restarted_in_place(topo: RayTopology) -> None:
    before = topo.ps()["alpha-1"]
    follow = Proc(busctl("logs", "-f", "--tail", "50", "alpha-1"),
                  env={**topo.env, "BUSCTL_ENGINE": "ray", "RAY_ADDRESS": topo.cluster.address})
    follow.wait_line(lambda s: "alpha-1 |" in s, 30)  # its first read is done
    os.kill(before["pid"], signal.SIGKILL)
    try:  # `logs -f` follows the log on alpha-1's node: the keeper's note, then the new output
        follow.wait_line(lambda s: "exited with SIGKILL; restarting in 0.5s" in s, 30)
    finally:
        follow.stop()

    def again() -> dict | None:
        row = topo.ps()["alpha-1"]
        return row if row["state"] == "ready" and row["pid"] != before["pid"] else None

    row = wait_for(again, 60, "alpha-1 restarted")
    assert row["node_id"] == before["node_id"] and row["restarts"] == 1, row
    assert row["last_exit"] == "SIGKILL", row
    wait_for(lambda: "alpha-1" in _restarted(topo), 30, "process_restarted of alpha-1 logged")


def test_a_killed_hub_comes_back_where_its_peers_reconnect(topo: RayTopology) -> None:
    """The hub's keeper restarts it on the ports it had bound (its peers' address) and with the
    same keys: the topology answers again without anything else restarted."""
    before = topo.ps()
    os.kill(before["hub"]["pid"], signal.SIGKILL)

    def again() -> dict | None:
        row = topo.ps()["hub"]
        return row if row["state"] == "ready" and row["pid"] != before["hub"]["pid"] else None

    wait_for(again, 60, "the hub restarted")

    def answers() -> bool:
        out = topo.cli("run", "-q", "look at both")
        return out.returncode == 0 and "hello.txt" in out.stdout

    wait_for(answers, 60, "a run answered through the restarted hub")
    after = topo.ps()
    assert all(after[n]["pid"] == before[n]["pid"] for n in before if n != "hub"), (before, after)


def _restarted(topo: RayTopology) -> list[str]:
    """The processes named by `process_restarted` events in the log (`busctl watch`)."""
    out = topo.cli("watch", "--json", "--since", "0", "--no-follow", "--type", "process_restarted")
    assert out.returncode == 0, out.stderr
    return [json.loads(line).get("process", "") for line in out.stdout.splitlines()
            if line.startswith("{")]


def test_scale_adds_and_removes_workers_across_nodes(topo: RayTopology) -> None:
    out = topo.cli("scale", "alpha=3")
    assert out.returncode == 0 and "1 → 3" in out.stdout, (out.stdout, out.stderr)
    rows = topo.ps()
    assert all(rows[f"alpha-{i}"]["state"] == "ready" for i in (1, 2, 3)), rows
    assert {topo.node_of(rows[f"alpha-{i}"]) for i in (1, 2, 3)} <= {"a", "b"}, rows
    out = topo.cli("scale", "alpha=1")
    assert out.returncode == 0, out.stderr
    assert {"alpha-2", "alpha-3"}.isdisjoint(topo.ps())
    # an unknown name is a usage error on Ray as locally (README, "Exit codes")
    for verb, arg, said in (("scale", "nosuch=2", "no worker group `nosuch`"),
                            ("restart", "nosuch", "no process `nosuch`")):
        out = topo.cli(verb, arg)
        assert out.returncode == 2 and said in out.stderr, (verb, out.returncode, out.stderr)


def _experiment(tmp: Path, name: str) -> Path:
    """20 samples x 2 variants: `assistant` (coordinator-1) and `helper` (coordinator-2), which
    placement spread over nodes a and b; each cell's model call takes 0.5 s."""
    with (tmp / "samples.jsonl").open("w") as out:
        for i in range(20):
            out.write(f'{{"id": "s{i}", "input": "question {i}", "target": 7}}\n')
    path = tmp / f"{name}.toml"
    path.write_text(f'name = "{name}"\n[dataset]\npath = "samples.jsonl"\n'
                    '[[variants]]\nname = "one"\nagent = "assistant"\n'
                    '[[variants]]\nname = "two"\nagent = "helper"\n'
                    '[run]\nconcurrency = 4\nresume_wait = 30\nretries = 3\n'
                    '[[scorers]]\nkind = "number"\n')
    return path


def _journal(topo: RayTopology, name: str) -> Journal:
    holder = ray.get_actor(f"{NAME}:topology", namespace="agent-bus")
    curve = CurveClient.held(*ray.get(holder.owner_keys.remote()))

    async def read() -> Journal:
        async with connect_agents(topo.endpoint, name="test-journal", curve=curve) as bus:
            return await read_journal(bus.peer, name)

    return anyio.run(read)


def test_a_node_killed_mid_experiment_loses_no_cell_and_its_processes_come_back(
        topo: RayTopology) -> None:
    """Node b (a worker and coordinator-2) is removed outright while an experiment of 40 cells
    runs on both nodes: every cell is journaled exactly once, and b's processes come back on a."""
    cluster = topo.cluster
    before = topo.ps()
    on_b = sorted(n for n, row in before.items() if topo.node_of(row) == "b")
    assert "coordinator-1" in on_b or "coordinator-2" in on_b, before
    spec = _experiment(topo.state.parent, "lost-node")
    runner = Proc(busctl("experiment", "run", str(spec), "--name", "lost-node"),  # results: in cwd
                  env={**topo.env, "BUSCTL_ENGINE": "ray", "RAY_ADDRESS": cluster.address},
                  cwd=topo.state.parent)
    try:
        wait_for(lambda: len(_journal(topo, "lost-node").results) >= 8, 90, "8 cells journaled")
        started = time.monotonic()
        cluster.cluster.remove_node(cluster.b, allow_graceful=False)
        at_kill = len(_journal(topo, "lost-node").results)
        assert at_kill < 40, at_kill  # removed mid-run

        def back() -> dict[str, dict] | None:
            rows = topo.ps()
            moved = all(topo.node_of(rows[n]) == "a" for n in on_b)
            return rows if moved and all(r["state"] == "ready" for r in rows.values()) else None

        rows = wait_for(back, 150, f"{', '.join(on_b)} back on node a")
        took = time.monotonic() - started
        print(f"\nnode b removed with {at_kill}/40 cells done: {', '.join(on_b)} ready again on "
              f"node a after {took:.1f}s")
        assert runner.popen.wait(180) == 0, runner.output()
    finally:
        runner.stop()
    assert all(rows[n]["pid"] != before[n]["pid"] for n in on_b)
    wait_for(lambda: set(on_b) <= set(_restarted(topo)), 30, "their process_restarted logged")
    journal = _journal(topo, "lost-node")
    errors = {r.error for r in journal.results.values() if r.status != "ok"}
    assert len(journal.results) == 40 and journal.ok_entries == 40, (
        len(journal.results), journal.ok_entries, journal.ignored, errors)
    assert {r.status for r in journal.results.values()} == {"ok"}
    assert {r.score for r in journal.results.values()} == {1.0}
    out = topo.cli("run", "-q", "--agent", "helper", "look at both")
    assert out.returncode == 0 and "hello.txt" in out.stdout, (out.stdout, out.stderr)


def _our_processes(topo: RayTopology) -> list[str]:
    """Command lines of live processes that belong to the topology (its state folder, its
    workspace or its hub's address on their command line)."""
    marks = [str(topo.state), str(topo.workspace), topo.endpoint]
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "agent_bus.cli" in argv and any(m in argv for m in marks):
            found.append(f"{proc.name}: {argv}")
    return found


def test_down_leaves_no_actor_placement_group_or_process(topo: RayTopology) -> None:
    assert _our_processes(topo)
    out = topo.cli("down")
    assert out.returncode == 0, out.stderr
    actors = [e["name"] for e in ray.util.list_named_actors(all_namespaces=True)
              if e["name"].startswith(f"{NAME}:")]
    groups = [g for g in ray.util.placement_group_table().values()
              if g.get("name", "").startswith(f"{NAME}:") and g.get("state") != "REMOVED"]
    assert actors == [] and groups == [], (actors, groups)
    wait_for(lambda: not _our_processes(topo), 20, "no process of the topology left")
    ps = topo.cli("ps")
    assert ps.returncode != 0 and "no agent-bus topology" in ps.stderr, (ps.stdout, ps.stderr)
