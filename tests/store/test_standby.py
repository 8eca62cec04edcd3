"""The standby hub (issue 52 item 2, acceptance 3) on a real three-server JetStream cluster: two
`busctl hub` processes on one stream and its leader lease. The primary SIGKILLed: the standby
takes over within a bound that follows from the lease's TTL, and the log's seqs continue with no
hole and no reuse; the old primary restarted comes back as a standby; a write with the old
primary's view of the log is refused by the store; a primary paused past its TTL (SIGSTOP)
stands down when it resumes; a primary whose write the store refuses stands down at once.

Hellos are sent on a bare ZeroMQ DEALER (`_hello`), so what a hub answers is seen as sent,
whatever a client library does with it."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import zmq

from agent_bus.agents.launch.topology import HubSection, hub_problems
from agent_bus.bus import events as ev
from agent_bus.bus import protocol as p
from agent_bus.bus.client import connect
from agent_bus.bus.store import Retention, Row, StoreError, parse_store_url
from agent_bus.bus.store.leader import LATE_TTLS
from tests.store_cluster import Cluster
from tests.support import Proc, busctl, running, wait_for

TTL = 3.0  # the tests' lease TTL (--lease-ttl): short, so a takeover is seconds
# A takeover follows from the TTL: the primary's last renewal expires at most TTL after it was
# stored; the standby looks every TTL/4; then one read of the log's head and the marker's write.
# The slack is for the store's expiry timer and a busy 2-core machine.
TAKEOVER_BOUND = TTL + TTL / 4 + 4.0


def _hub(tmp_path: Path, name: str, url: str, *extra: str) -> list[str]:
    return busctl("hub", "--hub", "tcp://127.0.0.1:0", "--state-dir", str(tmp_path / name), "--store", url,
                  "--lease-ttl", str(TTL), *extra)


def _hello(endpoint: str, timeout: float = 5.0) -> tuple[str, Any]:
    """One hello on a fresh connection: ("welcome", Welcome) (then bye), ("error", Header),
    or ("none", None) when nothing answered within `timeout`."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send_multipart([p.SIGNATURE, p.encode(p.Header(kind=p.HELLO, id="probe")),
                             p.encode(p.Hello(name="standby-probe", session="test"))])
        if not sock.poll(int(timeout * 1000)):
            return "none", None
        frames = sock.recv_multipart()
        header = p.decode_header(frames[1])
        if header.kind != p.WELCOME:
            return header.kind, header
        sock.send_multipart([p.SIGNATURE, p.encode(p.Header(kind=p.BYE))])
        return "welcome", p.decode(frames[2], p.Welcome)
    finally:
        sock.close()


