"""Issue 12 §7: removing a key from the authorised directory disconnects its holder.

ZAP only authenticates at the handshake, so the hub itself drops the live peers of a revoked key
(within one heartbeat interval), re-routes their calls, and refuses what their old connection
still sends. Real CURVE processes on loopback; no root needed.
"""

from __future__ import annotations

import json
import shutil
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
from agent_bus.bus.security import CurveClient
from tests.multihost.conftest import Keys, generate
from tests.support import ROOT, Proc, busctl, py, until

pytestmark = pytest.mark.anyio

HB = 1.0  # the default heartbeat interval: the revoked peer must be gone within it
PEER_PROC = str(ROOT / "tests" / "bus" / "peer_proc.py")


@pytest.fixture
def revocable(keys: Keys, tmp_path: Path) -> CurveClient:
    """A third authorised client key, `revoked`, whose `.key` the test removes."""
    generate(tmp_path / "extra", "revoked")
    shutil.copy(tmp_path / "extra" / "revoked.key", keys.authorized / "revoked.key")
    return CurveClient(server_public_key_file=str(keys.dir / "hub.key"),
                       secret_key_file=str(tmp_path / "extra" / "revoked.key_secret"))


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    try:
        yield started
    finally:
        for proc in reversed(started):
            proc.stop()


def worker(procs: list[Proc], ep: str, curve: CurveClient, name: str) -> dict[str, Any]:
    proc = Proc(py(PEER_PROC, ep, "--name", name, "--idempotent", "--curve-server-key",
                   curve.server_public_key_file, "--curve-key", curve.secret_key_file))
    procs.append(proc)
    info = proc.wait_ready()
    info["proc"] = proc
    return info


def raw_dealer(ctx: zmq.Context[Any], ep: str, curve: CurveClient) -> zmq.Socket[Any]:
    """A bare DEALER that said hello and got its welcome: it can send after the revocation."""
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    curve.apply(sock)
    sock.connect(ep)
    sock.send_multipart([p.SIGNATURE, p.encode(p.Header(kind=p.HELLO, id=p.new_id())),
                         p.encode(p.Hello(name="raw", session="raw", pid=1, host="h"))])
    assert recv_kind(sock, {p.WELCOME}) == p.WELCOME
    return sock


def recv_kind(sock: zmq.Socket[Any], wanted: set[str], timeout: float = 5.0) -> str:
    """Read until a message of a kind in `wanted` (heartbeats etc. skipped); return its kind,
    or the error code for an `error`."""
    end = time.monotonic() + timeout
    while sock.poll(max(1, int((end - time.monotonic()) * 1000))):
        header = p.decode_header(sock.recv_multipart()[1])
        if header.kind in wanted:
            return header.code if header.kind == p.ERROR else header.kind
    raise TimeoutError(f"no {sorted(wanted)} within {timeout} s")


async def servers(driver: Peer, n: int) -> list[int]:
    """The pids that served `n` concurrent `echo` calls."""
    pids: list[int] = []

    async def call() -> None:
        reply = await driver.request("echo", json.dumps({"delay": 0.05}).encode(), timeout=10)
        pids.append(json.loads(reply)["pid"])

    async with anyio.create_task_group() as tg:
        for _ in range(n):
            tg.start_soon(call)
    return pids


async def test_revoked_key_is_dropped_rerouted_and_refused(
        keys: Keys, revocable: CurveClient, tmp_path: Path, procs: list[Proc]) -> None:
    hub = Proc(busctl("hub", "--hub", "tcp://127.0.0.1:0", "--state-dir", str(tmp_path / "hub"),
                      "--heartbeat-interval", str(HB), *keys.hub_args()))
    procs.append(hub)
    ep = hub.wait_ready()["endpoint"]
    kept = worker(procs, ep, keys.client("worker"), "kept")
    gone = worker(procs, ep, revocable, "gone")
    ctx = zmq.Context()
    raw = raw_dealer(ctx, ep, revocable)
    try:
        async with connect(ep, name="driver", curve=keys.client("driver")) as driver:
            assert set(await servers(driver, 12)) == {kept["pid"], gone["pid"]}

            # One slow call in flight on each worker, then the key is removed.
            results: list[bytes] = []

            async def slow() -> None:
                results.append(await driver.request("slow", b"2.0", timeout=15))

            async with anyio.create_task_group() as tg:
                for _ in range(2):
                    tg.start_soon(slow)
                for info in (kept, gone):  # (in a thread: the calls run on this loop)
                    await anyio.to_thread.run_sync(info["proc"].wait_line, _started, 10)
                before = (await driver.status()).counters
                (keys.authorized / "revoked.key").unlink()
                revoked_at = time.monotonic()
                await until(lambda: _peer_gone(driver, gone["peer"]), 5,
                            "the revoked worker to be dropped")
                dropped_in = time.monotonic() - revoked_at
            # The call the revoked worker held was re-routed to the kept one.
            assert sorted(results) == [f"done by {kept['pid']}".encode()] * 2
            assert dropped_in < HB, f"dropped {dropped_in:.2f} s after the key was removed"

            # Only the still-authorised worker serves now.
            assert set(await servers(driver, 12)) == {kept["pid"]}

            # The revoked key's old connection: told to reconnect, then refused.
            assert recv_kind(raw, {p.RECONNECT}) == p.RECONNECT
            raw.send_multipart([p.SIGNATURE, p.encode(p.Header(kind=p.REQUEST, id="r1",
                                                               service=p.HUB_STATUS))])
            assert recv_kind(raw, {p.ERROR, p.REPLY}) == p.UNAUTHORIZED
            assert recv_kind(raw, {p.RECONNECT}) == p.RECONNECT
            raw.send_multipart([p.SIGNATURE, p.encode(p.Header(kind=p.HELLO, id=p.new_id())),
                                p.encode(p.Hello(name="raw", session="raw2", pid=1, host="h"))])
            assert recv_kind(raw, {p.WELCOME, p.RECONNECT}) == p.RECONNECT

            st = await driver.status()
            assert {peer.name for peer in st.peers} == {"kept", "driver"}
            assert st.counters["peers_revoked"] - before.get("peers_revoked", 0) == 2
            assert st.counters["revoked_key"] >= 2
            # The revoked worker process reconnected as told; ZAP refused its new handshake.
            await until(lambda: _refused_past(driver, before["auth_refused"]), 5,
                        "the revoked worker's new handshake to be refused")
        assert gone["proc"].popen.poll() is None  # refused, not crashed
        assert "revoked" in hub.output()
    finally:
        raw.close(0)
        ctx.term()


