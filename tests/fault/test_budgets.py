"""Issue 12 §5, §3 (hub) and §11: the hub's memory budgets, the re-dispatch limit, and the hub's
own refusals. Every test drives a real hub process (`python -m agent_bus.cli hub`) over tcp and reads its
RSS from /proc; attacks run at a reduced size here and at the issue's size under `-m slow`.

Run as a script (`python tests/fault/test_budgets.py replay ENDPOINT`) it is the process that
replays the hub's log in a loop while the p99 test measures requests.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":  # the replayer process: make `bus` and `tests` importable
    sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402
import pytest  # noqa: E402
import zmq  # noqa: E402

from agent_bus.bus import protocol as p  # noqa: E402
from tests.fault.conftest import FIXTURES, proc_rss_kb  # noqa: E402
from tests.fault.test_fuzz import RawPeer  # noqa: E402
from tests.support import Proc, busctl, py, wait_for  # noqa: E402

MiB = 1024 * 1024
RSS_BOUND_KB = 256 * 1024  # documented: each attack keeps hub RSS within 256 MiB of idle
FREEZE_TOOLS = str(FIXTURES / "freeze_tools.py")


def start_hub(tmp_path: Path, *flags: str) -> Proc:
    """A hub whose raw test peers (which send no heartbeats) stay known for 100 s."""
    proc = Proc(busctl("hub", "--hub", "tcp://127.0.0.1:0", "--state-dir", str(tmp_path / "hub"),
                   "--liveness", "100", *flags))
    try:
        proc.ready = proc.wait_ready()  # type: ignore[attr-defined]
    except BaseException:
        proc.stop()
        raise
    return proc


def event_body(type_: str, size: int) -> bytes:
    """An event body of about `size` bytes whose `type` matches the header's (the hub refuses
    a body that does not say its type, and one that does not match its type's schema)."""
    if type_ == "message_end":  # its `message` is required
        return msgspec.msgpack.encode({"type": type_, "message": {
            "role": "assistant", "content": [{"type": "text", "text": "e" * size}]}})
    if type_ == "message_update":  # its `delta` is required
        return msgspec.msgpack.encode({"type": type_, "delta": {"kind": "text", "delta": "e" * size}})
    return msgspec.msgpack.encode({"type": type_, "data": "e" * size})


def status(peer: RawPeer) -> p.Status:
    header, frames = peer.request(p.HUB_STATUS, timeout=30)
    assert header.kind == p.REPLY, header
    return p.decode(frames[0], p.Status)


def drain(peer: RawPeer, codes: Counter[str], wait: float = 0) -> None:
    """Count the answers waiting for `peer` to its requests (error replies by code)."""
    while peer.sock.poll(wait * 1000):
        header = p.decode_header(peer.sock.recv_multipart()[1])
        if header.kind in (p.REPLY, p.ERROR):
            codes[header.code or "reply"] += 1
        wait = 0


def flood(peer: RawPeer, n: int, names: int, body: bytes, pid: int) -> tuple[Counter[str], int]:
    """Send `n` requests with a deadline over `names` unserved services, reading the replies as
    they come (an attacker that does not read them only fills its own queue). Returns the
    replies by code and the peak RSS (kB) of the hub seen meanwhile."""
    codes: Counter[str] = Counter()
    deadline = time.time() + 120
    peak = 0
    for i in range(n):
        if i % 2000 == 0:
            drain(peer, codes)
            peak = max(peak, proc_rss_kb(pid))
        header = {"kind": p.REQUEST, "id": f"{peer.name}-{i}", "service": f"nobody.{i % names}",
                  "deadline": deadline}
        peer.send([p.SIGNATURE, msgspec.msgpack.encode(header), body])
    return codes, peak


# --- §5: request budgets ---------------------------------------------------------------------


