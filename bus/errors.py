"""agent-bus's one exception tree: every error we raise on purpose is an `AgentBusError`.

    AgentBusError
    ├── ConfigError          a topology, flag or setting that cannot work (names the key/flag)
    │   ├── TopologyError      agents/launch/topology.py
    │   ├── HubConfigError     bus/hub.py (e.g. a non-loopback bind without CURVE)
    │   ├── InsecureBindError  bus/security.py: `busctl hub`/`up` binding exposed without CURVE
    │   ├── ModelSetupError    agents/gateway/engine.py (no model configured, unknown alias)
    │   └── CoordinatorError   agents/coordinator/process.py (an agent's hook does not import, …)
    ├── ChildFailed          agents/launch/supervisor.py: a child of `busctl up` did not start
    ├── UnknownName          a name the user gave (agent, process, experiment) names nothing
    ├── ToolError            tools/_exceptions.py: a tool call failed (the model sees the message)
    ├── AgentError           agents/loop/agent.py: the agent loop was misused (e.g. already running)
    ├── StreamError          agents/gateway/providers/base.py: a provider's stream broke
    └── BusError             the bus itself, below:

    BusError
    ├── HubUnreachable      no welcome from the hub within the connect timeout
    ├── RegisterRefused     the hub refused to register a service (`.service`, `.code`, `.reason`)
    ├── ProtocolError       a frame we cannot make sense of (callers count and drop it)
    └── RequestError        a request ended with an error reply; `.code` names the case
        ├── NoService         no peer serves the service (code `no_service`)
        │   └── NoSuchAgent     ... because no live coordinator hosts the agent (also UnknownName)
        ├── PeerLost          the serving peer died mid-request (code `peer_lost`)
        ├── HubLost           the hub went away or forgot us mid-request (code `hub_lost`)
        ├── DeadlineExceeded  the request's deadline passed (code `deadline_exceeded`)
        ├── Overloaded        the service's queue is full (code `overloaded`)
        └── RemoteError       the handler failed (any other code, e.g. `handler_error`)
"""

from __future__ import annotations

from agent_bus.bus import protocol as p


class AgentBusError(Exception):
    """The root: `busctl` turns any of these into one line on stderr and a non-zero exit."""


class ConfigError(AgentBusError):
    """Configuration that cannot work; the message names the key or flag and how to fix it."""


class UnknownName(AgentBusError):
    """A name the user gave (an agent, a process, a worker group, an experiment) that names
    nothing; the message lists the names that exist. busctl exits 2 (`commands.base`): the
    command line is wrong, as for a bad flag, and running it again will not help."""


class BusError(AgentBusError):
    pass


class HubUnreachable(BusError):
    pass


class ProtocolError(BusError):
    pass


class RegisterRefused(BusError):
    """The hub refused to register `service` (`Peer.serve`): `code` `forbidden` (this peer's
    roles may not serve it; docs/protocol.md section 8, "Roles") or `bad_request` (a bad
    spec); `reason` is the hub's text, which names the roles or what is wrong."""

    def __init__(self, service: str, code: str, reason: str) -> None:
        super().__init__(f"the hub refused to register `{service}` ({code}): {reason}")
        self.service, self.code, self.reason = service, code, reason


class RequestError(BusError):
    code: str = ""

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code or self.code
        self.message = message


class NoService(RequestError):
    code = p.NO_SERVICE


class NoSuchAgent(NoService, UnknownName):
    """No live coordinator hosts the agent named (`agents.client.remote`)."""


class PeerLost(RequestError):
    code = p.PEER_LOST


class HubLost(RequestError):
    code = p.HUB_LOST


class DeadlineExceeded(RequestError):
    code = p.DEADLINE


class Overloaded(RequestError):
    code = p.OVERLOADED


class RemoteError(RequestError):
    code = p.HANDLER_ERROR


_BY_CODE: dict[str, type[RequestError]] = {
    cls.code: cls for cls in (NoService, PeerLost, HubLost, DeadlineExceeded, Overloaded)
}


def error_for(code: str, message: str) -> RequestError:
    """The most specific `RequestError` for an error reply's code."""
    return _BY_CODE.get(code, RemoteError)(message, code)
