"""The default event store (bus/store/__init__.py): an append-only SQLite table of stamped
events, in WAL mode, and its reader (`hub.replay`'s, on a connection of its own).

Durability policy: each hub loop pass appends its batch in one transaction and commits before the
batch is published, with `synchronous=NORMAL`. In WAL mode that survives a SIGKILL of the hub (the
commit is in the WAL file); only an OS crash or power loss can lose the last commits.

Checkpoints (copying the WAL back into the database file, with its fsyncs) run on a thread of
their own (`Checkpointer`), not in the routing loop: SQLite's automatic one runs in the commit
that crosses its threshold, and stopped the loop every ~110,000 small events for ~200x a lone
round trip (bench/bench_flood.py: a subscriber and every request waited for it). Under a steady
flood the loop still copies the last few frames of each checkpoint itself (see `Checkpointer`).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import sqlite3
import threading
import time
from pathlib import Path

from agent_bus.bus import events as ev
from agent_bus.bus import protocol as p
from agent_bus.bus.store import REPLAY_LIMIT, Row, StoreError

log = logging.getLogger("bus.hub")

PAGE_SIZE = 16384  # for a new log file
CHECKPOINT_BYTES = 32 * 1024 * 1024  # rows appended between two checkpoints (~the WAL's size)
COPIES = 3  # checkpoints in a row, each of what the writer added during the one before

_SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY,
    ts REAL NOT NULL,
    type TEXT NOT NULL,
    agent TEXT NOT NULL,
    run TEXT NOT NULL,
    experiment TEXT NOT NULL,
    header BLOB NOT NULL,
    body BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS events_experiment ON events(experiment) WHERE experiment != '';
CREATE INDEX IF NOT EXISTS events_deltas ON events(run) WHERE type = 'message_update';
CREATE TABLE IF NOT EXISTS retention (
    id INTEGER PRIMARY KEY CHECK (id = 0),
    pruned_upto INTEGER NOT NULL,
    reason TEXT NOT NULL
);
"""
PRUNE_ROWS = 2000  # rows deleted per retention step: the routing loop's work stays bounded

# A batch is inserted with multi-row `INSERT ... VALUES (...),(...)` statements of these many rows
# (largest first): one sqlite3_step and one GIL release per statement instead of per row, ~15-25%
# less CPU per event than `executemany` (measured on batches of 64-256). A few fixed sizes keep
# every statement in the connection's prepared-statement cache; 8 x 256 parameters is far under
# SQLite's limit (32,766).
# A batch of up to SMALL_BATCH rows (the common pass) is one statement of exactly its size, run
# without BEGIN/COMMIT: a single statement is its own transaction (all rows or none), and the two
# statements less save ~10% of a small commit's CPU.
_CHUNKS = (256, 64, 16, 4, 1)
SMALL_BATCH = 16
_INSERTS = {n: "INSERT INTO events VALUES " + ",".join(["(?,?,?,?,?,?,?,?)"] * n)
            for n in (*_CHUNKS, *range(1, SMALL_BATCH + 1))}
_flatten = itertools.chain.from_iterable

# Reading a batch (`read_batch`):
BLOB_READ_BYTES = 65536  # a body this big or bigger is read through the blob API
# The reader blocks for a moment after PACE_SECONDS of reading (bus/replay_reader.py, "Pacing").
PACE_SECONDS = 0.0003  # the reader blocks after this long reading a batch
PACE_SLEEP = 1e-6  # ...for the shortest sleep (the timer slack makes it ~50-60 us)
PACE_CHECK = 32  # rows between looks at the clock


def connect_reader(uri: str) -> sqlite3.Connection:
    """A read-only connection for another thread (the replay reader). In WAL mode it reads the
    last committed state and never blocks the writer; an in-memory log is a shared-cache
    database, read uncommitted so that the reader takes no table lock the writer would meet
    (it only reads rows up to a head that is already committed)."""
    db = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
    if "mode=memory" in uri:
        db.execute("PRAGMA read_uncommitted=1")
    db.execute("PRAGMA busy_timeout=5000")
    return db


