"""The Host and Origin check of every local HTTP surface (`busctl ui`, `busctl mcp serve --http`).

A page in the user's browser can reach a port on 127.0.0.1 under a name of its own (DNS
rebinding: `attacker.example` first resolves to the attacker, then to 127.0.0.1); the browser
then sends `Host: attacker.example:PORT` and, on a script's request, the attacker's `Origin`.
So a server bound to loopback answers only requests whose Host names loopback and whose Origin,
when there is one, is a loopback page: 421 (wrong Host) or 403 (wrong Origin) otherwise. The
rule is the MCP SDK's own for a local streamable-HTTP server (127.0.0.1, localhost, [::1], any
port), kept here once so that every surface applies the same one. It keeps out pages, not local
users: `busctl ui` also asks its token on loopback (`bus/ui/access.py`), after this check; off
loopback the surface's token alone protects it (a rebinding name carries none of its cookies).
"""

from __future__ import annotations

import ipaddress
import urllib.parse

#: The host names a request to a loopback server may carry (Host, and the Origin's host).
LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "[::1]"})


def is_loopback(host: str) -> bool:
    """Whether the bind address `host` is a loopback one (a name other than localhost: no)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def refusal(bind: str, host: str | None, origin: str | None) -> tuple[int, str] | None:
    """Why a request to a server bound to `bind` is refused, as (HTTP status, text), or None.

    `host` and `origin` are the request's headers (None when absent)."""
    if not is_loopback(bind):
        return None
    if host is None or _host_name(host) not in LOOPBACK_NAMES:
        return 421, (f"421: Host {host!r} is not a loopback name: this server answers only "
                     "http://127.0.0.1, http://localhost or http://[::1] (DNS rebinding guard)")
    if origin is not None and not _loopback_origin(origin):
        return 403, (f"403: Origin {origin!r} is not a loopback page: this server answers only "
                     "pages from http://127.0.0.1, http://localhost or http://[::1]")
    return None


def _host_name(host: str) -> str:
    """`127.0.0.1:8080` → `127.0.0.1`, `[::1]:80` → `[::1]`, lower-cased."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[:host.find("]") + 1]
    return host.rpartition(":")[0] if ":" in host else host


def _loopback_origin(origin: str) -> bool:
    parts = urllib.parse.urlsplit(origin.strip().lower())
    return parts.scheme == "http" and not parts.path and _host_name(parts.netloc) in LOOPBACK_NAMES
