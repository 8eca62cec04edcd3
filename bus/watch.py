"""`busctl watch`: replay and follow the event stream, filtered, as human lines or JSON lines."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from bus import events as ev
from bus import protocol as p
from bus.client import Envelope, Peer, connect
from bus.render import HumanPrinter, json_line
from bus.security import CurveClient


@dataclass
class WatchFilter:
    types: set[str] = field(default_factory=set)
    agents: set[str] = field(default_factory=set)
    runs: set[str] = field(default_factory=set)
    experiments: set[str] = field(default_factory=set)

    def topics(self) -> list[str]:
        """Hub-side prefixes: only agent filters map onto the topic (`agent/<name>/`)."""
        if self.agents and not self.runs:
            return [f"agent/{a}/" for a in sorted(self.agents)]
        return []

    def accepts(self, header: p.Header, event: ev.Event) -> bool:
        if self.types and ev.event_type(event) not in self.types and not isinstance(event, ev.Gap):
            return False
        if self.agents and header.agent not in self.agents:
            return False
        if self.runs and header.run not in self.runs:
            return False
        return not (self.experiments and header.experiment not in self.experiments)


async def replay(peer: Peer, since: int, topics: list[str]) -> AsyncIterator[Envelope]:
    """Logged events after `since` up to the head at the time of the first call, then stop."""
    cursor, head = since, None
    while head is None or cursor < head:
        request = p.ReplayRequest(since=cursor, topics=topics)
        batch = p.decode(await peer.request(p.HUB_REPLAY, p.encode(request)), p.ReplayBatch)
        head = batch.head if head is None else head
        for header_bytes, body in batch.events:
            header = p.decode_header(header_bytes)
            if header.seq > head:
                return
            event = ev.decode_event(body)
            if event is not None:
                yield Envelope(header, event)
        if batch.upto <= cursor:
            return
        cursor = batch.upto


async def watch_events(hub: str, curve: CurveClient | None, filt: WatchFilter, since: int | None,
                       last: int | None, follow: bool, as_json: bool, color: bool) -> None:
    out = sys.stdout
    printer = HumanPrinter(out, color)

    def show(envelope: Envelope) -> None:
        if not filt.accepts(envelope.header, envelope.event):
            return
        if as_json:
            out.write(json_line(envelope.header, envelope.event) + "\n")
            out.flush()
        else:
            printer.print(envelope.header, envelope.event)

    async with connect(hub, name="busctl-watch", role="watcher", curve=curve) as peer:
        if last is not None:
            since = max(0, (await peer.status()).seq - last)
        if not follow:
            async for envelope in replay(peer, since or 0, filt.topics()):
                show(envelope)
            return
        async with peer.subscribe(filt.topics(), since=since, fill_gaps=False) as sub:
            async for envelope in sub:
                show(envelope)
