"""The peer client: how every process (and every test) talks to the hub, on anyio/asyncio.

`async with connect(hub, name=...) as peer:` says hello, keeps heartbeats going both ways, and
reconnects (re-registering its services) when the hub restarts. Replies are matched to requests
by id. Subscriptions use their own SUB socket and are read by the consumer's task.

This module is the public face; the parts, each with one job:

- `bus/peer.py`: `Peer`, the connection's lifecycle (`PeerState`, in `bus/link.py` with the
  `PeerLink` protocol its parts see it by), its one reader, sending and publishing;
- `bus/outbox.py`: the messages held to go out together (held events, replies, partials), their
  flush and the multi-body event runs;
- `bus/ledger.py`: what the hub confirmed of the events published (`confirm()`);
- `bus/housekeeping.py`: the peer's periodic duties: heartbeats, the hub's silence, the expiry of
  calls, background confirmations;
- `bus/rpc.py`: requests this peer makes: the call map the reader feeds, `request`/`stream`, a
  cancel when the requester leaves early;
- `bus/serving.py`: requests it serves: registers and their refusals, an `async def` handler in a
  task and a cancel scope per request, a plain function at once in the reader; exactly one
  answer each;
- `bus/subscription.py`: `Subscription`, live events plus replays from the log, no hole and no
  duplicate;
- `bus/transport.py`: framing and the DEALER's transport, the fast (`add_reader`) one or the
  portable (`zmq.asyncio`) one;
- `bus/endpoints.py`: a peer's list of hub endpoints (`hub_list`), followed when the hub moves;
  `bus/keyed.py`: what a server remembers of keyed requests (a repeat is answered once).
- `bus/backoff.py`: the retry policy of the reconnect loop and of a subscription's replays.
"""

from __future__ import annotations

from agent_bus.bus.endpoints import hub_list
from agent_bus.bus.link import PeerState
from agent_bus.bus.peer import (
    CONNECT_TIMEOUT,
    DEFAULT_HUB,
    FLUSH_TIMEOUT,
    HUB_ENV,
    Peer,
    connect,
    default_hub,
)
from agent_bus.bus.rpc import REPLY_GRACE
from agent_bus.bus.serving import Handler, IncomingRequest
from agent_bus.bus.subscription import REPLAY_RETRY_FOR, Envelope, Subscription

__all__ = [
    "CONNECT_TIMEOUT",
    "DEFAULT_HUB",
    "FLUSH_TIMEOUT",
    "HUB_ENV",
    "REPLAY_RETRY_FOR",
    "REPLY_GRACE",
    "Envelope",
    "Handler",
    "IncomingRequest",
    "Peer",
    "PeerState",
    "Subscription",
    "connect",
    "default_hub",
    "hub_list",
]
