"""Two "hosts" as Linux network namespaces joined by a veth pair, CURVE on.

Host A is the root namespace on the veth address 10.250.N.1 (the hub, the fake model server and
this test's clients); host B is a fresh namespace at 10.250.N.2 running a tool worker, an LLM
gateway and a coordinator via `ip netns exec`. Nothing binds or routes outside 10.250.N.0/24 and
loopback. Needs root and `ip`; otherwise every test skips with the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec
import pytest

from agent_bus.agents.client.remote import connect as connect_agents
from agent_bus.agents.gateway.fakellm import FakeLLMServer, load_script
from agent_bus.bus import events as ev
from agent_bus.bus.client import connect
from agent_bus.bus.errors import PeerLost
from agent_bus.bus.messages import ToolCallRequest
from tests.coordinator.conftest import TOOLS, calls, text, topology_text
from tests.multihost.conftest import Keys, generate
from tests.multihost.test_curve_loopback import until
from tests.support import ROOT, Proc, busctl

pytestmark = pytest.mark.anyio

HEARTBEAT, LIVENESS = 0.5, 3  # the hub declares a silent peer lost after ~1.5 s
CUT = 5.0  # seconds the link stays down

IP = shutil.which("ip")


def sh(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    assert IP is not None
    argv = [IP, "netns", "exec", ns, *args] if ns else list(args)
    if argv[0] == "ip":
        argv[0] = IP
    return subprocess.run(argv, capture_output=True, text=True, timeout=15, check=check)


@dataclass
class Net:
    ns: str
    host_if: str  # root namespace end (host A)
    remote_if: str  # in `ns` (host B)
    host_ip: str
    remote_ip: str

    def remote(self, *args: str) -> list[str]:
        assert IP is not None
        return [IP, "netns", "exec", self.ns, *args]

    def link(self, up: bool) -> None:
        sh("ip", "link", "set", self.remote_if, "up" if up else "down", ns=self.ns)


def _free_subnet() -> int:
    used = sh("ip", "-4", "addr", "show").stdout
    start = os.getpid() % 200
    for i in range(200):
        n = 1 + (start + i) % 250
        if f"10.250.{n}." not in used:
            return n
    pytest.skip("no free 10.250.x.0/24 subnet")


@pytest.fixture(scope="module")
def net() -> Iterator[Net]:
    if sys.platform != "linux" or IP is None:
        pytest.skip("needs Linux with the `ip` tool (iproute2) to make network namespaces")
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces and veth pairs")
    tag = f"{os.getpid() % 10_000_000}"
    n = _free_subnet()
    net = Net(f"agb-{tag}", f"agbh{tag}", f"agbr{tag}", f"10.250.{n}.1", f"10.250.{n}.2")
    created_ns = created_link = False
    try:
        probe = sh("ip", "netns", "add", net.ns, check=False)
        if probe.returncode != 0:
            pytest.skip(f"`ip netns add` failed: {probe.stderr.strip()}")
        created_ns = True
        sh("ip", "link", "add", net.host_if, "type", "veth", "peer", "name", net.remote_if)
        created_link = True
        sh("ip", "link", "set", net.remote_if, "netns", net.ns)
        sh("ip", "addr", "add", f"{net.host_ip}/24", "dev", net.host_if)
        sh("ip", "link", "set", net.host_if, "up")
        sh("ip", "link", "set", "lo", "up", ns=net.ns)
        sh("ip", "addr", "add", f"{net.remote_ip}/24", "dev", net.remote_if, ns=net.ns)
        sh("ip", "link", "set", net.remote_if, "up", ns=net.ns)
        yield net
    finally:
        if created_link:
            sh("ip", "link", "del", net.host_if, check=False)  # deletes both ends
        if created_ns:
            sh("ip", "netns", "del", net.ns, check=False)


@dataclass
class Cluster:
    net: Net
    keys: Keys
    endpoint: str
    events: str
    srv: FakeLLMServer
    procs: dict[str, Proc] = field(default_factory=dict)

    def dump(self) -> str:
        return "\n".join(f"--- {name}\n{proc.output()[-2000:]}" for name, proc in self.procs.items())


REMOTE = ("remote-worker", "remote-gateway", "remote-coordinator")


@pytest.fixture(scope="module")
def cluster(net: Net, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("multihost")
    generate(tmp / "keys", "driver", "remote")
    generate(tmp / "elsewhere", "stranger")
    keys = Keys(tmp / "keys", tmp / "elsewhere")
    srv = FakeLLMServer(host=net.host_ip).start()  # the model endpoint, reached over the veth
    topology = tmp / "topology.toml"
    topology.write_text(topology_text(srv.base_url))
    cluster = Cluster(net, keys, "", "", srv)
    try:
        hub = cluster.procs["hub"] = Proc(busctl(
            "hub", "--hub", f"tcp://{net.host_ip}:0", "--state-dir", str(tmp / "hub"),
            "--heartbeat-interval", str(HEARTBEAT), "--liveness", str(LIVENESS),
            *keys.hub_args()))
        info = hub.wait_ready()
        cluster.endpoint, cluster.events = info["endpoint"], info["events"]
        assert cluster.endpoint.startswith(f"tcp://{net.host_ip}:")
        common = ["--hub", cluster.endpoint, *keys.cli_args("remote")]
        argv = {
            "remote-worker": ["worker", *common, "--tools", TOOLS, "--name", "remote-worker"],
            "remote-gateway": ["gateway", *common, "--topology", str(topology),
                               "--name", "remote-gateway"],
            "remote-coordinator": ["coordinator", *common, "--topology", str(topology),
                                   "--agent", "a", "--state-dir", str(tmp / "agents"),
                                   "--name", "remote-coordinator"],
        }
        for name in REMOTE:  # start all, then wait: the imports overlap
            cluster.procs[name] = Proc(net.remote(sys.executable, "-m", "agent_bus.cli",
                                                  *argv[name]))
        for name in REMOTE:
            cluster.procs[name].wait_ready(20)
        yield cluster
    except BaseException:
        print(cluster.dump())
        raise
    finally:
        for proc in reversed(list(cluster.procs.values())):
            proc.stop()  # kills the process group of each `ip netns exec`
        srv.close()


async def test_run_succeeds_across_hosts_with_key_identities(cluster: Cluster) -> None:
    keys = cluster.keys
    script = load_script([calls(("echo", {"text": "across the veth"})), text("all done")])
    cluster.srv.set_script(script)
    with anyio.fail_after(30):
        async with connect_agents(cluster.endpoint, name="driver",
                                  curve=keys.client("driver")) as bus:
            run = await bus.prompt("a", "use echo", new_session=True)
            result = await run.result()
    assert result.stop_reason == "stop", result
    assert result.final_text == "all done"
    # The tool ran on host B: its result went back to the model behind the gateway on host B.
    assert "across the veth" in repr(cluster.srv.requests[-1])

    async with connect(cluster.endpoint, name="driver", curve=keys.client("driver")) as peer:
        st = await peer.status()
    remote_prefix = "key:" + keys.public_z85("remote")[:12] + ":"
    ids = {p_.name: p_.peer for p_ in st.peers}
    for name in REMOTE:
        assert ids[name].startswith(remote_prefix), ids
    assert len({ids[name] for name in REMOTE}) == 3  # one key, three processes, three ids


REMOTE_STRANGER = r"""
import json, sys
import anyio, zmq
from agent_bus.bus.client import connect
from agent_bus.bus.errors import HubUnreachable
from agent_bus.bus.security import CurveClient
hub, events, hub_key, bad, good = sys.argv[1:6]
clients = {"bad": CurveClient(server_public_key_file=hub_key, secret_key_file=bad),
           "good": CurveClient(server_public_key_file=hub_key, secret_key_file=good)}