def _started(line: str) -> bool:
    return line.startswith('{"started"')


async def _peer_gone(peer: Peer, peer_id: str) -> bool:
    return peer_id not in {info.peer for info in (await peer.status()).peers}


async def _refused_past(peer: Peer, n: int) -> bool:
    return (await peer.status()).counters["auth_refused"] > n


async def test_revoked_key_loses_the_event_stream_and_others_miss_nothing(
        keys: Keys, revocable: CurveClient, tmp_path: Path, procs: list[Proc]) -> None:
    """A subscriber holding the revoked key stops receiving events; ZeroMQ cannot close one
    subscriber, so the hub resets every event connection, and the others lose nothing."""
    hub = Proc(busctl("hub", "--hub", "tcp://127.0.0.1:0", "--state-dir", str(tmp_path / "hub"),
                      "--heartbeat-interval", str(HB), *keys.hub_args()))
    procs.append(hub)
    ready = hub.wait_ready()
    ctx = zmq.Context()
    spy = ctx.socket(zmq.SUB)
    spy.linger = 0
    revocable.apply(spy)
    spy.setsockopt(zmq.SUBSCRIBE, b"")
    spy.connect(ready["events"])
    try:
        async with connect(ready["endpoint"], name="driver", curve=keys.client("driver")) as driver, \
                driver.subscribe([], since=0) as events:
            async def publish(text: str) -> None:
                await driver.publish(ev.TopicMessage(topic="t", text=text), agent="a",
                                     confirm=True)

            await until(lambda: _spy_hears(spy, publish), 10, "the spy to receive events")
            before = (await driver.status()).counters.get("subscribers_reset", 0)
            (keys.authorized / "revoked.key").unlink()
            await until(lambda: _resets_past(driver, before), 5, "the event connections reset")
            _drain(spy)
            for i in range(20):
                await publish(f"after-{i}")
            texts: list[str] = []
            seqs: list[int] = []
            with anyio.fail_after(10):
                async for envelope in events:
                    seqs.append(envelope.header.seq)
                    if isinstance(envelope.event, ev.TopicMessage):
                        texts.append(envelope.event.text)
                        if texts[-1] == "after-19":
                            break
            after = [t for t in texts if t.startswith("after-")]
            assert after == [f"after-{i}" for i in range(20)]  # no hole, no duplicate
            assert seqs == sorted(set(seqs))  # every event once, in order
            # the revoked key's reconnect is refused: nothing published after the reset reaches it
            assert not any(b"after-" in frame for frame in _drain(spy, wait=HB))
    finally:
        spy.close(0)
        ctx.term()


async def _spy_hears(spy: zmq.Socket[Any], publish: Any) -> bool:
    await publish("probe")
    return any(b"probe" in frame for frame in _drain(spy, wait=0.2))


def _drain(spy: zmq.Socket[Any], wait: float = 0.0) -> list[bytes]:
    """Every frame the spy has received (waiting up to `wait` seconds for the first)."""
    frames: list[bytes] = []
    if wait and not spy.poll(int(wait * 1000)):
        return frames
    while spy.poll(0):
        frames.extend(spy.recv_multipart())
    return frames


async def _resets_past(peer: Peer, n: int) -> bool:
    return (await peer.status()).counters.get("subscribers_reset", 0) > n
