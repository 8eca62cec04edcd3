"""The event log's checkpoints run on their own thread, not in the routing loop's commits.

SQLite's automatic checkpoint runs inside the commit that crosses its threshold: the hub's
routing loop stopped for ~60 ms every ~110,000 small events, and a request or a subscriber
waited for it. The log now turns it off and a `Checkpointer` thread copies the WAL back, so the
WAL must still stay bounded (it starts over only at a commit that begins after a complete
copy), and the thread must end with the store.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from agent_bus.bus.store import Row
from agent_bus.bus.store.sqlite import CHECKPOINT_BYTES, SqliteStore

BODY = b"b" * 2000
HEADER = b"h" * 100


def rows(first: int, count: int) -> list[Row]:
    return [(seq, time.time(), "custom", "a", "r", "", HEADER, BODY)
            for seq in range(first, first + count)]


def test_the_wal_stays_bounded_with_checkpoints_off_the_writer(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    store = SqliteStore(path)
    try:
        assert store._db.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0
        seq, written, largest = 1, 0, 0
        wal_path = Path(f"{path}-wal")
        while written < 4 * CHECKPOINT_BYTES:  # four thresholds' worth
            store.append(rows(seq, 512))
            seq += 512
            written += 512 * (len(HEADER) + len(BODY))
            largest = max(largest, wal_path.stat().st_size)
            time.sleep(0.002)  # the hub's pass between two appends (reading, stamping)
        checkpointer = store._checkpointer
        assert checkpointer is not None
        deadline = time.monotonic() + 60
        while checkpointer.done < checkpointer.asks and time.monotonic() < deadline:
            time.sleep(0.05)  # each takes a moment
        assert checkpointer.done >= 2, (checkpointer.done, checkpointer.asks)
        # The WAL started over during the writes: unchecked, or with a copy that never ends
        # between two commits (this writer never pauses for as long as the copy's fsyncs), it
        # grows to 150 MiB here.
        print(f"largest WAL {largest >> 20} MiB over {written >> 20} MiB of rows, "
              f"{checkpointer.done} checkpoints")
        assert largest <= 3 * CHECKPOINT_BYTES, largest  # (quiet machine: ~50 MiB)
        store.append(rows(seq, 1))  # after the last copy: starts over, truncated to the limit
        assert wal_path.stat().st_size <= 2 * CHECKPOINT_BYTES
        assert store.last_seq() == seq
    finally:
        store.close()
    assert not [t for t in threading.enumerate() if t.name == "event-log-checkpoint"]


def test_an_in_memory_log_has_no_checkpointer() -> None:
    store = SqliteStore(None, "checkpoint-test")
    try:
        assert store._checkpointer is None
        store.append(rows(1, 3))
        assert store.last_seq() == 3
    finally:
        store.close()