def request_flood(tmp_path: Path, peers: int, per_peer: int, names: int, body_bytes: int) -> None:
    hub = start_hub(tmp_path)
    ctx = zmq.Context()
    endpoint = hub.ready["endpoint"]  # type: ignore[attr-defined]
    flooders = [RawPeer(ctx, endpoint, f"flood{i}") for i in range(peers)]
    observer = RawPeer(ctx, endpoint, "observer")  # reads status without eating flood replies
    try:
        pid = hub.ready["pid"]  # type: ignore[attr-defined]
        for peer in [*flooders, observer]:
            peer.hello()
        base = peak = proc_rss_kb(pid)
        codes: Counter[str] = Counter()
        for peer in flooders:  # one after another: each fills its own budget, then the total
            got, seen = flood(peer, per_peer, names, b"x" * body_bytes, pid)
            codes += got
            peak = max(peak, seen)
        total = peers * per_peer
        asked: list[p.Status] = []

        def all_read() -> bool:  # `requests` counts the observer's status requests too
            asked.append(status(observer))
            return asked[-1].counters["requests"] >= total + len(asked)

        wait_for(all_read, 30, "the hub to read every request")
        st = asked[-1]
        held = sum(s.queued for s in st.services)

        def all_answered() -> bool:
            for peer in flooders:
                drain(peer, codes, 0.05)
            return sum(codes.values()) + held == total

        # every request is held or answered (`overloaded`): none is left waiting in silence
        wait_for(all_answered, 30, f"an answer to each refused request ({codes}, {held} held)")
        peak = max(peak, proc_rss_kb(pid))
        assert set(codes) == {p.OVERLOADED}, codes
        budgets = st.budgets
        assert 0 < budgets["request_bytes"].used <= budgets["request_bytes"].limit, budgets
        assert budgets["peer_request_bytes"].used <= budgets["peer_request_bytes"].limit, budgets
        assert budgets["queued_services"].used <= budgets["queued_services"].limit, budgets
        refused = sum(st.counters.get(k, 0) for k in
                      ("overloaded_peer_bytes", "overloaded_request_bytes", "overloaded_services"))
        assert refused == codes[p.OVERLOADED], (st.counters, codes)
        assert st.counters.get("overloaded_peer_bytes", 0) > 0, st.counters
        if names > budgets["queued_services"].limit:
            assert st.counters.get("overloaded_services", 0) > 0, st.counters
        if peers * budgets["peer_request_bytes"].limit > budgets["request_bytes"].limit:
            assert st.counters.get("overloaded_request_bytes", 0) > 0, st.counters
        print(f"request flood: {peers} x {per_peer} over {names} names: held {held}, refused "
              f"{codes[p.OVERLOADED]}, hub RSS {base // 1024} -> peak {peak // 1024} MiB")
        assert peak - base < RSS_BOUND_KB, (base, peak)
    finally:
        for peer in [*flooders, observer]:
            peer.close()
        ctx.term()
        hub.stop()


def test_request_flood_over_many_names_stays_within_the_budgets(tmp_path: Path) -> None:
    # 4 KiB bodies reach the 64 MiB per-peer and 128 MiB total budgets in ~13,000 requests each
    request_flood(tmp_path, peers=3, per_peer=20_000, names=1_500, body_bytes=4096)


@pytest.mark.slow
def test_request_flood_full_size(tmp_path: Path) -> None:
    """The issue's attack: 200,000 queued requests over 1,000 unserved service names."""
    request_flood(tmp_path, peers=2, per_peer=100_000, names=1_000, body_bytes=100)


# --- §5: a subscriber that never reads, big events -------------------------------------------


