"""A peer's hub endpoints: the list a client follows when the hub moves (issue 52).

`--hub`, `BUSCTL_HUB`, `connect(hub=...)` and `Peer(hub=...)` take one address or several: a
list, or one string with commas (`tcp://primary:7400,tcp://standby:7400`, what `busctl up`
hands the processes it starts when a standby is configured). Each entry is read by the one
parser of hub addresses (`bus.paths.parse_hub_address`), so the forms stay those of one
address. The list is checked whole before anything connects: an empty entry or a bad address
is a `ValueError` naming the entry, never found later on a failover.

See docs/protocol.md section 5, "Following the hub", for what a peer does with the list.
"""

from __future__ import annotations

from collections.abc import Sequence

from agent_bus.bus.paths import HUB_FORMS, parse_hub_address


def hub_list(value: str | Sequence[str]) -> list[str]:
    """The endpoints of `value` (a comma-separated string or a sequence of addresses), each
    parsed, in order, without repeats. Raises ValueError naming the bad entry."""
    entries = value.split(",") if isinstance(value, str) else list(value)
    if not entries:
        raise ValueError(f"no hub address given (use {HUB_FORMS}, several separated by commas)")
    endpoints: list[str] = []
    for index, entry in enumerate(entries, 1):
        where = f"entry {index} of {_shown(value)}" if len(entries) > 1 else repr(entry)
        entry = entry.strip()
        if not entry:
            raise ValueError(f"{where} is empty: give {HUB_FORMS}, several separated by "
                             f"commas with nothing between two commas")
        try:
            endpoint = _checked(parse_hub_address(entry))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        if endpoint not in endpoints:
            endpoints.append(endpoint)
    return endpoints


def joined(endpoints: Sequence[str]) -> str:
    """The list as one string (`hub_list` reads it back): how it travels in argv and env."""
    return ",".join(endpoints)


_SCHEMES = ("tcp", "ipc", "inproc", "ws", "wss", "tipc", "vmci")


def _checked(endpoint: str) -> str:
    """`endpoint` when its form is one ZeroMQ connects to (as `bus.paths.hub_refusal` checks it,
    without its probe: the list is checked before any hub needs to be up)."""
    scheme, sep, rest = endpoint.partition("://")
    ok = bool(sep and rest and scheme in _SCHEMES)
    if ok and scheme == "tcp":
        host, _, port = rest.rpartition(":")
        ok = bool(host) and port.isdigit() and 0 < int(port) < 65536
    if not ok:
        raise ValueError(f"bad hub address {endpoint!r} (use {HUB_FORMS})")
    return endpoint


def _shown(value: str | Sequence[str]) -> str:
    return repr(value if isinstance(value, str) else ",".join(value))