def read_meta(db: sqlite3.Connection) -> tuple[int, str]:
    """(the highest seq retention removed, why): replay of (since, pruned_upto] is a gap."""
    row = db.execute("SELECT pruned_upto, reason FROM retention WHERE id = 0").fetchone()
    return (0, "") if row is None else (int(row[0]), str(row[1]))


class SqliteStore:
    """Append and read stamped events (an `EventStore`). Not thread-safe: the hub loop owns it."""

    fenced = False  # one hub per file: no other writer can be ahead of it

    def __init__(self, path: Path | None, name: str = "events") -> None:
        self.path = path
        # The URI other threads open (`connect_reader`): in memory, a shared-cache database
        # named after the hub session, so the replay reader sees the same rows.
        self.uri = (f"file:bus-{name}?mode=memory&cache=shared" if path is None
                    else path.resolve().as_uri())
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.uri, uri=True, isolation_level=None,
                                   check_same_thread=False)
        # Throughput (measured ~10% per row): 16 kB pages in a new log (a no-op on an existing
        # one), and a checkpoint (which fsyncs) every ~32 MB of rows rather than every 1000
        # pages, by the `Checkpointer` thread; the WAL file is truncated back to 64 MB when it
        # starts over after a checkpoint, if it grew past that.
        self._db.execute(f"PRAGMA page_size={PAGE_SIZE}")
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(f"PRAGMA journal_size_limit={2 * CHECKPOINT_BYTES}")
        self._db.executescript(_SCHEMA)
        # An in-memory log has no WAL to copy back
        self._checkpointer = Checkpointer(self.uri) if path is not None else None
        if self._checkpointer is not None:
            self._db.execute("PRAGMA wal_autocheckpoint=0")
        self._since_checkpoint = 0  # bytes of rows appended since the last checkpoint was asked

    @property
    def where(self) -> str:
        return str(self.path) if self.path is not None else ":memory:"

    @property
    def reader_uri(self) -> str:
        return self.uri

    def last_seq(self) -> int:
        try:
            row = self._db.execute("SELECT MAX(seq) FROM events").fetchone()
        except sqlite3.Error as exc:
            raise StoreError(str(exc)) from exc
        return int(row[0] or 0)

    def append(self, rows: list[Row]) -> None:
        """Append `rows` in one transaction: all of them or none (else StoreError, from the SQLite
        error). (A try costs nothing in Python 3.11 until it catches.)"""
        try:
            self._append(rows)
        except sqlite3.Error as exc:
            if self._logged_anyway(rows):  # an error after COMMIT (a checkpoint) left it logged
                return
            raise StoreError(str(exc)) from exc

    def _logged_anyway(self, rows: list[Row]) -> bool:
        try:
            row = self._db.execute("SELECT MAX(seq) FROM events").fetchone()
        except sqlite3.Error:
            return False  # unreadable too: the batch counts as not logged
        return int(row[0] or 0) >= rows[-1][0]

    def _append(self, rows: list[Row]) -> None:
        """Append `rows` in one transaction: all of them or none (then the SQLite error is raised).

        On SQLITE_FULL or an I/O error SQLite may already have rolled the transaction back
        itself; a second ROLLBACK would then raise "no transaction is active" and hide the cause.
        """
        db = self._db
        if not rows:
            return
        checkpointer = self._checkpointer
        if checkpointer is not None:
            checkpointer.catch_up(db)
        if len(rows) <= SMALL_BATCH:
            db.execute(_INSERTS[len(rows)], tuple(_flatten(rows)))
        else:
            db.execute("BEGIN")
            try:
                self._insert(rows)
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    # the first error is the one to report; a failing ROLLBACK would only hide it
                    with contextlib.suppress(sqlite3.Error):
                        db.execute("ROLLBACK")
                raise
        if checkpointer is not None:
            checkpointer.commits += 1
            # the rows' headers and bodies: the WAL grows by about as much (and their pages)
            self._since_checkpoint += sum(len(row[6]) + len(row[7]) for row in rows)
            if self._since_checkpoint >= CHECKPOINT_BYTES:
                self._since_checkpoint = 0
                checkpointer.ask()

    def _insert(self, rows: list[Row]) -> None:
        """Insert `rows` in chunks of `_CHUNKS` sizes (inside the caller's transaction)."""
        execute = self._db.execute
        start, count = 0, len(rows)
        for size in _CHUNKS:
            sql = _INSERTS[size]
            while count - start >= size:
                execute(sql, tuple(_flatten(rows[start:start + size])))
                start += size

    def read(self, since: int, limit: int) -> list[tuple[int, bytes, bytes]]:
        """Events with seq > since, oldest first: (seq, header, body)."""
        cur = self._db.execute(
            "SELECT seq, header, body FROM events WHERE seq > ? ORDER BY seq LIMIT ?",
            (since, limit),
        )
        return cur.fetchall()

    def prune_before(self, ts: float, reason: str) -> int:
        """Delete up to PRUNE_ROWS of the oldest events stamped before `ts`; rows deleted."""
        try:
            return self._prune_before(ts, reason)
        except sqlite3.Error as exc:
            raise StoreError(str(exc)) from exc

    def _prune_before(self, ts: float, reason: str) -> int:
        oldest = self._db.execute("SELECT ts FROM events ORDER BY seq LIMIT 1").fetchone()
        if oldest is None or oldest[0] >= ts:  # the common case: one indexed row read
            return 0
        row = self._db.execute("SELECT MAX(seq) FROM (SELECT seq, ts FROM events ORDER BY seq "
                               "LIMIT ?) WHERE ts < ?", (PRUNE_ROWS, ts)).fetchone()
        return self._prune_upto(int(row[0] or 0), reason)

    def prune_to_bytes(self, limit: int, reason: str) -> int:
        """Delete up to PRUNE_ROWS of the oldest events while the log's pages in use (freed
        pages are reused, so the file itself does not shrink) are over `limit` bytes."""
        try:
            return self._prune_to_bytes(limit, reason)
        except sqlite3.Error as exc:
            raise StoreError(str(exc)) from exc

    def _prune_to_bytes(self, limit: int, reason: str) -> int:
        used = self._used_bytes()
        if used <= limit:
            return 0
        rows = self._db.execute("SELECT seq, length(header) + length(body) FROM events "
                                "ORDER BY seq LIMIT ?", (PRUNE_ROWS,)).fetchall()
        upto, freed = 0, 0
        for seq, size in rows:  # only what is needed: freeing in row bytes approximates pages
            upto, freed = seq, freed + size
            if used - freed <= limit:
                break
        return self._prune_upto(upto, reason)

    def _used_bytes(self) -> int:
        pages = self._db.execute("PRAGMA page_count").fetchone()[0]
        free = self._db.execute("PRAGMA freelist_count").fetchone()[0]
        return int((pages - free) * self._db.execute("PRAGMA page_size").fetchone()[0])

    def _prune_upto(self, seq: int, reason: str) -> int:
        """Delete events with seq <= `seq` and record the pruned range (one transaction)."""
        if seq <= 0:
            return 0
        self._db.execute("BEGIN")
        try:
            deleted = self._db.execute("DELETE FROM events WHERE seq <= ?", (seq,)).rowcount
            self._db.execute("INSERT INTO retention VALUES (0, ?, ?) ON CONFLICT(id) DO UPDATE "
                             "SET pruned_upto = MAX(pruned_upto, excluded.pruned_upto), "
                             "reason = excluded.reason", (seq, reason))
            self._db.execute("COMMIT")
        except BaseException:
            if self._db.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    self._db.execute("ROLLBACK")
            raise
        return int(deleted)

    def drop_deltas(self, run: str) -> int:
        """Delete the `message_update` events of `run` (its `message_end` holds the message)."""
        try:
            cur = self._db.execute("DELETE FROM events WHERE run = ? AND type = 'message_update'",
                                   (run,))
        except sqlite3.Error as exc:
            raise StoreError(str(exc)) from exc
        return int(cur.rowcount)

    def close(self) -> None:
        if self._checkpointer is not None:
            self._checkpointer.close()
        self._db.close()