def stalled_subscriber(ctx: zmq.Context, events: str) -> zmq.Socket:
    """A SUB that never reads: a 1-message queue and a small kernel buffer, so what it does not
    take piles up in the hub (as far as the hub lets it)."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 1)
    sub.setsockopt(zmq.RCVBUF, 4096)
    sub.linger = 0
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(events)
    assert sub.poll(10_000), "the hub's heartbeat answering the subscription"
    sub.recv_multipart()
    return sub


def big_events_to_a_stalled_subscriber(tmp_path: Path, n: int) -> None:
    hub = start_hub(tmp_path)  # the default budget: 64 MiB per subscriber
    ctx = zmq.Context()
    publisher = RawPeer(ctx, hub.ready["endpoint"], "publisher")  # type: ignore[attr-defined]
    sub = stalled_subscriber(ctx, hub.ready["events"])  # type: ignore[attr-defined]
    try:
        pid = hub.ready["pid"]  # type: ignore[attr-defined]
        publisher.hello()
        base = peak = proc_rss_kb(pid)
        body = event_body("custom", 256 * 1024)
        for i in range(n):
            if i % 50 == 0:
                peak = max(peak, proc_rss_kb(pid))
            header = {"kind": p.EVENT, "id": f"e{i}", "type": "custom", "agent": "flood"}
            publisher.send([p.SIGNATURE, msgspec.msgpack.encode(header), body])
        too_big = event_body("custom", MiB + 1)  # over the default `max_event_bytes`
        publisher.send([p.SIGNATURE, msgspec.msgpack.encode({"kind": p.EVENT, "id": "big",
                                                             "type": "custom"}), too_big])
        st = status(publisher)  # read after every event above
        peak = max(peak, proc_rss_kb(pid))
        assert st.counters.get("oversize_events") == 1, st.counters
        assert st.counters.get("internal_errors", 0) == 0, st.counters
        # the stalled subscriber was sent stubs (empty bodies: too large for the live stream),
        # so its queue stays small; anything it missed is a gap in the seqs, and the log has
        # every event, bodies included, for a replay
        seqs, bodies = [], 0
        while sub.poll(500):
            frames = sub.recv_multipart()
            if frames[0] != p.HEARTBEAT_TOPIC:
                seqs.append(p.decode_header(frames[2]).seq)
                bodies += len(frames[3])
        assert seqs and bodies < 4096 * len(seqs), (len(seqs), bodies)
        logged = sqlite3.connect(tmp_path / "hub" / "events.db")
        try:
            (count,) = logged.execute("SELECT COUNT(*) FROM events WHERE type='custom'").fetchone()
        finally:
            logged.close()
        assert count == n
        budgets = st.budgets
        assert budgets["subscriber_messages"].limit * budgets["publish_inline_bytes"].limit \
            <= budgets["subscriber_bytes"].limit <= 64 * MiB, budgets
        published = status(publisher).counters.get("published_stubs", 0)  # after the last flush
        assert published == n, published  # 256 KiB bodies: every one a stub
        print(f"stalled subscriber, {n} x 256 KiB events: it got {len(seqs)}, hub RSS "
              f"{base // 1024} -> peak {peak // 1024} MiB")
        assert peak - base < RSS_BOUND_KB, (base, peak)
    finally:
        sub.close()
        publisher.close()
        ctx.term()
        hub.stop()


def test_stalled_subscriber_fed_big_events_stays_within_the_budget(tmp_path: Path) -> None:
    big_events_to_a_stalled_subscriber(tmp_path, 1_200)


@pytest.mark.slow
def test_stalled_subscriber_full_size(tmp_path: Path) -> None:
    big_events_to_a_stalled_subscriber(tmp_path, 4_000)


# --- §5: replay of big events, next to requests ----------------------------------------------


class Cursor(msgspec.Struct):
    """The part of a `ReplayBatch` the replayer needs (its events are skipped, not copied, so
    the replayer leaves the 2 cores to the hub and the requests being measured)."""

    upto: int
    head: int


def replayer(endpoint: str) -> None:
    """Replay the whole log again and again; print a JSON line per batch. It runs at the
    lowest CPU priority: on a 2-core machine its own decoding would otherwise delay the requests
    being measured, while the hub's work per batch (what the test is about) is unchanged."""
    os.nice(19)
    ctx = zmq.Context()
    peer = RawPeer(ctx, endpoint, "replayer")
    peer.hello()
    upto = batches = biggest = 0
    while True:
        header, frames = peer.request(p.HUB_REPLAY, p.encode(p.ReplayRequest(since=upto, limit=10_000)),
                                      timeout=30)
        assert header.kind == p.REPLY, header
        batch = msgspec.msgpack.decode(frames[0], type=Cursor)
        upto = 0 if batch.upto >= batch.head else batch.upto
        batches += 1
        biggest = max(biggest, len(frames[0]))
        if True:  # every batch: a paced replay answers only a few a second
            print(json.dumps({"ready": "replayer", "batches": batches, "biggest": biggest}),
                  flush=True)


