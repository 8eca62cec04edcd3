"""Conversation store: each agent's current session and its messages, in SQLite (WAL) in the
coordinator's state directory, so an agent continues the same conversation after a restart.

    store = ConversationStore(state_dir)              # <state_dir>/conversations.sqlite
    session, messages = store.load("assistant")       # creates a session on first use
    recorder = store.recorder("assistant", session)   # keeps the store in step with a history
    recorder.sync(agent.state.messages)               # append what is new / rewrite when replaced
    store.new_session("assistant")                    # a fresh conversation (the old one is kept)
    store.touch("assistant", session)                 # the one `continue` without an id resumes

An agent has any number of sessions (one per conversation, see `agents.coordinator.process`); the
"current" one is the session it used last.

Messages are stored one row each as msgpack, in history order. `ConversationRecorder.sync` is
called as messages end (the Agent's `on_message_end`) and at turn and run boundaries, by the
coordinator once per group commit (`at_commit`: a turn's 4 tool results cost one sync): when
the stored rows are still a prefix (by identity) of the history it appends the new tail,
otherwise (compaction, `prepare_next_turn`, tool-output trimming, reset) it rewrites the session
in one transaction. Writes are synchronous and small; WAL with `synchronous=NORMAL` keeps each
one well under a millisecond. Several coordinators may share one state directory. With group
commits a thread copies the WAL back into the database (`CHECKPOINT_COMMITS`), as the hub's
event log does (bus/store/sqlite.py, `Checkpointer`).

Group commit (`defer_commits()`, what the coordinator uses): writes made while the event loop
runs go into one open transaction, committed by a callback at the end of the loop iteration, so
the writes of all sessions that ran in that iteration cost one commit (~20 us CPU each, and
about 14 writes per turn). A failed write is undone alone (each is one statement, or a
sequence that can only fail by an I/O error). Whoever must not act before its writes are
durable awaits `committed()`, or calls `commit()` itself (the coordinator's peer does before it
sends held events: "journaled before published"; the end-of-iteration callback then finds
nothing open). A failed commit loses the whole group: `lost_groups` counts it
and every recorder rewrites its session on its next sync.

Full texts of cut or trimmed tool outputs (`ToolOutputStore`) are stored too, so `tool_output`
refs in a restored conversation stay readable.

The run journal (durable runs, see `agents.coordinator.process`): a row per live run (`runs`: session,
coordinator, experiment, parent, last turn begun) and per tool call begun (`run_calls`: its result
once it ended), written before the matching event is published and deleted when the run ends.
The model replies a run completed are its session's messages, stored as each one ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import operator
import sqlite3
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec

from agent_bus.agents.loop.context import ToolOutputStore
from agent_bus.bus.messages import Message, RunWorkspace, ToolResultMessage
from agent_bus.bus.store.sqlite import Checkpointer

DB_NAME = "conversations.sqlite"
# With group commits, the WAL is copied back into the database on a thread (`Checkpointer`,
# the event log's), every this many commits (a few pages each: about SQLite's own default of
# 1,000 pages), not by SQLite inside the commit that crosses its threshold, in the event loop:
# that copy and its fsyncs stalled every session of the process (bench_loop, alternated runs:
# a turn took 1.04x as long with it; never checkpointing, 0.99x of the thread's).
CHECKPOINT_COMMITS = 256

log = logging.getLogger("agents.coordinator.persistence")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    agent   TEXT NOT NULL,
    session TEXT NOT NULL,
    created REAL NOT NULL,
    PRIMARY KEY (agent, session)
);
CREATE TABLE IF NOT EXISTS current_session (
    agent   TEXT PRIMARY KEY,
    session TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    agent   TEXT NOT NULL,
    session TEXT NOT NULL,
    idx     INTEGER NOT NULL,
    body    BLOB NOT NULL,
    PRIMARY KEY (agent, session, idx)
);
CREATE TABLE IF NOT EXISTS runs (
    run_id      TEXT PRIMARY KEY,
    agent       TEXT NOT NULL,
    session     TEXT NOT NULL,
    coordinator TEXT NOT NULL,
    experiment  TEXT NOT NULL,
    parent      TEXT NOT NULL,
    turn        INTEGER NOT NULL,
    max_turns   INTEGER NOT NULL,
    started     REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS run_calls (
    run_id  TEXT NOT NULL,
    call_id TEXT NOT NULL,
    tool    TEXT NOT NULL,
    result  BLOB,
    PRIMARY KEY (run_id, call_id)
);
CREATE TABLE IF NOT EXISTS run_workspaces (
    run_id  TEXT PRIMARY KEY,
    body    BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS tool_outputs (
    agent   TEXT NOT NULL,
    ref     TEXT NOT NULL,
    text    TEXT NOT NULL,
    PRIMARY KEY (agent, ref)
);
"""

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


