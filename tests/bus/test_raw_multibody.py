"""Multi-body `event` messages, checked by a peer written from docs/protocol.md (sections 4 and
6) alone: plain pyzmq DEALER/SUB sockets and msgspec MessagePack, no `bus` import on the
sending or receiving side (only the hub process runs our code).

One header, N body frames: the hub makes N events of them, each with its own seq, ts and id
(`<header id>.<i>`), the header's other fields, and publishes each as its own 4-frame message;
a body it refuses is answered with an `error` naming that body's id and index, and its siblings
are still logged and published."""

from __future__ import annotations

from typing import Any

import msgspec
import zmq

from tests.bus.test_raw_contracts import TIMEOUT, raw_peers, replay_all, subscriber

MAX_BODIES = 1024  # docs/protocol.md §4: the most bodies one event message may carry
HEADER = {"kind": "event", "type": "topic_message", "agent": "poet", "run": "r-1",
          "experiment": "x-9", "peer": "hub"}


def topic(text: str, type_: str = "topic_message") -> bytes:
    return msgspec.msgpack.encode({"type": type_, "topic": "t", "text": text})


def published_until(sub: zmq.Socket[Any], last_text: str) -> list[list[bytes]]:
    """Every published event message up to the one whose body's text is `last_text`."""
    out: list[list[bytes]] = []
    while True:
        assert sub.poll(TIMEOUT * 1000), f"`{last_text}` not published; saw {len(out)}"
        frames = sub.recv_multipart()
        if frames[0] == b"hb":
            continue
        out.append(frames)
        if msgspec.msgpack.decode(frames[3]).get("text") == last_text:
            return out


def test_welcome_says_how_many_bodies_an_event_message_may_carry(hub: dict) -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(hub["endpoint"])
        sock.send_multipart([b"AGB/1", msgspec.msgpack.encode({"kind": "hello", "id": "h"}),
                             msgspec.msgpack.encode({"name": "n", "session": "s"})])
        assert sock.poll(TIMEOUT * 1000)
        frames = sock.recv_multipart()
        assert msgspec.msgpack.decode(frames[1])["kind"] == "welcome"
        welcome = msgspec.msgpack.decode(frames[2])
        assert welcome["event_bodies"] == MAX_BODIES
        assert welcome["mixed_types"] is True  # it takes `type: "*"` messages (below)
    finally:
        ctx.destroy(linger=0)


def test_each_body_is_its_own_event_with_its_own_seq_ts_and_id(hub: dict) -> None:
    with raw_peers(hub["endpoint"], "poet") as (poet,), subscriber(poet) as sub:
        bodies = [topic(f"line {i}") for i in range(5)]
        poet.send({**HEADER, "id": "m1"}, *bodies)
        poet.send({**HEADER, "id": "single"}, topic("alone"))  # one body: the id is kept
        frames = published_until(sub, "alone")
        assert all(len(f) == 4 for f in frames), [len(f) for f in frames]
        headers = [msgspec.msgpack.decode(f[2]) for f in frames]
        assert [f[3] for f in frames] == [*bodies, topic("alone")]
        assert [h["id"] for h in headers] == ["m1.0", "m1.1", "m1.2", "m1.3", "m1.4", "single"]
        seqs = [h["seq"] for h in headers]
        assert seqs == list(range(seqs[0], seqs[0] + 6)), seqs
        ts = [h["ts"] for h in headers]
        assert ts == sorted(ts) and ts[0] > 0, ts
        for h, f in zip(headers, frames, strict=True):
            assert (h["type"], h["agent"], h["run"], h["experiment"], h["peer"]) == (
                "topic_message", "poet", "r-1", "x-9", poet.peer_id), h
            assert f[0].endswith(b"/poet/r-1/topic_message"), f[0]
        logged = [(h, b) for h, b in replay_all(poet) if h.get("peer") == poet.peer_id]
        assert [(h["seq"], h["id"], b) for h, b in logged] == [
            (h["seq"], h["id"], f[3]) for h, f in zip(headers, frames, strict=True)]