class Checkpointer:
    """Copies the WAL back into the database file on a thread of its own, when asked (`ask`).

    A PASSIVE checkpoint never blocks the writer, which keeps appending meanwhile, and the
    sqlite3 module releases the GIL while SQLite works, so the routing loop goes on. The WAL
    starts over (and is truncated to `journal_size_limit`) only at a commit that begins after
    a checkpoint copied every frame. When the writer committed nothing while the thread copied
    (the usual bursts), its next commit does. Under a steady flood its commits overlap every
    copy (which takes as long as its fsyncs): the thread copies again what came meanwhile, up to
    COPIES times, and the writer copies the little left itself, just before its next commit
    (`catch_up`, ~5% of the whole copy's time), and the WAL stays bounded.

    The writer's part: `catch_up(db)` just before each commit begins, `commits += 1` after it,
    `ask()` every so many bytes or commits. `name` says whose database it is (its log lines,
    its thread)."""

    def __init__(self, uri: str, name: str = "event log") -> None:
        self.name = name
        self._db = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA busy_timeout=5000")
        self._asked = threading.Event()
        self._closing = False
        self.commits = 0  # the writer's commits (counted by it)
        # Set by the thread once it copied every frame there was when it began: the writer's
        # commit count then (the writer clears it)
        self.copied_at: int | None = None
        self.asks = 0  # checkpoints asked for, and run (for tests)
        self.done = 0
        self._thread = threading.Thread(target=self._run, name=f"{name}-checkpoint".replace(" ", "-"),
                                        daemon=True)
        self._thread.start()

    def catch_up(self, db: sqlite3.Connection) -> None:
        """The writer's, on its own connection `db`, just before a commit begins: once the
        thread's copy is done, copy what was committed while it copied (if anything: a few
        commits' worth), so this commit starts the WAL over."""
        copied_at = self.copied_at
        if copied_at is None:
            return
        if copied_at != self.commits:
            checkpoint(db, self.name)
        self.copied_at = None

    def ask(self) -> None:
        self.asks += 1
        self._asked.set()

    def _run(self) -> None:
        while True:
            self._asked.wait()
            self._asked.clear()
            if self._closing:
                return
            copied_at = None
            for _ in range(COPIES):  # each copies what the writer added during the last
                commits = self.commits
                if not checkpoint(self._db, self.name):
                    break
                copied_at = commits
                if self.commits == commits:
                    break  # the writer added nothing meanwhile: its next commit starts over
            self.copied_at = copied_at
            self.done += 1

    def close(self) -> None:
        self._closing = True
        self._asked.set()
        self._thread.join()
        self._db.close()