class JournaledRun(msgspec.Struct):
    """A run that was live when its coordinator last wrote the journal."""

    run_id: str
    agent: str
    session: str
    coordinator: str
    experiment: str = ""
    parent: str = ""
    turn: int = 0  # the last turn begun
    max_turns: int = 0  # 0: the agent's own bound
    #: the run's own folder on the tool workers (its prompt's); a table of its own
    #: (`run_workspaces`), so a journal from before it opens as it is
    workspace: RunWorkspace | None = None


class JournaledCall(msgspec.Struct):
    """A tool call a journaled run began; `result` None: it had not ended (may have run)."""

    call_id: str
    tool: str
    result: ToolResultMessage | None = None


def _workspace(body: bytes | None) -> RunWorkspace | None:
    """A journaled run's workspace. One that no longer decodes is logged and replaced by one
    with an empty id, which every worker refuses: the run's tool calls then fail, and never run
    in the workers' own workspaces instead."""
    if body is None:
        return None
    try:
        return _workspace_decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        log.warning("a journaled run's workspace does not decode (%s): its tool calls will fail",
                    exc)
        return RunWorkspace(id="")


_workspace_decoder = msgspec.msgpack.Decoder(RunWorkspace)


class ConversationStore:
    """One SQLite file for all agents of a state directory. Not thread-safe: use from one thread."""

    def __init__(self, state_dir: str | Path) -> None:
        self.dir = Path(state_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / DB_NAME
        self.db = sqlite3.connect(self.path, isolation_level=None, timeout=10.0)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute("PRAGMA busy_timeout=10000")
        self.db.executescript(_SCHEMA)
        self.skipped = 0  # rows that no longer decode (dropped on load)
        self.deferred = False  # group commit (see `defer_commits`)
        self.commits = 0  # transactions committed (for benchmarks and tests)
        self.lost_groups = 0  # group commits that failed (their writes are gone)
        self._group: asyncio.Event | None = None  # set once the open group is committed
        #: Writes due just before the open group commits (`at_commit`), in order, once each.
        self._at_commit: dict[Callable[[], None], None] = {}
        self._checkpointer: Checkpointer | None = None  # with group commits (`defer_commits`)

    def close(self) -> None:
        if self._group is not None:
            self.commit()
        if self._checkpointer is not None:
            self._checkpointer.close()
            self._checkpointer = None
        self.db.close()

    # --- group commit --------------------------------------------------------------------

    def defer_commits(self) -> None:
        """From now on, writes made inside a running event loop share one transaction per
        loop iteration (see the module doc); outside one they still commit at once. The WAL is
        then copied back on a thread of its own (`CHECKPOINT_COMMITS`)."""
        self.deferred = True
        if self._checkpointer is None:
            self.db.execute("PRAGMA wal_autocheckpoint=0")
            self._checkpointer = Checkpointer(self.path.resolve().as_uri(), "conversation store")

    async def committed(self) -> None:
        """Return once every write made so far is committed (at once when none is pending)."""
        group = self._group
        if group is not None:
            await group.wait()

    def at_commit(self, write: Callable[[], None]) -> None:
        """Run `write` in the open group just before it commits (once, however often it is
        asked for in the group), or at once when writes are not grouped. A session's history
        changes by several messages in one loop iteration (a turn's tool results): synced
        once at commit, they cost one identity scan and one insert, not one per message.
        `write` must not raise (it is the caller's to catch and log)."""
        if self.deferred and self._open_group():
            self._at_commit[write] = None
        else:
            write()

    def commit(self) -> None:
        """Commit the open group now (the end-of-iteration callback; also on close)."""
        if self._group is None:  # nothing open (e.g. committed by `close` before this callback)
            return
        while self._at_commit:  # inside the group: their writes commit with it
            pending, self._at_commit = self._at_commit, {}
            for write in pending:
                write()
        group, self._group = self._group, None
        try:
            self.db.execute("COMMIT")
            self.commits += 1
            checkpointer = self._checkpointer
            if checkpointer is not None:
                checkpointer.commits += 1
                if not checkpointer.commits % CHECKPOINT_COMMITS:
                    checkpointer.ask()
        except sqlite3.Error:
            self.lost_groups += 1  # recorders rewrite their sessions (`sync`)
            log.exception("could not commit the conversation store; its last writes are lost "
                          "and are written again with the next ones")
            if self.db.in_transaction:
                self.db.execute("ROLLBACK")
        finally:
            group.set()

    # --- sessions ------------------------------------------------------------------------

    def current_session(self, agent: str) -> str:
        """The agent's current session id, creating one on first use."""
        row = self.db.execute("SELECT session FROM current_session WHERE agent = ?",
                              (agent,)).fetchone()
        return row[0] if row else self.new_session(agent)

    def new_session(self, agent: str, session: str = "") -> str:
        """Start a fresh, empty session (id `session`, else a uuid4 hex) and make it current
        (earlier ones stay stored)."""
        session = session or uuid.uuid4().hex
        with self._tx():
            self.db.execute("INSERT INTO sessions (agent, session, created) VALUES (?, ?, ?)",
                            (agent, session, time.time()))
            self.db.execute("INSERT OR REPLACE INTO current_session (agent, session) VALUES (?, ?)",
                            (agent, session))
        return session

    def last_session(self, agent: str) -> str:
        """The session the agent used last ("" when it has none); unlike `current_session`
        this creates nothing."""
        row = self.db.execute("SELECT session FROM current_session WHERE agent = ?",
                              (agent,)).fetchone()
        return row[0] if row else ""

    def touch(self, agent: str, session: str) -> None:
        """Make `session` the agent's last one (what `continue` without an id continues)."""
        with self._tx():
            self.db.execute("INSERT OR REPLACE INTO current_session (agent, session) VALUES (?, ?)",
                            (agent, session))

    def has_session(self, agent: str, session: str) -> bool:
        return self.db.execute("SELECT 1 FROM sessions WHERE agent = ? AND session = ?",
                               (agent, session)).fetchone() is not None

    def count_sessions(self, agent: str) -> int:
        count: int = self.db.execute("SELECT COUNT(*) FROM sessions WHERE agent = ?",
                                     (agent,)).fetchone()[0]
        return count

    def sessions(self, agent: str) -> list[str]:
        rows = self.db.execute("SELECT session FROM sessions WHERE agent = ? ORDER BY created",
                               (agent,)).fetchall()
        return [r[0] for r in rows]

    # --- messages ------------------------------------------------------------------------

    def messages(self, agent: str, session: str) -> list[Message]:
        rows = self.db.execute(
            "SELECT body FROM messages WHERE agent = ? AND session = ? ORDER BY idx",
            (agent, session)).fetchall()
        out: list[Message] = []
        for (body,) in rows:
            try:
                out.append(_decoder.decode(body))
            except (msgspec.DecodeError, msgspec.ValidationError):
                self.skipped += 1
        return out

    def load(self, agent: str) -> tuple[str, list[Message]]:
        """(current session id, its messages in order)."""
        session = self.current_session(agent)
        return session, self.messages(agent, session)

    def append(self, agent: str, session: str, start: int, messages: Sequence[Message]) -> None:
        """Store `messages` at positions start, start+1, ..."""
        rows = [(agent, session, start + i, _encoder.encode(m)) for i, m in enumerate(messages)]
        with self._tx():
            self.db.executemany(
                "INSERT OR REPLACE INTO messages (agent, session, idx, body) VALUES (?, ?, ?, ?)",
                rows)

    def rewrite(self, agent: str, session: str, messages: Sequence[Message]) -> None:
        """Replace the session's messages with `messages` (one transaction)."""
        rows = [(agent, session, i, _encoder.encode(m)) for i, m in enumerate(messages)]
        with self._tx():
            self.db.execute("DELETE FROM messages WHERE agent = ? AND session = ?",
                            (agent, session))
            self.db.executemany(
                "INSERT INTO messages (agent, session, idx, body) VALUES (?, ?, ?, ?)", rows)

    def recorder(self, agent: str, session: str, persisted: Sequence[Message] = ()) -> ConversationRecorder:
        return ConversationRecorder(self, agent, session, persisted)

    # --- run journal ---------------------------------------------------------------------

    def run_begin(self, run: JournaledRun) -> None:
        with self._tx():
            self.db.execute(
                "INSERT OR REPLACE INTO runs (run_id, agent, session, coordinator, experiment, "
                "parent, turn, max_turns, started) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (run.run_id, run.agent, run.session, run.coordinator, run.experiment, run.parent,
                 run.turn, run.max_turns, time.time()))
            if run.workspace is not None:
                self.db.execute("INSERT OR REPLACE INTO run_workspaces (run_id, body) VALUES "
                                "(?, ?)", (run.run_id, _encoder.encode(run.workspace)))

    def run_turn(self, run_id: str, turn: int) -> None:
        with self._tx():
            self.db.execute("UPDATE runs SET turn = ? WHERE run_id = ?", (turn, run_id))

    def call_begin(self, run_id: str, call_id: str, tool: str) -> None:
        with self._tx():
            self.db.execute("INSERT OR IGNORE INTO run_calls (run_id, call_id, tool) "
                            "VALUES (?, ?, ?)", (run_id, call_id, tool))

    def call_end(self, run_id: str, call_id: str, tool: str, result: ToolResultMessage) -> None:
        with self._tx():
            self.db.execute("INSERT OR REPLACE INTO run_calls (run_id, call_id, tool, result) "
                            "VALUES (?, ?, ?, ?)", (run_id, call_id, tool, _encoder.encode(result)))

    def run_end(self, run_id: str) -> None:
        with self._tx():
            self.db.execute("DELETE FROM run_calls WHERE run_id = ?", (run_id,))
            self.db.execute("DELETE FROM runs WHERE run_id = ?", (run_id,))
            self.db.execute("DELETE FROM run_workspaces WHERE run_id = ?", (run_id,))

    def live_runs(self, coordinator: str) -> list[JournaledRun]:
        """The runs `coordinator` had in progress when it stopped without ending them."""
        rows = self.db.execute(
            "SELECT runs.run_id, agent, session, coordinator, experiment, parent, turn, "
            "max_turns, run_workspaces.body FROM runs LEFT JOIN run_workspaces USING (run_id) "
            "WHERE coordinator = ? ORDER BY started", (coordinator,)).fetchall()
        return [JournaledRun(run_id=row[0], agent=row[1], session=row[2], coordinator=row[3],
                             experiment=row[4], parent=row[5], turn=row[6], max_turns=row[7],
                             workspace=_workspace(row[8])) for row in rows]

    def run_calls(self, run_id: str) -> dict[str, JournaledCall]:
        rows = self.db.execute("SELECT call_id, tool, result FROM run_calls WHERE run_id = ?",
                               (run_id,)).fetchall()
        out: dict[str, JournaledCall] = {}
        for call_id, tool, body in rows:
            result = _result(body) if body is not None else None
            out[call_id] = JournaledCall(call_id, tool, result)
        return out

    # --- tool outputs --------------------------------------------------------------------

    def put_output(self, agent: str, ref: str, text: str) -> None:
        with self._tx():
            self.db.execute("INSERT OR REPLACE INTO tool_outputs (agent, ref, text) VALUES (?, ?, ?)",
                            (agent, ref, text))

    def get_output(self, agent: str, ref: str) -> str | None:
        row = self.db.execute("SELECT text FROM tool_outputs WHERE agent = ? AND ref = ?",
                              (agent, ref)).fetchone()
        return row[0] if row else None

    def output_store(self, agent: str) -> PersistentOutputStore:
        return PersistentOutputStore(self, agent)

    # --- helpers -------------------------------------------------------------------------

    def _tx(self) -> _Transaction | contextlib.nullcontext[None]:
        if self.deferred and self._open_group():
            # No savepoint per write (2 more statements each): a failing statement is undone
            # by SQLite alone, and none of the writes here can fail half-way but by an I/O
            # error, which dooms the whole group anyway (`lost_groups`).
            return contextlib.nullcontext()
        return _Transaction(self)

    def _open_group(self) -> bool:
        """Make sure a group transaction is open, its commit scheduled (False: no event loop
        runs here, so this write commits alone)."""
        if self._group is not None:
            return True
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return False
        if self._checkpointer is not None:  # (outside a transaction: a checkpoint cannot be in one)
            self._checkpointer.catch_up(self.db)
        self.db.execute("BEGIN IMMEDIATE")
        self._group = asyncio.Event()
        loop.call_soon(self.commit)
        return True