ctx = zmq.Context()
subs = {}
for name, curve in clients.items():
    sock = ctx.socket(zmq.SUB)
    sock.linger = 0
    curve.apply(sock)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(events)
    subs[name] = sock

async def main():
    try:
        async with connect(hub, name="stranger", curve=clients["bad"], connect_timeout=2.0):
            return "connected"
    except HubUnreachable:
        return "unreachable"

outcome = anyio.run(main)  # meanwhile (2 s, 4 hub heartbeats) the SUBs listen
heard = {}
for name, sock in subs.items():
    heard[name] = 0
    while sock.poll(0):
        sock.recv_multipart()
        heard[name] += 1
print(json.dumps({"connect": outcome, "heard": heard}))
"""


async def test_unknown_key_on_the_remote_host_gets_nothing_and_is_counted(
        cluster: Cluster) -> None:
    keys = cluster.keys
    async with connect(cluster.endpoint, name="driver", curve=keys.client("driver")) as peer:
        before = (await peer.status()).counters.get("auth_refused", 0)
        out = await anyio.to_thread.run_sync(lambda: subprocess.run(
            cluster.net.remote(sys.executable, "-c", REMOTE_STRANGER, cluster.endpoint,
                               cluster.events, str(keys.dir / "hub.key"),
                               str(keys.stranger_dir / "stranger.key_secret"),
                               str(keys.dir / "remote.key_secret")),
            capture_output=True, text=True, timeout=30, cwd=ROOT))
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout.strip().splitlines()[-1])
        assert result["connect"] == "unreachable"
        assert result["heard"]["bad"] == 0
        assert result["heard"]["good"] > 0  # the same path works for a known key
        st = await peer.status()
        assert st.counters["auth_refused"] >= before + 2  # the DEALER and the SUB
        assert "stranger" not in {p_.name for p_ in st.peers}


async def test_link_cut_loses_the_remote_worker_and_it_comes_back(cluster: Cluster) -> None:
    keys, net = cluster.keys, cluster.net
    body = msgspec.msgpack.encode(ToolCallRequest(call_id="c1", name="slow",
                                                  arguments=json.dumps({"label": "x",
                                                                        "seconds": 30})))
    async with connect(cluster.endpoint, name="driver", curve=keys.client("driver")) as peer:
        old = {p_.name: p_.peer for p_ in (await peer.status()).peers}
        async with peer.subscribe() as sub:
            outcome: dict[str, Any] = {}

            async def in_flight() -> None:
                try:
                    await peer.request("tool.slow", body, timeout=30)
                    outcome["result"] = "replied"
                except PeerLost as exc:
                    outcome["result"] = "peer_lost"
                    outcome["at"] = time.monotonic()
                    outcome["text"] = str(exc)

            async def serving() -> bool:
                st = await peer.status()
                return any(s.name == "tool.slow" and s.load == 1 for s in st.services)

            async def lost_events() -> None:
                async for env in sub:
                    if isinstance(env.event, (ev.WorkerLost, ev.PeerLeft)) \
                            and env.event.peer == old["remote-worker"]:
                        outcome.setdefault("events", set()).add(type(env.event).__name__)
                        if outcome["events"] == {"WorkerLost", "PeerLeft"}:
                            return

            async with anyio.create_task_group() as tg:
                tg.start_soon(in_flight)
                await until(serving, 10, "the remote worker to start the call")
                net.link(False)
                cut = time.monotonic()
                try:
                    with anyio.fail_after(HEARTBEAT * LIVENESS + 3):
                        await lost_events()
                    st = await peer.status()
                    assert "remote-worker" not in {p_.name for p_ in st.peers}
                    assert not any(s.name == "tool.slow" for s in st.services)
                    await anyio.sleep(max(0.0, CUT - (time.monotonic() - cut)))  # the cut itself
                finally:
                    net.link(True)
            assert outcome["result"] == "peer_lost", outcome
            assert outcome["at"] - cut < HEARTBEAT * LIVENESS + 3
            assert "remote-worker" in outcome["text"]

        async def back() -> Any:
            st = await peer.status()
            ids = {p_.name: p_ for p_ in st.peers}
            if all(name in ids for name in REMOTE) and \
                    any(s.name == "tool.slow" for s in ids["remote-worker"].services):
                return ids
            return None

        ids = await until(back, 20, "the remote processes to re-register by themselves")
        for name in REMOTE:  # new connections (new routing ids), same authenticated key
            assert ids[name].peer != old[name]
            assert ids[name].peer.rpartition(":")[0] == old[name].rpartition(":")[0]
        quick = msgspec.msgpack.encode(ToolCallRequest(call_id="c2", name="echo",
                                                       arguments='{"text": "back"}'))
        reply = await peer.request("tool.echo", quick, timeout=10)
        assert b"back" in reply
