"""Where `fetch_url` may connect: public addresses, plus what the worker's allow-list names.

A URL's host is resolved once; the address to connect to is picked from the answer and checked,
and the request then goes to that very address (the caller keeps the Host header and TLS SNI of
the name), so a DNS answer that changes between check and connect (rebinding) cannot slip past.
Loopback, private, link-local, multicast, reserved, unspecified and other non-global addresses are
refused, whatever form the URL writes them in (`2130706433`, `0x7f000001`, `[::ffff:127.0.0.1]`…),
because the check runs on resolved addresses, not on the URL's text. An IPv6 address that carries
an IPv4 one (6to4 `2002::/16`, Teredo `2001::/32`, NAT64 `64:ff9b::/96`, IPv4-compatible or
-mapped) is refused when that IPv4 address would be; local-use NAT64 `64:ff9b:1::/48` always.

The allow-list is the environment variable `BUSCTL_FETCH_ALLOW` of the worker process: a comma-
separated list of entries, each a host name, an IP address or a network, optionally with a port:
`localhost`, `intranet.example.com:8080`, `127.0.0.1:8000`, `[::1]:8000`, `10.0.0.0/8`.
A host name entry trusts whatever that name resolves to; an address or network entry allows that
address whatever name led to it. It is read on every call, so a malformed entry fails the call
with a message naming it rather than stopping the worker.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from dataclasses import dataclass

import anyio

from agent_bus.tools._exceptions import ToolError

ALLOW_ENV = "BUSCTL_FETCH_ALLOW"

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

_HOST_NAME_RE = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?\.?")
# IPv6 ranges that carry an IPv4 address a relay or gateway would reach: the IPv4 address decides.
# NAT64 (RFC 6052) and IPv4-compatible (::a.b.c.d, deprecated) hold it in their last 32 bits.
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_V4_COMPATIBLE = ipaddress.IPv6Network("::/96")
# Local-use NAT64 (RFC 8215): where the IPv4 address sits depends on the operator's prefix
# length, and the range is not global: refused whatever it embeds.
_LOCAL_NAT64 = ipaddress.IPv6Network("64:ff9b:1::/48")


@dataclass(frozen=True)
class AllowRule:
    """One allow-list entry: a host name or a network, on one port or (port None) on any."""

    name: str | None = None
    network: IPNetwork | None = None
    port: int | None = None

    def permits(self, name: str, address: IPAddress, port: int) -> bool:
        if self.port is not None and self.port != port:
            return False
        if self.name is not None:
            return self.name == name
        assert self.network is not None  # built by `_parse_entry` with one of the two
        return address.version == self.network.version and address in self.network


def allow_list_from_env() -> list[AllowRule]:
    """The rules in `BUSCTL_FETCH_ALLOW` (none when unset). Raises ToolError on a bad entry."""
    return parse_allow_list(os.environ.get(ALLOW_ENV, ""))


def parse_allow_list(text: str) -> list[AllowRule]:
    """Parse a comma-separated allow-list; raises ToolError naming the first bad entry."""
    return [_parse_entry(entry.strip()) for entry in text.split(",") if entry.strip()]


def _parse_entry(entry: str) -> AllowRule:
    host, port = _split_port(entry)
    try:
        network = ipaddress.ip_network(host, strict=False)
    except ValueError:
        if not _HOST_NAME_RE.fullmatch(host) or "/" in host:
            raise _bad_entry(entry, "expected a host name, an IP address or a network") from None
        return AllowRule(name=normalize_host(host), port=port)
    return AllowRule(network=_unmapped_network(network), port=port)


def _split_port(entry: str) -> tuple[str, int | None]:
    if entry.startswith("["):  # [IPv6] or [IPv6]:port
        inside, closed, rest = entry[1:].partition("]")
        if not closed or (rest and not rest.startswith(":")):
            raise _bad_entry(entry, "write an IPv6 address with a port as `[::1]:8080`")
        return inside, _port(entry, rest[1:]) if rest else None
    if entry.count(":") == 1:  # host:port (a bare IPv6 address has two or more colons)
        host, _, port = entry.partition(":")
        return host, _port(entry, port)
    return entry, None


def _port(entry: str, text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise _bad_entry(entry, f"the port must be a number from 1 to 65535, got `{text}`")
    return int(text)


def _bad_entry(entry: str, why: str) -> ToolError:
    return ToolError(
        f"Invalid entry `{entry}` in `{ALLOW_ENV}`: {why}. Example: "
        f"`{ALLOW_ENV}=localhost:8080,[::1]:8080,10.0.0.0/8` (set it in the worker's environment)"
    )


def _unmapped_network(network: IPNetwork) -> IPNetwork:
    """`::ffff:10.0.0.0/104` means the IPv4 network `10.0.0.0/8`: compare like with like."""
    if isinstance(network, ipaddress.IPv6Network) and network.prefixlen >= 96:
        mapped = network.network_address.ipv4_mapped
        if mapped is not None:
            return ipaddress.IPv4Network((mapped, network.prefixlen - 96))
    return network


def normalize_host(host: str) -> str:
    return host.lower().rstrip(".")


def unmapped(address: IPAddress) -> IPAddress:
    """The IPv4 address behind an IPv4-mapped IPv6 one (`::ffff:127.0.0.1` is 127.0.0.1)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def non_public_kind(address: IPAddress) -> str | None:
    """Why `address` is not a public unicast address ("a loopback address"…), or None if it is.

    `is_global` alone is not enough: on Python 3.11 `2002:7f00:1::` (6to4 of 127.0.0.1) is
    global, so the IPv4 address embedded in 6to4, Teredo, NAT64 and IPv4-compatible addresses is
    checked too (IPv4-mapped ones are compared as the IPv4 address itself)."""
    address = unmapped(address)
    if isinstance(address, ipaddress.IPv6Address):
        embedded = _embedded_kind(address)
        if embedded is not None:
            return embedded
    checks = (
        ("unspecified", address.is_unspecified),
        ("loopback", address.is_loopback),
        ("link-local", address.is_link_local),
        ("multicast", address.is_multicast),
        ("reserved", address.is_reserved),  # before "private": Python counts 240/4 as both
        ("private", address.is_private),
        ("non-public", not address.is_global),
    )
    for kind, hit in checks:
        if hit:
            return _article(kind)
    return None