def request_times(peer: RawPeer, n: int) -> list[float]:
    times = []
    for _ in range(n):
        started = time.perf_counter()
        header, _ = peer.request("echo", b"{}", timeout=10)
        times.append(time.perf_counter() - started)
        assert header.kind == p.REPLY, header
    return times


def p99(times: list[float]) -> float:
    return statistics.quantiles(times, n=100)[98]


class ReplayLatency(msgspec.Struct):
    idle: float  # request p99 (s) with the replayer stopped
    busy: float  # ...and while it replays
    batches: int  # replay batches answered while measuring
    biggest: int  # the largest batch (bytes)
    limit: int  # the hub's `replay_bytes`


def requests_next_to_a_replay(tmp_path: Path, *hub_flags: str) -> ReplayLatency:
    """1,000 echo requests with a back-to-back replay of 200 x 512 KiB events running, 1,000
    without, alternated 250 at a time so the machine's other load hits both alike."""
    from tests.bus.helpers import serving_peers

    hub = start_hub(tmp_path, *hub_flags)
    ctx = zmq.Context()
    endpoint = hub.ready["endpoint"]  # type: ignore[attr-defined]
    requester = RawPeer(ctx, endpoint, "requester")
    replaying: Proc | None = None
    try:
        requester.hello()
        body = event_body("custom", 512 * 1024)
        for i in range(200):  # 100 MiB of big events in the log
            requester.send([p.SIGNATURE, msgspec.msgpack.encode(
                {"kind": p.EVENT, "id": f"e{i}", "type": "custom"}), body])
        status(requester)
        with serving_peers(endpoint, 1, "--capacity", "4"):
            request_times(requester, 100)  # warm up
            replaying = Proc(py(__file__, "replay", endpoint))
            before = replaying.wait_ready(20)["batches"]
            idle_times: list[float] = []
            busy_times: list[float] = []
            for _ in range(4):
                replaying.signal(signal.SIGSTOP)
                idle_times += request_times(requester, 250)
                replaying.signal(signal.SIGCONT)
                busy_times += request_times(requester, 250)
            after = json.loads(replaying.output().splitlines()[-1])  # its latest report
            replaying.stop()
        got = ReplayLatency(p99(idle_times), p99(busy_times), after["batches"] - before,
                            after["biggest"], status(requester).budgets["replay_bytes"].limit)
        print(f"request p99 idle {got.idle * 1e3:.2f} ms, during replay {got.busy * 1e3:.2f} ms "
              f"({got.busy / got.idle:.2f}x) ({got.batches}+ batches, biggest "
              f"{got.biggest / MiB:.1f} MiB)")
        assert got.batches >= 1  # the replay ran (paced: a few batches a second)
        assert got.biggest <= got.limit + 512 * 1024 + 4096  # the cap, plus one event past it
        return got
    finally:
        if replaying is not None:
            replaying.stop()
        requester.close()
        ctx.term()
        hub.stop()


