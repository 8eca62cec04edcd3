"""The bus's exception tree.

    BusError
    ├── HubUnreachable      no welcome from the hub within the connect timeout
    ├── ProtocolError       a frame we cannot make sense of (callers count and drop it)
    └── RequestError        a request ended with an error reply; `.code` names the case
        ├── NoService         no peer serves the service (code `no_service`)
        ├── PeerLost          the serving peer died mid-request (code `peer_lost`)
        ├── HubLost           the hub went away or forgot us mid-request (code `hub_lost`)
        ├── DeadlineExceeded  the request's deadline passed (code `deadline_exceeded`)
        ├── Overloaded        the service's queue is full (code `overloaded`)
        └── RemoteError       the handler failed (any other code, e.g. `handler_error`)
"""

from __future__ import annotations

from bus import protocol as p


class BusError(Exception):
    pass


class HubUnreachable(BusError):
    pass


class ProtocolError(BusError):
    pass


class RequestError(BusError):
    code: str = ""

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code or self.code
        self.message = message


class NoService(RequestError):
    code = p.NO_SERVICE


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
