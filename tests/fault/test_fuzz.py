"""Hostile input on every socket, with real processes (issue 8, point 4).

Property-based (hypothesis, bounded and derandomized) fuzzing of:
- the hub's ROUTER, from a stranger and from a peer that said hello (frames, headers, and the
  bodies of hello / register / unregister / event / hub.replay requests);
- the hub's event PUB socket (XSUB-style subscription frames and raw TCP garbage);
- a peer's DEALER as seen from the hub side: a rogue hub that a client process and a real tool
  worker connect to, and that sends them garbage;
- the gateway, a tool worker and the coordinator receiving hostile request bodies (LlmRequest,
  ToolCallRequest, agent commands) and hostile event bodies through a real hub.

What must hold: no process dies; each bad message is counted (hub counters, the client's
`peer.counters`) or answered with an error reply (`bad_request` / `handler_error`); memory
(VmRSS) stays bounded; every process still serves a normal request afterwards. A frame over the
size limit disconnects only its sender.

Run as a script (`python tests/fault/test_fuzz.py peer ENDPOINT`) it is the client process the
rogue-hub test connects to.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":  # the helper peer process: make `bus` and `tests` importable
    sys.path.insert(0, str(ROOT))

from agent_bus.bus import protocol as p  # noqa: E402
from tests.support import busctl, until  # noqa: E402

if __name__ != "__main__":
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    from tests.support import Proc, busctl, py, wait_for

    SETTINGS = settings(max_examples=120, deadline=None, derandomize=True, database=None,
                        # no shrinking: a failing example is reported as found (each check
                        # can wait seconds, so shrinking would take minutes)
                        phases=[Phase.explicit, Phase.generate],
                        suppress_health_check=list(HealthCheck))

LIMIT = 65536  # the fuzzed hub's --max-message-bytes; MAXMSGSIZE (one frame) is LIMIT + 64 KiB
FRAME_LIMIT = LIMIT + 65536  # a bigger frame makes libzmq drop the sender's connection
BAD_COUNTERS = ("malformed", "wrong_version", "unknown_kind", "oversize", "unknown_peer",
                "bad_register", "bad_request", "unexpected_kind", "internal_errors")
HERE = Path(__file__).resolve().parent
MY_TOOLS = str(ROOT / "tests" / "coordinator" / "fixtures" / "my_tools.py")


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def _pack(obj: Any) -> bytes:
    return msgspec.msgpack.encode(obj)


# --- a synchronous raw peer ---------------------------------------------------------------


class RawPeer:
    """A DEALER speaking AGB/1 by hand (no client library), for driving and inspecting a hub."""

    def __init__(self, ctx: zmq.Context, endpoint: str, name: str = "raw") -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.connect(endpoint)
        self.name = name

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def hello(self, timeout: float = 5.0) -> p.Welcome:
        hid = p.new_id()
        self.send([p.SIGNATURE, p.encode(p.Header(kind=p.HELLO, id=hid)),
                   p.encode(p.Hello(name=self.name, session=p.new_session()))])
        header, frames = self.wait(lambda h: h.kind == p.WELCOME and h.id == hid, timeout)
        return p.decode(frames[0], p.Welcome)

    def wait(self, match: Any, timeout: float) -> tuple[p.Header, list[bytes]]:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if not self.sock.poll(left * 1000):
                break
            frames = self.sock.recv_multipart()
            try:
                header = p.decode_header(frames[1])
            except (msgspec.DecodeError, msgspec.ValidationError, IndexError):
                continue
            if match(header):
                return header, frames[2:]
        raise TimeoutError(f"{self.name}: no matching message within {timeout}s")

    def request(self, service: str, body: bytes = b"", timeout: float = 5.0,
                **header: Any) -> tuple[p.Header, list[bytes]]:
        for attempt in range(2):
            rid = p.new_id()
            fields = {"kind": p.REQUEST, "id": rid, "service": service,
                      "deadline": time.time() + timeout, **header}
            self.send([p.SIGNATURE, _pack(fields), body])
            got = self.wait(lambda h: h.id == rid and h.kind in (p.REPLY, p.ERROR), timeout + 1)
            if got[0].code != p.HUB_LOST or attempt:
                return got
            self.hello()  # idle past the liveness window (a raw peer sends no heartbeats)
        raise AssertionError("unreachable")

    def counters(self) -> dict[str, int]:
        header, frames = self.request(p.HUB_STATUS)
        assert header.kind == p.REPLY, header
        return p.decode(frames[0], p.Status).counters

    def close(self) -> None:
        self.sock.close(0)


def bad_total(counters: dict[str, int]) -> int:
    return sum(counters.get(k, 0) for k in BAD_COUNTERS)


# --- hostile values -------------------------------------------------------------------------

if __name__ != "__main__":
    _scalars = st.one_of(
        st.none(), st.booleans(),
        st.integers(min_value=-(2**63), max_value=2**64 - 1),
        st.sampled_from([0, -1, 2**31, 2**63 - 1, 2**64 - 1, -(2**63)]),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=40),
        st.sampled_from(["", "hub.status", "hub.replay", "hub.x", "\x00", "é" * 1000,
                         "agent/../../x", "x" * 70_000]),
        st.binary(max_size=40),
    )
    #: wrong types, huge strings, deep-ish nesting, negative/huge numbers, NaN/inf
    hostile = st.recursive(
        _scalars,
        lambda kids: st.one_of(st.lists(kids, max_size=4),
                               st.dictionaries(st.text(max_size=8), kids, max_size=4)),
        max_leaves=12,
    )
    _kinds = st.one_of(st.sampled_from(sorted(p.KINDS) + ["", "frob", "REQUEST", "hello "]),
                       st.text(max_size=12), hostile)
    _header_keys = st.sampled_from(list(p.Header.__struct_fields__) + ["zz", "", "kind "])
    headers = st.builds(
        lambda kind, extra: {"kind": kind, **extra},
        _kinds, st.dictionaries(_header_keys, hostile, max_size=6),
    )
    _bodies = st.one_of(st.binary(max_size=64), hostile.map(_pack),
                        st.integers(0, 100_000).map(lambda n: b"\x92" + b"x" * n))

    @st.composite
    def messages(draw: Any) -> list[bytes]:
        """One multipart message as a DEALER would send it (no routing id)."""
        shape = draw(st.integers(0, 9))
        if shape == 0:  # random frames
            return draw(st.lists(st.binary(max_size=64), min_size=1, max_size=5))
        if shape == 1:  # wrong signature, good header
            sig = draw(st.sampled_from([b"AGB/2", b"AGB/0", b"agb/1", b"", b"AGB/1\x00"]))
            return [sig, p.encode(p.Header(kind=p.HEARTBEAT))]
        if shape == 2:  # signature only / header only
            return [p.SIGNATURE]
        if shape == 3:  # a header that is not a map / not msgpack
            return [p.SIGNATURE, draw(_bodies), *draw(st.lists(_bodies, max_size=2))]
        header = draw(headers)
        return [p.SIGNATURE, _pack(header), *draw(st.lists(_bodies, max_size=3))]


# --- the fuzzed hub -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fuzz_hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    state = tmp_path_factory.mktemp("fuzzhub")
    proc = Proc(busctl("hub", "--hub", "tcp://127.0.0.1:0", "--state-dir", str(state), "--max-message-bytes",
                   str(LIMIT), "--log-level", "CRITICAL"))
    try:
        info = proc.wait_ready()
        info["proc"] = proc
        ctx = zmq.Context()
        info["ctx"] = ctx
        admin = RawPeer(ctx, info["endpoint"], "admin")
        admin.hello()
        info["admin"] = admin
        try:
            yield info
        finally:
            admin.close()
            ctx.term()
    finally:
        proc.stop()


def _alive_and_serving(info: dict[str, Any]) -> None:
    """The hub process is alive and routes a request from a new peer to a new server."""
    assert info["proc"].popen.poll() is None, info["proc"].output()[-2000:]
    ctx = info["ctx"]
    server, client = RawPeer(ctx, info["endpoint"], "srv"), RawPeer(ctx, info["endpoint"], "cli")
    try:
        server.hello()
        client.hello()
        server.send([p.SIGNATURE, p.encode(p.Header(kind=p.REGISTER)),
                     p.encode(p.Register([p.ServiceSpec("fuzz.echo")]))])
        server.request(p.HUB_STATUS)  # same connection, in order: registered
        rid = p.new_id()
        client.send([p.SIGNATURE, _pack({"kind": p.REQUEST, "id": rid, "service": "fuzz.echo",
                                         "deadline": time.time() + 5}), b"ping"])
        header, frames = server.wait(lambda h: h.kind == p.REQUEST and h.id == rid, 5)
        server.send([p.SIGNATURE, p.encode(p.Header(kind=p.REPLY, id=rid)), b"pong:" + frames[0]])
        header, frames = client.wait(lambda h: h.id == rid, 5)
        assert (header.kind, frames) == (p.REPLY, [b"pong:ping"])
    finally:
        for peer in (server, client):
            peer.send([p.SIGNATURE, p.encode(p.Header(kind=p.BYE))])
            peer.close()


def test_hub_router_counts_every_message_from_a_stranger(fuzz_hub: dict[str, Any]) -> None:
    """A connection that never said hello: whatever it sends is counted exactly once."""
    admin: RawPeer = fuzz_hub["admin"]
    stranger = RawPeer(fuzz_hub["ctx"], fuzz_hub["endpoint"], "stranger")
    rss0 = rss_kb(fuzz_hub["pid"])
    sent = 0

    @SETTINGS
    @given(msg=messages())
    def one(msg: list[bytes]) -> None:
        nonlocal sent
        if len(msg) > 1 and msg[0] == p.SIGNATURE:  # a stranger's hello would make it a peer
            try:
                if p.decode_header(msg[1]).kind == p.HELLO:
                    msg[1] = _pack({"kind": "helo"})
            except (msgspec.DecodeError, msgspec.ValidationError):
                pass
        if max(map(len, msg)) > FRAME_LIMIT:
            return  # libzmq drops the connection: test_frame_over_the_size_limit_...
        before = bad_total(admin.counters())
        stranger.send(msg)
        sent += 1
        after = wait_for(lambda: (n := bad_total(admin.counters())) > before and n, 2,
                         f"the hub to count {msg!r:.200}")
        assert after == before + 1, f"counted {after - before} times: {msg!r:.200}"

    try:
        one()
        assert admin.counters().get("internal_errors", 0) == 0
        _alive_and_serving(fuzz_hub)
        growth = rss_kb(fuzz_hub["pid"]) - rss0
        print(f"{sent} hostile messages; hub VmRSS growth {growth} kB")
        assert growth < 50_000
    finally:
        stranger.close()


# bodies of the control messages a known peer may send, and of the built-in services
if __name__ != "__main__":
    _spec = st.fixed_dictionaries({}, optional={
        "name": hostile, "capacity": hostile, "idempotent": hostile, "meta": hostile})
    control_bodies = st.one_of(
        st.tuples(st.just(p.HELLO), st.fixed_dictionaries({}, optional={
            "name": hostile, "session": hostile, "pid": hostile, "host": hostile,
            "role": hostile})),
        st.tuples(st.just(p.REGISTER), st.one_of(
            hostile, st.fixed_dictionaries({"services": st.lists(st.one_of(_spec, hostile),
                                                                 max_size=3)}))),
        st.tuples(st.just(p.UNREGISTER), st.one_of(
            hostile, st.fixed_dictionaries({"services": st.lists(hostile, max_size=3)}))),
        st.tuples(st.just("replay"), st.one_of(hostile, st.fixed_dictionaries({}, optional={
            "since": hostile, "limit": hostile, "topics": hostile}))),
    )

    def _valid(body: bytes, type_: type) -> Any:
        try:
            return p.decode(body, type_)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None


def test_hub_router_control_bodies_from_a_known_peer(fuzz_hub: dict[str, Any]) -> None:
    """Hello / register / unregister / hub.replay bodies: a bad one is counted (or, for a
    request, answered); the peer stays known; the hub keeps serving."""
    admin: RawPeer = fuzz_hub["admin"]
    peer = RawPeer(fuzz_hub["ctx"], fuzz_hub["endpoint"], "fuzzer")
    peer.hello()
    rss0 = rss_kb(fuzz_hub["pid"])

    @SETTINGS
    @given(item=control_bodies)
    def one(item: tuple[str, Any]) -> None:
        kind, value = item
        body = _pack(value)
        if len(body) > FRAME_LIMIT:
            return  # libzmq drops the connection: test_frame_over_the_size_limit_...
        before = admin.counters()
        if kind == "replay":
            request = _valid(body, p.ReplayRequest)
            if request is None:
                return  # covered by test_hub_replay_with_a_bad_body_gets_an_error_reply
            header, frames = peer.request(p.HUB_REPLAY, body)
            assert header.kind == p.REPLY, header
            batch = p.decode(frames[0], p.ReplayBatch)
            assert batch.upto <= batch.head
            return
        peer.send([p.SIGNATURE, p.encode(p.Header(kind=kind, id=p.new_id())), body])
        typed = {p.HELLO: p.Hello, p.REGISTER: p.Register, p.UNREGISTER: p.Unregister}[kind]
        decoded = _valid(body, typed)
        bad = decoded is None or (kind == p.REGISTER and any(
            not s.name or s.name.startswith("hub.") or s.capacity < 1 for s in decoded.services))
        # in order on this connection: the status answer comes after the message was handled
        header, frames = peer.request(p.HUB_STATUS)
        assert header.kind == p.REPLY, f"the peer was forgotten after {kind} {value!r:.200}"
        after = p.decode(frames[0], p.Status).counters
        if bad:
            assert bad_total(after) > bad_total(before), f"{kind} {value!r:.200} not counted"
        if kind == p.HELLO and decoded is not None:
            return
        if kind == p.REGISTER and decoded is not None:  # do not keep serving garbage names
            names = [s.name for s in decoded.services if s.name and not s.name.startswith("hub.")]
            peer.send([p.SIGNATURE, p.encode(p.Header(kind=p.UNREGISTER)),
                       p.encode(p.Unregister(names))])

    try:
        one()
        assert admin.counters().get("internal_errors", 0) == 0
        _alive_and_serving(fuzz_hub)
        growth = rss_kb(fuzz_hub["pid"]) - rss0
        print(f"hub VmRSS growth {growth} kB")
        assert growth < 50_000
    finally:
        peer.close()


def test_hub_replay_with_a_bad_body_gets_an_error_reply(fuzz_hub: dict[str, Any]) -> None:
    peer = RawPeer(fuzz_hub["ctx"], fuzz_hub["endpoint"], "replayer")
    try:
        peer.hello()
        for body in (b"\xc1", _pack({"since": "zero"}), _pack([1, 2, 3])):
            header, _ = peer.request(p.HUB_REPLAY, body, timeout=1.0)
            assert (header.kind, header.code) == (p.ERROR, p.BAD_REQUEST), (body, header)
        # A `since` past the head (even beyond SQLite's int64) is just "nothing newer".
        for body in (_pack({"since": 2**64 - 1}), _pack({"since": 2**63})):
            header, frames = peer.request(p.HUB_REPLAY, body, timeout=1.0)
            assert header.kind == p.REPLY, (body, header)
            assert p.decode(frames[0], p.ReplayBatch).events == []
    finally:
        peer.close()


def test_nan_deadline_does_not_stop_deadline_enforcement(hub: dict[str, Any]) -> None:
    ctx = zmq.Context()  # its own hub: the NaN poisons the deadline heap for good
    peer = RawPeer(ctx, hub["endpoint"], "nan")
    try:
        peer.hello()
        for i in range(3):
            peer.send([p.SIGNATURE, _pack({"kind": p.REQUEST, "id": f"nan{i}{p.new_id()}",
                                           "service": f"nobody.nan{i}",
                                           "deadline": float("nan")}), b""])
        t0 = time.monotonic()
        header, _ = peer.request("nobody.later", timeout=0.5)
        assert (header.kind, header.code) == (p.ERROR, p.NO_SERVICE)
        assert time.monotonic() - t0 < 1.5
    finally:
        peer.close()
        ctx.term()


def test_deeply_nested_header_is_counted_malformed(fuzz_hub: dict[str, Any]) -> None:
    admin: RawPeer = fuzz_hub["admin"]
    before = admin.counters()
    deep = b"\x91" * 60_000 + b"\xc0"
    stranger = RawPeer(fuzz_hub["ctx"], fuzz_hub["endpoint"], "deep")
    try:
        stranger.send([p.SIGNATURE, b"\x82\xa4kind\xa9heartbeat\xa1x" + deep])
        after = wait_for(lambda: (c := admin.counters()) and bad_total(c) > bad_total(before)
                         and c, 5, "the deep header to be counted")
        assert after.get("malformed", 0) == before.get("malformed", 0) + 1, after
        assert after.get("internal_errors", 0) == before.get("internal_errors", 0)
    finally:
        stranger.close()


def test_event_socket_survives_garbage_subscriptions_and_raw_bytes(
        fuzz_hub: dict[str, Any]) -> None:
    """The PUB socket only reads subscription frames: random ones, floods of distinct topics,
    a frame over its 64 KiB MAXMSGSIZE (that connection is dropped), and non-ZMTP bytes on both
    ports. A normal subscriber keeps receiving, the hub stays within memory bounds."""
    ctx: zmq.Context = fuzz_hub["ctx"]
    rss0 = rss_kb(fuzz_hub["pid"])
    good = ctx.socket(zmq.SUB)
    good.linger = 0
    good.setsockopt(zmq.SUBSCRIBE, b"ext/")
    good.connect(fuzz_hub["events"])
    xsubs: list[zmq.Socket] = []

    @SETTINGS
    @given(frames=st.lists(st.one_of(
        st.binary(max_size=80),
        st.binary(max_size=80).map(lambda b: b"\x01" + b),  # subscribe
        st.binary(max_size=80).map(lambda b: b"\x00" + b),  # unsubscribe
        st.integers(60_000, 70_000).map(lambda n: b"\x01" + b"t" * n),  # around MAXMSGSIZE
    ), min_size=1, max_size=20))
    def one(frames: list[bytes]) -> None:
        xsub = ctx.socket(zmq.XSUB)
        xsub.linger = 0
        xsub.connect(fuzz_hub["events"])
        for frame in frames:
            xsub.send(frame)
        xsubs.append(xsub)
        if len(xsubs) > 20:
            xsubs.pop(0).close(0)

    try:
        one()
        flood = ctx.socket(zmq.XSUB)  # 20,000 distinct subscriptions on one connection
        flood.linger = 0
        flood.connect(fuzz_hub["events"])
        for i in range(20_000):
            flood.send(b"\x01flood/%d/" % i)
        xsubs.append(flood)
        for port_endpoint in (fuzz_hub["endpoint"], fuzz_hub["events"]):
            host, port = port_endpoint[6:].rsplit(":", 1)
            for blob in (os.urandom(4096), b"\xff" + b"\x00" * 8 + b"\x7f" + os.urandom(100),
                         b"GET / HTTP/1.0\r\n\r\n"):
                with socket.create_connection((host, int(port)), timeout=5) as raw:
                    raw.sendall(blob)
        # a real subscriber still gets events
        admin: RawPeer = fuzz_hub["admin"]
        got: list[bytes] = []

        def delivered() -> bool:
            # A raw peer sends no heartbeats: after the fuzzing above (seconds on a loaded
            # machine) the hub may have expired it, and its events are refused until it says
            # hello again.
            admin.hello()
            admin.send([p.SIGNATURE, p.encode(p.Header(kind=p.EVENT, type="topic_message")),
                        p.encode({"type": "topic_message", "topic": "t", "text": "hi"})])
            while good.poll(50):
                got.append(good.recv_multipart()[0])
            return any(t.startswith(b"ext/") for t in got)

        wait_for(delivered, 10, "an event on the good subscriber")
        _alive_and_serving(fuzz_hub)
        growth = rss_kb(fuzz_hub["pid"]) - rss0
        print(f"hub VmRSS growth after subscription fuzzing {growth} kB")
        assert growth < 50_000
    finally:
        for s in xsubs:
            s.close(0)
        good.close(0)


def test_frame_over_the_size_limit_disconnects_only_its_sender(fuzz_hub: dict[str, Any]) -> None:
    """A frame over MAXMSGSIZE: libzmq drops that connection; the hub drops that peer (and only
    it); others keep being served while it happens. A whole message over the limit (frames
    under it) is counted `oversize` and dropped; its sender stays connected."""
    ctx: zmq.Context = fuzz_hub["ctx"]
    admin: RawPeer = fuzz_hub["admin"]
    big = RawPeer(ctx, fuzz_hub["endpoint"], "big")
    welcome = big.hello()
    before = admin.counters()
    # message over the limit, frames under it: counted, sender kept
    big.send([p.SIGNATURE, p.encode(p.Header(kind=p.EVENT, type="topic_message")),
              b"x" * (LIMIT // 2), b"y" * (LIMIT // 2 + 10)])
    wait_for(lambda: admin.counters().get("oversize", 0) > before.get("oversize", 0), 5,
             "oversize to be counted")
    assert big.request(p.HUB_STATUS)[0].kind == p.REPLY
    # one frame over MAXMSGSIZE: that connection goes
    big.send([p.SIGNATURE, p.encode(p.Header(kind=p.HEARTBEAT)), b"z" * (LIMIT + 70_000)])

    def gone() -> bool:
        header, frames = admin.request(p.HUB_STATUS)
        return all(peer.peer != welcome.peer for peer in p.decode(frames[0], p.Status).peers)

    wait_for(gone, 5, "the hub to drop the oversize sender")
    big.close()
    _alive_and_serving(fuzz_hub)  # others: a fresh pair is served, the admin peer still known
    assert admin.request(p.HUB_STATUS)[0].kind == p.REPLY


# --- a rogue hub: garbage into a peer's DEALER ---------------------------------------------


class RogueHub:
    """A ROUTER that plays hub for one client: welcome, then whatever the test sends."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.idents: dict[str, bytes] = {}  # hello name -> routing id

    def pump(self, timeout: float, until: Any = None) -> Any:
        """Handle hellos (welcome) for `timeout` s, or until `until(ident, header, frames)`."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if not self.sock.poll(left * 1000):
                break
            ident, *frames = self.sock.recv_multipart()
            try:
                header = p.decode_header(frames[1])
            except Exception:
                continue
            if header.kind == p.HELLO:
                hello = p.decode(frames[2], p.Hello)
                self.idents[hello.name] = ident
                welcome = p.Welcome(peer=ident.hex(), hub_session="rogue", events="tcp://127.0.0.1:9",
                                    heartbeat_interval=1.0, liveness=30, max_message_bytes=LIMIT)
                self.sock.send_multipart([ident, p.SIGNATURE, p.encode(
                    p.Header(kind=p.WELCOME, id=header.id)), p.encode(welcome)])
            if header.kind == p.REQUEST and header.service == p.HUB_STATUS:
                status = p.Status("rogue", "", "", 0.0, 0, [], [], {})
                self.sock.send_multipart([ident, p.SIGNATURE, p.encode(
                    p.Header(kind=p.REPLY, id=header.id)), p.encode(status)])
            if until is not None and (got := until(ident, header, frames[2:])):
                return got
        if until is not None:
            raise TimeoutError("rogue hub: no matching message")
        return None

    def request(self, name: str, service: str, body: bytes, timeout: float = 10) -> tuple[p.Header, list[bytes]]:
        rid = p.new_id()
        self.sock.send_multipart([self.idents[name], p.SIGNATURE, _pack(
            {"kind": p.REQUEST, "id": rid, "service": service, "deadline": time.time() + timeout}),
            body])
        return self.pump(timeout, lambda i, h, f: h.id == rid and h.kind in (p.REPLY, p.ERROR)
                         and (h, f))

    def send(self, name: str, frames: list[bytes]) -> None:
        self.sock.send_multipart([self.idents[name], *frames])


if __name__ != "__main__":
    #: what a rogue hub may send a peer; valid welcome / reconnect are left out (they are
    #: protocol, a re-handshake, not garbage)
    @st.composite
    def to_peer(draw: Any) -> list[bytes]:
        msg = draw(messages())
        if len(msg) > 1 and msg[0] == p.SIGNATURE:
            try:
                kind = p.decode_header(msg[1]).kind
            except (msgspec.DecodeError, msgspec.ValidationError):
                return msg
            if kind == p.RECONNECT or (kind == p.WELCOME and len(msg) > 2
                                       and _valid(msg[2], p.Welcome) is not None):
                msg[1] = _pack({"kind": "welcom"})
        return msg


def test_peer_dealer_survives_a_rogue_hub(tmp_path: Path) -> None:
    """A client process and a real tool worker connect to a rogue hub that sends them fuzzed
    frames. Each bad message is counted by the client (`peer.counters`: malformed, unknown_kind,
    stale_replies, unserved_requests); both keep serving requests; memory stays bounded."""
    ctx = zmq.Context()
    rogue = RogueHub(ctx)
    client = Proc(py(__file__, "peer", rogue.endpoint))
    worker = Proc(busctl("worker", "--hub", rogue.endpoint, "--tools", MY_TOOLS, "--name",
                         "fuzzworker", "--workspace", str(tmp_path)))
    try:
        def ready(proc: Proc) -> bool:
            return any(line.startswith('{"ready"') for line in proc.lines)

        deadline = time.monotonic() + 20
        while not (ready(client) and ready(worker)):  # answer hellos and hub.status meanwhile
            assert time.monotonic() < deadline, client.output() + worker.output()
            rogue.pump(0.05)
        rss0 = {proc.pid: rss_kb(proc.pid) for proc in (client, worker)}

        def counters() -> dict[str, int]:
            header, frames = rogue.request("fuzzpeer", "counters", b"")
            assert header.kind == p.REPLY, header
            return json.loads(frames[0])

        @SETTINGS
        @given(msg=to_peer())
        def one(msg: list[bytes]) -> None:
            before = counters()
            rogue.send("fuzzpeer", msg)
            rogue.send("fuzzworker", msg)
            after = counters()  # in order on the connection: the garbage was handled first
            grew = sum(after.values()) - sum(before.values())
            kind = None
            if len(msg) > 1 and msg[0] == p.SIGNATURE:
                try:
                    kind = p.decode_header(msg[1]).kind
                except (msgspec.DecodeError, msgspec.ValidationError):
                    pass
            silent = {p.HEARTBEAT, p.CANCEL}  # legitimately nothing to count
            served = kind == p.REQUEST and "echo" in msg[1].decode("latin-1")
            if kind not in silent and not served:
                assert grew >= 1, f"not counted: {msg!r:.300} ({before} -> {after})"

        one()
        for proc in (client, worker):
            assert proc.popen.poll() is None, proc.output()[-3000:]
        header, frames = rogue.request("fuzzpeer", "echo", b"still here")
        assert (header.kind, frames) == (p.REPLY, [b"still here"])
        call = p.encode(msgspec.msgpack.decode(_pack({"call_id": "c1", "name": "echo",
                                                      "arguments": '{"text": "alive"}'})))
        header, frames = rogue.request("fuzzworker", "tool.echo", call)
        assert header.kind == p.REPLY, header
        assert msgspec.msgpack.decode(frames[0])["content"][0]["text"] == "alive"
        for proc in (client, worker):
            growth = rss_kb(proc.pid) - rss0[proc.pid]
            print(f"{proc.args[1]} VmRSS growth {growth} kB")
            assert growth < 50_000
        print("client counters:", counters())
    finally:
        client.stop()
        worker.stop()
        rogue.sock.close(0)
        ctx.term()


# --- hostile request and event bodies through a real hub ----------------------------------

STACK_AGENTS = """
[[agents]]
name = "fz"
model = "x"
tools = ["echo"]

