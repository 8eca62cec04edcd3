"""Subscriptions: live events from the hub's PUB socket, read on their own SUB socket by the
consumer's task, with replays from the event log so that nothing is missed or repeated.

See `Subscription` and docs/protocol.md ("Events").
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import zmq
import zmq.asyncio
from zmq.backend import Socket as _BackendSocket

from agent_bus.bus import events as ev
from agent_bus.bus import protocol as p
from agent_bus.bus.backoff import Backoff, retry
from agent_bus.bus.errors import HubLost, Overloaded, ProtocolError
from agent_bus.bus.transport import FdWaiter, PollWaiter, Waiter, transport_kind

if TYPE_CHECKING:
    from agent_bus.bus.link import PeerLink

log = logging.getLogger("bus.client")

_brecv = _BackendSocket.recv  # the plain non-blocking receive, also on a zmq.asyncio socket
_NOBLOCK = int(zmq.NOBLOCK)


def recv_published(sock: zmq.Socket[Any]) -> list[bytes]:
    """One message from the event socket, without blocking (zmq.Again when there is none).

    The hub publishes `topic, signature, header[, body]` (docs/protocol.md §2): the topic and the
    signature are always followed by another frame, so they are received straight into bytes
    (a `zmq.Frame`, needed to see whether more follows, costs ~0.5 us more per frame; this is
    the subscriber's hottest line). If a message were shorter, the frame read in its place
    starts the next message, whose frames then fail the signature check and are dropped
    (counted `unknown`): one more message lost, and the reads are back on a message boundary."""
    frames = [_brecv(sock, _NOBLOCK, True), _brecv(sock, _NOBLOCK, True)]
    frame = _brecv(sock, _NOBLOCK, False)
    frames.append(frame.bytes)
    while frame.more:
        frame = _brecv(sock, _NOBLOCK, False)
        frames.append(frame.bytes)
    return frames


REPLAY_RETRY_FOR = 30.0  # a subscription asks `hub.replay` again this long (hub restarting)
# While the peer reconnects or the hub's replay reader drains: soon at first, then every 0.5 s.
REPLAY_BACKOFF = Backoff(first=0.05, factor=2.0, cap=0.5, jitter=0.2)


class Envelope(msgspec.Struct):
    """One event as a subscriber sees it: the stamped header and the decoded body."""

    header: p.Header
    event: ev.Event


class Subscription:
    """Async iterator of `Envelope`s with no hole and no duplicate (see docs/protocol.md).

    With `since`, logged events after that seq are replayed first (a batch at a time, as they
    are read), then the stream continues live. Without topic filters, a jump in `seq` (a slow
    reader's dropped messages, or a loss at the tail noticed from the hub's heartbeat) is filled
    from the log when `fill_gaps`, or reported as a `Gap` event otherwise.

    When the peer moves to another hub (its welcome names another event endpoint, `follow`),
    the subscription moves too: a new SUB socket on the new endpoint, subscribed before the
    log is replayed from the last seq delivered to the head, then live again; what the replay
    delivered is skipped live (docs/protocol.md section 5, "Following the hub").
    """

    def __init__(self, peer: PeerLink, topics: list[str], since: int | None, fill_gaps: bool) -> None:
        self.peer = peer
        self.topics = topics
        self.since = since
        self.fill_gaps = fill_gaps
        self.last_seq = since if since is not None else -1
        self.filled = 0
        self.unknown = 0
        #: decodes each event's body: counts (and names) what it skips; a reader may put its
        #: own in place to name itself in those lines and read the counts
        self.tally = ev.EventTally("subscription")
        self._sock: zmq.Socket[Any] | None = None
        self._fdw: Waiter | None = None
        self._backlog: deque[Envelope] = deque()
        self._held: list[bytes] | None = None
        # With `since`, the log is replayed one batch at a time as the events are read, not
        # all at once on entry: `watch --since 0` on a big log shows its first event at once and
        # holds one batch, not the whole log. Live messages wait in the SUB queue meanwhile;
        # any it drops are a gap in seq, filled from the log like any other.
        self._catching_up = False
        self._endpoint = ""  # the event endpoint the SUB socket is connected to
        self._move_to: str | None = None  # another hub's event endpoint to follow (`follow`)

    async def __aenter__(self) -> Subscription:
        self._open(self.peer.events_endpoint)
        self.peer.subscriptions.add(self)
        try:
            await self._await_subscription()
            self._catching_up = self.since is not None
        except BaseException:
            self._close()
            raise
        return self

    def _open(self, endpoint: str) -> None:
        portable = transport_kind(asyncio.get_running_loop()) == "portable"
        # A plain socket watched with `add_reader`, or a zmq.asyncio one polled (see
        # bus/transport.py); either way it is read with non-blocking backend calls.
        sock: zmq.Socket[Any] = (self.peer.ctx.socket(zmq.SUB) if portable
                                 else zmq.Socket(self.peer.ctx, zmq.SUB))
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        if self.peer.curve is not None:
            self.peer.curve.apply(sock)
        for topic in self.topics or [""]:
            sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        if self.topics:
            sock.setsockopt(zmq.SUBSCRIBE, p.HEARTBEAT_TOPIC)
        sock.connect(endpoint)
        self._sock = sock
        self._endpoint = endpoint
        self._fdw = (PollWaiter(sock) if isinstance(sock, zmq.asyncio.Socket)
                     else FdWaiter(sock))

    def follow(self, endpoint: str) -> None:
        """The peer was welcomed by a hub publishing on `endpoint`: when that is not where this
        subscription listens, move there at the next read (`_follow`); wakes a waiting reader."""
        if endpoint == self._endpoint or self._sock is None:
            self._move_to = None
            return
        self._move_to = endpoint
        fdw = self._fdw
        waiter = fdw.waiter if fdw is not None else None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _follow(self) -> None:
        """Listen on the new hub's event endpoint, then replay the log from the last seq
        delivered up to its head (queued on the backlog): live messages that arrive meanwhile
        wait in the new socket and those already replayed are skipped (`seq <= last_seq`).
        Before any event or heartbeat was seen (`last_seq < 0`) there is nothing to resume."""
        endpoint, self._move_to = self._move_to, None
        if endpoint is None:
            return
        log.info("subscription moving to the events of %s from seq %d", endpoint, self.last_seq)
        self._close()
        self._held = None
        self._open(endpoint)
        await self._await_subscription()
        if self.last_seq >= 0:
            await self._replay_until(None)

    async def __aexit__(self, *exc_info: Any) -> None:
        self._close()

    def _close(self) -> None:
        fdw, self._fdw, self._sock = self._fdw, None, None
        if fdw is not None:
            fdw.close()

    async def _recv(self) -> list[bytes] | None:
        """The next live message; None when the hub moved (`follow`: the caller follows)."""
        while True:
            sock, fdw = self._sock, self._fdw
            if sock is None or fdw is None:
                raise StopAsyncIteration
            if self._move_to is not None:
                return None
            try:
                return recv_published(sock)
            except zmq.Again:
                pass
            await fdw.wait()

    async def _await_subscription(self) -> None:
        """Hold the first live message: once one arrives the subscription is in place.

        The hub publishes a heartbeat (topic `hb`, carrying the latest seq) every heartbeat
        interval, so this takes at most about one interval.
        """
        interval = self.peer.welcome.heartbeat_interval if self.peer.welcome else 1.0
        with anyio.move_on_after(interval * 3):
            self._held = await self._recv()
            if self._held is not None:
                return
        log.warning("no message on %s within %.1fs; events before now may be missed",
                    self.peer.events_endpoint, interval * 3)

    async def _replay_until(self, until: int | None) -> None:
        """Queue logged events with last_seq < seq (< until, when given) on the backlog.

        Replay is finished only when a batch reaches the head it names (`upto >= head`) or
        `until`: a batch may end early (`replay_bytes`) or hold no matching event at all, and
        neither means "caught up". A range the log no longer holds is queued as a `Gap`."""
        cursor = max(self.last_seq, 0)
        stop = math.inf if until is None else until - 1  # the last seq wanted
        while cursor < stop:
            cursor, at_head = await self._replay_step(cursor, stop)
            if at_head:
                break
        # Everything up to the cursor has been seen in the log (filtered ones are not ours).
        self.last_seq = max(self.last_seq, cursor if until is None else min(cursor, until - 1))
        if until is not None and self.last_seq < stop:  # announced, yet not in the log
            self._missed(self.last_seq + 1, until - 1, "not in the hub's event log")

    async def _catch_up(self) -> None:
        """One batch of the replay from `since`; the catch-up ends at the head it names."""
        cursor, at_head = await self._replay_step(max(self.last_seq, 0), math.inf)
        self.last_seq = max(self.last_seq, cursor)
        self._catching_up = not at_head

    async def _replay_step(self, cursor: int, stop: float) -> tuple[int, bool]:
        """Queue one `hub.replay` batch from `cursor` on the backlog: (its end, head reached)."""
        batch = await self._replay_batch(cursor)
        if batch.gap is not None:
            self._missed(batch.gap.first, min(batch.gap.last, stop), batch.gap.reason)
        self._queue_replayed(batch.events, stop)
        if batch.upto >= batch.head:
            return batch.head, True
        if batch.upto <= cursor:  # a hub that does not move on would loop us forever
            raise ProtocolError(f"`hub.replay` from {cursor} answered upto={batch.upto} "
                                f"< head={batch.head} without progress")
        return batch.upto, False

    async def _replay_batch(self, cursor: int) -> p.ReplayBatch:
        """One `hub.replay` round trip. It is idempotent, so a hub that is restarting (the
        peer is not welcomed yet) or busy is asked again until REPLAY_RETRY_FOR has passed."""
        body = p.encode(p.ReplayRequest(since=cursor, topics=self.topics))

        async def ask() -> p.ReplayBatch:
            return p.decode(await self.peer.request(p.HUB_REPLAY, body), p.ReplayBatch)

        return await retry(ask, retry_on=(HubLost, Overloaded), policy=REPLAY_BACKOFF,
                           deadline=time.monotonic() + REPLAY_RETRY_FOR)

    def _queue_replayed(self, events: list[tuple[bytes, bytes]], stop: float) -> None:
        for header_bytes, body in events:
            envelope = self._decode(header_bytes, body)
            if envelope is None:
                continue
            seq = envelope.header.seq
            if seq > stop:
                return
            if seq > self.last_seq:
                self._backlog.append(envelope)
                self.last_seq = seq

    def _missed(self, first: int, last: float, reason: str) -> None:
        """Queue a `Gap` for seqs the log no longer holds (never for what it can replay)."""
        first = max(first, self.last_seq + 1)
        if last < first:
            return
        gap = ev.Gap(first=first, last=int(last), reason=reason)
        self._backlog.append(Envelope(p.Header(kind=p.EVENT, type="gap", seq=0), gap))
        self.last_seq = int(last)

    def _decode(self, header_bytes: bytes, body: bytes) -> Envelope | None:
        try:
            header = p.decode_header(header_bytes)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.unknown += 1
            return None
        event = self.tally.decode(header.seq, header.type, body)
        if event is None:
            self.unknown += 1
            return None
        return Envelope(header, event)

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Envelope:
        while True:
            if self._backlog:
                return self._backlog.popleft()
            if self._catching_up:
                await self._catch_up()
                continue
            envelope = await self._next_live()
            if envelope is not None:
                return envelope
            if self._move_to is not None:
                await self._follow()

    async def _next_live(self) -> Envelope | None:
        frames = self._held
        if frames is not None:
            self._held = None
        else:
            sock = self._sock
            try:  # a message is usually waiting: no coroutine for the read (see `_recv`)
                frames = recv_published(sock) if sock is not None else await self._recv()
            except zmq.Again:
                frames = await self._recv()
            if frames is None:
                return None  # the hub moved: `__anext__` follows it
        if len(frames) < 3 or frames[1] != p.SIGNATURE:
            self.unknown += 1
            return None
        if frames[0] == p.HEARTBEAT_TOPIC:
            try:
                hb = p.decode_header(frames[2])
            except (msgspec.DecodeError, msgspec.ValidationError):
                self.unknown += 1
                return None
            if self.last_seq < 0:
                self.last_seq = hb.seq
            elif not self.topics and hb.seq > self.last_seq:
                await self._on_gap(hb.seq + 1)
            return None
        if len(frames) != 4:
            self.unknown += 1
            return None
        try:
            header = p.decode_header(frames[2])
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.unknown += 1
            return None
        seq = header.seq
        if seq <= self.last_seq:
            return None  # already delivered by a replay
        if not self.topics and self.last_seq >= 0 and seq > self.last_seq + 1:
            await self._on_gap(seq)
            if seq <= self.last_seq:
                return None
        if not frames[3]:  # a stub: the body was too large for the live stream; read the log
            await self._replay_until(seq + 1)
            return None
        event = self.tally.decode(seq, header.type, frames[3])
        self.last_seq = seq
        if event is None:
            self.unknown += 1
            return None
        envelope = Envelope(header, event)
        if self._backlog:  # the gap's events go first
            self._backlog.append(envelope)
            return None
        return envelope

    async def _on_gap(self, next_seq: int) -> None:
        """Seqs last_seq+1 .. next_seq-1 were not seen: fill them from the log, or report them."""
        first = self.last_seq + 1
        if self.fill_gaps:
            before = len(self._backlog)
            await self._replay_until(next_seq)
            self.filled += len(self._backlog) - before
            return
        self._missed(first, next_seq - 1, "")