def checkpoint(db: sqlite3.Connection, name: str = "event log") -> bool:
    """A PASSIVE checkpoint on `db` (the `name`d database's): whether it copied every frame
    (False also when it failed, e.g. disk full: the next one copies what this did not)."""
    try:
        busy, frames, copied = db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
    except sqlite3.Error as exc:
        log.warning("%s checkpoint failed (the next one copies what this did not): %s", name,
                    exc)
        return False
    # busy: another checkpoint was running (it copied nothing); frames -1: not in WAL mode
    return bool(not busy and 0 <= frames <= copied)


class SqliteReader:
    """`hub.replay`'s reader of a SQLite log (a `StoreReader`): a connection of its own."""

    def __init__(self, uri: str) -> None:
        self._db = connect_reader(uri)

    def read_batch(self, request: p.ReplayRequest, head: int, budget: int) -> p.ReplayBatch:
        try:
            return read_batch(self._db, request, head, budget)
        except sqlite3.Error as exc:
            raise StoreError(str(exc)) from exc

    def close(self) -> None:
        self._db.close()


def read_batch(db: sqlite3.Connection, request: p.ReplayRequest, head: int,
               budget: int) -> p.ReplayBatch:
    """Logged events in (since, head] of the request's experiment (when it names one) matching
    its topics, until `budget` bytes were read (at least one row) or `limit` rows were scanned.
    `upto` is where to ask again; `upto == head` means this reply reaches the head — a reply
    with fewer events says nothing by itself.

    One read transaction: the rows and the bodies read through the blob API are one snapshot
    (retention may delete rows meanwhile)."""
    db.execute("BEGIN")
    try:
        batch = _read_batch(db, request, head, budget)
    except BaseException:
        with contextlib.suppress(sqlite3.Error):  # the read's error is the one to report
            db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")  # a read transaction: this only ends the snapshot
    return batch