[[agents]]
name = "listener"
model = "x"
tools = []
subscribe = [{ topic = "news" }]
"""

if __name__ != "__main__":
    _str = st.one_of(st.text(max_size=30), st.just("x" * 70_000), hostile)
    _message = st.one_of(
        hostile,
        st.fixed_dictionaries({"role": st.sampled_from(
            ["user", "assistant", "tool_result", "custom", "compaction_summary", "system", "x"])},
            optional={"content": st.one_of(hostile, st.lists(st.one_of(hostile, st.fixed_dictionaries(
                {"type": st.sampled_from(["text", "image", "thinking", "tool_call", "video"])},
                optional={"text": _str, "data": hostile, "id": _str, "name": _str,
                          "arguments": _str})), max_size=3)),
                "tool_call_id": _str, "tool_name": _str, "stop_reason": hostile,
                "timestamp": hostile, "usage": hostile}),
    )
    llm_bodies = st.one_of(hostile, st.fixed_dictionaries(
        {"messages": st.lists(_message, max_size=3)},
        optional={"model": st.one_of(st.just("x"), _str), "system_prompt": _str,
                  "tools": st.one_of(hostile, st.lists(st.fixed_dictionaries(
                      {"name": hostile}, optional={"parameters": hostile}), max_size=2)),
                  "tool_choice": hostile, "reasoning": hostile, "max_tokens": hostile,
                  "temperature": hostile, "agent": _str, "run_id": _str,
                  "retry": st.fixed_dictionaries({}, optional={
                      "max_attempts": hostile, "base_delay": hostile, "max_delay": hostile,
                      "retry_statuses": hostile})}))
    tool_bodies = st.one_of(hostile, st.fixed_dictionaries(
        {"call_id": _str, "name": st.one_of(st.just("echo"), _str)},
        optional={"arguments": st.one_of(hostile, st.sampled_from(
            ['{"text": "x"}', "{", "[]", '{"text": 5}', '{"text": "' + "y" * 100_000 + '"}',
             '{"nope": 1}', "null", "1e999", '{"text": "a", "text": "b"}', "[" * 5000])),
            "agent": _str, "run_id": _str, "experiment": _str}))
    agent_bodies = st.one_of(hostile, st.fixed_dictionaries(
        {"command": st.one_of(st.sampled_from(["prompt", "continue", "steer", "follow_up",
                                               "abort", "reset", "state", "frob", ""]), hostile)},
        optional={"text": _str, "messages": st.lists(_message, max_size=2),
                  "experiment": _str, "parent_run_id": _str, "new_session": hostile,
                  "call_chain": hostile}))
    event_bodies = st.tuples(
        st.sampled_from(["topic_message", "agent_start", "turn_end", "message_update", "gap",
                         "nope", "tool_execution_end"]),
        st.one_of(st.binary(max_size=64), hostile.map(_pack), st.fixed_dictionaries(
            {"type": st.sampled_from(["topic_message", "agent_end", "zzz"])},
            optional={"topic": st.one_of(st.just("news"), hostile), "text": hostile,
                      "sender": hostile, "turn": hostile}).map(_pack)))

# the coordinator refuses a nonsense command with one of these (agents/coordinator/process.py)
OK_CODES = {p.BAD_REQUEST, p.HANDLER_ERROR, "agent_busy", "invalid", "call_cycle", "call_depth",
            "idle", "ambiguous", "unknown_session", "no_run", "aborted"}


def test_services_survive_hostile_request_and_event_bodies(tmp_path: Path) -> None:
    """Gateway (`llm`), tool worker (`tool.echo`) and coordinator (`agent.fz`) get fuzzed bodies
    through a real hub; garbage events (topic_message and others) reach the coordinator's topic
    router and any subscriber. Every request ends with a reply or an error reply with code
    bad_request / handler_error (or the agent's own refusals), never a dead or hung process."""
    import anyio

    from agent_bus.bus.client import connect
    from agent_bus.bus.errors import RemoteError
    from tests.coordinator.conftest import start_stack

    stack = start_stack(tmp_path, coordinator=("fz", "listener"), agents=STACK_AGENTS)
    stack.script([])
    procs = {name: proc for name, proc in stack.procs.items()}
    try:
        rss0 = {name: rss_kb(proc.pid) for name, proc in procs.items()}
        outcomes: dict[str, int] = {}

        async def main() -> None:
            async with connect(stack.endpoint, name="fuzzer") as peer:
                async def ask(service: str, body: bytes) -> None:
                    try:
                        with anyio.fail_after(20):
                            await peer.request(service, body, timeout=15)
                        outcome = "reply"
                    except RemoteError as exc:
                        assert exc.code in OK_CODES, (service, exc.code, str(exc)[:300])
                        outcome = exc.code
                    key = f"{service}:{outcome}"
                    outcomes[key] = outcomes.get(key, 0) + 1

                @settings(SETTINGS, max_examples=200)
                @given(which=st.sampled_from(["llm", "tool.echo", "agent.fz", "event"]),
                       data=st.data())
                def one(which: str, data: Any) -> None:
                    if which == "event":
                        type_, body = data.draw(event_bodies)
                        anyio.from_thread.run(lambda: peer.publish_raw(type_, body, agent="zz"))
                        return
                    strategy = {"llm": llm_bodies, "tool.echo": tool_bodies,
                                "agent.fz": agent_bodies}[which]
                    anyio.from_thread.run(ask, which, _pack(data.draw(strategy)))

                await anyio.to_thread.run_sync(one)
                # still whole: a normal request to each
                call = msgspec.msgpack.encode({"call_id": "c", "name": "echo",
                                               "arguments": '{"text": "ok"}'})
                reply = msgspec.msgpack.decode(await peer.request("tool.echo", call, timeout=10))
                assert reply["content"][0]["text"] == "ok"
                llm = msgspec.msgpack.encode({"messages": [
                    {"role": "user", "content": [{"type": "text", "text": "hello"}]}],
                    "model": "x"})
                reply = msgspec.msgpack.decode(await peer.request("llm", llm, timeout=10))
                assert "hello" in json.dumps(reply)
                from agent_bus.agents.client.remote import connect as connect_agents
            async with connect_agents(stack.endpoint, name="checker") as bus:
                async def idle() -> bool:  # a fuzzed run may still be ending
                    return not (await bus.state("fz")).is_running

                await until(idle, 30, "the fuzzed agent to be idle")
                with anyio.fail_after(30):
                    run = await bus.prompt("fz", "are you there", new_session=True)
                    result = await run.result()
                assert result.stop_reason == "stop" and not result.error, result

        anyio.run(main)
        print("outcomes:", json.dumps(outcomes, sort_keys=True))
        for name, proc in procs.items():
            assert proc.popen.poll() is None, f"{name} died:\n{proc.output()[-3000:]}"
            growth = rss_kb(proc.pid) - rss0[name]
            print(f"{name} VmRSS growth {growth} kB")
            assert growth < 100_000, name
    finally:
        stack.close()


# --- helper process ------------------------------------------------------------------------


async def _peer_main(endpoint: str) -> None:
    import anyio

    from agent_bus.bus.client import connect

    async with connect(endpoint, name="fuzzpeer", connect_timeout=10) as peer:
        async def echo(req: Any) -> bytes:
            return req.body

        async def counters(req: Any) -> bytes:
            return json.dumps(peer.counters).encode()

        await peer.serve("echo", echo, capacity=64)
        await peer.serve("counters", counters)
        print(json.dumps({"ready": "fuzzpeer", "pid": os.getpid()}), flush=True)
        await anyio.sleep_forever()


if __name__ == "__main__":
    import logging

    import anyio

    logging.basicConfig(level=logging.CRITICAL)
    if sys.argv[1:2] == ["peer"]:
        anyio.run(_peer_main, sys.argv[2])
