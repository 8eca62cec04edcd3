"""The hub's event log: an append-only SQLite table of stamped events, in WAL mode.

Durability policy: each hub loop pass appends its batch in one transaction and commits before the
batch is published, with `synchronous=NORMAL`. In WAL mode that survives a SIGKILL of the hub (the
commit is in the WAL file); only an OS crash or power loss can lose the last commits.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

Row = tuple[int, float, str, str, str, str, bytes, bytes]

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
"""


class EventLog:
    """Append and read stamped events. Not thread-safe: the hub loop owns it."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        target = ":memory:" if path is None else str(path)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(target, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def last_seq(self) -> int:
        row = self._db.execute("SELECT MAX(seq) FROM events").fetchone()
        return int(row[0] or 0)

    def append(self, rows: list[Row]) -> None:
        self._db.execute("BEGIN")
        try:
            self._db.executemany("INSERT INTO events VALUES (?,?,?,?,?,?,?,?)", rows)
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def read(self, since: int, limit: int) -> list[tuple[int, bytes, bytes]]:
        """Events with seq > since, oldest first: (seq, header, body)."""
        cur = self._db.execute(
            "SELECT seq, header, body FROM events WHERE seq > ? ORDER BY seq LIMIT ?",
            (since, limit),
        )
        return cur.fetchall()

    def close(self) -> None:
        self._db.close()
