"""The client sends held events that share every header field but the id (and, to a hub whose
welcome has `mixed_types`, but the type: header type `*`) as one multi-body `event` message
(docs/protocol.md §4), bounded in bodies and bytes, and only to a hub whose welcome says it
takes them; what subscribers and the log see is unchanged.

Two ends: a real hub (order, confirmation, refusal of one body), and a recording hub — a plain
ROUTER socket in a thread speaking the protocol — to see exactly what messages the client sends."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import anyio
import msgspec
import pytest
import zmq

from agent_bus.bus import events as ev
from agent_bus.bus import protocol as p
from agent_bus.bus.client import connect
from agent_bus.bus.errors import HubLost
from agent_bus.bus.outbox import COALESCE_BYTES, COALESCE_EVENTS, EVENT_LINGER
from tests.support import until


def body(type_: str, text: str, size: int = 0) -> bytes:
    """A valid event of `type_` carrying `text` (other types: a map with that `type`)."""
    if type_ == "llm_retry":
        return ev.encode_event(ev.LlmRetry(attempt=1, delay=0.0, error=text))
    return msgspec.msgpack.encode({"type": type_, "topic": "t", "text": text + "y" * size})


def text_of(event: ev.Event) -> str:
    return event.error if isinstance(event, ev.LlmRetry) else getattr(event, "text", "?")


class RecordingHub:
    """Welcomes every peer (with `event_bodies` as given; None: a welcome without the field, as
    from a hub older than multi-body events), records every `event` message's frames, and
    answers requests (the client's closing confirmation) with an empty replay batch."""

    def __init__(self, event_bodies: int | None, mixed_types: bool = False) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        welcome: dict[str, Any] = {
            "peer": "rec", "hub_session": "rec", "events": "tcp://127.0.0.1:9",
            "heartbeat_interval": 60.0, "liveness": 3, "max_message_bytes": 16 * 2**20}
        if event_bodies is not None:
            welcome["event_bodies"] = event_bodies
        if mixed_types:
            welcome["mixed_types"] = True
        self.welcome = msgspec.msgpack.encode(welcome)
        self.events: list[tuple[dict[str, Any], list[bytes]]] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopping.is_set():
            if not self.sock.poll(50):
                continue
            ident, sig, header_frame, *bodies = self.sock.recv_multipart()
            header = msgspec.msgpack.decode(header_frame)
            if header["kind"] == "hello":
                reply = msgspec.msgpack.encode({"kind": "welcome", "id": header.get("id", "")})
                self.sock.send_multipart([ident, sig, reply, self.welcome])
            elif header["kind"] == "event":
                self.on_event(header, bodies)
            elif header["kind"] == "request":  # `hub.replay`, the client's confirmation
                reply = msgspec.msgpack.encode({"kind": "reply", "id": header["id"]})
                batch = msgspec.msgpack.encode({"events": [], "upto": 0, "head": 0})
                self.sock.send_multipart([ident, sig, reply, batch])

    def on_event(self, header: dict[str, Any], bodies: list[bytes]) -> None:
        """An `event` message arrived (on the recording thread)."""
        self.events.append((header, bodies))

    def bodies(self) -> list[bytes]:
        return [b for _, bodies in list(self.events) for b in bodies]

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(5)
        self.sock.close(0)
        self.ctx.term()


@contextmanager
def recording_hub(event_bodies: int | None, mixed_types: bool = False) -> Iterator[RecordingHub]:
    rec = RecordingHub(event_bodies, mixed_types)
    try:
        yield rec
    finally:
        rec.close()


# Interleaved runs of keys: (type, run) changes every few events, and back.
PATTERN = [("topic_message", "r1")] * 5 + [("topic_message", "r2")] * 3 + [
    ("llm_retry", "r1")] + [("topic_message", "r1")] * 4 + [("llm_retry", "r1")] * 2


async def publish_pattern(rec: RecordingHub) -> None:
    """Publish PATTERN three times over in one loop iteration through a client of `rec`; wait
    until every body is recorded, in order."""
    async with connect(rec.endpoint, name="coalescer") as peer:
        sent = []
        for i, (type_, run) in enumerate(PATTERN * 3):  # all held in one loop iteration
            sent.append(body(type_, str(i)))
            await peer.publish_raw(type_, sent[-1], agent="a", run=run, experiment="x")
        await until(lambda: len(rec.bodies()) == len(sent), what="every body recorded")
        assert rec.bodies() == sent  # order kept across keys


@pytest.mark.anyio
async def test_runs_of_one_header_share_a_message_in_order() -> None:
    with recording_hub(p.MAX_EVENT_BODIES) as rec:
        await publish_pattern(rec)
        runs = 1 + sum(PATTERN[i] != PATTERN[i - 1] for i in range(1, len(PATTERN)))
        runs = runs * 3 - 2 * (PATTERN[0] == PATTERN[-1])
        assert len(rec.events) == runs, [len(b) for _, b in rec.events]
        for header, bodies in rec.events:
            assert {msgspec.msgpack.decode(b)["type"] for b in bodies} == {header["type"]}
            assert (header["agent"], header["experiment"]) == ("a", "x"), header
        assert len({h["id"] for h, _ in rec.events}) == len(rec.events)  # ids distinct


@pytest.mark.anyio
async def test_with_mixed_types_runs_of_one_run_share_a_message_whatever_their_types() -> None:
    """A hub whose welcome has `mixed_types` takes one message for events of several types:
    header `type` "*" when they differ, the type itself when they do not."""
    with recording_hub(p.MAX_EVENT_BODIES, mixed_types=True) as rec:
        await publish_pattern(rec)
        runs = [run for _, run in PATTERN * 3]
        expected = 1 + sum(runs[i] != runs[i - 1] for i in range(1, len(runs)))
        assert len(rec.events) == expected, [len(b) for _, b in rec.events]
        for header, bodies in rec.events:
            types = {msgspec.msgpack.decode(b)["type"] for b in bodies}
            assert header["type"] == (types.pop() if len(types) == 1 else p.MIXED_TYPES)
        assert p.MIXED_TYPES in {h["type"] for h, _ in rec.events}
        assert "topic_message" in {h["type"] for h, _ in rec.events}  # r2: one type


@pytest.mark.anyio
async def test_a_message_is_bounded_in_bodies_and_bytes() -> None:
    with recording_hub(p.MAX_EVENT_BODIES) as rec:
        async with connect(rec.endpoint, name="bounded") as peer:
            many = 2 * COALESCE_EVENTS + 10
            for i in range(many):
                await peer.publish_raw("topic_message", body("topic_message", str(i)), run="n")
            size = COALESCE_BYTES // 3 + 1  # two fit under the bound, three do not
            for _ in range(5):
                await peer.publish_raw("topic_message", body("topic_message", "big", size),
                                       run="big")
            await until(lambda: len(rec.bodies()) == many + 5, what="every body recorded")
            counts = [len(b) for h, b in rec.events]
            small = [n for (h, _), n in zip(rec.events, counts, strict=True) if h["run"] == "n"]
            big = [n for (h, _), n in zip(rec.events, counts, strict=True) if h["run"] == "big"]
            assert sum(small) == many and max(small) <= COALESCE_EVENTS and len(small) >= 3
            assert sum(big) == 5 and max(big) == 2, big


@pytest.mark.anyio
@pytest.mark.parametrize("event_bodies", [None, 1])
async def test_a_hub_that_takes_one_body_gets_one_body(event_bodies: int | None) -> None:
    """A welcome without `event_bodies` is a hub from before multi-body events: it would drop
    a multi-body message as malformed, so every event goes alone."""
    with recording_hub(event_bodies) as rec:
        async with connect(rec.endpoint, name="compatible") as peer:
            for i in range(20):
                await peer.publish_raw("topic_message", body("topic_message", str(i)), run="r")
            await until(lambda: len(rec.bodies()) == 20, what="every body recorded")
            assert [len(b) for _, b in rec.events] == [1] * 20


def logged(peer_events: list[tuple[p.Header, bytes]]) -> list[str]:
    return [text_of(ev.decode_event(b)) for _, b in peer_events]


async def replay_run(peer: Any, run: str) -> list[tuple[p.Header, bytes]]:
    batch = p.decode(await peer.request(p.HUB_REPLAY, p.encode(p.ReplayRequest(since=0))),
                     p.ReplayBatch)
    out = [(p.decode_header(h), b) for h, b in batch.events]
    return [(h, b) for h, b in out if h.run == run]


@pytest.mark.anyio
async def test_through_a_hub_subscribers_and_the_log_see_one_event_per_body(hub: dict) -> None:
    async with connect(hub["endpoint"], name="watcher") as watcher, \
            connect(hub["endpoint"], name="burst") as peer:
        async with watcher.subscribe() as sub:  # subscribed when entered
            texts = [str(i) for i in range(len(PATTERN) * 3)]
            for text, (type_, run) in zip(texts, PATTERN * 3, strict=True):
                await peer.publish_raw(type_, body(type_, text), agent="a", run=f"s-{run}")
            head = await peer.confirm()  # exact: every body logged, none refused
            seen: list[tuple[str, str, str]] = []
            with anyio.fail_after(10):
                async for envelope in sub:
                    header = envelope.header
                    if header.run.startswith("s-"):
                        seen.append((header.type, header.run, text_of(envelope.event)))
                    if len(seen) == len(texts):
                        break
        expected = [(t, f"s-{r}", text) for text, (t, r) in zip(texts, PATTERN * 3, strict=True)]
        assert seen == expected
        assert head >= len(texts)
        assert peer.counters.get("events_refused", 0) == 0


@pytest.mark.anyio
async def test_a_refused_body_is_reported_and_its_siblings_logged(hub: dict) -> None:
    async with connect(hub["endpoint"], name="mixed") as peer:
        for i in range(6):  # body 3 lies about its type; all six share one message
            type_ = "agent_end" if i == 3 else "topic_message"
            await peer.publish_raw("topic_message", body(type_, str(i)), run="mixed")
        with pytest.raises(HubLost, match="1 events"):
            await peer.confirm()
        assert peer.counters["events_refused"] == 1
        events = await replay_run(peer, "mixed")
        assert logged(events) == ["0", "1", "2", "4", "5"]
        assert [h.id.rsplit(".", 1)[1] for h, _ in events] == ["0", "1", "2", "4", "5"]
        await peer.publish_raw("topic_message", body("topic_message", "6"), run="mixed",
                               confirm=True)  # nothing missing since: no error


@pytest.mark.anyio
async def test_events_of_several_loop_iterations_linger_into_one_message() -> None:
    """Events held alone wait up to EVENT_LINGER for company while the peer is sending: ones
    published a loop iteration apart (a turn's tool results arrive one by one) share a message;
    a request sent meanwhile takes them along before it; one held alone still goes out by itself."""
    with recording_hub(p.MAX_EVENT_BODIES, mixed_types=True) as rec:
        async with connect(rec.endpoint, name="lingerer") as peer:
            sent = []
            started = time.monotonic()
            await peer.confirm()  # a request: the channel is not idle, so events linger
            for i in range(4):
                sent.append(body("topic_message", str(i)))
                await peer.publish_raw("topic_message", sent[-1], agent="a", run="r")
                await anyio.lowlevel.checkpoint()  # the next one comes in a later iteration
            await peer.confirm()  # a request: the held events go out first
            elapsed = time.monotonic() - started
            assert rec.bodies() == sent
            # One message, unless this machine took longer than a linger between sends: each
            # message but the last waited a whole linger, or followed an idle linger's length.
            assert len(rec.events) <= 1 + int(elapsed / EVENT_LINGER), (len(rec.events), elapsed)
            if elapsed < EVENT_LINGER:
                assert len(rec.events) == 1
            messages = len(rec.events)
            sent.append(body("topic_message", "alone"))
            await peer.publish_raw("topic_message", sent[-1], agent="a", run="r")
            await until(lambda: rec.bodies() == sent, what="the lone event sent after its linger")
            assert len(rec.events) == messages + 1


@pytest.mark.anyio
async def test_an_event_on_an_idle_channel_goes_at_the_end_of_the_loop_iteration() -> None:
    """Nothing sent within EVENT_LINGER: nothing is coming for a held event to ride with, so it
    goes once the loop iteration ends (a streamed delta 10 ms after the last one waited the
    whole linger for nobody), not a linger later."""
    with recording_hub(p.MAX_EVENT_BODIES, mixed_types=True) as rec:
        async with connect(rec.endpoint, name="idle") as peer:
            await until(lambda: time.monotonic() - peer.outbox.sent_at > EVENT_LINGER,
                        what="the channel idle for a linger")
            event = body("topic_message", "delta")
            await peer.publish_raw("topic_message", event, agent="a", run="r")
            assert peer.outbox.items, "held for the end of the iteration"
            await anyio.lowlevel.checkpoint()  # the iteration ends: the flush runs before us
            assert not peer.outbox.items, "still held: it waits a linger on an idle channel"
            await until(lambda: rec.bodies() == [event], what="the event at the hub")
            assert len(rec.events) == 1