def test_replay_of_big_events_does_not_stall_requests(tmp_path: Path) -> None:
    """No replay batch stalls the routing loop (before the byte cap: 3 GB batches, 2.7 s), even
    unpaced, a batch answered as soon as it is read (the hardest case for the loop). The issue's
    2x of idle is `test_replay_of_big_events_p99_within_2x_of_idle` (slow, paced as by default):
    unpaced, measured on 2 cores, quiet, 1.6-2.7x; at load 5-10 idle p99 itself is 4-20 ms and the
    ratio mostly 0.4-1.8x, but single rounds reach 3.5x (docs/reliability.md). 4x idle + 10 ms
    still catches any stall of the loop and holds on a busy machine."""
    got = requests_next_to_a_replay(tmp_path, "--replay-pace-bytes", "0")
    assert got.batches >= 10  # unpaced: the replay ran all along
    assert got.busy <= 4 * got.idle + 0.010, got


@pytest.mark.slow
def test_replay_of_big_events_p99_within_2x_of_idle(tmp_path: Path) -> None:
    """Issue 12 §5 as stated: request p99 beside a replay of 512 KiB events within 2x of idle
    (+2 ms for the timer and scheduler on a small machine), with the hub's default pacing
    (`replay_pace_bytes`, 4 MiB/s while requests flow). Holds on a quiet machine only."""
    got = requests_next_to_a_replay(tmp_path)
    assert got.busy <= 2 * got.idle + 0.002, got


def replay_whole_log(peer: RawPeer) -> tuple[float, int]:
    """Replay the log from the start to its head: (seconds taken, events of 64 KiB or more)."""
    started = time.perf_counter()
    upto = events = 0
    while True:
        header, frames = peer.request(p.HUB_REPLAY, p.encode(p.ReplayRequest(since=upto)),
                                      timeout=30)
        assert header.kind == p.REPLY, header
        batch = msgspec.msgpack.decode(frames[0], type=p.ReplayBatch)
        events += sum(len(body) >= 65536 for _, body in batch.events)
        upto = batch.upto
        if upto >= batch.head:
            return time.perf_counter() - started, events


def test_replay_answers_are_paced_while_requests_flow_and_not_when_idle(tmp_path: Path) -> None:
    """`replay_pace_bytes`: while requests are routed, replay answers leave at that many bytes a
    second (a lower bound on the replay's time, whatever the machine's speed); on an idle bus,
    and as soon as requests stop, at once."""
    import threading

    from tests.bus.helpers import serving_peers

    pace, size, count = 1024 * 1024, 256 * 1024, 9  # 1 MiB/s: each batch (one event) 0.25 s
    hub = start_hub(tmp_path, "--replay-pace-bytes", str(pace))
    ctx = zmq.Context()
    endpoint = hub.ready["endpoint"]  # type: ignore[attr-defined]
    reader = RawPeer(ctx, endpoint, "reader")
    stop = threading.Event()
    served: list[int] = []

    def keep_requesting() -> None:
        requester = RawPeer(ctx, endpoint, "requester")
        try:
            requester.hello()
            while not stop.is_set():
                header, _ = requester.request("echo", b"{}", timeout=10)
                assert header.kind == p.REPLY, header
                served.append(1)
        finally:
            requester.close()

    try:
        reader.hello()
        body = event_body("custom", size)
        for i in range(count):
            reader.send([p.SIGNATURE, msgspec.msgpack.encode(
                {"kind": p.EVENT, "id": f"e{i}", "type": "custom"}), body])
        status(reader)  # answered after the events: they are logged
        idle_took, idle_events = replay_whole_log(reader)
        assert idle_events == count
        assert status(reader).counters.get("replay_paced", 0) == 0  # no request: none held
        with serving_peers(endpoint, 1, "--capacity", "4"):
            thread = threading.Thread(target=keep_requesting, daemon=True)
            thread.start()
            try:
                wait_for(lambda: len(served) > 10, 20, "requests to flow")
                busy_took, busy_events = replay_whole_log(reader)
                assert status(reader).budgets["replay_pace_bytes"].limit == pace
            finally:
                stop.set()
                thread.join(20)
            assert busy_events == count  # slower, nothing lost
            # the first big batch goes at once, each next one after the previous one's bytes
            least = (count - 1) * size / pace
            assert busy_took >= least * 0.99, (busy_took, least, idle_took)
            paced = status(reader).counters["replay_paced"]
            assert paced >= count - 1, paced  # all but the first big batch waited

            def unpaced_replay() -> bool:
                before = status(reader).counters["replay_paced"]
                replay_whole_log(reader)
                return status(reader).counters["replay_paced"] == before

            # requests stopped: soon (`BUSY_FOR` after the last one) no answer waits
            wait_for(unpaced_replay, 20, "a replay with no answer held back")
        assert status(reader).budgets["replay_pace_bytes"].used == 0
    finally:
        stop.set()
        reader.close()
        ctx.term()
        hub.stop()


