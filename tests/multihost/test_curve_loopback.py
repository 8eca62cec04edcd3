"""CURVE on loopback (no root needed): who gets in, who is counted out, keys reloaded live."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import zmq

from agent_bus.bus import events as ev
from agent_bus.bus import protocol as p
from agent_bus.bus.client import Peer, connect
from agent_bus.bus.errors import HubUnreachable
from agent_bus.bus.hub import Hub, HubConfig
from agent_bus.bus.security import generate_keys
from tests.multihost.conftest import Keys
from tests.support import Proc, busctl, py, until

pytestmark = pytest.mark.anyio

HB = 0.2  # hub heartbeat interval in these tests


def start_hub(args: list[str], tmp: Path) -> Proc:
    proc = Proc(busctl("hub", "--hub", "tcp://127.0.0.1:0", "--state-dir", str(tmp / "hub"),
                       "--heartbeat-interval", str(HB), *args))
    return proc


@pytest.fixture
def curve_hub(keys: Keys, tmp_path: Path) -> Iterator[dict[str, Any]]:
    proc = start_hub(keys.hub_args(), tmp_path)
    try:
        info = proc.wait_ready()
        info["proc"] = proc
        yield info
    finally:
        proc.stop()


def sub_socket(ctx: zmq.Context[Any], endpoint: str, curve: Any) -> zmq.Socket[Any]:
    sock = ctx.socket(zmq.SUB)
    sock.linger = 0
    curve.apply(sock)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    return sock


def refused_subscriber_gets_nothing(events: str, keys: Keys, window: float = 1.0) -> None:
    """A SUB with the stranger's key hears nothing while one with a known key hears heartbeats."""
    ctx = zmq.Context()
    good = sub_socket(ctx, events, keys.client("driver"))
    bad = sub_socket(ctx, events, keys.client("stranger"))
    try:
        poller = zmq.Poller()
        poller.register(good, zmq.POLLIN)
        poller.register(bad, zmq.POLLIN)
        heard_good = False
        end = time.monotonic() + window
        while time.monotonic() < end:
            ready = dict(poller.poll(max(1, int((end - time.monotonic()) * 1000))))
            assert bad not in ready, "an unauthorised subscriber received an event"
            if good in ready:
                good.recv_multipart()
                heard_good = True
        assert heard_good, "the authorised subscriber heard nothing (test is not meaningful)"
    finally:
        good.close(0)
        bad.close(0)
        ctx.term()


async def test_authorised_clients_request_serve_subscribe_with_key_identity(
        curve_hub: dict[str, Any], keys: Keys) -> None:
    ep = curve_hub["endpoint"]
    async with connect(ep, name="server", curve=keys.client("worker")) as server, \
            connect(ep, name="driver", curve=keys.client("driver")) as driver:

        async def echo(req: Any) -> bytes:
            return b"echo:" + req.body

        await server.serve("echo", echo)
        await server.status()  # same connection, in order: registered
        assert await driver.request("echo", b"hi", timeout=5) == b"echo:hi"

        # Peer ids come from the authenticated key, not from the name the client gave.
        st = await driver.status()
        by_name = {peer.name: peer.peer for peer in st.peers}
        for name, key_name in (("server", "worker"), ("driver", "driver")):
            assert by_name[name].startswith("key:" + keys.public_z85(key_name)[:12] + ":"), by_name
        assert server.peer_id == by_name["server"]

        # The event socket is CURVE too, and events carry the key-derived id.
        async with driver.subscribe() as sub:
            async with connect(ep, name="late", curve=keys.client("worker")) as late:
                with anyio.fail_after(5):
                    async for env in sub:
                        if isinstance(env.event, ev.PeerJoined) and env.event.name == "late":
                            assert env.event.peer == late.peer_id
                            assert late.peer_id.startswith("key:" + keys.public_z85("worker")[:12])
                            break
        assert st.counters.get("auth_refused", 0) == 0


async def test_unknown_key_gets_no_reply_no_event_and_is_counted(
        curve_hub: dict[str, Any], keys: Keys) -> None:
    ep, events = curve_hub["endpoint"], curve_hub["events"]
    with anyio.fail_after(5):
        with pytest.raises(HubUnreachable, match="CURVE"):
            async with connect(ep, name="stranger", curve=keys.client("stranger"),
                               connect_timeout=1.0):
                pass
    await anyio.to_thread.run_sync(refused_subscriber_gets_nothing, events, keys)
    # A client without CURVE at all gets nowhere either.
    with pytest.raises(HubUnreachable):
        async with connect(ep, name="plain", connect_timeout=0.5):
            pass
    async with connect(ep, name="driver", curve=keys.client("driver")) as driver:
        st = await driver.status()
        assert st.counters["auth_refused"] >= 2  # the DEALER and the SUB
        assert "stranger" not in {peer.name for peer in st.peers}
        joined = [env.event.name async for env in _logged(driver)
                  if isinstance(env.event, ev.PeerJoined)]
        assert "stranger" not in joined and "plain" not in joined
        assert "driver" in joined


