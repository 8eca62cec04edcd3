"""What the pieces of a peer see of it: `PeerLink`, the part of `bus.peer.Peer` that its calls
(bus/rpc.py), served handlers (bus/serving.py), subscriptions (bus/subscription.py), publish
accounting (bus/ledger.py) and periodic duties (bus/housekeeping.py) use, and its lifecycle,
`PeerState`.

`bus.peer` imports those modules to build a `Peer`; they name it by this protocol instead of
importing `bus.peer` back, so the imports of bus/ go one way (tests/test_import_graph.py). Every
member is public: what they share of the peer's send path (`send_now`, `hold`, the `outbox`, the
current socket) is named here, and nothing else of its internals is reached."""

from __future__ import annotations

import asyncio
import enum
import weakref
from typing import Any, Protocol

import zmq.asyncio

from agent_bus.bus import protocol as p
from agent_bus.bus.outbox import Outbox
from agent_bus.bus.security import CurveClient
from agent_bus.bus.transport import Transport


class PeerState(enum.Enum):
    """A peer's lifecycle; see bus/peer.py's docstring."""

    CONNECTING = "connecting"
    READY = "ready"
    RECONNECTING = "reconnecting"
    CLOSING = "closing"
    CLOSED = "closed"


class PeerLink(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def hub(self) -> str: ...

    @property
    def counters(self) -> dict[str, int]: ...

    @property
    def session(self) -> str: ...

    @property
    def peer_id(self) -> str: ...

    @property
    def welcome(self) -> p.Welcome | None: ...

    @property
    def closing(self) -> bool: ...

    @property
    def state(self) -> PeerState: ...

    @property
    def last_heard(self) -> float: ...

    @property
    def events_endpoint(self) -> str: ...

    @property
    def ctx(self) -> zmq.asyncio.Context: ...

    @property
    def curve(self) -> CurveClient | None: ...

    @property
    def sock(self) -> Transport | None: ...

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None: ...

    @property
    def outbox(self) -> Outbox: ...

    @property
    def subscriptions(self) -> weakref.WeakSet[Any]: ...

    async def request(self, service: str, body: bytes, *, timeout: float | None = 30.0,
                      parent: str = "") -> bytes: ...

    def send_now(self, frames: list[Any]) -> bool: ...

    async def send(self, frames: list[Any], *, wait: bool = True,
                    deadline: float = float("inf")) -> None: ...

    async def send_blocked(self, message: list[Any], deadline: float) -> None: ...

    async def wait_connection(self, deadline: float) -> None: ...

    def hold(self, frames: list[Any], *, linger: bool = False) -> bool: ...

    def count(self, name: str) -> None: ...

    def drain(self) -> None: ...

    def flush_soon(self) -> None: ...

    def reconnect(self) -> None: ...