# --- §11: a failed replay is answered; leaving is O(own requests) ----------------------------


def test_replay_that_fails_on_a_database_error_is_answered(tmp_path: Path) -> None:
    # the log's reader is what fails: no recent events in memory, which would answer instead
    hub = start_hub(tmp_path, "--recent-bytes", "0")
    ctx = zmq.Context()
    peer = RawPeer(ctx, hub.ready["endpoint"], "reader")  # type: ignore[attr-defined]
    try:
        peer.hello()
        assert status(peer).seq > 0  # the hub has stamped events (peer_joined)...
        db = sqlite3.connect(tmp_path / "hub" / "events.db")  # someone breaks the log
        # ...and committed them: a replay from 0 must read the log (a replay from the head is
        # answered without reading it)
        wait_for(lambda: db.execute("SELECT COUNT(*) FROM events").fetchone()[0] > 0, 10,
                 "the hub to commit its first event")
        db.execute("DROP TABLE events")
        db.commit()
        db.close()
        started = time.monotonic()
        header, _ = peer.request(p.HUB_REPLAY, p.encode(p.ReplayRequest()), timeout=20)
        assert time.monotonic() - started < 2
        assert header.kind == p.ERROR and header.code == p.HANDLER_ERROR, header
        assert "`hub.replay` could not read the event log" in header.error
        assert "no such table" in header.error
        assert status(peer).counters["replay_errors"] == 1
    finally:
        peer.close()
        ctx.term()
        hub.stop()


def test_requester_leaving_with_ten_thousand_queued_requests_is_quick(tmp_path: Path) -> None:
    """Leaving costs the hub no more than the same requests cost arriving (it was O(n^2):
    each queued request was searched for in its queue)."""
    hub = start_hub(tmp_path)
    ctx = zmq.Context()
    peer = RawPeer(ctx, hub.ready["endpoint"], "leaver")  # type: ignore[attr-defined]
    try:
        peer.hello()
        deadline = time.time() + 120
        started = time.perf_counter()
        for i in range(10_000):  # the default `queue_limit`, all to one unserved service
            peer.send([p.SIGNATURE, msgspec.msgpack.encode(
                {"kind": p.REQUEST, "id": f"q{i}", "service": "nobody", "deadline": deadline}), b""])
        st = status(peer)  # answered after all of them (one connection is read in order)
        arrive = time.perf_counter() - started
        assert [s.queued for s in st.services if s.name == "nobody"] == [10_000]
        started = time.perf_counter()
        peer.send([p.SIGNATURE, p.encode(p.Header(kind=p.BYE))])
        peer.hello()
        st = status(peer)
        leave = time.perf_counter() - started
        print(f"10,000 queued requests: arriving {arrive * 1e3:.0f} ms, leaving {leave * 1e3:.0f} ms")
        assert not [s for s in st.services if s.name == "nobody"]
        assert st.budgets["request_bytes"].used < 10_000  # released (only the status request)
        assert leave < arrive, (arrive, leave)
    finally:
        peer.close()
        ctx.term()
        hub.stop()


