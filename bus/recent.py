"""The hub's newest logged events, kept in memory so that a live subscriber's gap is filled at
once instead of by the log reader.

A subscriber that falls behind a burst loses messages at the hub's PUB queue and asks
`hub.replay` for the seqs it missed: always the newest ones. Reading them from the log means the
reader process (bus/replay_reader.py), which runs only on a core nobody else wants, and is
started by the first replay that needs it: on a busy machine a gap waited 0.2-1 s for it
(bench/bench_bus.py, unpaced events/s 0.45-0.65x raw PUB->SUB). The events are still in the
hub's memory then: it logged and published them a moment ago. So the hub keeps the newest
`max_bytes` of them, exactly as logged (the stamped header and the body), and answers a replay
that starts within them itself, with at most `BATCH_BYTES` a reply so that the routing loop
never stops long for one. Anything older goes to the reader as before.

Only what the log holds is kept: rows enter once their batch was appended, and the window is
emptied whenever the log may have dropped some of them (retention) or seqs stop being
contiguous (a store that resynced its head).
"""

from __future__ import annotations

import bisect

from agent_bus.bus import protocol as p
from agent_bus.bus.store import REPLAY_LIMIT, Row

# Most bytes of events in one reply from memory (or the hub's `replay_bytes`, if smaller):
# ~300 small events, ~0.06 ms of the routing loop. Smaller than the reader's batches (256 KiB),
# which are built in its own process.
BATCH_BYTES = 64 * 1024
_COMPACT = 1024  # dropped batches' slots kept at the list's head before it is compacted
_DROPPED: tuple[list[Row], list[bytes], int] = ([], [], 0)  # a dropped batch's slot


class RecentEvents:
    """The newest logged batches (rows and their topics, as the pipeline appended them), at most
    `max_bytes` of headers and bodies; `max_bytes` 0 keeps none. Kept by batch, not by row, so
    the routing loop pays per flush, not per event."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._firsts: list[int] = []  # each batch's first seq, ascending (for bisect)
        self._batches: list[tuple[list[Row], list[bytes], int]] = []  # (rows, topics, bytes)
        self._start = 0  # index of the oldest kept batch (those before it are dropped lazily)

    def __len__(self) -> int:
        return len(self._batches) - self._start

    @property
    def first_seq(self) -> int:
        """The oldest kept seq (0: none kept)."""
        return self._firsts[self._start] if len(self) else 0

    @property
    def last_seq(self) -> int:
        """The newest kept seq (0: none kept)."""
        return self._batches[-1][0][-1][0] if len(self) else 0

    def add(self, rows: list[Row], topics: list[bytes], size: int) -> None:
        """Keep a batch the log has just appended (`size`: its headers' and bodies' bytes),
        dropping the oldest batches past `max_bytes`."""
        if self.max_bytes <= 0 or not rows:
            return
        if len(self) and rows[0][0] != self.last_seq + 1:
            self.clear()  # not contiguous: a seq the window does not hold would look read
        self._firsts.append(rows[0][0])
        self._batches.append((rows, topics, size))
        self.bytes += size
        start = self._start
        batches = self._batches
        while self.bytes > self.max_bytes and start < len(batches):
            self.bytes -= batches[start][2]
            batches[start] = _DROPPED  # its rows are freed now, the list slot at compaction
            start += 1
        if start > _COMPACT and start * 2 > len(self._batches):  # O(1) amortised
            del self._batches[:start]
            del self._firsts[:start]
            start = 0
        self._start = start

    def clear(self) -> None:
        self._firsts = []
        self._batches = []
        self._start = 0
        self.bytes = 0

    def read_batch(self, request: p.ReplayRequest, head: int,
                   budget: int = BATCH_BYTES) -> p.ReplayBatch | None:
        """The reply to `request` from memory, or None when its range starts before the window
        (or the window does not reach `head`): then the log must be read. The same events, in
        the same terms (`upto`, `head`), as the log's reader answers; the batch ends once
        min(`budget`, BATCH_BYTES) bytes were read (always >= 1 event)."""
        budget = min(budget, BATCH_BYTES)
        since = max(0, request.since)
        if not len(self) or self.last_seq != head or since < self.first_seq - 1 \
                or since >= head:
            return None
        limit = max(1, min(request.limit, REPLAY_LIMIT))
        prefixes = [t.encode() for t in request.topics]
        experiment = request.experiment
        # the batch holding since + 1, then row by row from there
        at = bisect.bisect_right(self._firsts, since + 1, lo=self._start) - 1
        offset = since + 1 - self._firsts[at]
        events: list[tuple[bytes, bytes]] = []
        upto, read, scanned = since, 0, 0
        for rows, topics, _ in self._batches[at:]:
            for index in range(offset, len(rows)):
                row = rows[index]
                upto, scanned = row[0], scanned + 1
                read += len(row[6]) + len(row[7])
                if ((not experiment or row[5] == experiment)
                        and (not prefixes or any(topics[index].startswith(x) for x in prefixes))):
                    events.append((row[6], row[7]))
                if read >= budget or scanned >= limit:
                    return p.ReplayBatch(events=events, upto=upto, head=head)
            offset = 0
        return p.ReplayBatch(events=events, upto=upto, head=head)
