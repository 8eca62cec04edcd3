"""What the pieces of a peer see of it: `PeerLink`, the part of `bus.peer.Peer` that its calls
(bus/rpc.py), served handlers (bus/serving.py) and subscriptions (bus/subscription.py) use.

`bus.peer` imports those modules to build a `Peer`; they name it by this protocol instead of
importing `bus.peer` back, so the imports of bus/ go one way (tests/test_import_graph.py). The
underscored members are the peer's internals, shared with those modules and nothing else."""

from __future__ import annotations

import asyncio
import weakref
from typing import Any, Protocol

import zmq.asyncio

from agent_bus.bus import protocol as p
from agent_bus.bus.outbox import Outbox
from agent_bus.bus.security import CurveClient
from agent_bus.bus.transport import Transport


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
    def events_endpoint(self) -> str: ...

    @property
    def ctx(self) -> zmq.asyncio.Context: ...

    @property
    def curve(self) -> CurveClient | None: ...

    @property
    def _sock(self) -> Transport | None: ...

    @property
    def _loop(self) -> asyncio.AbstractEventLoop | None: ...

    @property
    def outbox(self) -> Outbox: ...

    @property
    def _subs(self) -> weakref.WeakSet[Any]: ...

    async def request(self, service: str, body: bytes, *, timeout: float | None = 30.0,
                      parent: str = "") -> bytes: ...

    def _send_now(self, frames: list[Any]) -> bool: ...

    async def _send(self, frames: list[Any], *, wait: bool = True,
                    deadline: float = float("inf")) -> None: ...

    async def _send_blocked(self, message: list[Any], deadline: float) -> None: ...

    async def _connection(self, deadline: float) -> None: ...

    def hold(self, frames: list[Any], *, linger: bool = False) -> bool: ...

    def _count(self, name: str) -> None: ...
