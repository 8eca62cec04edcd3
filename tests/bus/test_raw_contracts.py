"""The request and event contracts, checked by peers written from docs/protocol.md alone: plain
pyzmq DEALER/SUB sockets and msgspec MessagePack, no `bus` import (only the hub process runs
our code). Sections 2-6 of the doc: exactly one `reply`/`error` per request, cancellation
included; request ids scoped to their sender; only the hub speaks for the bus."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import zmq

SIG = b"AGB/1"
TIMEOUT = 10.0  # seconds any one expected message may take
BEAT = 0.3  # seconds between heartbeats: the hub drops a peer silent for 3 intervals (3 s)


class RawPeer:
    """A DEALER that said hello. While any peer of its group waits, all of them heartbeat, as
    every peer must while connected (a peer left silent is dropped, its calls failed)."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str, name: str,
                 group: list[RawPeer]) -> None:
        self.group = group
        group.append(self)
        self.last_sent = time.monotonic()
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.connect(endpoint)
        self.inbox: list[tuple[dict[str, Any], list[bytes]]] = []  # received, not yet taken
        self.send({"kind": "hello", "id": "h"}, {"name": name, "session": uuid.uuid4().hex[:12]})
        header, body = self.expect(lambda h: h["kind"] == "welcome")
        welcome = msgspec.msgpack.decode(body[0])
        self.peer_id: str = welcome["peer"]
        self.events: str = welcome["events"]

    def send(self, header: dict[str, Any], *body: Any) -> None:
        frames = [SIG, msgspec.msgpack.encode(header)]
        frames += [b if isinstance(b, bytes) else msgspec.msgpack.encode(b) for b in body]
        self.sock.send_multipart(frames)
        self.last_sent = time.monotonic()

    def _read(self, timeout: float) -> bool:
        if not self.sock.poll(timeout * 1000):
            return False
        frames = self.sock.recv_multipart()
        assert frames[0] == SIG, frames
        header = msgspec.msgpack.decode(frames[1])
        if header["kind"] != "heartbeat":
            self.inbox.append((header, frames[2:]))
        return True

    def expect(self, match: Any, timeout: float = TIMEOUT) -> tuple[dict[str, Any], list[bytes]]:
        """Take the first message `match(header)` accepts, waiting at most `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            for i, (header, body) in enumerate(self.inbox):
                if match(header):
                    del self.inbox[i]
                    return header, body
            left = deadline - time.monotonic()
            assert left > 0, f"no matching message within {timeout} s; got {self.inbox}"
            self._read(min(left, BEAT))
            for peer in self.group:
                if time.monotonic() - peer.last_sent >= BEAT:
                    peer.send({"kind": "heartbeat"})

    def answer_to(self, req_id: str) -> tuple[dict[str, Any], list[bytes]]:
        return self.expect(lambda h: h["kind"] in ("reply", "error") and h.get("id") == req_id)

    def sync(self) -> None:
        """A `hub.status` round trip: the hub has handled all this peer sent before, and every
        message it sent this peer before answering has arrived (one connection is FIFO)."""
        sync_id = uuid.uuid4().hex
        self.send({"kind": "request", "id": sync_id, "service": "hub.status"}, b"")
        self.answer_to(sync_id)

    def status(self) -> dict[str, Any]:
        sync_id = uuid.uuid4().hex
        self.send({"kind": "request", "id": sync_id, "service": "hub.status"}, b"")
        return msgspec.msgpack.decode(self.answer_to(sync_id)[1][0])


@contextmanager
def raw_peers(endpoint: str, *names: str) -> Iterator[list[RawPeer]]:
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        group: list[RawPeer] = []
        yield [RawPeer(ctx, endpoint, name, group) for name in names]
    finally:
        ctx.destroy(linger=0)


def register(peer: RawPeer, service: str, capacity: int) -> None:
    peer.send({"kind": "register", "id": "reg"},
              {"services": [{"name": service, "capacity": capacity}]})
    peer.sync()  # registered before anyone asks


def request(peer: RawPeer, req_id: str, service: str, body: bytes = b"x") -> None:
    peer.send({"kind": "request", "id": req_id, "service": service}, body)


def next_request(server: RawPeer) -> dict[str, Any]:
    return server.expect(lambda h: h["kind"] == "request")[0]


def answers(peer: RawPeer) -> list[tuple[str, str]]:
    """(id, code or "reply") of every reply/error left in the inbox (taken)."""
    out = [(h.get("id", ""), h.get("code", "") or h["kind"]) for h, _ in peer.inbox
           if h["kind"] in ("reply", "error")]
    peer.inbox = [m for m in peer.inbox if m[0]["kind"] not in ("reply", "error")]
    return out


def test_cancel_in_flight_and_queued_each_get_exactly_one_cancelled(hub: dict) -> None:
    with raw_peers(hub["endpoint"], "server", "client") as (server, client):
        register(server, "raw.work", capacity=1)
        request(client, "r1", "raw.work")
        assert next_request(server)["id"] == "r1"
        request(client, "r2", "raw.work")  # queued: the one slot is busy
        client.sync()
        client.send({"kind": "cancel", "id": "r2"})
        assert client.answer_to("r2")[0]["code"] == "cancelled"  # at once, from the hub
        client.send({"kind": "cancel", "id": "r1"})
        cancel = server.expect(lambda h: h["kind"] == "cancel")[0]
        assert cancel["id"] == "r1"
        server.send({"kind": "error", "id": "r1", "code": "cancelled", "error": "stopped"})
        assert client.answer_to("r1")[0]["code"] == "cancelled"  # the server's own answer
        # a server that does not answer the cancel: the hub answers after its grace period
        request(client, "r3", "raw.work")
        assert next_request(server)["id"] == "r3"  # not r2: it was cancelled while queued
        client.send({"kind": "cancel", "id": "r3"})
        assert server.expect(lambda h: h["kind"] == "cancel")[0]["id"] == "r3"
        header, _ = client.answer_to("r3")
        assert header["code"] == "cancelled" and "did not answer" in header["error"], header
        server.send({"kind": "reply", "id": "r3"}, b"too late")
        server.sync()  # the hub has handled the late reply...
        client.sync()  # ...and anything it sent the client for it has arrived
        assert answers(client) == []  # no second answer to any of them
        assert not [h for h, _ in server.inbox if h["kind"] == "request"]


def test_two_requesters_may_use_the_same_id(hub: dict) -> None:
    with raw_peers(hub["endpoint"], "server", "a", "b") as (server, a, b):
        register(server, "raw.echo", capacity=2)
        for round_ in range(2):  # the second round reuses ids whose requests have ended
            request(a, "1", "raw.echo", b"from a")
            request(b, "1", "raw.echo", b"from b")
            held = [server.expect(lambda h: h["kind"] == "request") for _ in range(2)]
            ids = [h["id"] for h, _ in held]
            assert len(set(ids)) == 2, ids  # both in flight at one server, told apart
            for header, body in held:  # echo, answering with the id the server was given
                server.send({"kind": "reply", "id": header["id"]}, body[0])
            assert a.answer_to("1")[1] == [b"from a"], round_
            assert b.answer_to("1")[1] == [b"from b"], round_


def test_a_duplicate_of_an_in_flight_id_is_refused_naming_it(hub: dict) -> None:
    with raw_peers(hub["endpoint"], "server", "client") as (server, client):
        register(server, "raw.hold", capacity=2)
        request(client, "dup-7", "raw.hold", b"first")
        next_request(server)
        request(client, "dup-7", "raw.hold", b"second")
        header, _ = client.answer_to("dup-7")
        assert header["kind"] == "error" and header["code"] == "bad_request", header
        assert "`dup-7`" in header["error"]
        server.send({"kind": "reply", "id": "dup-7"}, b"first done")
        assert client.answer_to("dup-7")[1] == [b"first done"]
        server.sync()
        assert not [h for h, _ in server.inbox if h["kind"] == "request"]  # never forwarded


@contextmanager
def subscriber(peer: RawPeer) -> Iterator[zmq.Socket[Any]]:
    """A SUB on everything, subscribed (its answering heartbeat has arrived)."""
    ctx: zmq.Context[Any] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.linger = 0
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(peer.events)
        assert sub.poll(TIMEOUT * 1000), "no heartbeat answering the subscription"
        sub.recv_multipart()
        yield sub
    finally:
        sub.close(0)
        ctx.term()


def test_peers_cannot_speak_for_the_bus_or_lie_about_an_event(hub: dict) -> None:
    with raw_peers(hub["endpoint"], "liar") as (liar,), subscriber(liar) as sub:
        forged = [
            ("f1", "peer_joined", {"type": "peer_joined", "peer": "hub", "name": "forged"}),
            ("f2", "worker_lost", {"type": "worker_lost", "peer": "x", "failed": 9}),
            ("f3", "topic_message", {"type": "agent_end", "final_text": "lie"}),
            ("f4", "topic_message", b"\x93\x01\x02\x03"),  # not a map
        ]
        for event_id, type_, body in forged:
            liar.send({"kind": "event", "id": event_id, "type": type_, "peer": "hub"}, body)
        for event_id, type_, _ in forged:
            header, _ = liar.expect(lambda h: h["kind"] == "error" and h["id"] == event_id)
            assert header["code"] == "bad_event", header
            assert f"`{type_}`" in header["error"], header
        marker = {"type": "topic_message", "topic": "t", "text": "honest"}
        liar.send({"kind": "event", "id": "ok", "type": "topic_message", "peer": "hub"},
                  marker)
        published = []
        while True:  # up to the marker, which comes after anything the liar sent earlier
            assert sub.poll(TIMEOUT * 1000), f"marker not published; saw {published}"
            frames = sub.recv_multipart()
            if frames[0] == b"hb":
                continue
            header = msgspec.msgpack.decode(frames[2])
            published.append((header["type"], header.get("peer"),
                              msgspec.msgpack.decode(frames[3])))
            if published[-1][2] == marker:
                break
        assert published == [("topic_message", liar.peer_id, marker)], published
        # and the log holds nothing of the refused events either
        logged = replay_all(liar)
        mine = [(h["type"], h["peer"]) for h, _ in logged if h.get("peer") == liar.peer_id]
        assert mine == [("topic_message", liar.peer_id)], mine
        assert not [b for h, b in logged if b"forged" in b or b"lie" in b]
        assert liar.status()["counters"].get("bad_events") == len(forged)


def replay_all(peer: RawPeer) -> list[tuple[dict[str, Any], bytes]]:
    """Every logged event, read with `hub.replay` until `upto == head` (section 5)."""
    out: list[tuple[dict[str, Any], bytes]] = []
    since = 0
    while True:
        req_id = uuid.uuid4().hex
        peer.send({"kind": "request", "id": req_id, "service": "hub.replay"}, {"since": since})
        batch = msgspec.msgpack.decode(peer.answer_to(req_id)[1][0])
        out += [(msgspec.msgpack.decode(h), b) for h, b in batch["events"]]
        since = batch["upto"]
        if since >= batch["head"]:
            return out