async def _logged(peer: Peer) -> Any:
    """Every event in the hub's log so far (replayed), then stop."""
    st = await peer.status()
    async with peer.subscribe(since=0) as sub:
        async for env in sub:
            yield env
            if env.header.seq >= st.seq:
                return


async def test_key_added_to_authorised_dir_is_admitted_without_restart(
        curve_hub: dict[str, Any], keys: Keys) -> None:
    ep = curve_hub["endpoint"]
    with pytest.raises(HubUnreachable):
        async with connect(ep, name="stranger", curve=keys.client("stranger"),
                           connect_timeout=0.5):
            pass
    shutil.copy(keys.stranger_dir / "stranger.key", keys.authorized / "stranger.key")
    with anyio.fail_after(10):
        async with connect(ep, name="stranger", curve=keys.client("stranger"),
                           connect_timeout=8) as stranger:
            st = await stranger.status()
            assert stranger.peer_id.startswith("key:" + keys.public_z85("stranger")[:12])
            assert "stranger" in {peer.name for peer in st.peers}
    # Removing a key shuts the door for new connections, again without a restart.
    (keys.authorized / "stranger.key").unlink()
    async with connect(ep, name="driver", curve=keys.client("driver")) as driver:
        before = (await driver.status()).counters["auth_reloads"]
        await until(lambda: _reloads_past(driver, before), 5, "the hub to re-read the key dir")
    with pytest.raises(HubUnreachable):
        async with connect(ep, name="stranger", curve=keys.client("stranger"),
                           connect_timeout=0.5):
            pass


async def _reloads_past(peer: Peer, n: int) -> bool:
    return (await peer.status()).counters["auth_reloads"] > n


SIGHUP_HUB = """
import sys
import agent_bus.bus.security
agent_bus.bus.security.RELOAD_POLL = 3600.0  # no polling: only SIGHUP reloads
from agent_bus.bus.hub import HubConfig, serve
from agent_bus.bus.security import CurveServer
serve(HubConfig(endpoint="tcp://127.0.0.1:0", heartbeat_interval=0.2,
                curve=CurveServer(secret_key_file=sys.argv[1], authorized_dir=sys.argv[2])))
"""


async def test_sighup_reloads_the_authorised_keys(keys: Keys) -> None:
    proc = Proc(py("-c", SIGHUP_HUB, str(keys.hub_secret), str(keys.authorized)))
    try:
        ep = proc.wait_ready()["endpoint"]
        shutil.copy(keys.stranger_dir / "stranger.key", keys.authorized / "stranger.key")
        async with connect(ep, name="driver", curve=keys.client("driver")) as driver:
            reloads = (await driver.status()).counters["auth_reloads"]
            with pytest.raises(HubUnreachable):  # not polled: still unknown
                async with connect(ep, name="stranger", curve=keys.client("stranger"),
                                   connect_timeout=0.5):
                    pass
            assert (await driver.status()).counters["auth_reloads"] == reloads
            proc.signal(signal.SIGHUP)
            await until(lambda: _reloads_past(driver, reloads), 5, "a reload after SIGHUP")
            async with connect(ep, name="stranger", curve=keys.client("stranger"),
                               connect_timeout=5) as stranger:
                assert stranger.peer_id.startswith("key:" + keys.public_z85("stranger")[:12])
    finally:
        proc.stop()
    assert proc.popen.returncode in (0, -signal.SIGTERM)


def test_busctl_keys_generate_permissions(tmp_path: Path) -> None:
    directory = tmp_path / "k"
    old = os.umask(0)  # the worst case: files would be world-writable by default
    try:
        result = subprocess.run(busctl("keys", "generate", str(directory), "--client", "a",
                                       "--client", "b"), capture_output=True, text=True,
                                timeout=30)
    finally:
        os.umask(old)
    assert result.returncode == 0, result.stderr
    mode = lambda path: stat.S_IMODE(path.stat().st_mode)  # noqa: E731
    assert mode(directory) == 0o700
    assert mode(directory / "authorized") == 0o700
    names = sorted(path.name for path in directory.iterdir() if path.is_file())
    assert names == ["a.key", "a.key_secret", "b.key", "b.key_secret", "hub.key", "hub.key_secret"]
    for path in [*directory.iterdir(), *(directory / "authorized").iterdir()]:
        if path.is_file():
            assert mode(path) == 0o600, path
    assert sorted(path.name for path in (directory / "authorized").iterdir()) == ["a.key", "b.key"]
    # An existing, too-open directory is tightened.
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    generate_keys(loose, "x")
    assert mode(loose) == 0o700


def test_ipc_endpoint_directory_and_socket_are_private(tmp_path: Path) -> None:
    run_dir = tmp_path / "run" / "bus"
    original = os.umask(0)  # the loosest umask: the sockets must be private all the same
    try:
        hub = Hub(HubConfig(endpoint=f"ipc://{run_dir}/hub.sock"))
        left_by_bind = os.umask(0)
    finally:
        os.umask(original)
    try:
        assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
        for name in ("hub.sock", "hub.sock.events"):
            assert stat.S_IMODE((run_dir / name).stat().st_mode) & 0o077 == 0, name
        assert left_by_bind == 0  # the bind restored the process umask it found
    finally:
        hub.close()