def _read_batch(db: sqlite3.Connection, request: p.ReplayRequest, head: int,
                budget: int) -> p.ReplayBatch:
    since = min(max(0, request.since), head)
    pruned_upto, reason = read_meta(db)
    gap = None
    if since < pruned_upto:  # retention removed (since, pruned_upto]: say so, never silently
        gap = p.ReplayGap(first=since + 1, last=min(pruned_upto, head), reason=reason)
        since = min(pruned_upto, head)
    limit = max(1, min(request.limit, REPLAY_LIMIT))
    prefixes = [t.encode() for t in request.topics]
    # A body from BLOB_READ_BYTES up is not in the row: `Blob.read` copies it with the GIL
    # released (the cursor would copy it holding the GIL). `length(body)` reads no overflow
    # page, and rows that do not match the topics never have a body read.
    cur = db.execute(_SELECT + (_OF_EXPERIMENT if request.experiment else "") + _RANGE,
                     (BLOB_READ_BYTES, *([request.experiment] if request.experiment else []),
                      since, head, limit))
    events: list[tuple[bytes, bytes]] = []
    upto, read, scanned = since, 0, 0
    clock = time.perf_counter
    pace_at = clock() + PACE_SECONDS
    for seq, type_, agent, run, header, size, body in cur:
        upto, scanned = seq, scanned + 1
        if not scanned % PACE_CHECK and clock() >= pace_at:
            time.sleep(PACE_SLEEP)  # let a task the scheduler kept waiting behind us run
            pace_at = clock() + PACE_SECONDS
        read += len(header) + size
        if not prefixes or _matches(type_, agent, run, prefixes):
            events.append((header, body if body is not None else _read_body(db, seq)))
        if read >= budget:
            break
    else:
        if scanned < limit:  # the cursor ran out: everything up to the head was read
            upto = head
    cur.close()
    return p.ReplayBatch(events=events, upto=upto, head=head, gap=gap)


_SELECT = ("SELECT seq, type, agent, run, header, length(body), CASE WHEN length(body) < ? "
           "THEN body END FROM events WHERE ")
# An experiment's rows come from its index (`events_experiment`, on `experiment != ''`: the
# term is repeated so SQLite may use it), in seq order: the other experiments' are never read,
# nor counted in `limit` or the byte budget.
_OF_EXPERIMENT = "experiment = ? AND experiment != '' AND "
_RANGE = "seq > ? AND seq <= ? ORDER BY seq LIMIT ?"


def _read_body(db: sqlite3.Connection, seq: int) -> bytes:
    """A big body, copied out of SQLite with the GIL released (seq is the table's rowid)."""
    with db.blobopen("events", "body", seq, readonly=True) as blob:
        return blob.read()


def _matches(type_: str, agent: str, run: str, prefixes: list[bytes]) -> bool:
    topic = p.event_topic(ev.event_family(type_), agent, run, type_)
    return any(topic.startswith(prefix) for prefix in prefixes)