def test_a_refused_body_is_named_by_index_and_its_siblings_are_kept(hub: dict) -> None:
    with raw_peers(hub["endpoint"], "liar") as (liar,), subscriber(liar) as sub:
        before = liar.status()["counters"]
        bodies = [topic("kept 0"), topic("lie", type_="agent_end"), topic("kept 2"),
                  b"\x93\x01\x02\x03", b"x" * (1024 * 1024 + 1), topic("kept 5")]
        liar.send({**HEADER, "id": "m2"}, *bodies)
        for index in (1, 3):
            header, _ = liar.expect(lambda h, i=index: h["kind"] == "error"
                                    and h["id"] == f"m2.{i}")
            assert header["code"] == "bad_event", header
            assert f"(body {index} of 6)" in header["error"], header
        liar.send({**HEADER, "id": "end"}, topic("end"))
        texts = [msgspec.msgpack.decode(f[3])["text"] for f in published_until(sub, "end")]
        assert texts == ["kept 0", "kept 2", "kept 5", "end"], texts
        logged = [h["id"] for h, _ in replay_all(liar) if h.get("peer") == liar.peer_id]
        assert logged == ["m2.0", "m2.2", "m2.5", "end"], logged
        counters = liar.status()["counters"]
        assert counters.get("bad_events", 0) - before.get("bad_events", 0) == 2
        # the oversized body is dropped as a single one would be: counted, no error
        assert counters.get("oversize_events", 0) - before.get("oversize_events", 0) == 1
        liar.sync()
        assert not [h for h, _ in liar.inbox if h["kind"] == "error"], liar.inbox


def test_a_hub_only_type_refuses_every_body_and_too_many_bodies_refuse_the_message(
        hub: dict) -> None:
    with raw_peers(hub["endpoint"], "rogue") as (rogue,), subscriber(rogue) as sub:
        forged = msgspec.msgpack.encode({"type": "peer_joined", "peer": "hub", "name": "f"})
        rogue.send({**HEADER, "type": "peer_joined", "id": "m3"}, forged, forged)
        for index in (0, 1):
            header, _ = rogue.expect(lambda h, i=index: h["kind"] == "error"
                                     and h["id"] == f"m3.{i}")
            assert header["code"] == "bad_event" and "`peer_joined`" in header["error"], header
        rogue.send({**HEADER, "id": "m4"}, *[topic("many")] * (MAX_BODIES + 1))
        header, _ = rogue.expect(lambda h: h["kind"] == "error" and h["id"] == "m4")
        assert header["code"] == "bad_event" and str(MAX_BODIES) in header["error"], header
        rogue.send({**HEADER, "id": "ok"}, topic("ok"))
        frames = published_until(sub, "ok")
        assert [msgspec.msgpack.decode(f[2])["id"] for f in frames] == ["ok"]
        assert [h["id"] for h, _ in replay_all(rogue) if h.get("peer") == rogue.peer_id] == ["ok"]


def test_a_mixed_type_message_makes_each_body_an_event_of_its_own_type(hub: dict) -> None:
    """Header `type` "*": each body is an event of the `type` it names (docs/protocol.md §4),
    published under its own topic; a body naming a hub-only type, no type or "*" is refused by
    index and its siblings are kept."""
    with raw_peers(hub["endpoint"], "mixer") as (mixer,), subscriber(mixer) as sub:
        start = msgspec.msgpack.encode({"type": "turn_start", "turn": 1})
        forged = msgspec.msgpack.encode({"type": "worker_lost", "peer": "p", "name": "w"})
        untyped = msgspec.msgpack.encode({"topic": "t", "text": "no type"})
        starred = msgspec.msgpack.encode({"type": "*", "text": "star"})
        bodies = [start, topic("one"), forged, untyped, starred, topic("end")]
        mixer.send({**HEADER, "type": "*", "id": "mx"}, *bodies)
        for index in (2, 3, 4):
            header, _ = mixer.expect(lambda h, i=index: h["kind"] == "error"
                                     and h["id"] == f"mx.{i}")
            assert header["code"] == "bad_event", header
            assert f"(body {index} of 6)" in header["error"], header
        frames: list[list[bytes]] = []
        while len(frames) < 3:
            assert sub.poll(TIMEOUT * 1000), f"published so far: {frames}"
            got = sub.recv_multipart()
            if got[0] != b"hb":
                frames.append(got)
        headers = [msgspec.msgpack.decode(f[2]) for f in frames]
        assert [h["type"] for h in headers] == ["turn_start", "topic_message", "topic_message"]
        assert [h["id"] for h in headers] == ["mx.0", "mx.1", "mx.5"]
        assert [f[3] for f in frames] == [start, topic("one"), topic("end")]
        assert frames[0][0].endswith(b"/poet/r-1/turn_start"), frames[0][0]
        assert frames[1][0].endswith(b"/poet/r-1/topic_message"), frames[1][0]
        for h in headers:
            assert (h["agent"], h["run"], h["experiment"], h["peer"]) == (
                "poet", "r-1", "x-9", mixer.peer_id), h
        logged = [(h["id"], h["type"]) for h, _ in replay_all(mixer)
                  if h.get("peer") == mixer.peer_id]
        assert logged == [("mx.0", "turn_start"), ("mx.1", "topic_message"),
                          ("mx.5", "topic_message")], logged