def test_non_loopback_bind_without_keys_refused_and_says_how_to_make_keys(tmp_path: Path) -> None:
    for args in (["--hub", "tcp://0.0.0.0:7999"],
                 ["--hub", "tcp://127.0.0.1:7999", "--events", "tcp://0.0.0.0:7998"]):
        result = subprocess.run(busctl("hub", *args, "--state-dir", str(tmp_path / "s")),
                                capture_output=True, text=True, timeout=30)
        assert result.returncode != 0, args
        assert "busctl keys generate" in result.stderr, result.stderr


def test_busctl_up_non_loopback_without_keys_refused(tmp_path: Path) -> None:
    topo = tmp_path / "topo.toml"
    topo.write_text(f'[hub]\nendpoint = "tcp://0.0.0.0:7999"\nstate_dir = "{tmp_path / "st"}"\n')
    result = subprocess.run(busctl("up", "-c", str(topo)), capture_output=True, text=True,
                            timeout=30)
    assert result.returncode != 0
    assert "busctl keys generate" in result.stderr, result.stdout + result.stderr
    assert not (tmp_path / "st").exists()  # refused before anything started


def test_public_key_given_as_client_secret_is_a_usage_error(keys: Keys) -> None:
    result = subprocess.run(busctl("status", "--hub", "tcp://127.0.0.1:1", "--curve-server-key",
                                   str(keys.dir / "hub.key"), "--curve-key",
                                   str(keys.dir / "driver.key")),
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert "key_secret" in result.stderr


async def test_routing_id_reused_by_another_key_is_rejected(keys: Keys, tmp_path: Path) -> None:
    """A second authorised key cannot speak as a peer whose connection dropped.

    While the victim's connection is open, libzmq itself refuses a second connection with its
    routing id; the hub's key check covers the moment after it closed, before the hub forgets
    the victim (a peer that chose its own routing id is kept until its heartbeats run out). The
    heartbeat interval is long here, so only the key check can drop the victim."""
    proc = start_hub([*keys.hub_args(), "--heartbeat-interval", "30"], tmp_path)
    ctx = zmq.Context()
    try:
        ep = proc.wait_ready()["endpoint"]
        victim = _dealer(ctx, ep, keys.client("worker"))
        victim.send_multipart([p.SIGNATURE, p.encode(p.Header(kind=p.HELLO, id=p.new_id())),
                               p.encode(p.Hello(name="victim", session="s1", pid=1, host="h"))])
        assert victim.poll(5000), "no welcome"
        assert p.decode_header(victim.recv_multipart()[1]).kind == p.WELCOME
        victim.close(0)
        async with connect(ep, name="driver", curve=keys.client("driver")) as driver:
            st = await driver.status()
            victim_id = {peer.name: peer.peer for peer in st.peers}["victim"]  # still registered
            intruder = _dealer(ctx, ep, keys.client("driver"))
            request = [p.SIGNATURE, p.encode(p.Header(kind=p.REQUEST, id="r1", service=p.HUB_STATUS))]

            async def refused() -> bool:
                try:  # again until the ROUTER has let go of the closed connection's id
                    intruder.send_multipart(request, zmq.NOBLOCK)
                except zmq.Again:
                    return False
                return (await driver.status()).counters.get("key_mismatch", 0) > 0

            await until(refused, 10, "the hub's key check to refuse the reused routing id")
            st = await driver.status()
            assert st.counters["key_mismatch"] == 1 and st.counters.get("peers_expired", 0) == 0
            assert "victim" not in {peer.name for peer in st.peers}  # dropped, not impersonated
            left = [env.event async for env in _logged(driver) if isinstance(env.event, ev.PeerLeft)
                    and env.event.peer == victim_id]
            assert [e.reason for e in left] == ["its routing id was taken by another key"], left
        proc.wait_line(lambda s: "key_mismatch #1" in s and "routing id reused by another key" in s, 5)
        # From now on the intruder is a stranger to the hub: its request is refused, never served.
        intruder.send_multipart([p.SIGNATURE, p.encode(p.Header(kind=p.REQUEST, id="after",
                                                                service=p.HUB_STATUS))])
        answers: list[p.Header] = []
        while not any(h.id == "after" for h in answers):
            assert intruder.poll(5000), f"no answer to the intruder's request; got {answers}"
            answers.append(p.decode_header(intruder.recv_multipart()[1]))
        assert all(h.kind == p.RECONNECT or (h.kind == p.ERROR and h.code == p.HUB_LOST)
                   for h in answers), answers
        intruder.close(0)
    finally:
        ctx.destroy(0)
        proc.stop()


def _dealer(ctx: zmq.Context[Any], endpoint: str, curve: Any) -> zmq.Socket[Any]:
    """A raw DEALER that chose its own routing id, as a hand-written client may."""
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.routing_id = b"shared-id"
    curve.apply(sock)
    sock.connect(endpoint)
    return sock
