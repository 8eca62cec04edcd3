"""A store URL (`busctl hub --store`, a topology's `[hub] store`), parsed and checked without
importing the store's client library, so a bad value is named before anything starts.

    nats://HOST:PORT[,HOST:PORT...][?stream=NAME&replicas=N&timeout=SECONDS]

Every server of the JetStream cluster may be listed (the client moves to another when one is
lost); `stream` (default `agent_bus_events`) names the stream, `replicas` (default 3, the
majority of 3 being 2) how many servers hold each event, `timeout` (default 1 s) how long one
append may wait for the majority's acknowledgment before the hub refuses the batch.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qs

import msgspec

from agent_bus.bus.errors import ConfigError

JETSTREAM_SCHEME = "nats"
DEFAULT_STREAM = "agent_bus_events"
DEFAULT_REPLICAS = 3
DEFAULT_TIMEOUT = 1.0
_STREAM_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # JetStream's rule, and a subject token
_HOST_PORT = re.compile(r"^[A-Za-z0-9.\-\[\]:]+:\d{1,5}$")


class StoreUrlError(ConfigError, ValueError):
    """A store URL that cannot be used; the message names the key and the fix."""


class StoreUrl(msgspec.Struct, frozen=True):
    servers: tuple[str, ...]  # nats://HOST:PORT each
    stream: str = DEFAULT_STREAM
    replicas: int = DEFAULT_REPLICAS
    timeout: float = DEFAULT_TIMEOUT

    def text(self) -> str:
        """The URL again (what a reader process is handed)."""
        hosts = ",".join(s.removeprefix(f"{JETSTREAM_SCHEME}://") for s in self.servers)
        return (f"{JETSTREAM_SCHEME}://{hosts}?stream={self.stream}&replicas={self.replicas}"
                f"&timeout={self.timeout:g}")


def parse_store_url(url: str, key: str = "store") -> StoreUrl:
    """`url` as a StoreUrl; StoreUrlError naming `key` (the flag or topology key) if it is not one."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme != JETSTREAM_SCHEME:
        raise StoreUrlError(f"{key}: {url!r} is not a store URL: give nats://HOST:PORT[,HOST:PORT...]"
                            " (a NATS JetStream cluster), or leave it unset for the SQLite log in "
                            "the state dir")
    hosts, _, query = rest.partition("?")
    servers = tuple(h.strip().removeprefix(f"{JETSTREAM_SCHEME}://") for h in hosts.split(","))
    bad = [h for h in servers if not _HOST_PORT.match(h)]
    if not servers or bad:
        raise StoreUrlError(f"{key}: {bad[0] if bad else hosts!r} is not HOST:PORT (in {url!r})")
    params = {k: v[-1] for k, v in parse_qs(query, keep_blank_values=True).items()}
    unknown = sorted(set(params) - {"stream", "replicas", "timeout"})
    if unknown:
        raise StoreUrlError(f"{key}: unknown parameter `{unknown[0]}` in {url!r}; known: stream, "
                            "replicas, timeout")
    stream = params.get("stream", DEFAULT_STREAM)
    if not _STREAM_NAME.match(stream):
        raise StoreUrlError(f"{key}: stream {stream!r} is not a JetStream stream name (letters, "
                            "digits, `_` and `-`, at most 64)")
    replicas = _number(key, "replicas", params.get("replicas", str(DEFAULT_REPLICAS)))
    if replicas not in (1, 2, 3, 4, 5):  # JetStream's own bound
        raise StoreUrlError(f"{key}: replicas={replicas:g}: JetStream keeps 1 to 5 replicas; 3 "
                            "survives the loss of one server")
    timeout = _number(key, "timeout", params.get("timeout", str(DEFAULT_TIMEOUT)))
    if not 0.05 <= timeout <= 60:
        raise StoreUrlError(f"{key}: timeout={timeout:g}: give 0.05 to 60 seconds")
    return StoreUrl(tuple(f"{JETSTREAM_SCHEME}://{h}" for h in servers), stream, int(replicas),
                    timeout)


def _number(key: str, name: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise StoreUrlError(f"{key}: {name}={text!r} is not a number") from None
