"""Routing state of the hub, without sockets: peers, services and their slots, least-loaded
dispatch, queues, deadlines, cancellation, budgets and peer loss.

The hub reads messages and hands them here; everything the registry wants said goes out through
two callables it is given: `send(frames) -> bool` (`[routing id, SIGNATURE, header, *body]`;
False when the message could not be handed to the socket) and `emit(event)` (a bus event the hub
stamps, logs and publishes). Time comes from `clock` (monotonic) and `wall` (unix), so the unit
tests (tests/bus/test_registry.py) drive every path without a socket or a sleep.

The contracts kept here (docs/protocol.md, section 5):
- every request the registry accepts ends with exactly one `reply` or `error` to its requester,
  cancellation included (unless the requester itself is gone);
- request ids are scoped to their sender: requests are keyed by (requester, id). A server sees
  the requester's id unless it is already serving a request with the same id from someone else;
  then it sees an id the hub chose, and the hub puts the requester's id back on the answer.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agent_bus.bus import events as ev
from agent_bus.bus import protocol as p
from agent_bus.bus.toolnames import TOOL_PREFIX, tool_service_fault

# A held request costs its frames plus about this much in Python objects (Pending, key,
# dict/set/heap/deque entries; measured ~850 B), charged to the request budgets.
REQUEST_OVERHEAD = 1024
CANCEL_GRACE = 1.0  # seconds a server has to answer a `cancel` before the hub answers for it

Send = Callable[[list[Any]], bool]
Emit = Callable[[ev.Event], None]
Key = tuple[bytes, str]  # (requester routing id, request id as the requester sent it)


@dataclass(slots=True)
class Limits:
    """The hub budgets the registry enforces (HubConfig holds them; docs/reliability.md)."""

    queue_limit: int = 10_000
    request_bytes: int = 128 * 1024 * 1024
    peer_request_bytes: int = 64 * 1024 * 1024
    queued_services: int = 1000
    max_redispatch: int = 1
    cancel_grace: float = CANCEL_GRACE


@dataclass(slots=True, eq=False)  # identity: `in`/`remove` on queues must not compare fields
class Pending:
    id: str  # as the requester sent it
    requester: bytes
    service: str
    deadline: float  # monotonic; math.inf when none
    header: bytes
    body: list[Any]
    server: bytes | None = None
    wire_id: str = ""  # the id its server sees ("" until dispatched; see `_forward`)
    cancelled: bool = False  # left in its service's queue (removed lazily, see Service)
    cancelling: bool = False  # the requester cancelled it while served: the server may answer
    done: bool = False  # answered or dropped; any heap entry for it is stale
    size: int = 0  # bytes charged to the request budgets while the hub holds it
    lost: int = 0  # servers lost while serving it (see `max_redispatch`)
    prefer: bytes = b""  # routing id of the server its requester prefers (header `prefer`)
    wait_until: float = math.inf  # monotonic: unserved by then, it fails (header `wait`)


@dataclass(slots=True)
class Slot:
    capacity: int
    load: int = 0
    last: int = 0  # the service's dispatch count when this slot was last picked (tie rotation)
    # this peer's registration meta (the service's `meta` is the latest registration's): a
    # peer's own, as `hub.status` shows it per peer (e.g. which workspace a tool worker uses)
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Service:
    name: str
    idempotent: bool = False
    meta: dict[str, Any] = field(default_factory=dict)
    slots: dict[bytes, Slot] = field(default_factory=dict)
    # Cancelled requests stay in the deque (marked) until they reach its head or the deque is
    # compacted, so a requester leaving with n queued requests costs O(n), not O(n x queue).
    queue: deque[Pending] = field(default_factory=deque)
    queued: int = 0  # live (not cancelled) requests in `queue`
    dispatched: int = 0  # requests sent to a server so far (orders slots for tie rotation)


@dataclass(slots=True)
class PeerState:
    ident: bytes
    id: str
    hello: p.Hello
    since: float
    last_seen: float
    services: set[str] = field(default_factory=set)
    serving: dict[str, Pending] = field(default_factory=dict)  # by the id the server sees
    requested: set[str] = field(default_factory=set)  # ids of its requests the hub holds
    request_bytes: int = 0  # charged for its requests the hub holds (`peer_request_bytes`)
    user_id: str = ""  # the CURVE key (ZAP User-Id) this peer authenticated with
    # Every service it registered on this connection, also since unregistered: whom it may
    # speak for (a coordinator may end its runs after taking its agents off the bus).
    served: set[str] = field(default_factory=set)
    # Its `peer_service_bytes` token bucket (bytes it may still be answered, and when that was
    # reckoned); starts full: the first reckoning fills it.
    service_tokens: float = 0.0
    service_at: float = 0.0
    # Its `hub.replay` requests not answered yet (with the reader, or held for pacing): at most
    # PEER_REPLAY_QUEUE (bus/replay_reader.py)
    replays: int = 0
    # Roles from a credential in its hello (the service patterns it may serve; None: full
    # rights); `by_credential` False: its roles come from its CURVE key, or it has full rights.
    roles: tuple[str, ...] | None = None
    by_credential: bool = False


class Counters(dict[str, int]):
    def bump(self, name: str, n: int = 1) -> int:
        value = self.get(name, 0) + n
        self[name] = value
        return value


def no_service_text(service: str) -> str:
    return f"no peer serves `{service}` (start one, e.g. `busctl worker`, or check the name)"


def error_frames(ident: bytes, req_id: str, code: str, text: str) -> list[Any]:
    return [ident, p.SIGNATURE, p.encode(p.Header(kind=p.ERROR, id=req_id, code=code, error=text))]


class Registry:
    """Peers, services and the requests the hub holds. Not thread-safe: the hub loop owns it."""

    def __init__(self, limits: Limits, counters: Counters, send: Send, emit: Emit,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.limits = limits
        self.counters = counters
        self.send = send
        self.emit = emit
        self.clock = clock
        self.wall = wall
        # These dicts are never rebound: the hub keeps references to them.
        self.peers: dict[bytes, PeerState] = {}
        self.services: dict[str, Service] = {}
        self.requests: dict[Key, Pending] = {}
        # (when, tiebreak, request): deadlines, and cancel grace periods ending
        self.deadlines: list[tuple[float, int, Pending]] = []
        self.graces: list[tuple[float, int, Pending]] = []
        self._order = itertools.count()
        self._wire_ids = itertools.count(1)
        self.request_bytes = 0  # charged for all held requests (budget `request_bytes`)

    # --- peers ---------------------------------------------------------------------------

    def add_peer(self, ident: bytes, peer_id: str, hello: p.Hello, user_id: str = "") -> PeerState:
        """A peer said hello (a second hello from the same connection replaces it)."""
        old = self.peers.get(ident)
        if old is not None:
            self.drop_peer(old, "said hello again (restarted)")
        peer = PeerState(ident, peer_id, hello, self.wall(), self.clock(), user_id=user_id)
        self.peers[ident] = peer
        self.emit(ev.PeerJoined(peer=peer.id, name=hello.name, host=hello.host, pid=hello.pid,
                                session=hello.session))
        return peer

    def register(self, peer: PeerState, reg: p.Register, req_id: str) -> None:
        """Add or update the peer's services; each refused spec is answered with an `error`."""
        for spec in reg.services:
            why = self._bad_spec(spec) or self._schema_clash(peer, spec)
            if why:
                self._refuse("bad_register", peer.ident, req_id, p.BAD_REQUEST, why)
                continue
            service = self.services.get(spec.name)
            if service is None:
                service = self.services[spec.name] = Service(spec.name)
            service.idempotent = spec.idempotent
            service.meta = spec.meta
            old = service.slots.get(peer.ident)
            service.slots[peer.ident] = Slot(spec.capacity, old.load if old else 0,
                                             old.last if old else 0, spec.meta)
            peer.services.add(spec.name)
            peer.served.add(spec.name)
            self.emit(ev.ServiceRegistered(service=spec.name, peer=peer.id,
                                           capacity=spec.capacity))
            self._dispatch_queued(service)

    @staticmethod
    def _bad_spec(spec: p.ServiceSpec) -> str:
        if not spec.name:
            return "register refused: a service has an empty `name`"
        if spec.name.startswith("hub."):
            return f"register refused: service names starting `hub.` are the hub's ({spec.name!r})"
        if spec.capacity < 1:
            return (f"register refused: service {spec.name!r} has `capacity` {spec.capacity}; "
                    "it must be >= 1")
        return tool_service_fault(spec.name, spec.meta)  # a name/schema no model API takes

    def _schema_clash(self, peer: PeerState, spec: p.ServiceSpec) -> str:
        """Why `spec` may not join the live `tool.<name>`: other peers serve it with other
        parameters. Calls are balanced over every peer of a service and the model sees one
        schema, so a second function under the same name would get arguments meant for the
        first (issue 49): refused, naming the peers, rather than joined silently."""
        service = self.services.get(spec.name)
        if service is None or not spec.name.startswith(TOOL_PREFIX):
            return ""
        mine = spec.meta.get("parameters")
        others = sorted({f"`{self.peers[ident].hello.name}`" for ident, slot in service.slots.items()
                         if ident != peer.ident and ident in self.peers
                         and slot.meta.get("parameters") != mine})
        if not others:
            return ""
        return (f"register refused: service {spec.name!r} is served by {', '.join(others)} with "
                f"other parameters (a tool name means one schema: calls are shared by every peer "
                f"serving it); stop those first to change the tool, or give this one another "
                f"name (a prefix)")

    def unregister(self, peer: PeerState, names: list[str]) -> None:
        for name in names:
            if name in peer.services:
                self._remove_slot(peer, name, "unregistered")

    def _remove_slot(self, peer: PeerState, name: str, reason: str) -> None:
        peer.services.discard(name)
        service = self.services.get(name)
        if service is not None:
            service.slots.pop(peer.ident, None)
        self.emit(ev.ServiceRemoved(service=name, peer=peer.id, reason=reason))

    def expired_peers(self, now: float, expiry: float) -> list[PeerState]:
        """Peers silent for longer than `expiry` seconds (the hub drops them)."""
        return [peer for peer in self.peers.values() if now - peer.last_seen > expiry]

    def drop_peer(self, peer: PeerState, reason: str) -> None:
        """Forget a peer: remove its services; re-dispatch (idempotent) or fail `peer_lost` the
        calls it was serving; cancel the calls it made (nobody is left to answer)."""
        if self.peers.get(peer.ident) is peer:
            del self.peers[peer.ident]
        for name in list(peer.services):
            self._remove_slot(peer, name, reason)
        failed = redispatched = 0
        for req in list(peer.serving.values()):
            peer.serving.pop(req.wire_id, None)
            req.server = None
            if req.cancelling:  # the requester asked to stop it: that is its answer
                self._answer_cancelled(req, f"cancelled; its server was lost ({reason})")
                continue
            if self._redispatch(req):
                redispatched += 1
                continue
            failed += 1
            self._error(req, p.PEER_LOST, self._lost_text(peer, req, reason))
            self._finish(req)
        for req_id in list(peer.requested):
            made = self.requests.get((peer.ident, req_id))
            if made is not None:
                self._withdraw(made)
        self.emit(ev.PeerLeft(peer=peer.id, name=peer.hello.name, reason=reason))
        if failed or redispatched:
            self.emit(ev.WorkerLost(peer=peer.id, name=peer.hello.name, failed=failed,
                                    redispatched=redispatched))
        self.prune_services()

    def _redispatch(self, req: Pending) -> bool:
        """Serve an idempotent call again after its server was lost, unless it has already been
        re-dispatched `max_redispatch` times: a call that takes down every peer it reaches (a
        tool that hangs its worker) must not take down the next one, and the next."""
        service = self.services.get(req.service)
        if service is None or not service.idempotent or req.done:
            return False
        req.lost += 1
        if req.lost > self.limits.max_redispatch:
            self.counters.bump("redispatch_refused")
            return False
        if not self._try_dispatch(service, req):
            self._enqueue(service, req, front=True)
        return True

    def _lost_text(self, peer: PeerState, req: Pending, reason: str) -> str:
        text = f"peer `{peer.hello.name}` ({peer.id}) serving `{req.service}` was lost: {reason}"
        limit = self.limits.max_redispatch
        if req.lost <= limit:
            return text
        return (f"{text}; this call has now lost {req.lost} peers serving it and is not "
                f"re-dispatched again (hub `max_redispatch` = {limit}): "
                f"`{req.service}` may be what hangs or kills its servers")

    # --- requests ------------------------------------------------------------------------

    def request(self, peer: PeerState, header: p.Header, frames: list[Any]) -> bool:
        """Take a request from `peer` (frames as read: routing id, signature, header, body…).
        Every refusal is answered here. Returns True only for a well-formed request to a `hub.`
        service, which the hub serves itself."""
        ident = peer.ident
        req_id = header.id
        if not req_id:
            self._refuse("bad_request", ident, "", p.BAD_REQUEST,
                         "request has no `id`: set a string unique among your in-flight requests")
            return False
        key = (ident, req_id)
        requests = self.requests
        if key in requests:
            self._refuse("bad_request", ident, req_id, p.BAD_REQUEST,
                         f"request id `{req_id}` is already in flight from this peer: use an id "
                         "unique among your in-flight requests")
            return False
        if header.service.startswith("hub."):
            return True
        deadline = self._deadline(ident, header) if header.deadline else math.inf
        if deadline != deadline:  # NaN: refused (answered) already
            return False
        req = Pending(req_id, ident, header.service, deadline, frames[2], frames[3:],
                      size=REQUEST_OVERHEAD + sum(map(len, frames)))
        if header.wait > 0:  # (False for NaN: ignored, as a wait of 0)
            req.wait_until = self.clock() + header.wait
        service = self._service_for(req)
        if service is None:
            return False
        refusal = self._over_budget(peer, service, req)
        if refusal:
            self._error(req, p.OVERLOADED, refusal)
            return False
        requests[key] = req
        peer.requested.add(req_id)
        size = req.size
        peer.request_bytes += size
        self.request_bytes += size
        if deadline != math.inf or req.wait_until != math.inf:
            self._watch_deadline(req)
        if header.prefer:
            req.prefer = self._preferred(header.prefer)
        if not self._try_dispatch(service, req):
            self._enqueue(service, req)
        return False

    def _preferred(self, peer_id: str) -> bytes:
        """The routing id of live peer `peer_id` (ids end with their routing id's hex, see
        bus/security.curve_peer_id), or b"": an unknown or malformed `prefer` is ignored."""
        try:
            ident = bytes.fromhex(peer_id.rpartition(":")[2])
        except ValueError:
            return b""
        peer = self.peers.get(ident)
        return ident if peer is not None and peer.id == peer_id else b""

    def _watch_deadline(self, req: Pending) -> None:
        """Put `req` on the deadline heap, at the end of its `wait` for a server when that comes
        first (`expire` then puts it back at its deadline if it is served or queued behind busy
        servers). Entries of ended requests stay until popped, so the heap is rebuilt from the
        live ones once they are outnumbered: memory follows the requests held, not the request
        rate times the deadlines (amortised O(log n) per request)."""
        heap = self.deadlines
        if len(heap) > 2 * len(self.requests) + 64:
            heap[:] = [entry for entry in heap if not entry[2].done]
            heapq.heapify(heap)
        heapq.heappush(heap, (min(req.deadline, req.wait_until), next(self._order), req))

    def _deadline(self, ident: bytes, header: p.Header) -> float:
        """The request's deadline on the monotonic clock; NaN after refusing it."""
        if header.deadline != header.deadline:  # NaN would sit in the deadline heap forever
            self._refuse("bad_request", ident, header.id, p.BAD_REQUEST,
                         "`deadline` is not a number: send unix seconds, or 0 for none")
            return math.nan
        left = header.deadline - self.wall()
        if left <= 0:  # refused at once: queueing it would only answer it on the next tick
            self._refuse("expired_requests", ident, header.id, p.DEADLINE,
                         f"`deadline` {header.deadline:.3f} is {-left:.3f} s in the past (unix "
                         "seconds; check the clocks of both hosts)")
            return math.nan
        return self.clock() + left

    def _service_for(self, req: Pending) -> Service | None:
        """The service to queue `req` on, or None after answering why it cannot be queued."""
        service = self.services.get(req.service)
        if service is not None and service.slots:
            return service
        if req.deadline == math.inf and req.wait_until == math.inf:  # it would wait forever
            self._error(req, p.NO_SERVICE, no_service_text(req.service))
            return None
        if service is not None:
            return service
        limit = self.limits.queued_services
        # names are free: without this cap each new one gets its own `queue_limit`
        if len(self.services) >= limit and self.unserved() >= limit:
            self.counters.bump("overloaded_services")
            self._error(req, p.OVERLOADED,
                        f"{limit} unserved service names already have queued requests "
                        f"(hub budget `queued_services`); {no_service_text(req.service)}")
            return None
        service = self.services[req.service] = Service(req.service)
        return service

    def unserved(self) -> int:
        return sum(1 for s in self.services.values() if not s.slots)

    def _over_budget(self, peer: PeerState, service: Service, req: Pending) -> str:
        """Why holding `req` would break a budget (counted), or "" when it fits."""
        lim = self.limits
        if service.queued >= lim.queue_limit:
            counter = "overloaded_queue"
            text = f"service `{service.name}` queue is full ({lim.queue_limit}, `queue_limit`)"
        elif peer.request_bytes + req.size > lim.peer_request_bytes:
            counter = "overloaded_peer_bytes"
            text = (f"this peer's requests held by the hub would take {peer.request_bytes + req.size}"
                    f" bytes, over the hub budget `peer_request_bytes` ({lim.peer_request_bytes});"
                    " wait for replies before sending more")
        elif self.request_bytes + req.size > lim.request_bytes:
            counter = "overloaded_request_bytes"
            text = (f"requests held by the hub would take {self.request_bytes + req.size} bytes, "
                    f"over the hub budget `request_bytes` ({lim.request_bytes}); retry later")
        else:
            return ""
        self.counters.bump(counter)
        return text

    def answer(self, server: PeerState, header: p.Header, frames: list[Any]) -> None:
        """A `partial`, `reply` or `error` from `server` (frames as read). Only the peer serving
        the request may answer it; after a cancel, the requester gets `error` `cancelled`."""
        req = server.serving.get(header.id)
        if req is None:
            self.counters.bump("stale_replies")
            return
        kind = header.kind
        if req.cancelling:
            if kind == p.PARTIAL:
                self.counters.bump("cancelled_partials")
                return
            if kind != p.ERROR or header.code != p.CANCELLED:
                self._answer_cancelled(req, f"cancelled; the server's `{kind}` that crossed the "
                                            "cancel was dropped")
                return
        if req.wire_id == req.id:
            self.send([req.requester, p.SIGNATURE, *frames[2:]])
        else:  # the server saw a hub-chosen id: put the requester's back
            header.id = req.id
            self.send([req.requester, p.SIGNATURE, p.encode(header), *frames[3:]])
        if kind != p.PARTIAL:
            self._finish(req)

    def cancel(self, requester: bytes, req_id: str) -> None:
        """The requester cancels one of its requests. A queued one is answered `cancelled` at
        once; a served one is cancelled at its server, which has `cancel_grace` seconds to
        answer before the hub answers `cancelled` itself. Unknown ids (answered already) and
        repeated cancels are ignored: the request has, or will get, its one answer."""
        req = self.requests.get((requester, req_id))
        if req is None or req.cancelling:
            self.counters.bump("cancel_ignored")
            return
        if req.server is None:
            self._unqueue(req)
            self._answer_cancelled(req, "cancelled by the requester while queued")
            return
        req.cancelling = True
        self.send([req.server, p.SIGNATURE, p.encode(p.Header(kind=p.CANCEL, id=req.wire_id))])
        grace = self.clock() + self.limits.cancel_grace
        heapq.heappush(self.graces, (grace, next(self._order), req))

    def _answer_cancelled(self, req: Pending, text: str) -> None:
        self._error(req, p.CANCELLED, text)
        self._finish(req)

    def _withdraw(self, req: Pending) -> None:
        """Forget a request whose requester is gone: tell its server; nobody is left to answer."""
        if req.server is not None:
            self.send([req.server, p.SIGNATURE, p.encode(p.Header(kind=p.CANCEL, id=req.wire_id))])
        elif not req.cancelled:  # a live request without a server is in its service's queue
            self._unqueue(req)
        self._finish(req)

    def expire(self, now: float) -> None:
        """Answer requests past their deadline (`deadline_exceeded`, or `no_service` when nobody
        serves it) and cancelled ones whose server let the grace period pass."""
        while self.deadlines and self.deadlines[0][0] <= now:
            at, _, req = heapq.heappop(self.deadlines)
            if req.done or req.cancelling:  # a cancelled one is answered at its grace's end
                continue
            service = self.services.get(req.service)
            unserved = req.server is None and (service is None or not service.slots)
            if at < req.deadline:  # the end of its `wait` for a server
                self._end_wait(req, unserved)
                continue
            self.counters.bump("expired_requests")
            if unserved:
                self._error(req, p.NO_SERVICE, no_service_text(req.service))
            else:
                where = "in the queue" if req.server is None else "while being served"
                self._error(req, p.DEADLINE,
                            f"request to `{req.service}` passed its deadline {where}")
            self._withdraw(req)
        while self.graces and self.graces[0][0] <= now:
            req = heapq.heappop(self.graces)[2]
            if req.done:
                continue
            self.counters.bump("cancel_unanswered")
            self._answer_cancelled(req, f"cancelled; the server did not answer the cancel within "
                                        f"{self.limits.cancel_grace:g} s")
        self.prune_services()

    def _end_wait(self, req: Pending, unserved: bool) -> None:
        """`req`'s `wait` is over: still nobody to serve it, it fails `no_service`; otherwise
        (served, or queued behind busy servers) it is watched until its deadline again."""
        if not unserved:
            if req.deadline != math.inf:
                heapq.heappush(self.deadlines, (req.deadline, next(self._order), req))
            return
        self.counters.bump("waits_expired")
        self._error(req, p.NO_SERVICE, f"{no_service_text(req.service)}; the request waited "
                                       "its `wait` for one to register")
        self._withdraw(req)

    def prune_services(self) -> None:
        empty = [n for n, s in self.services.items() if not s.slots and not s.queued]
        for name in empty:
            del self.services[name]

    # --- dispatch ------------------------------------------------------------------------

    def _try_dispatch(self, service: Service, req: Pending) -> bool:
        """Send `req` to the least-loaded slot (load / capacity); among equals, the one picked
        longest ago, so ties rotate instead of always landing on the first registered."""
        if req.prefer and self._dispatch_preferred(service, req):
            return True
        best: Slot | None = None
        best_ident = b""
        best_ratio = 2.0
        for ident, slot in service.slots.items():
            load = slot.load
            if load >= slot.capacity:
                continue
            ratio = load / slot.capacity
            if ratio < best_ratio or (ratio == best_ratio and slot.last < best.last):  # type: ignore[union-attr]
                best, best_ident, best_ratio = slot, ident, ratio
        if best is None:
            return False
        server = self.peers[best_ident]
        if not self._forward(server, req):
            return False
        best.load += 1
        service.dispatched += 1
        best.last = service.dispatched
        return True

    def _dispatch_preferred(self, service: Service, req: Pending) -> bool:
        """Send `req` to the server its requester prefers, when that one serves `service` and
        has a free slot (False: it goes the usual way; a preference, not a pin)."""
        slot = service.slots.get(req.prefer)
        if slot is None or slot.load >= slot.capacity:
            return False
        if not self._forward(self.peers[req.prefer], req):
            return False
        slot.load += 1
        service.dispatched += 1
        slot.last = service.dispatched
        return True

    def _forward(self, server: PeerState, req: Pending) -> bool:
        """Send the request frames to `server`, under the requester's id unless the server is
        already serving that id for another requester (ids are only unique per sender)."""
        serving = server.serving
        wire_id = req.id
        header = req.header
        if wire_id in serving:
            wire_id = f"{req.id}~{next(self._wire_ids):x}"
            decoded = p.decode_header(header)
            decoded.id = wire_id
            header = p.encode(decoded)
        if not self.send([server.ident, p.SIGNATURE, header, *req.body]):
            return False
        req.server = server.ident
        req.wire_id = wire_id
        serving[wire_id] = req
        return True

    def _dispatch_queued(self, service: Service) -> None:
        queue = service.queue
        while queue:
            head = queue[0]
            if head.cancelled:  # removed lazily (see `_unqueue`)
                queue.popleft()
                continue
            if not self._try_dispatch(service, head):
                return
            queue.popleft()
            service.queued -= 1

    def _enqueue(self, service: Service, req: Pending, front: bool = False) -> None:
        if front:
            service.queue.appendleft(req)
        else:
            service.queue.append(req)
        service.queued += 1

    def _unqueue(self, req: Pending) -> None:
        """Take a queued request out in O(1): it is marked and its body let go; the deque is
        compacted once cancelled entries outnumber live ones (amortised O(1) per request)."""
        req.cancelled = True
        req.body = []
        service = self.services.get(req.service)
        if service is None:
            return
        service.queued -= 1
        if not service.queued:
            service.queue.clear()
        elif len(service.queue) > 2 * service.queued + 64:
            service.queue = deque(r for r in service.queue if not r.cancelled)

    def _finish(self, req: Pending) -> None:
        """The request is over: release its budget and its server's slot (once)."""
        if req.done:
            return
        req.done = True
        req.body = []  # a deadline heap entry may outlive it for a while (see _watch_deadline)
        peers = self.peers
        requester_ident = req.requester
        requester = peers.get(requester_ident)
        if self.requests.pop((requester_ident, req.id), None) is req:
            self.request_bytes -= req.size
            if requester is not None:
                requester.request_bytes -= req.size
        if requester is not None:
            requester.requested.discard(req.id)
        server_ident = req.server
        if server_ident is None:
            return
        server = peers.get(server_ident)
        if server is not None:
            serving = server.serving
            if serving.get(req.wire_id) is req:
                del serving[req.wire_id]
        service = self.services.get(req.service)
        if service is None:
            return
        slot = service.slots.get(server_ident)
        if slot is not None and slot.load > 0:
            slot.load -= 1
        if service.queue:  # (most finish with nothing queued: no call)
            self._dispatch_queued(service)

    # --- answers -------------------------------------------------------------------------

    def _error(self, req: Pending, code: str, text: str) -> None:
        self.send(error_frames(req.requester, req.id, code, text))

    def _refuse(self, counter: str, ident: bytes, req_id: str, code: str, text: str) -> None:
        self.counters.bump(counter)
        self.send(error_frames(ident, req_id, code, text))