def _request_answer(endpoint: str, timeout: float = 5.0) -> p.Header | None:
    """The header a hub answers a `hub.status` request with, sent without a hello first."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send_multipart([p.SIGNATURE, p.encode(p.Header(kind=p.REQUEST, id="r1",
                                                            service=p.HUB_STATUS))])
        if not sock.poll(int(timeout * 1000)):
            return None
        return p.decode_header(sock.recv_multipart()[1])
    finally:
        sock.close()


def _not_leader(endpoint: str) -> str:
    """The `not_leader` error text `endpoint` answers a hello with ("" for anything else)."""
    kind, answer = _hello(endpoint)
    if kind == p.ERROR and answer.code == p.NOT_LEADER:
        return str(answer.error)
    return ""


def _welcome(endpoint: str) -> p.Welcome | None:
    kind, answer = _hello(endpoint, 2.0)
    return answer if kind == "welcome" else None


async def _publish(endpoint: str, texts: list[str]) -> None:
    async with connect(endpoint, name="standby-test") as peer:
        for text in texts:
            await peer.publish(ev.TopicMessage(topic="t", text=text), confirm=True)


def _publish_sync(endpoint: str, texts: list[str]) -> None:
    anyio.run(_publish, endpoint, texts)


def _stored(cluster: Cluster, url: str) -> list[tuple[int, p.Header, ev.Event]]:
    return [(seq, p.decode_header(header), ev.decode_event(body))
            for seq, header, body in cluster.stream_seqs(url)]


def _check_log(cluster: Cluster, url: str, texts: list[str]) -> list[ev.HubLeader]:
    """The log: seqs 1..N with no hole, every published text once; its epoch markers."""
    stored = _stored(cluster, url)
    assert [seq for seq, _, _ in stored] == list(range(1, len(stored) + 1)), "a hole in the log"
    logged = [event.text for _, _, event in stored if isinstance(event, ev.TopicMessage)]
    assert logged == texts
    markers = [(seq, event) for seq, _, event in stored if isinstance(event, ev.HubLeader)]
    for seq, marker in markers:
        assert marker.head == seq - 1  # the new primary continued from the log's head
    return [marker for _, marker in markers]


@contextmanager
def _pair(tmp_path: Path, url: str) -> Iterator[tuple[Proc, str, Proc, str]]:
    """Hub `a`, the primary (it takes the lease first), and hub `b`, its standby."""
    with running(_hub(tmp_path, "a", url)) as a:
        ready = a.wait_ready(30)
        assert ready["role"] == "primary" and ready["epoch"] > 0
        with running(_hub(tmp_path, "b", url, "--standby")) as b:
            standby = b.wait_ready(30)
            assert standby["role"] == "standby"
            yield a, ready["endpoint"], b, standby["endpoint"]


def _take_over_time(endpoint: str, since: float) -> tuple[float, p.Welcome]:
    welcome = wait_for(lambda: _welcome(endpoint), TAKEOVER_BOUND + 30, "the standby to take over")
    return time.monotonic() - since, welcome


def _rows_at(seq: int, text: str = "from the old epoch") -> list[Row]:
    header = p.Header(kind=p.EVENT, id=f"row{seq}", type="topic_message", seq=seq,
                      ts=time.time())
    body = ev.encode_event(ev.TopicMessage(topic="t", text=text))
    return [(seq, header.ts, header.type, "", "", "", msgspec.msgpack.encode(header), body)]


def test_primary_sigkilled_the_standby_takes_over_and_the_old_primary_comes_back_standby(
        tmp_path: Path, jetstream: Cluster) -> None:
    from agent_bus.bus.store.jetstream import JetStreamStore

    url = jetstream.stream_url()
    with _pair(tmp_path, url) as (a, a_endpoint, b, b_endpoint):
        first = _welcome(a_endpoint)
        assert first is not None and first.epoch > 0, "the primary's welcome carries its epoch"
        assert a_endpoint in _not_leader(b_endpoint), "the standby names the primary"
        answer = _request_answer(b_endpoint)  # a request too, with the request's id
        assert answer is not None and (answer.kind, answer.code, answer.id) == \
            (p.ERROR, p.NOT_LEADER, "r1") and answer.error.startswith(a_endpoint)
        _publish_sync(a_endpoint, [f"a{i}" for i in range(20)])
        old_head = len(jetstream.stream_seqs(url))  # the old primary's view of the log's end

        a.signal(signal.SIGKILL)
        killed = time.monotonic()
        took, welcome = _take_over_time(b_endpoint, killed)
        print(f"\nthe standby took over {took:.2f} s after the primary's SIGKILL (bound "
              f"{TAKEOVER_BOUND:g} s = lease ttl {TTL:g} s + ttl/4 between a standby's looks + "
              f"4 s slack); epochs {first.epoch} -> {welcome.epoch}")
        assert took < TAKEOVER_BOUND
        assert welcome.epoch > first.epoch
        _publish_sync(b_endpoint, [f"b{i}" for i in range(20)])

        # the old primary restarted: a standby (fail-back is by hand). On a new port: its old
        # events port (+1, never reserved) may be any process's ephemeral port by now
        with running(_hub(tmp_path, "a", url)) as again:
            again_endpoint = again.wait_ready(30)["endpoint"]
            assert b_endpoint in _not_leader(again_endpoint)
            assert _welcome(b_endpoint) is not None  # b still leads

        # a write with the old primary's view of the log (it ended at old_head) is refused by
        # the store itself: the new primary's epoch marker is there
        stale = JetStreamStore(parse_store_url(url), Retention())
        try:
            with pytest.raises(StoreError, match="wrong last"):
                stale.append(_rows_at(old_head + 1))
            assert stale.fenced
        finally:
            stale.close()
    markers = _check_log(jetstream, url, [f"a{i}" for i in range(20)] + [f"b{i}" for i in range(20)])
    assert [m.epoch for m in markers] == [first.epoch, welcome.epoch]
    assert [m.endpoint for m in markers] == [a_endpoint, b_endpoint]


def test_a_primary_paused_past_its_ttl_stands_down_when_it_resumes(
        tmp_path: Path, jetstream: Cluster) -> None:
    url = jetstream.stream_url()
    with _pair(tmp_path, url) as (a, a_endpoint, b, b_endpoint):
        _publish_sync(a_endpoint, ["before"])
        a.signal(signal.SIGSTOP)
        try:
            stopped = time.monotonic()
            took, welcome = _take_over_time(b_endpoint, stopped)
            print(f"\nthe standby took over {took:.2f} s after the primary's SIGSTOP "
                  f"(bound {TAKEOVER_BOUND:g} s, lease ttl {TTL:g} s)")
            _publish_sync(b_endpoint, ["after"])
        finally:
            a.signal(signal.SIGCONT)
        assert wait_for(lambda: b_endpoint in _not_leader(a_endpoint), 15,
                        "the resumed primary to answer not_leader naming the new one")
        a.wait_line(lambda line: "standing down as primary" in line, 15)
        assert _welcome(b_endpoint) is not None
    markers = _check_log(jetstream, url, ["before", "after"])
    assert markers[-1].epoch == welcome.epoch and markers[-1].endpoint == b_endpoint


def test_a_primary_whose_write_the_store_refuses_stands_down(tmp_path: Path,
                                                             jetstream: Cluster) -> None:
    """Another writer got ahead of the primary in the log (what a new leader's epoch marker
    does to a primary that missed its lapse): the store refuses the primary's next append, and
    the primary stands down at once, its publisher told `not_leader`."""
    url = jetstream.stream_url()
    with running(_hub(tmp_path, "a", url)) as a:
        endpoint = a.wait_ready(30)["endpoint"]
        # one connection throughout: a second one's hub events (peer_left, peer_joined) would
        # be the primary's first refused write, not the publish
        outcome = anyio.run(_publish_across_a_writer, endpoint, url)
        # not acknowledged: the client is told `not_leader` for the event, then to reconnect
        # (how a client reports that is its own: today's Python client raises HubLost)
        assert outcome != "acknowledged"
        assert _not_leader(endpoint)
        a.wait_line(lambda line: "the store refused its write" in line, 15)
    stored = _stored(jetstream, url)
    texts = [event.text for _, _, event in stored if isinstance(event, ev.TopicMessage)]
    assert texts == ["mine", "from another writer"]


def _write_ahead(url: str) -> None:
    """Another writer appends at the log's end (what a new primary's epoch marker does)."""
    from agent_bus.bus.store.jetstream import JetStreamStore

    ahead = JetStreamStore(parse_store_url(url), Retention())
    try:
        ahead.append(_rows_at(ahead.last_seq() + 1, "from another writer"))
    finally:
        ahead.close()


async def _publish_across_a_writer(endpoint: str, url: str) -> str:
    async with connect(endpoint, name="fenced-test") as peer:
        await peer.publish(ev.TopicMessage(topic="t", text="mine"), confirm=True)
        await anyio.to_thread.run_sync(_write_ahead, url)
        try:
            await peer.publish(ev.TopicMessage(topic="t", text="refused"), confirm=True)
        except Exception as exc:  # the client's error for the event's `not_leader`
            return f"{type(exc).__name__}: {exc}"
    return "acknowledged"


def test_standby_or_lease_on_the_sqlite_log_is_a_config_error(tmp_path: Path) -> None:
    """No `store`: the flag named, and the fix (a nats:// store); exit 2 before anything binds."""
    for flag in (["--standby"], ["--lease-ttl", "3"]):
        done = subprocess.run(busctl("hub", "--hub", "tcp://127.0.0.1:0", "--state-dir",
                                     str(tmp_path), *flag), capture_output=True, text=True,
                              timeout=30)
        assert done.returncode == 2, done.stderr
        assert flag[0] in done.stderr and "--store nats://" in done.stderr
    ttl = subprocess.run(busctl("hub", "--hub", "tcp://127.0.0.1:0", "--state-dir", str(tmp_path),
                                "--store", "nats://127.0.0.1:4222", "--lease-ttl", "0.2"),
                         capture_output=True, text=True, timeout=30)
    assert ttl.returncode == 2 and "--lease-ttl" in ttl.stderr and "1 to 300" in ttl.stderr


def test_a_topology_standby_needs_a_store_and_its_own_address() -> None:
    problems = hub_problems(HubSection(standby="tcp://127.0.0.1:7500"))
    assert any(p.startswith("hub.standby:") and "hub.store" in p for p in problems)
    same = hub_problems(HubSection(store="nats://127.0.0.1:4222", endpoint="tcp://127.0.0.1:7400",
                                   standby="tcp://127.0.0.1:7400"))
    assert any("an address of its own" in p for p in same)
    assert any(p.startswith("hub.lease_ttl:") for p in hub_problems(HubSection(lease_ttl=2)))
    assert not hub_problems(HubSection(store="nats://127.0.0.1:4222",
                                       standby="tcp://127.0.0.1:7500", lease_ttl=3))


def test_up_starts_the_standby_and_hands_every_process_both_hubs() -> None:
    """`[hub] standby`: the second hub's command (--standby, a state dir of its own, the same
    store and lease TTL), and the hub list "primary,standby" in every process `up` starts."""
    from agent_bus.agents.launch.topology import ProcessSpec, Topology
    from agent_bus.agents.launch.up import child_specs, hub_argv

    topo = Topology(hub=HubSection(endpoint="tcp://10.0.0.1:7400", store="nats://n1:4222",
                                   standby="tcp://10.0.0.2:7400", lease_ttl=4, insecure=True),
                    processes=[ProcessSpec(name="p", command=["true"])])
    primary, standby = hub_argv(topo), hub_argv(topo, "")
    assert "--standby" not in primary and "--standby" in standby
    assert standby[standby.index("--hub") + 1] == "tcp://10.0.0.2:7400"
    assert standby[standby.index("--state-dir") + 1].endswith("hub-standby")
    for argv in (primary, standby):
        assert argv[argv.index("--store") + 1] == "nats://n1:4222"
        assert float(argv[argv.index("--lease-ttl") + 1]) == 4
    hubs = "tcp://10.0.0.1:7400,tcp://10.0.0.2:7400"
    specs = child_specs(topo, hubs)
    assert [spec.env.get("BUSCTL_HUB") for spec in specs if spec.role == "process"] == [hubs]
    assert all(hubs in spec.argv for spec in specs if spec.role in ("worker", "coordinator",
                                                                    "gateway"))


def _ps(cwd: Path) -> list[dict[str, Any]]:
    done = subprocess.run(busctl("ps", "--json"), cwd=cwd, capture_output=True, text=True,
                          timeout=60)
    return [msgspec.json.decode(line) for line in done.stdout.splitlines()]


def test_busctl_up_runs_a_hub_pair_and_ps_and_status_show_their_roles(
        tmp_path: Path, jetstream: Cluster) -> None:
    """A real `busctl up` with `[hub] store` and `standby`: two hub processes, the standby's
    address in every process's hub list, `busctl ps` showing which hub is the primary and
    `busctl status` the primary's role and epoch; then the primary SIGKILLed: the standby
    leads, and the supervisor's restart of the old primary is the standby."""
    hubs_file = tmp_path / "hubs.txt"
    (tmp_path / "pair.toml").write_text(f"""
workers = []
agents = []
coordinators = 0

[gateways]
count = 0

[hub]
store = "{jetstream.stream_url()}"
standby = "tcp://127.0.0.1:0"
lease_ttl = {TTL}

[[processes]]
name = "shows-hubs"
command = ["sh", "-c", "echo $BUSCTL_HUB > {hubs_file}; exec sleep 600"]
""")
    with running(busctl("up", "--json", "-c", "pair.toml", "--hub", "tcp://127.0.0.1:0"),
                 cwd=tmp_path) as up:
        endpoint = up.wait_ready(60)["endpoint"]
        primary, standby = wait_for(lambda: hubs_file.exists() and hubs_file.read_text().strip(),
                                    30, "the process's hub list").split(",")
        # on one machine both listen privately (ipc://, as a local hub does): this user only
        assert primary == endpoint and standby == f"{endpoint}-standby"
        assert endpoint in _not_leader(standby)

        def roles() -> dict[str, str]:
            return {row["name"]: row["role"] for row in _ps(tmp_path)}

        shown = wait_for(lambda: (r := roles()).get("hub-standby", "").startswith("hub standby")
                         and r, 30, "busctl ps to show the pair")
        assert shown["hub"].startswith("hub primary e")
        status = subprocess.run(busctl("status", "--hub", endpoint), capture_output=True,
                                text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        assert f"primary, epoch {shown['hub'].removeprefix('hub primary e')}" in status.stdout

        # Binary Star under the supervisor: the primary hub SIGKILLed, the standby takes over,
        # and the supervisor's restart of the old primary (within 0.5 s, while its lease
        # lives) comes back as the standby: a primary started while another hub leads leaves
        # a lease that lapses to the standby that was following (LATE_TTLS)
        os.kill(next(row["pid"] for row in _ps(tmp_path) if row["name"] == "hub"),
                signal.SIGKILL)
        swapped = wait_for(lambda: (r := roles())["hub-standby"].startswith("hub primary")
                           and r["hub"].startswith("hub standby") and r,
                           TAKEOVER_BOUND + LATE_TTLS * TTL + 30, "the standby to lead and the old primary to "
                                                "come back as the standby")
        assert int(swapped["hub-standby"].removeprefix("hub primary e")) > \
            int(shown["hub"].removeprefix("hub primary e"))
        wait_for(lambda: standby in _not_leader(endpoint), 15,  # (it looks every TTL/4)
                 "the restarted old primary to name the new one")
        assert up.popen.poll() is None  # the supervisor lives on


def test_a_hub_with_another_lease_ttl_than_the_pairs_is_refused_naming_it(
        tmp_path: Path, jetstream: Cluster) -> None:
    """Hubs of a pair with different TTLs would disagree on when a lease lapsed: the second
    one's start fails, naming `lease_ttl` and how to change it."""
    url = jetstream.stream_url()
    with running(_hub(tmp_path, "a", url)) as a:
        a.wait_ready(30)
        done = subprocess.run(busctl("hub", "--hub", "tcp://127.0.0.1:0", "--state-dir",
                                     str(tmp_path / "b"), "--store", url, "--lease-ttl",
                                     str(TTL + 1), "--standby"),
                              capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "lease_ttl" in done.stderr and "nats kv del" in done.stderr, done.stderr


def test_a_primary_stopped_cleanly_gives_the_lease_up(tmp_path: Path, jetstream: Cluster) -> None:
    """SIGTERM: the primary deletes its lease key on the way out, so the standby takes over at
    its next look (every TTL/4), well before the TTL a lost primary costs."""
    url = jetstream.stream_url()
    with _pair(tmp_path, url) as (a, a_endpoint, b, b_endpoint):
        first = _welcome(a_endpoint)
        assert first is not None
        a.stop()
        stopped = time.monotonic()
        took, welcome = _take_over_time(b_endpoint, stopped)
        print(f"\nthe standby took over {took:.2f} s after the primary's clean stop (lease ttl "
              f"{TTL:g} s, looks every {TTL / 4:g} s)")
        assert took < TTL
        assert welcome.epoch > first.epoch