def _result(body: bytes) -> ToolResultMessage | None:
    """A journaled tool result; one that no longer decodes counts as not ended."""
    try:
        message = _decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return message if isinstance(message, ToolResultMessage) else None


class _Transaction:
    def __init__(self, store: ConversationStore) -> None:
        self.store = store

    def __enter__(self) -> None:
        self.store.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, et: object, e: object, tb: object) -> None:
        self.store.db.execute("COMMIT" if et is None else "ROLLBACK")
        if et is None:
            self.store.commits += 1


class ConversationRecorder:
    """Keeps one agent's stored session equal to its in-memory history with few writes."""

    def __init__(self, store: ConversationStore, agent: str, session: str,
                 persisted: Sequence[Message] = ()) -> None:
        self.store = store
        self.agent = agent
        self.session = session
        self._persisted: list[Message] = list(persisted)  # the objects stored, in order
        self._lost = store.lost_groups  # a group commit failed since: rewrite everything
        self.appends = 0
        self.rewrites = 0

    def sync(self, messages: Sequence[Message]) -> None:
        """Make the stored session equal `messages`: append the new tail, or rewrite it all."""
        stored = self._persisted
        n = len(stored)
        lost = self.store.lost_groups
        # A C-level identity scan of the stored prefix (the history is usually just longer).
        if lost == self._lost and len(messages) >= n and all(map(operator.is_, messages, stored)):
            if len(messages) > n:
                tail = list(messages[n:])
                self.store.append(self.agent, self.session, n, tail)
                stored.extend(tail)
                self.appends += 1
            return
        self.store.rewrite(self.agent, self.session, messages)
        self._persisted = list(messages)
        self._lost = lost
        self.rewrites += 1

    def switch(self, session: str, messages: Sequence[Message] = ()) -> None:
        """Follow a new session (its stored messages are `messages`)."""
        self.session = session
        self._persisted = list(messages)


class PersistentOutputStore(ToolOutputStore):
    """A `ToolOutputStore` whose texts are also written to the conversation store."""

    def __init__(self, store: ConversationStore, agent: str) -> None:
        super().__init__()
        self._store = store
        self._agent = agent

    def put(self, text: str) -> str:
        ref = super().put(text)
        self._store.put_output(self._agent, ref, text)
        return ref

    def get(self, ref: str) -> str | None:
        text = super().get(ref)
        return text if text is not None else self._store.get_output(self._agent, ref)


__all__ = ["DB_NAME", "ConversationRecorder", "ConversationStore", "JournaledCall", "JournaledRun",
           "PersistentOutputStore"]
