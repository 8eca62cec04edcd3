"""The event log read from its file, with no hub: `busctl export`, `busctl experiment report`
and `diff` of a stopped topology. Read-only: a running hub's writes are not disturbed, and a log
we may not write is still read. The one reader of the log file outside the hub."""

from __future__ import annotations

import sqlite3
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path

from agent_bus.bus.experiments import holds_entries_of

#: One logged event as the file holds it: seq, type, header bytes, body bytes.
Row = tuple[int, str, bytes, bytes]


def log_file(state: Path) -> Path | None:
    """The hub's event log in a state directory: a topology's (`<state>/hub/events.db`) or a
    hub's own (`<state>/events.db`); None when neither exists."""
    for path in (state / "events.db", state / "hub" / "events.db"):
        if path.is_file():
            return path
    return None


@contextmanager
def open_log(path: Path) -> Iterator[sqlite3.Connection]:
    """The log file, read-only (a hub writing it meanwhile is waited for up to 5 s)."""
    db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        db.execute("PRAGMA busy_timeout=5000")
        yield db
    finally:
        db.close()


def rows(db: sqlite3.Connection, tags: Collection[str],
         types: Collection[str] = ()) -> Iterator[Row]:
    """The logged events of the experiment ids `tags` (of `types` only, when given), in seq
    order: read through the experiment index, no other experiment's row is read."""
    if not tags:
        return
    marks = ",".join("?" * len(tags))
    where = f"experiment IN ({marks})"
    if types:
        where += f" AND type IN ({','.join('?' * len(types))})"
    yield from db.execute(f"SELECT seq, type, header, body FROM events WHERE {where} "
                          f"ORDER BY seq", (*tags, *types))


def experiments(db: sqlite3.Connection) -> list[str]:
    """Every experiment id the log holds (to name them when one asked for is not there)."""
    return [row[0] for row in db.execute(
        "SELECT DISTINCT experiment FROM events WHERE experiment != '' ORDER BY 1")]


def covered(db: sqlite3.Connection, name: str) -> list[str]:
    """The experiment ids in the log whose events `name` selects (bus.experiments): itself
    and, for an experiment E, every cell's `E.<variant>.r<N>` (for a variant's or a cell's,
    also E's, its journal). Read from the index: E and ids from `E.` up to `E/` (the
    character after `.`), then checked."""
    base = name.split(".", 1)[0]
    found = [row[0] for row in db.execute(
        "SELECT DISTINCT experiment FROM events WHERE experiment IN (?, ?) OR "
        "(experiment >= ? AND experiment < ?) ORDER BY 1", (name, base, f"{base}.", f"{base}/"))]
    return [tag for tag in found if holds_entries_of(name, tag)]
