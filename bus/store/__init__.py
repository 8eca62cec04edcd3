"""The hub's event store: one interface, two implementations (docs/architecture.md, "The event
store").

- `sqlite.py`: the default, a SQLite file in the hub's state dir (or in memory): one machine,
  nothing to install.
- `jetstream.py`: a NATS JetStream stream with three replicas (the `nats` extra): an event is
  stored once a majority of the store's servers has it, so the loss of a machine loses no
  acknowledged event.

The hub's routing loop is the only writer (`EventStore`); `hub.replay`'s reader (a child process
or a thread, bus/replay_reader.py) opens its own `StoreReader` from the store's `reader_uri`. Both
raise `StoreError` (and only that) when the store cannot do what was asked, so the hub's answer to
a store that fails (refuse events with `log_unavailable`, retry every second) is the same for both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import msgspec

from agent_bus.bus import protocol as p
from agent_bus.bus.store.url import JETSTREAM_SCHEME, StoreUrlError, parse_store_url

__all__ = ["REPLAY_LIMIT", "Row", "StoreError", "StoreUrlError", "EventStore", "StoreReader", "Retention",
           "open_store", "open_reader", "reader_in_process", "parse_store_url"]

REPLAY_LIMIT = 10_000  # rows one batch may scan (ReplayRequest.limit is capped to this)

# A stamped event as the hub logs it: (seq, ts, type, agent, run, experiment, header, body).
Row = tuple[int, float, str, str, str, str, bytes, bytes]


class StoreError(Exception):
    """The store could not append or read (disk full, I/O error, no quorum of servers). An
    append that raised stored none of its rows, or (JetStream) an unknown prefix of them: the
    writer asks `last_seq()` again before it stamps more (see EventPipeline)."""


class Retention(msgspec.Struct, frozen=True):
    """What the log keeps (docs/reliability.md, "Event log retention"). 0 disables a bound."""

    days: float = 7.0
    bytes: int = 0
    deltas_until_end: bool = False  # drop a run's `message_update`s once its `message_end` is logged


class EventStore(Protocol):
    """The writer's side. Not thread-safe: the hub's routing loop owns it."""

    # Whether the last append was refused because another writer wrote since (a standby hub
    # took over): a fencing refusal, not a failure to answer. Always False on SQLite.
    fenced: bool

    @property
    def where(self) -> str:
        """Where the log is, for messages (the events.db path, the stream and its servers)."""
        ...

    @property
    def reader_uri(self) -> str:
        """What a reader opens (`open_reader`), in another thread or process."""
        ...

    def last_seq(self) -> int:
        """The highest stored seq (0 for an empty log). Raises StoreError."""
        ...

    def append(self, rows: list[Row]) -> None:
        """Store `rows` (seqs last_seq()+1, +2, ...) before returning: on SQLite committed, on
        JetStream acknowledged by a majority of the stream's replicas. Raises StoreError."""
        ...

    def prune_before(self, ts: float, reason: str) -> int:
        """Retention by age, a bounded step (rows removed)."""
        ...

    def prune_to_bytes(self, limit: int, reason: str) -> int:
        """Retention by size, a bounded step (rows removed)."""
        ...

    def drop_deltas(self, run: str) -> int:
        """Remove `run`'s `message_update` events (its `message_end` holds the message)."""
        ...

    def close(self) -> None:
        ...


class StoreReader(Protocol):
    """A reader's side (`hub.replay`): its own connection, in the replay reader."""

    def read_batch(self, request: p.ReplayRequest, head: int, budget: int) -> p.ReplayBatch:
        """Stored events in (request.since, head] matching the request (see
        bus/store/sqlite.py `read_batch`, the reference). Raises StoreError."""
        ...

    def close(self) -> None:
        ...


def open_store(url: str, path: Path | None, name: str, retention: Retention,
               max_event_bytes: int = 0) -> EventStore:
    """The hub's store: `url` "" is SQLite at `path` (None: in memory, named `name`), a
    `nats://` URL a JetStream stream (bus/store/url.py) whose servers must take a message of
    `max_event_bytes` (the hub's budget) and a header. Raises StoreError."""
    if not url:
        from agent_bus.bus.store.sqlite import SqliteStore

        return SqliteStore(path, name)
    from agent_bus.bus.store.jetstream import JetStreamStore

    return JetStreamStore(parse_store_url(url), retention, max_event_bytes)


def open_reader(uri: str) -> StoreReader:
    """A reader of the store an `EventStore.reader_uri` names."""
    if uri.startswith(f"{JETSTREAM_SCHEME}://"):
        from agent_bus.bus.store.jetstream import JetStreamReader

        return JetStreamReader(parse_store_url(uri))
    from agent_bus.bus.store.sqlite import SqliteReader

    return SqliteReader(uri)


def reader_in_process(uri: str) -> bool:
    """Whether the reader must run inside the hub's process (a thread): an in-memory SQLite
    log is only reachable there."""
    return "mode=memory" in uri
