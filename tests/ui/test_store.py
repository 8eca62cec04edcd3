"""The UI server's event store: readers resume after their last seq, the store stays bounded."""

from __future__ import annotations

import threading
import time

from agent_bus.bus.ui import EventStore


def test_after_resumes_past_a_seq_and_the_store_stays_bounded() -> None:
    store = EventStore(limit=100)
    for seq in range(1, 1001):
        store.add(seq * 2, f"e{seq}")           # seqs need not be contiguous (gaps are skipped)
    assert len(store.seqs) <= 100
    oldest = store.seqs[0]
    assert [s for s, _ in store.after(0, 0)][:1] == [oldest]  # older than the store: its start
    assert store.after(1995, 0) == [(1996, "e998"), (1998, "e999"), (2000, "e1000")]
    assert store.after(2000, 0) == []
    assert len(store.after(0, 0, most=7)) == 7


def test_a_waiting_reader_wakes_on_a_new_event() -> None:
    store = EventStore()
    got: list[list[tuple[int, str]]] = []
    reader = threading.Thread(target=lambda: got.append(store.after(0, 10.0)))
    reader.start()
    t0 = time.monotonic()
    store.add(1, "first")
    reader.join(10)
    assert got == [[(1, "first")]] and time.monotonic() - t0 < 5  # woken, not timed out
