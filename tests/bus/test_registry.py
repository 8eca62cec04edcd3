"""The hub's routing state without sockets (bus/registry.py): dispatch, capacity, queue bound,
deadlines, tie rotation, peer loss, cancellation and per-sender request ids.

The registry speaks through `send` and `emit`; here they record into a `Wire`, and time is a
`Clock` the test moves, so every path runs in microseconds and without a sleep."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from agent_bus.bus import events as ev
from agent_bus.bus import protocol as p
from agent_bus.bus.registry import Counters, Limits, PeerState, Registry

WALL0 = 1_700_000_000.0  # the fake unix time at monotonic 0


@dataclass
class Clock:
    now: float = 0.0

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> float:
        return WALL0 + self.now


@dataclass
class Wire:
    """What the registry sent: (to, header, body frames), plus the events it emitted."""

    sent: list[tuple[bytes, p.Header, list[Any]]] = field(default_factory=list)
    events: list[ev.Event] = field(default_factory=list)
    unroutable: set[bytes] = field(default_factory=set)

    def send(self, frames: list[Any]) -> bool:
        assert frames[1] == p.SIGNATURE
        if frames[0] in self.unroutable:
            return False
        self.sent.append((frames[0], p.decode_header(frames[2]), list(frames[3:])))
        return True

    def take(self, to: bytes | None = None) -> list[p.Header]:
        """Headers sent (to one peer, or all) since the last take."""
        out = [h for ident, h, _ in self.sent if to is None or ident == to]
        self.sent = [s for s in self.sent if to is not None and s[0] != to]
        return out


class Bus:
    def __init__(self, **limits: Any) -> None:
        self.clock = Clock()
        self.wire = Wire()
        self.counters = Counters()
        self.reg = Registry(Limits(**limits), self.counters, self.wire.send, self.wire.events.append,
                            clock=self.clock.monotonic, wall=self.clock.wall)

    def peer(self, name: str) -> PeerState:
        ident = b"\x00" + name.encode()
        return self.reg.add_peer(ident, name, p.Hello(name=name, session="s"))

    def serve(self, peer: PeerState, service: str, capacity: int = 1,
              idempotent: bool = False) -> None:
        spec = p.ServiceSpec(service, capacity=capacity, idempotent=idempotent)
        self.reg.register(peer, p.Register([spec]), "reg")

    def request(self, peer: PeerState, req_id: str, service: str = "svc",
                timeout: float = 0.0, wait: float = 0.0) -> bool:
        header = p.Header(kind=p.REQUEST, id=req_id, service=service,
                          deadline=self.clock.wall() + timeout if timeout else 0.0, wait=wait)
        frames = [peer.ident, p.SIGNATURE, p.encode(header), b"body-" + req_id.encode()]
        return self.reg.request(peer, header, frames)

    def answer(self, server: PeerState, wire_id: str, kind: str = p.REPLY,
               code: str = "") -> None:
        header = p.Header(kind=kind, id=wire_id, code=code)
        frames = [server.ident, p.SIGNATURE, p.encode(header), b"answer"]
        self.reg.answer(server, header, frames[:3] if kind == p.ERROR else frames)

    def cancel(self, peer: PeerState, req_id: str) -> None:
        self.reg.cancel(peer.ident, req_id)

    def load(self, service: str = "svc") -> dict[str, int]:
        slots = self.reg.services[service].slots
        return {self.reg.peers[i].id: s.load for i, s in slots.items()}


def finals(headers: list[p.Header]) -> list[tuple[str, str, str]]:
    """(kind, id, code) of each reply/error, the answers a requester counts."""
    return [(h.kind, h.id, h.code) for h in headers if h.kind in (p.REPLY, p.ERROR)]


# --- dispatch and capacity --------------------------------------------------------------------


def test_least_loaded_by_ratio_then_queued_past_capacity() -> None:
    bus = Bus()
    small, big, client = bus.peer("small"), bus.peer("big"), bus.peer("client")
    bus.serve(small, "svc", capacity=1)
    bus.serve(big, "svc", capacity=4)
    for i in range(6):
        bus.request(client, f"r{i}")
    assert bus.load() == {"small": 1, "big": 4}
    assert bus.reg.services["svc"].queued == 1
    # a reply frees a slot, and the queued request takes it at once
    served_by_big = [h.id for h in bus.wire.take(big.ident) if h.kind == p.REQUEST]
    bus.wire.take()
    bus.answer(big, served_by_big[0])
    assert finals(bus.wire.take(client.ident)) == [(p.REPLY, served_by_big[0], "")]
    assert bus.reg.services["svc"].queued == 0
    assert bus.load() == {"small": 1, "big": 4}


def test_ties_rotate_instead_of_picking_the_first_registered() -> None:
    bus = Bus()
    servers = [bus.peer(f"s{i}") for i in range(3)]
    client = bus.peer("client")
    for server in servers:
        bus.serve(server, "svc", capacity=1)
    picked = []
    for i in range(9):  # each request is answered before the next: every slot is idle each time
        bus.request(client, f"r{i}")
        (to, header, _), = [s for s in bus.wire.sent if s[1].kind == p.REQUEST]
        bus.wire.sent.clear()
        picked.append(bus.reg.peers[to].id)
        bus.answer(bus.reg.peers[to], header.id)
        bus.wire.take()
    assert picked == ["s0", "s1", "s2"] * 3


def test_queue_limit_refuses_with_overloaded() -> None:
    bus = Bus(queue_limit=2)
    server, client = bus.peer("server"), bus.peer("client")
    bus.serve(server, "svc", capacity=1)
    for i in range(4):
        bus.request(client, f"r{i}")
    answers = finals(bus.wire.take(client.ident))
    assert answers == [(p.ERROR, "r3", p.OVERLOADED)]
    assert bus.counters["overloaded_queue"] == 1


def test_unroutable_server_is_skipped_and_the_request_waits() -> None:
    bus = Bus()
    server, client = bus.peer("server"), bus.peer("client")
    bus.serve(server, "svc")
    bus.wire.unroutable.add(server.ident)
    bus.request(client, "r1")
    assert bus.reg.services["svc"].queued == 1 and bus.load() == {"server": 0}


# --- deadlines ----------------------------------------------------------------------------------


def test_deadline_in_queue_in_service_and_without_a_server() -> None:
    bus = Bus()
    server, client = bus.peer("server"), bus.peer("client")
    bus.serve(server, "svc", capacity=1)
    bus.request(client, "served", timeout=2.0)
    bus.request(client, "queued", timeout=1.0)
    bus.request(client, "nobody", service="other", timeout=1.5)
    bus.wire.take()
    bus.clock.now = 0.9
    bus.reg.expire(bus.clock.now)
    assert bus.wire.take() == []
    bus.clock.now = 2.0
    bus.reg.expire(bus.clock.now)
    answers = bus.wire.take(client.ident)
    assert finals(answers) == [(p.ERROR, "queued", p.DEADLINE), (p.ERROR, "nobody", p.NO_SERVICE),
                               (p.ERROR, "served", p.DEADLINE)]
    assert "in the queue" in answers[0].error and "while being served" in answers[2].error
    # the server was told to stop the one it held; its late answer is stale
    assert [(h.kind, h.id) for h in bus.wire.take(server.ident)] == [(p.CANCEL, "served")]
    bus.answer(server, "served", p.ERROR, p.CANCELLED)
    assert bus.wire.take() == [] and bus.counters["stale_replies"] == 1
    assert bus.counters["expired_requests"] == 3 and not bus.reg.requests


def test_wait_bounds_the_time_a_request_waits_for_a_server() -> None:
    """`wait`: a request nobody serves fails `no_service` once it has waited that long (not at
    its far deadline); one a server took, or that waits behind busy servers, is watched until
    its deadline; without a deadline, `wait` alone lets it wait for a server."""
    bus = Bus()
    server, client = bus.peer("server"), bus.peer("client")
    bus.serve(server, "svc", capacity=1)
    bus.request(client, "served", timeout=600.0, wait=1.0)
    bus.request(client, "behind", timeout=600.0, wait=1.0)
    bus.request(client, "gone", service="left", timeout=600.0, wait=1.0)
    bus.request(client, "no-deadline", service="left", wait=1.0)
    bus.request(client, "arrives", service="later", timeout=600.0, wait=1.0)
    bus.request(client, "at-once", service="left")  # neither: refused at once, as before
    sent = bus.wire.take()
    assert finals(sent) == [(p.ERROR, "at-once", p.NO_SERVICE)]
    assert [h.id for h in sent if h.kind == p.REQUEST] == ["served"]
    bus.clock.now = 0.5
    bus.serve(bus.peer("late"), "later")  # a server registers within the wait: dispatched
    bus.reg.expire(bus.clock.now)
    assert [h.id for h in bus.wire.take() if h.kind == p.REQUEST] == ["arrives"]
    bus.clock.now = 1.0
    bus.reg.expire(bus.clock.now)
    answers = bus.wire.take(client.ident)
    assert finals(answers) == [(p.ERROR, "gone", p.NO_SERVICE),
                               (p.ERROR, "no-deadline", p.NO_SERVICE)]
    assert "`wait`" in answers[0].error and bus.counters["waits_expired"] == 2
    # the served one and the one queued behind it keep their deadline
    bus.clock.now = 599.0
    bus.reg.expire(bus.clock.now)
    assert bus.wire.take() == []
    bus.answer(server, "served")
    assert [h.id for h in bus.wire.take(server.ident)] == ["behind"]
    bus.clock.now = 600.0
    bus.reg.expire(bus.clock.now)
    assert finals(bus.wire.take(client.ident)) == [(p.REPLY, "served", ""),
                                                   (p.ERROR, "behind", p.DEADLINE),
                                                   (p.ERROR, "arrives", p.DEADLINE)]
    assert not bus.reg.requests


@pytest.mark.parametrize("wait", [float("nan"), -1.0, 0.0])
def test_a_wait_that_is_not_positive_is_none(wait: float) -> None:
    bus = Bus()
    client = bus.peer("client")
    bus.request(client, "a", service="nobody", wait=wait)
    assert finals(bus.wire.take(client.ident)) == [(p.ERROR, "a", p.NO_SERVICE)]
    bus.request(client, "b", service="nobody", timeout=5.0, wait=wait)
    bus.clock.now = 4.9
    bus.reg.expire(bus.clock.now)
    assert bus.wire.take() == []
    bus.clock.now = 5.0
    bus.reg.expire(bus.clock.now)
    assert finals(bus.wire.take(client.ident)) == [(p.ERROR, "b", p.NO_SERVICE)]
    assert "waits_expired" not in bus.counters


def test_past_deadline_is_refused_at_once() -> None:
    bus = Bus()
    server, client = bus.peer("server"), bus.peer("client")
    bus.serve(server, "svc")
    header = p.Header(kind=p.REQUEST, id="late", service="svc", deadline=bus.clock.wall() - 0.5)
    bus.reg.request(client, header, [client.ident, p.SIGNATURE, p.encode(header), b""])
    (answer,) = bus.wire.take(client.ident)
    assert (answer.code, answer.id) == (p.DEADLINE, "late") and "0.500 s in the past" in answer.error
    assert bus.wire.take(server.ident) == []


def test_nan_deadline_and_missing_id_are_answered_bad_request() -> None:
    bus = Bus()
    client = bus.peer("client")
    for header in (p.Header(kind=p.REQUEST, id="n", service="svc", deadline=float("nan")),
                   p.Header(kind=p.REQUEST, service="svc")):
        bus.reg.request(client, header, [client.ident, p.SIGNATURE, p.encode(header)])
    answers = bus.wire.take(client.ident)
    assert [(h.id, h.code) for h in answers] == [("n", p.BAD_REQUEST), ("", p.BAD_REQUEST)]
    assert "`deadline`" in answers[0].error and "`id`" in answers[1].error


# --- cancellation: exactly one answer -----------------------------------------------------------


def test_cancel_of_a_queued_request_is_answered_at_once() -> None:
    bus = Bus()
    server, client = bus.peer("server"), bus.peer("client")
    bus.serve(server, "svc", capacity=1)
    bus.request(client, "busy")
    bus.request(client, "waiting")
    bus.wire.take()
    bus.cancel(client, "waiting")
    bus.cancel(client, "waiting")  # a repeat is ignored: it already has its answer
    assert finals(bus.wire.take(client.ident)) == [(p.ERROR, "waiting", p.CANCELLED)]
    bus.answer(server, "busy")  # the freed slot does not pick the cancelled request
    assert bus.wire.take(server.ident) == [] and bus.reg.services["svc"].queued == 0


@pytest.mark.parametrize("server_says", ["cancelled", "reply", "other_error", "nothing"])
def test_cancel_in_flight_ends_with_one_cancelled(server_says: str) -> None:
    bus = Bus(cancel_grace=1.0)
    server, client = bus.peer("server"), bus.peer("client")
    bus.serve(server, "svc", capacity=1)
    bus.request(client, "r1", timeout=0.5)  # the deadline falls inside the grace: still `cancelled`
    bus.request(client, "r2")
    bus.wire.take()
    bus.cancel(client, "r1")
    assert [(h.kind, h.id) for h in bus.wire.take(server.ident)] == [(p.CANCEL, "r1")]
    assert bus.load() == {"server": 1}  # the server still holds it until it answers
    bus.answer(server, "r1", p.PARTIAL)  # dropped: the requester asked to stop
    if server_says == "cancelled":
        bus.answer(server, "r1", p.ERROR, p.CANCELLED)
    elif server_says == "reply":
        bus.answer(server, "r1")
    elif server_says == "other_error":
        bus.answer(server, "r1", p.ERROR, p.HANDLER_ERROR)
    for now in (0.6, 1.1):
        bus.clock.now = now
        bus.reg.expire(now)
    bus.answer(server, "r1", p.ERROR, p.CANCELLED)  # too late in every case: stale
    answers = bus.wire.take(client.ident)
    assert finals(answers) == [(p.ERROR, "r1", p.CANCELLED)], answers
    assert [h.kind for h in answers] == [p.ERROR]  # the partial after the cancel is not sent
    # the slot went to the queued request once the cancelled one ended
    assert [(h.kind, h.id) for h in bus.wire.take(server.ident)] == [(p.REQUEST, "r2")]
    assert bus.counters.get("cancel_unanswered", 0) == (server_says == "nothing")


def test_a_repeated_cancel_changes_nothing() -> None:
    bus = Bus(cancel_grace=1.0)
    server, client = bus.peer("server"), bus.peer("client")
    bus.serve(server, "svc")
    bus.request(client, "r1")
    bus.wire.take()
    bus.cancel(client, "r1")
    bus.cancel(client, "r1")
    assert [(h.kind, h.id) for h in bus.wire.take(server.ident)] == [(p.CANCEL, "r1")]
    for now in (1.1, 2.2):
        bus.clock.now = now
        bus.reg.expire(now)
    assert finals(bus.wire.take(client.ident)) == [(p.ERROR, "r1", p.CANCELLED)]
    assert bus.counters.get("cancel_ignored", 0) == 1


def test_cancel_then_server_lost_answers_cancelled_not_redispatched() -> None:
    bus = Bus()
    server, spare, client = bus.peer("server"), bus.peer("spare"), bus.peer("client")
    bus.serve(server, "svc", idempotent=True)
    bus.request(client, "r1")
    bus.serve(spare, "svc", idempotent=True)
    bus.wire.take()
    bus.cancel(client, "r1")
    bus.reg.drop_peer(server, "connection closed")
    assert finals(bus.wire.take(client.ident)) == [(p.ERROR, "r1", p.CANCELLED)]
    assert bus.wire.take(spare.ident) == []


def test_cancel_from_another_peer_does_not_touch_the_request() -> None:
    bus = Bus()
    server, client, other = bus.peer("server"), bus.peer("client"), bus.peer("other")
    bus.serve(server, "svc")
    bus.request(client, "r1")
    bus.wire.take()
    bus.cancel(other, "r1")
    assert bus.wire.take() == [] and bus.counters["cancel_ignored"] == 1
    bus.answer(server, "r1")
    assert finals(bus.wire.take(client.ident)) == [(p.REPLY, "r1", "")]


# --- request ids are scoped to their sender -----------------------------------------------------


def test_two_requesters_with_the_same_id_at_one_server_both_get_their_reply() -> None:
    bus = Bus()
    server, a, b = bus.peer("server"), bus.peer("a"), bus.peer("b")
    bus.serve(server, "svc", capacity=2)
    bus.request(a, "1")
    bus.request(b, "1")
    to_server = [(h.id, body) for ident, h, body in bus.wire.sent if ident == server.ident]
    bus.wire.take()
    assert to_server[0] == ("1", [b"body-1"]) and to_server[1][0] != "1"  # the server can tell them apart
    bus.answer(server, to_server[1][0])
    bus.answer(server, "1")
    assert finals(bus.wire.take(b.ident)) == [(p.REPLY, "1", "")]
    assert finals(bus.wire.take(a.ident)) == [(p.REPLY, "1", "")]
    # cancelling through the hub-chosen id reaches the right request
    bus.request(a, "2")
    bus.request(b, "2")
    bus.wire.take()
    bus.cancel(b, "2")
    (cancel,) = bus.wire.take(server.ident)
    assert cancel.kind == p.CANCEL and cancel.id != "2"
    bus.answer(server, cancel.id, p.ERROR, p.CANCELLED)
    assert finals(bus.wire.take(b.ident)) == [(p.ERROR, "2", p.CANCELLED)]
    assert bus.wire.take(a.ident) == []


def test_duplicate_in_flight_id_is_refused_naming_it_and_a_finished_id_may_be_reused() -> None:
    bus = Bus()
    server, client = bus.peer("server"), bus.peer("client")
    bus.serve(server, "svc", capacity=2)
    bus.request(client, "7", timeout=1.0)
    bus.request(client, "7")
    (refusal,) = bus.wire.take(client.ident)
    assert (refusal.code, refusal.id) == (p.BAD_REQUEST, "7") and "`7`" in refusal.error
    bus.answer(server, "7")
    bus.wire.take()
    bus.request(client, "7", timeout=5.0)  # reused once answered
    assert [(h.kind, h.id) for h in bus.wire.take(server.ident)] == [(p.REQUEST, "7")]
    bus.clock.now = 1.5  # the first "7"'s deadline must not expire the second
    bus.reg.expire(bus.clock.now)
    assert bus.wire.take() == []
    bus.answer(server, "7")
    assert finals(bus.wire.take(client.ident)) == [(p.REPLY, "7", "")]


# --- peer loss ----------------------------------------------------------------------------------


def test_lost_server_fails_or_redispatches_and_lost_requester_cancels() -> None:
    bus = Bus(max_redispatch=1)
    s1, s2, client = bus.peer("s1"), bus.peer("s2"), bus.peer("client")
    bus.serve(s1, "plain")
    bus.serve(s1, "idem", idempotent=True)
    bus.request(client, "p", service="plain")
    bus.request(client, "i", service="idem")
    bus.serve(s2, "idem", idempotent=True)
    bus.wire.take()
    bus.reg.drop_peer(s1, "missed 3 heartbeats")
    (plain,) = bus.wire.take(client.ident)
    assert (plain.kind, plain.id, plain.code) == (p.ERROR, "p", p.PEER_LOST)
    assert "max_redispatch" not in plain.error  # its first loss: no limit was reached
    assert [(h.kind, h.id) for h in bus.wire.take(s2.ident)] == [(p.REQUEST, "i")]
    lost = [e for e in bus.wire.events if isinstance(e, ev.WorkerLost)]
    assert [(e.failed, e.redispatched) for e in lost] == [(1, 1)]
    assert "plain" not in bus.reg.services  # pruned: nobody serves it, nothing queued
    # its second server lost too: past max_redispatch, failed naming the limit
    bus.reg.drop_peer(s2, "connection closed")
    (answer,) = bus.wire.take(client.ident)
    assert answer.code == p.PEER_LOST and "max_redispatch" in answer.error
    # a requester that leaves: its server is told to stop, nobody is answered
    s3 = bus.peer("s3")
    bus.serve(s3, "svc")
    bus.request(client, "c")
    bus.wire.take()
    bus.reg.drop_peer(client, "said bye")
    assert [(h.kind, h.id) for h in bus.wire.take()] == [(p.CANCEL, "c")]
    assert not bus.reg.requests and bus.reg.request_bytes == 0 and bus.load() == {"s3": 0}


def test_expired_peers_and_register_refusals() -> None:
    bus = Bus()
    quiet, alive = bus.peer("quiet"), bus.peer("alive")
    bus.clock.now = 3.5
    alive.last_seen = 3.0
    assert bus.reg.expired_peers(bus.clock.now, 3.0) == [quiet]
    bus.reg.register(alive, p.Register([p.ServiceSpec("hub.x"), p.ServiceSpec("ok", capacity=0)]),
                     "reg-1")
    refusals = bus.wire.take(alive.ident)
    assert [(h.id, h.code) for h in refusals] == [("reg-1", p.BAD_REQUEST)] * 2
    assert "`hub.`" in refusals[0].error and "`capacity` 0" in refusals[1].error
    assert bus.counters["bad_register"] == 2 and not bus.reg.services


def test_answered_requests_do_not_pile_up_on_the_deadline_heap() -> None:
    """Long deadlines at a high request rate: the heap follows the requests held, not the rate."""
    bus = Bus()
    server, client = bus.peer("server"), bus.peer("client")
    bus.serve(server, "svc", capacity=4)
    for i in range(5000):
        bus.request(client, str(i), timeout=600.0)
        bus.answer(server, str(i))
    bus.wire.take()
    assert len(bus.reg.deadlines) <= 2 * len(bus.reg.requests) + 65
    assert not bus.reg.requests and bus.reg.request_bytes == 0


# --- preferred server (header `prefer`) ------------------------------------------------------


def _hub_peer(bus: Bus, name: str, key: str = "") -> PeerState:
    """A peer whose id is as the hub makes them: its routing id's hex (after `key:<key>:` with
    CURVE, bus/security.curve_peer_id)."""
    ident = b"\x00" + name.encode()
    peer_id = f"key:{key}:{ident.hex()}" if key else ident.hex()
    return bus.reg.add_peer(ident, peer_id, p.Hello(name=name, session="s"))


def _prefer(bus: Bus, peer: PeerState, req_id: str, prefer: str) -> None:
    header = p.Header(kind=p.REQUEST, id=req_id, service="svc", prefer=prefer)
    bus.reg.request(peer, header, [peer.ident, p.SIGNATURE, p.encode(header), b"body"])


def _served(bus: Bus, server: PeerState) -> list[str]:
    return [h.id for h in bus.wire.take(server.ident) if h.kind == p.REQUEST]


def test_prefer_sends_to_that_peer_while_it_has_room_else_to_another() -> None:
    bus = Bus()
    first, second = _hub_peer(bus, "first"), _hub_peer(bus, "second", key="Zk:3")
    client = _hub_peer(bus, "client")
    bus.serve(first, "svc")
    bus.serve(second, "svc")
    _prefer(bus, client, "r0", second.id)  # idle both: least loaded would pick `first`
    assert _served(bus, second) == ["r0"]
    _prefer(bus, client, "r1", second.id)  # `second` is full: no waiting for it
    assert _served(bus, first) == ["r1"]
    _prefer(bus, client, "r2", second.id)  # both full: queued, then the first slot to free
    assert bus.reg.services["svc"].queued == 1
    bus.answer(first, "r1")
    assert _served(bus, first) == ["r2"]
    bus.answer(second, "r0")
    _prefer(bus, client, "r3", second.id)
    assert _served(bus, second) == ["r3"]
    assert finals(bus.wire.take(client.ident)) == [(p.REPLY, "r1", ""), (p.REPLY, "r0", "")]


@pytest.mark.parametrize("prefer", ["", "00ff", "not hex", "key:x:zz", "key:wrong:006669727374",
                                    "0063", "00" * 10_000])
def test_unknown_or_malformed_prefer_is_ignored(prefer: str) -> None:
    """Not a live peer's id (unknown, malformed, a CURVE id whose key part differs, a peer not
    serving the service, huge): dispatched as usual, no error, nothing counted as refused."""
    bus = Bus()
    first, second = _hub_peer(bus, "first"), _hub_peer(bus, "second")
    client = _hub_peer(bus, "c")  # id 0063: live, serves nothing
    bus.serve(first, "svc")
    bus.serve(second, "svc")
    _prefer(bus, client, "r0", prefer)
    _prefer(bus, client, "r1", prefer)
    assert (_served(bus, first), _served(bus, second)) == (["r0"], ["r1"])
    assert bus.wire.take(client.ident) == []


def test_prefer_of_a_lost_peer_goes_elsewhere() -> None:
    bus = Bus()
    first, second = _hub_peer(bus, "first"), _hub_peer(bus, "second")
    client = _hub_peer(bus, "client")
    bus.serve(first, "svc")
    bus.serve(second, "svc")
    _prefer(bus, client, "r0", second.id)
    _prefer(bus, client, "r1", first.id)
    _prefer(bus, client, "r2", second.id)  # queued: both busy
    bus.wire.take()
    bus.reg.drop_peer(second, "gone")  # r0 fails peer_lost; r2 waits for `first`
    bus.answer(first, "r1")
    assert _served(bus, first) == ["r2"]
    _prefer(bus, client, "r3", second.id)  # the id of a peer gone: ignored
    assert bus.reg.services["svc"].queued == 1
    assert finals(bus.wire.take(client.ident)) == [(p.ERROR, "r0", p.PEER_LOST),
                                                   (p.REPLY, "r1", "")]
