"""The topology's status as one typed value: the hub's, each gateway's, each agent's (summed over
its coordinators) and each reporting subscriber's, with the dropped events added up."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from agent_bus.agents import commands as cmd
from agent_bus.agents.gateway.wire import EngineStats
from agent_bus.bus.client import Peer
from agent_bus.bus.errors import AgentBusError, BusError
from agent_bus.bus.protocol import Status

if TYPE_CHECKING:
    from agent_bus.bus.ui import Drops

# What the dropped events add up: the hub's own refusals, and what each subscriber that reports
# (`subscriber.<name>`: busctl ui, busctl otel) says its live stream lost. A subscriber's drops
# happen in libzmq's PUB queue, which counts nothing: only the subscriber sees the hole in the
# seqs (and fills it from the log).
HUB_DROP_COUNTERS = ("oversize_events", "events_refused")


class AgentSummary(cmd.AgentState, omit_defaults=True):
    """An agent's state on its first coordinator, with `sessions`, `live`, `queued`, `idle` and
    `stored` summed over all coordinators serving it, and `coordinators` naming them."""

    coordinators: list[str] = msgspec.field(default_factory=list)


class Dropped(msgspec.Struct):
    # in this order in `busctl status --json`
    oversize_events: int
    events_refused: int
    subscribers: int
    total: int


@dataclass(frozen=True)
class TopologyStatus:
    hub: Status
    gateways: dict[str, EngineStats]
    agents: dict[str, AgentSummary]
    subscribers: dict[str, Drops]
    dropped: Dropped
    #: The same as the services answered it (fields this client does not know included), with
    #: `errors` naming the services that did not answer: what `busctl status --json` prints.
    report: dict[str, Any]


async def topology_status(peer: Peer) -> TopologyStatus:
    """Ask the hub, then each gateway, agent and reporting subscriber it lists."""
    status = await peer.status()
    report: dict[str, Any] = msgspec.to_builtins(status)
    report["gateways"] = {}
    report["agents"] = {}
    for service in status.services:
        try:
            if service.name.startswith("gateway."):
                body = await peer.request(service.name, b"", timeout=3)
                report["gateways"][service.name[8:]] = msgspec.msgpack.decode(body)
            elif service.name.startswith("agent.") and "@" in service.name and service.peers:
                body = await peer.request(service.name, cmd.encode(cmd.GetState()), timeout=3)
                _merge_agent(report["agents"], msgspec.msgpack.decode(body))
        except BusError as exc:
            report.setdefault("errors", []).append(f"{service.name}: {exc}")
    report["subscribers"] = await _subscriber_drops(peer, report)
    return _typed(status, report)


def _typed(status: Status, report: dict[str, Any]) -> TopologyStatus:
    from agent_bus.bus.ui import Drops  # its module serves the web view: loaded only here

    gateways = {name: msgspec.convert(raw, EngineStats) for name, raw in report["gateways"].items()}
    agents = {name: msgspec.convert(raw, AgentSummary) for name, raw in report["agents"].items()}
    subscribers = {name: msgspec.convert(raw, Drops) for name, raw in report["subscribers"].items()}
    dropped = _drop_totals(status, subscribers)
    report["dropped"] = msgspec.to_builtins(dropped)
    return TopologyStatus(hub=status, gateways=gateways, agents=agents, subscribers=subscribers,
                          dropped=dropped, report=report)


def _merge_agent(agents: dict[str, Any], state: dict[str, Any]) -> None:
    coordinator = state.get("coordinator", "")
    for info in state.get("sessions", []):
        info["coordinator"] = coordinator
    merged = agents.get(state["name"])
    if merged is None:
        state["coordinators"] = [coordinator]
        agents[state["name"]] = state
        return
    merged["coordinators"].append(coordinator)
    merged["sessions"] = merged.get("sessions", []) + state.get("sessions", [])
    for key in ("live", "queued", "idle", "stored"):
        merged[key] = merged.get(key, 0) + state.get(key, 0)
    merged["is_running"] = merged.get("is_running", False) or state.get("is_running", False)


async def _subscriber_drops(peer: Peer, report: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for service in report["services"]:
        name = service["name"]
        if not name.startswith("subscriber.") or not service["peers"]:
            continue
        try:
            out[name[11:]] = msgspec.msgpack.decode(await peer.request(name, b"", timeout=3))
        except AgentBusError as exc:
            report.setdefault("errors", []).append(f"{name}: {exc}")
    return out


def _drop_totals(status: Status, subscribers: dict[str, Drops]) -> Dropped:
    oversize, refused = (status.counters.get(k, 0) for k in HUB_DROP_COUNTERS)
    lagging = sum(s.refilled + s.lost for s in subscribers.values())
    return Dropped(oversize_events=oversize, events_refused=refused, subscribers=lagging,
                   total=oversize + refused + lagging)