def _article(kind: str) -> str:
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} address"


def _embedded_kind(address: ipaddress.IPv6Address) -> str | None:
    """Why the IPv4 address embedded in `address` is refused (naming the range), or None."""
    if address in _LOCAL_NAT64:
        return _article("local-use NAT64")
    low32 = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    inside: list[tuple[IPAddress, str]] = []
    if address in _NAT64:
        inside.append((low32, "the NAT64 prefix"))
    elif address in _V4_COMPATIBLE and int(address) > 1:  # :: and ::1 are checked as themselves
        inside.append((low32, "an IPv4-compatible address"))
    if address.sixtofour is not None:
        inside.append((address.sixtofour, "a 6to4 address"))
    if address.teredo is not None:
        server, client = address.teredo
        inside += [(server, "a Teredo address"), (client, "a Teredo address")]
    for v4, where in inside:
        kind = non_public_kind(v4)
        if kind is not None:
            return f"{kind} (behind {where})"
    return None


def pick_address(
    host: str, port: int, addresses: list[IPAddress], rules: list[AllowRule]
) -> IPAddress:
    """The first of `addresses` that is public or allowed; ToolError when none is.

    `addresses` are what `host` resolved to, in resolver order.
    """
    name = normalize_host(host)
    for address in addresses:
        plain = unmapped(address)
        if non_public_kind(plain) is None or any(r.permits(name, plain, port) for r in rules):
            return plain
    first = unmapped(addresses[0])
    raise _refusal(host, port, first, non_public_kind(first) or "a refused address")


def _refusal(host: str, port: int, address: IPAddress, kind: str) -> ToolError:
    shown = f"[{address}]" if address.version == 6 else str(address)
    what = f"`{host}` is" if host == str(address) else f"`{host}` resolves to {address},"
    return ToolError(
        f"Refused to connect: {what} {kind}; fetch_url only "
        f"reaches public addresses. To allow it, add `{shown}:{port}` (or a host name or "
        f"network) to `{ALLOW_ENV}` in the worker's environment"
    )


async def resolve(host: str, port: int) -> list[IPAddress]:
    """Every address `host` resolves to (an IP literal resolves to itself), in resolver order.

    Raises ToolError when the name does not resolve.
    """
    try:
        infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise ToolError(f"Cannot resolve host `{host}`: {exc}") from exc
    addresses: list[IPAddress] = []
    for _family, _type, _proto, _canon, sockaddr in infos:
        address = ipaddress.ip_address(str(sockaddr[0]).partition("%")[0])  # drop a zone id
        if address not in addresses:
            addresses.append(address)
    if not addresses:
        raise ToolError(f"Cannot resolve host `{host}`: no addresses")
    return addresses
