"""What a peer holds back to send together: its `Outbox` of held events, replies, partials and
requests, flushed in order at the end of the event-loop iteration (or after `EVENT_LINGER`).

Why hold at all (bus/peer.py's module docstring has the whole story): on an idle socket every send
wakes ZeroMQ's I/O thread and then the hub, which costs far more than the send itself, so a burst
sent back to back is cheaper. Held events that differ only by id (or, to a hub that takes mixed
types, by id and type: header type `*`) go out as one multi-body `event` message (docs/protocol.md
§4). The outbox knows nothing of the connection: its owner says when it may hold (`Peer.hold`)
and hands it the socket and the welcome to flush into.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from agent_bus.bus import protocol as p
from agent_bus.bus.transport import Transport

HOLD_MAX = 1024  # messages (events, replies, partials) held for the end of the loop iteration
# Held *events* (only events) wait up to this long for company (`Outbox.hold_event`): the next
# request or answer this peer sends takes them along, or more events join them. An agent's turn
# emits its events over several loop iterations (each tool's end arrives on its own): sent at the
# end of each, they cost the hub (and this peer) one wake-up each; lingering, they ride with the
# turn's next request. Watchers see an event at most this much later. On an idle channel (nothing
# sent for this long) nothing is coming to ride with: held events go at the end of the loop
# iteration (a streamed delta 10 ms after the last one waited the whole linger for nobody).
# An owner whose events are mostly what watchers wait for sets its own (`Outbox.linger`: the
# gateway's streamed deltas, agents/gateway/process.py).
EVENT_LINGER = 0.002
# Held events that differ only by id (and type, with a hub that takes mixed types) go out as one
# multi-body `event` message (docs/protocol.md §4), up to this many bodies and bytes of bodies:
# the hub pays one message, not one per event.
COALESCE_EVENTS = 256
COALESCE_BYTES = 256 * 1024

_SIG = p.SIGNATURE
# A held event's header fields but its id: (type, agent, run, experiment, parent). Held events
# with equal keys, one after another, may share one message.
EventKey = tuple[str, str, str, str, str]


class HeldEvent(msgspec.Struct, gc=False):  # a Struct: made in C, one per event published
    """An event waiting to be sent: its body, and the header fields it will be sent with (its
    header, with a fresh id, is made when it goes out: one per message, `Outbox.flush`)."""

    body: bytes
    key: EventKey


# A whole message (signature included) waiting to be sent: a reply, a partial reply (whose body
# frames `IncomingRequest.partial` may still append to), or a request. Held as the frames list
# itself: no wrapper allocated per reply on the hot path (an event is the one wrapped kind).
Frames = list[Any]
Held = HeldEvent | Frames


class Outbox:
    """The held messages of one peer, in the order they go out; see the module docstring.

    `items` is read by the owner's hot path (is anything held?); `gen` changes whenever held
    messages leave it (sent or dropped): a partial still held may take more bodies while it is
    unchanged. `events_sent` counts events handed to a socket (the publish accounting);
    `sent_at` is when the owner last sent anything (the owner's direct sends set it too)."""

    __slots__ = ("_flush", "_flush_scheduled", "_linger", "_new_id", "_session", "events_sent",
                 "gen", "items", "linger", "loop", "sent_at")

    def __init__(self, session: str, new_id: Callable[[], str],
                 flush: Callable[[], None]) -> None:
        self.items: list[Held] = []
        self.gen = 0
        self.events_sent = 0
        self.linger = EVENT_LINGER  # seconds held events wait for company
        self.sent_at = -EVENT_LINGER  # time.monotonic() of the owner's last send
        self.loop: asyncio.AbstractEventLoop | None = None  # the owner's, set when it connects
        self._session = session
        self._new_id = new_id  # a request id of the owner's (an event's id is one too)
        self._flush = flush  # the owner's flush: it knows the socket
        self._flush_scheduled = False
        self._linger: asyncio.TimerHandle | None = None  # the flush of events held alone

    # --- holding -------------------------------------------------------------------------

    def hold(self, frames: list[Any], *, linger: bool = False) -> bool:
        """Hold a whole message for the end of this loop iteration (with `linger`, a partial
        reply: up to `linger` for the next send); False when full (send it now)."""
        items = self.items
        if len(items) >= HOLD_MAX:
            return False
        items.append(frames)
        if linger:
            self._schedule_linger()
        else:
            self._schedule_flush()
        return True

    def hold_event(self, body: bytes, key: EventKey) -> bool:
        """Hold an event for up to `linger`; False when full (send it now)."""
        items = self.items
        if len(items) >= HOLD_MAX:
            return False
        items.append(HeldEvent(body, key))
        self._schedule_linger()
        return True

    def held_events(self) -> int:
        return sum(1 for item in self.items if isinstance(item, HeldEvent))

    def stalled(self) -> bool:
        """Messages are held with no flush due (the HWM stopped the last one): flush now."""
        return bool(self.items) and not self._flush_scheduled and self._linger is None

    def event_header(self, key: EventKey, one_type: bool = True) -> bytes:
        type_, agent, run, experiment, parent = key
        return p.encode(p.Header(kind=p.EVENT, id=self._new_id(),
                                 type=type_ if one_type else p.MIXED_TYPES, agent=agent,
                                 run=run, experiment=experiment, parent=parent,
                                 session=self._session))

    # --- scheduling ----------------------------------------------------------------------

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled and self.loop is not None:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush_soon)

    def _schedule_linger(self) -> None:
        """Flush held events `linger` from now, unless something sends them sooner; at the end
        of the loop iteration when the channel is idle (nothing sent within the linger)."""
        if self._linger is not None or self._flush_scheduled or self.loop is None:
            return
        linger = self.linger
        if time.monotonic() - self.sent_at >= linger:
            self._schedule_flush()
            return
        self._linger = self.loop.call_later(linger, self._linger_ended)

    def _linger_ended(self) -> None:
        self._linger = None
        self._flush_soon()

    def _flush_soon(self) -> None:
        self._flush_scheduled = False
        self._flush()

    # --- sending -------------------------------------------------------------------------

    def flush(self, sock: Transport, welcome: p.Welcome | None) -> bool:
        """Send the held messages, in order; False when the HWM stopped it (the rest stay
        held and go out when the socket is writable again, before anything else).

        Consecutive held events with the same header but the id (and the type, header type `*`,
        when the hub takes mixed types) travel as one `event` message with a body frame each
        (at most `COALESCE_EVENTS` and `COALESCE_BYTES`, and only to a hub whose welcome says it
        takes them): the hub logs and publishes each body as its own event, so subscribers see
        exactly what separate messages would have given them."""
        held = self.items
        most = min(COALESCE_EVENTS, welcome.event_bodies) if welcome is not None else 1
        mixed = welcome is not None and welcome.mixed_types
        sent = events = 0
        count = len(held)
        try:
            while sent < count:
                item = held[sent]
                if not isinstance(item, HeldEvent):
                    sock.send(item)
                    sent += 1
                    continue
                end, one_type = _run_end(held, sent, item, most, mixed)
                # (within a run every item is a HeldEvent: the filter only narrows the type)
                sock.send([_SIG, self.event_header(item.key, one_type), item.body,
                           *[e.body for e in held[sent + 1:end] if isinstance(e, HeldEvent)]])
                events += end - sent
                sent = end
        except zmq.Again:
            self._sent(sent, events)
            return False
        except BaseException:
            self._sent(sent, events)
            raise
        self._sent(sent, events)
        return True

    def _sent(self, sent: int, events: int) -> None:
        if sent:
            self.sent_at = time.monotonic()
            del self.items[:sent]
            self.gen += 1
            self.events_sent += events
        linger = self._linger
        if linger is not None and not self.items:  # what it waited for went out with another send
            linger.cancel()
            self._linger = None

    def drop(self, *, events: bool) -> tuple[int, int]:
        """The socket is gone: drop the held replies and partials (their requests are answered
        by the hub, or were forgotten with the connection) and, with `events`, the held events
        too; return how many events and how many replies (partials included) were dropped."""
        held = self.items
        kept = [item for item in held if isinstance(item, HeldEvent)] if not events else []
        # (a held request is no answer: its caller is failed with the connection)
        replies = sum(1 for item in held if not isinstance(item, HeldEvent)
                      and p.decode_header(item[1]).kind != p.REQUEST)
        dropped = self.held_events() - len(kept)
        held[:] = kept
        self.gen += 1
        return dropped, replies


def _run_end(held: list[Held], start: int, first: HeldEvent, most: int,
             mixed: bool) -> tuple[int, bool]:
    """End (exclusive) of the run of held events from `start` (`first`) that share its key (with `mixed`,
    all but its type), bounded by `most` bodies and `COALESCE_BYTES` of bodies (a bigger event
    still goes, alone); and whether the run's events are all of one type."""
    end = start + 1
    stop = min(len(held), start + most)
    key = first.key
    size = len(first.body)
    one_type = True
    while end < stop:
        item = held[end]
        if not isinstance(item, HeldEvent):
            break
        other = item.key
        if other != key and (not mixed or other[1:] != key[1:]):
            break
        size += len(item.body)
        if size > COALESCE_BYTES:
            break
        one_type = one_type and other == key
        end += 1
    return end, one_type
