"""The hub's event pipeline: stamp -> log -> publish, heartbeats on the XPUB socket, retention,
and the hand-over of `hub.replay` to the log reader (bus/replay_reader.py).

The hub's routing loop only stamps, appends one transaction per pass and publishes; reading the
log for a replay (up to `replay_bytes` of rows, decoding and filtering them, encoding the reply)
happens in the reader's process, so a `busctl watch --since 0` on a big log never stalls a
request. The loop takes at most `REPLIES_PER_PASS` finished replies per pass, and sends them as
the pacer lets it (bus/replay_pacing.py: at `replay_pace_bytes` a second while requests flow).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import zmq
from zmq.backend import Socket as _BackendSocket

from agent_bus.bus import events as ev
from agent_bus.bus import protocol as p
from agent_bus.bus.errors import Overloaded
from agent_bus.bus.recent import RecentEvents
from agent_bus.bus.replay_pacing import ReplayPacer
from agent_bus.bus.replay_reader import REPLAY_QUEUE, ReplayReader
from agent_bus.bus.store import Retention, Row, StoreError, open_store

log = logging.getLogger("bus.hub")

# New subscriptions are answered by a heartbeat at most once per this many seconds: a lone one at
# once (a prompt's subscription waited the whole gap: 39% of starting a run), a flood of
# them coalesced, so a subscriber cannot make the hub flood the stream.
SUBSCRIBE_BEAT_GAP = 0.002
DRAIN_LIMIT = 4096  # subscription messages read per pass
LOG_RETRY = 1.0  # seconds between attempts to write an event log that failed (e.g. disk full)
_TOPIC_CACHE_MAX = 4096  # distinct (type, agent, run) topics remembered
_COPY_THRESHOLD = 65536

_bsend = _BackendSocket.send
_NOBLOCK = int(zmq.NOBLOCK)
_MORE_NOBLOCK = int(zmq.NOBLOCK | zmq.SNDMORE)
_encode = msgspec.msgpack.Encoder().encode
_decode_header = msgspec.msgpack.Decoder(p.Header).decode
_time = time.time

Bump = Callable[..., int]  # Counters.bump(name, n=1)


class EventPipeline:
    """Stamp -> log -> publish. The routing loop calls `stamp`/`flush`; nothing here blocks.

    `refuse(rows)` is called with a batch the log refused (disk full): the hub tells each
    publisher `log_unavailable`."""

    def __init__(self, ctx: zmq.Context[Any], pub: zmq.Socket[Any], path: Path | None,
                 session: str, bump: Bump, refuse: Callable[[list[Row]], None],
                 replay_bytes: int, inline_bytes: int, retention: Retention,
                 replay_priority: str = "idle", replay_pace_bytes: int = 0,
                 store: str = "", max_event_bytes: int = 0, recent_bytes: int = 0) -> None:
        self.pub = pub
        self.inline_bytes = inline_bytes  # larger bodies are published as stubs (see flush)
        self.session = session
        self._bump = bump
        self._refuse = refuse
        self.replay_bytes = replay_bytes
        self.replay_peak = 0  # largest `hub.replay` batch sent, in bytes (shown in status)
        # the event store (bus/store/): SQLite at `path` (store ""), or a JetStream stream
        self.log = open_store(store, path, session, retention, max_event_bytes)
        self.retention = retention
        self.seq = self.log.last_seq()
        self.rows: list[Row] = []  # the batch: (seq, ts, type, agent, run, experiment, header, body)
        self._topics: list[bytes] = []  # the batch's topics, in step with rows
        self._batch_bytes = 0  # the batch's headers' and bodies' bytes (for `recent`)
        self._topic_cache: dict[tuple[str, str, str], bytes] = {}
        self._ended_runs: set[str] = set()  # runs whose deltas can go (retention.deltas_until_end)
        self.sub_beat_at = math.inf  # when the heartbeat answering new subscriptions is due
        self._beat_at = -math.inf  # when the last heartbeat went out
        # Event log not writable (disk full, I/O error): events are refused, not stamped, until
        # a retry every LOG_RETRY seconds succeeds. `log_error` says why (shown in status).
        self.log_error = ""
        self.refusing = False
        self._retry_at = math.inf
        self.reader = ReplayReader(ctx, self.log.reader_uri, replay_bytes, replay_priority)
        self.pacer = ReplayPacer(replay_pace_bytes)  # the reader's answers wait here to be sent
        # the newest logged events: a live subscriber's gap is answered from them at once
        self.recent = RecentEvents(recent_bytes)

    def close(self) -> None:
        self.reader.close()
        self.log.close()

    # --- stamp, log, publish ---------------------------------------------------------------

    def stamp(self, header: p.Header, body: bytes) -> None:
        """Stamp seq/ts and add the event to the pass's batch (counted in `events` at flush)."""
        self.seq = seq = self.seq + 1
        header.seq = seq
        header.ts = ts = _time()
        header_bytes = _encode(header)
        type_, agent, run = header.type, header.agent, header.run
        topic = self._topic_cache.get((type_, agent, run))
        if topic is None:
            topic = self._topic(type_, agent, run)
        self._topics.append(topic)
        self.rows.append((seq, ts, type_, agent, run, header.experiment, header_bytes, body))
        self._batch_bytes += len(header_bytes) + len(body)
        if type_ == "message_end" and run and self.retention.deltas_until_end:
            self._ended_runs.add(run)

    def _topic(self, type_: str, agent: str, run: str) -> bytes:
        cache = self._topic_cache
        if len(cache) >= _TOPIC_CACHE_MAX:
            cache.clear()
        topic = cache[(type_, agent, run)] = p.event_topic(ev.event_family(type_), agent, run,
                                                           type_)
        return topic

    def emit(self, event: ev.Event) -> None:
        """The hub's own event (`peer: "hub"`); refused like anyone's while the log is down."""
        if self.refusing:
            self._bump("events_refused")
            return
        header = p.Header(kind=p.EVENT, id=p.new_id(), type=ev.event_type(event), peer="hub",
                          session=self.session)
        self.stamp(header, ev.encode_event(event))

    def flush(self) -> None:
        """Log the batch in one transaction, then publish it (never before it is durable)."""
        rows = self.rows
        if not rows:
            return
        topics = self._topics
        size = self._batch_bytes
        self.rows = []
        self._topics = []
        self._batch_bytes = 0
        if not self._append(rows):
            return
        self._bump("events", len(rows))
        self.recent.add(rows, topics, size)
        pub = self.pub
        sig = p.SIGNATURE
        inline = self.inline_bytes
        dropped = stubs = 0
        for topic, row in zip(topics, rows, strict=True):
            body = row[7]
            if len(body) > inline:  # a stub: subscribers read the body from the log
                body = b""
                stubs += 1
            try:  # PUB never blocks: a subscriber at its HWM just misses the message
                _bsend(pub, topic, _MORE_NOBLOCK)
                _bsend(pub, sig, _MORE_NOBLOCK)
                _bsend(pub, row[6], _MORE_NOBLOCK)
                if len(body) < _COPY_THRESHOLD:
                    _bsend(pub, body, _NOBLOCK)
                else:  # a big body goes to libzmq without a copy
                    _bsend(pub, body, _NOBLOCK, copy=False)
            except zmq.Again:
                dropped += 1
        if dropped:
            self._bump("publish_dropped_hwm", dropped)
        if stubs:
            self._bump("published_stubs", stubs)

    def _append(self, rows: list[Row]) -> bool:
        """Log the batch (durable before anyone can see it); False when it was refused instead."""
        try:
            self.log.append(rows)
        except StoreError as exc:
            return self._append_failed(rows, exc)
        if self.log_error:
            log.warning("event log %s is writable again; logging and publishing events",
                        self.log.where)
            self.log_error = ""
        return True

    def _append_failed(self, rows: list[Row], exc: StoreError) -> bool:
        """The batch is not in the log (the store said so: SQLite checks a batch an error after
        its COMMIT left logged; JetStream does not claim a batch it could not see acknowledged):
        give its seqs back (the log stays gap-free), refuse its events with an error to each
        publisher, and refuse new ones until a retry succeeds."""
        self.seq = rows[0][0] - 1
        self._bump("log_write_errors")
        self._bump("events_refused", len(rows))
        if not self.log_error:  # say it once per episode, not once per retry
            log.error("event log %s cannot be written (%s); refusing events with `%s` until it "
                      "can, retrying every %.0f s", self.log.where, exc,
                      p.LOG_UNAVAILABLE, LOG_RETRY)
        self.log_error = f"event log cannot be written: {exc}"
        self.refusing = True
        self._retry_at = time.monotonic() + LOG_RETRY
        self._refuse(rows)
        return False

    def hold(self) -> list[Row]:
        """A hub that is not (or no longer) the leader: refuse every event, with no retry, until
        `resume`. The batch stamped and not yet logged is returned (its publishers are told),
        never logged: a deposed primary writes nothing more."""
        rows, self.rows, self._topics = self.rows, [], []
        self.refusing, self._retry_at, self.log_error = True, math.inf, ""
        return rows

    def resume(self, head: int) -> None:
        """The hub took the lease: continue the log from the store's `head` (no hole, no seq
        used twice)."""
        self.seq = head
        self.refusing, self._retry_at, self.log_error = False, math.inf, ""

    def refusal_text(self, state_dir: str) -> str:
        if self.log.reader_uri.startswith("nats://"):  # JetStream: not acknowledged, maybe stored
            return (f"event refused, not acknowledged: {self.log_error}; the JetStream cluster "
                    f"of the hub's `store` has no stream leader or no quorum now (it may still "
                    f"store the event); the hub retries every {LOG_RETRY:g} s and resumes by "
                    "itself once a majority of the servers answer")
        return (f"event refused, neither logged nor published: {self.log_error}; free space "
                f"for the hub's `state_dir` ({state_dir or 'in memory'}); the hub "
                f"retries every {LOG_RETRY:g} s and resumes logging by itself")

    def tick(self, now: float) -> None:
        """Periodic work: retry a failed log, prune what retention no longer keeps (bounded)."""
        if now >= self._retry_at and self._resync():
            self.refusing = False  # let the next batch try the log again
            self._retry_at = math.inf
        if self.refusing:
            return
        try:
            self._prune()
        except StoreError as exc:  # pruning is housekeeping: retried next tick
            self._bump("prune_errors")
            log.warning("event log retention failed (retried): %s", exc)

    def _resync(self) -> bool:
        """Before events are stamped again: continue from the store's head. On SQLite that is
        the seq the failed batch gave back; on JetStream a batch whose append timed out may
        have been stored after all (then its events are in the log though their publishers
        were refused). False (retried later) while the store cannot say."""
        try:
            self.seq = self.log.last_seq()
        except StoreError:
            self._retry_at = time.monotonic() + LOG_RETRY
            return False
        return True

    def _prune(self) -> None:
        ret = self.retention
        removed = 0
        if ret.days > 0:
            removed += self.log.prune_before(
                time.time() - ret.days * 86400,
                f"retention: older than {ret.days:g} days (`--retain-days`)")
        if ret.bytes > 0:
            removed += self.log.prune_to_bytes(
                ret.bytes, f"retention: log over {ret.bytes} bytes (`--retain-bytes`)")
        while self._ended_runs:
            removed += self.log.drop_deltas(self._ended_runs.pop())
        if removed:  # the window must never answer with an event the log no longer has
            self.recent.clear()

    # --- heartbeats and subscriptions --------------------------------------------------------

    def publish_heartbeat(self) -> None:
        # Everything stamped so far is published before the heartbeat that announces its seq,
        # so a subscriber never takes an event still in the batch for a lost one.
        self.flush()
        self.sub_beat_at = math.inf
        self._beat_at = time.monotonic()
        hb = _encode(p.Header(kind=p.HEARTBEAT, seq=self.seq, ts=time.time()))
        try:
            _bsend(self.pub, p.HEARTBEAT_TOPIC, _MORE_NOBLOCK)
            _bsend(self.pub, p.SIGNATURE, _MORE_NOBLOCK)
            _bsend(self.pub, hb, _NOBLOCK)
        except zmq.Again:
            self._bump("publish_dropped_hwm")

    def drain_subscriptions(self) -> None:
        """Note new subscriptions: a heartbeat answers them, at once when none went out within
        SUBSCRIBE_BEAT_GAP, else that long after the last one. Anything else is ignored."""
        for _ in range(DRAIN_LIMIT):
            try:
                message = self.pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if message[:1] == b"\x01" and self.sub_beat_at == math.inf:
                self.sub_beat_at = max(time.monotonic(), self._beat_at + SUBSCRIBE_BEAT_GAP)

    # --- replay ----------------------------------------------------------------------------

    def reads_nothing(self, request: p.ReplayRequest) -> bool:
        """Whether `replay` answers `request` at once, with no read of the log: it asks from
        past the head (a client's publish confirmation)."""
        self.flush()
        return request.since >= self.seq

    def replay(self, ident: bytes, req_id: str, request: p.ReplayRequest) -> bytes | None:
        """Start a replay: the reply body at once when there is nothing to read (a client's
        publish confirmation asks from past the head) or when memory (`recent`) holds the range
        and its events are small; else None: the answer from memory (with a big event) or the
        reader's goes out through the pacer (`ReplayPacer`).
        Raises `Overloaded` when REPLAY_QUEUE replays are waiting."""
        self.flush()  # the reply follows every event the requester sent before it, logged
        head = self.seq
        if request.since >= head:
            return _encode(p.ReplayBatch(events=[], upto=head, head=head))
        # answers held for pacing count too: replays not answered yet, and memory
        waiting = len(self.reader.outstanding) + len(self.pacer)
        if waiting >= REPLAY_QUEUE:
            raise Overloaded(f"`hub.replay`: {REPLAY_QUEUE} replays are already waiting to be "
                             f"answered; retry after one is")
        batch = self.recent.read_batch(request, head, self.replay_bytes)
        if batch is not None:  # a recent range (a live subscriber's gap): no log read
            self._bump("replay_from_memory")
            body = _encode(batch)
            if all(len(event) <= self.inline_bytes for _, event in batch.events):
                return body  # what the live stream carried anyway: at once
            # with a big event (published as a stub), like the reader's answers through the
            # pacer: while requests flow, a replayer of big events cannot copy them out faster
            self.pacer.add([(ident, req_id, b"", body)])
            return None
        if not self.reader.submit(ident, req_id, head, request):
            raise Overloaded(f"`hub.replay`: {REPLAY_QUEUE} replays are already waiting for "
                             f"the log reader; retry after one is answered")
        return None
