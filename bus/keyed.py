"""What a server remembers of keyed requests: a repeat of an idempotency key is answered once.

A requester that lost its hub before the final answer sends a keyed request again on the next
hub (bus/rpc.py, docs/protocol.md section 5, "Following the hub"). The serving process
survives the hub's loss (its handlers keep running; only their answers to the old hub are
lost), so it is the one that can tell a repeat: `Serving` looks each keyed request of a
non-idempotent service up here. A key still running gets the repeat's id added to the ids its
answers go to (attached: the partial bodies sent so far first, then the rest and the final
answer as they come); a key that ended is answered from what it answered (its partials, then
its final reply or error) without running the handler again. A key this process has not seen
(or no longer holds) runs as a new request.

Bounded: a finished key is kept `KEY_TTL` seconds, at most `KEY_LIMIT` keys and `KEY_BYTES`
bytes of answers in all (the oldest finished go first). A running key is never dropped.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

KEY_TTL = 600.0  # seconds a finished key's answer is kept for a repeat
KEY_LIMIT = 4096  # keys kept (finished ones beyond it go, the oldest first)
KEY_BYTES = 64 << 20  # bytes of kept answers (partials and finals) in all


@dataclass(slots=True)
class Final:
    """A keyed request's final answer: `reply` with a body, or `error` with a code and text."""

    kind: str
    body: bytes = b""
    code: str = ""
    error: str = ""


@dataclass(slots=True)
class Keyed:
    """One key's run: the request ids its answers go to, and what it answered so far."""

    ids: list[str]
    name: tuple[str, str] = ("", "")  # (service, key): where the window holds it
    partials: list[bytes] = field(default_factory=list)
    final: Final | None = None
    ended: float = 0.0  # monotonic, once `final` is set
    size: int = 0  # bytes of `partials` and the final body


class KeyWindow:
    """The keys one serving process has seen, by (service, key).

    Finished keys are also kept in the order they finished, so expiring them looks at the
    oldest finished alone: running keys (a coordinator holds a run per experiment cell, a
    thousand at once) are never walked past on every call."""

    def __init__(self, ttl: float = KEY_TTL, limit: int = KEY_LIMIT,
                 max_bytes: int = KEY_BYTES) -> None:
        self.ttl, self.limit, self.max_bytes = ttl, limit, max_bytes
        self._keys: dict[tuple[str, str], Keyed] = {}
        self._finished: OrderedDict[tuple[str, str], Keyed] = OrderedDict()  # oldest first
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._keys)

    def get(self, service: str, key: str) -> Keyed | None:
        self._expire(time.monotonic())
        return self._keys.get((service, key))

    def begin(self, service: str, key: str, req_id: str) -> Keyed:
        name = (service, key)
        entry = self._keys[name] = Keyed([req_id], name)
        return entry

    def partial(self, entry: Keyed, body: bytes) -> None:
        entry.partials.append(body)
        entry.size += len(body)
        self._bytes += len(body)

    def end(self, entry: Keyed, final: Final) -> None:
        entry.final = final
        entry.ended = time.monotonic()
        entry.size += len(final.body)
        self._bytes += len(final.body)
        self._finished[entry.name] = entry
        self._expire(entry.ended)

    def _expire(self, now: float) -> None:
        """Drop finished keys past their time, then the oldest finished while over a bound."""
        keys, finished = self._keys, self._finished
        while finished:
            name, entry = next(iter(finished.items()))
            over = len(keys) > self.limit or self._bytes > self.max_bytes
            if not over and now - entry.ended <= self.ttl:
                return  # (oldest first: the rest are younger)
            del finished[name]
            if keys.get(name) is entry:
                del keys[name]
            self._bytes -= entry.size