def test_every_way_of_starting_a_hub_refuses_an_exposed_bind_without_curve() -> None:
    from agent_bus.bus.hub import Hub, HubConfig, HubConfigError

    with pytest.raises(HubConfigError, match="refusing to bind `endpoint` tcp://0.0.0.0:0 "
                                              "without CURVE"):
        Hub(HubConfig(endpoint="tcp://0.0.0.0:0"))
    with pytest.raises(HubConfigError, match="refusing to bind `events`"):
        Hub(HubConfig(endpoint="tcp://127.0.0.1:0", events="tcp://0.0.0.0:0"))
    with pytest.raises(HubConfigError, match="hub budget `replay_bytes` is 0"):
        Hub(HubConfig(endpoint="tcp://127.0.0.1:0", replay_bytes=0))
    proc = Proc(busctl("hub", "--hub", "tcp://0.0.0.0:0"))
    try:
        assert proc.popen.wait(10) == 2
        wait_for(lambda: "Error:" in proc.output(), 5, "the error line")
        out = proc.output()
        assert "refusing to bind" in out and "tcp://0.0.0.0:0" in out and "CURVE" in out, out
        assert "Traceback" not in out, out
    finally:
        proc.stop()


# --- §3 (hub): a call that hangs every worker it reaches ------------------------------------


HEARTBEAT = 0.2
LIVENESS = 3


def frozen(pid: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        return any(line.startswith("State:") and "stopped" in line for line in f)


@pytest.mark.parametrize("max_redispatch", [1, 0])
@pytest.mark.anyio
async def test_a_call_that_hangs_its_workers_is_redispatched_at_most_n_times(
        tmp_path: Path, max_redispatch: int) -> None:
    from agent_bus.bus.client import connect
    from agent_bus.bus.errors import PeerLost

    hub = Proc(busctl("hub", "--hub", "tcp://127.0.0.1:0", "--state-dir", str(tmp_path / "hub"),
                      "--heartbeat-interval", str(HEARTBEAT), "--liveness", str(LIVENESS),
                      "--max-redispatch", str(max_redispatch)))
    workers: list[Proc] = []
    try:
        endpoint = hub.wait_ready()["endpoint"]
        for i in range(3):
            # unsandboxed: the tool SIGSTOPs its own worker, which as the first process of a
            # sandbox's PID namespace would ignore a signal it has no handler for
            workers.append(Proc(busctl("worker", "--hub", endpoint, "--tools", FREEZE_TOOLS,
                                       "--name", f"w{i}", "--sandbox", "off")))
        for worker in workers:
            worker.wait_ready()
        async with connect(endpoint, name="requester") as bus:
            body = msgspec.msgpack.encode({"call_id": "c1", "name": "freeze",
                                           "arguments": '{"tag": "x"}'})
            started = time.monotonic()
            with pytest.raises(PeerLost) as failed:
                await bus.request("tool.freeze", body, timeout=30)
            took = time.monotonic() - started
            message = str(failed.value)
            assert "`tool.freeze`" in message and "`max_redispatch`" in message, message
            assert f"lost {max_redispatch + 1} peers" in message, message
            # one worker per dispatch went down, each noticed within the liveness window
            assert took < (max_redispatch + 1) * (HEARTBEAT * LIVENESS + 1.0), took
            assert sum(frozen(w.pid) for w in workers) == max_redispatch + 1
            st = await bus.status()
            assert st.counters.get("redispatch_refused") == 1, st.counters
            alive = [peer.name for peer in st.peers if peer.name.startswith("w")]
            assert len(alive) == 3 - (max_redispatch + 1), alive
    finally:
        for worker in workers:
            worker.signal(signal.SIGCONT)
            worker.stop()
        hub.stop()


if __name__ == "__main__" and sys.argv[1:2] == ["replay"]:
    try:
        replayer(sys.argv[2])
    except KeyboardInterrupt:
        pass
