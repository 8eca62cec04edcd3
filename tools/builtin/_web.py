"""fetch_url: GET a web page or text resource over HTTP(S), size- and time-limited, text only.

Every hop (the URL and each redirect) is resolved and checked by `_netguard` before anything is
sent, then requested from the checked address: loopback, private and other internal addresses are
refused unless the worker's `BUSCTL_FETCH_ALLOW` lists them. Redirects are therefore followed here,
not by httpx, and proxies from the environment are ignored (a proxy would do its own resolving).

The body is read raw and decoded here, step by step, each `Content-Encoding` (gzip, deflate, in
any number and order) producing at most `_DECODE_STEP` bytes at a time, and the cap counts the
decoded bytes: a 2 KB `gzip, gzip` bomb that unpacks to gigabytes stops at 1 MiB. (httpx's own
decoding unpacks each received chunk whole before anyone can count it.)
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import AsyncIterator, Iterator
from typing import Annotated

import anyio
import httpx
import msgspec

from agent_bus.tools._exceptions import ToolError
from agent_bus.tools._tool import tool
from agent_bus.tools.builtin import _netguard

MAX_FETCH_BYTES = 1024 * 1024
FETCH_TIME_LIMIT = 20.0
MAX_REDIRECTS = 5
USER_AGENT = "agent-bus-fetch/0.1"
_DECODE_STEP = 64 * 1024  # the most one decoding step may produce: what bounds memory
_ENCODINGS = ("gzip", "x-gzip", "deflate", "identity")
_TEXT_TYPES = ("application/json", "application/xml", "application/javascript",
               "application/xhtml+xml", "application/x-yaml", "application/yaml", "application/toml")


@tool(idempotent=True, timeout=FETCH_TIME_LIMIT + 5)
async def fetch_url(
    url: Annotated[
        str,
        msgspec.Meta(
            pattern=r"^https?://", description="Absolute http:// or https:// URL to fetch with GET."
        ),
    ],
) -> str:
    """Fetch a URL with HTTP GET and return the response body as text.
    Only text responses (text/*, JSON, XML, JavaScript, YAML) are returned; bodies over 1 MiB are
    cut, up to 5 redirects are followed, and the whole fetch must finish within 20 seconds. HTML
    is returned as-is, not rendered. Only public addresses are reached: loopback, private and
    link-local hosts are refused unless the worker allows them.
    """
    rules = _netguard.allow_list_from_env()
    try:
        with anyio.fail_after(FETCH_TIME_LIMIT):
            return await _fetch(url, rules)
    except TimeoutError as exc:
        raise ToolError(f"Fetching `{url}` timed out after {FETCH_TIME_LIMIT:g}s") from exc
    except (httpx.HTTPError, httpx.InvalidURL) as exc:  # the one place httpx errors enter
        raise ToolError(f"Cannot fetch `{url}`: {type(exc).__name__}: {exc}") from exc


async def _fetch(url: str, rules: list[_netguard.AllowRule]) -> str:
    # No keep-alive: a pooled connection, keyed by address, must not carry a second host name.
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=10.0, trust_env=False, limits=limits) as client:
        target = httpx.URL(url)
        for hop in range(MAX_REDIRECTS + 1):
            try:
                request = await _pinned_request(client, target, rules)
            except ToolError as exc:
                if hop == 0:
                    raise
                raise ToolError(f"`{url}` redirected to `{target}`: {exc}") from exc
            async with _sent(client, request) as response:
                location = response.headers.get("location") if response.is_redirect else None
                if location is None:
                    return await _body(url, response)
            target = _next_hop(url, target, location)
    raise ToolError(f"`{url}` redirected more than {MAX_REDIRECTS} times; fetch the final URL")


async def _pinned_request(
    client: httpx.AsyncClient, target: httpx.URL, rules: list[_netguard.AllowRule]
) -> httpx.Request:
    """A GET of `target` sent to the checked address, with the name's Host header and TLS SNI."""
    host = target.raw_host.decode("ascii")
    port = target.port or (443 if target.scheme == "https" else 80)
    address = _netguard.pick_address(host, port, await _netguard.resolve(host, port), rules)
    headers = {"Host": target.netloc.decode("ascii"), "User-Agent": USER_AGENT,
               "Accept-Encoding": "gzip, deflate",  # what `_Decoder` decodes
               "Accept": "text/*, application/json;q=0.9, */*;q=0.1"}
    extensions = {"sni_hostname": host} if target.scheme == "https" else {}
    return client.build_request("GET", target.copy_with(host=str(address)), headers=headers,
                                extensions=extensions)


@contextlib.asynccontextmanager
async def _sent(client: httpx.AsyncClient, request: httpx.Request) -> AsyncIterator[httpx.Response]:
    """The streamed response to `request`, closed on the way out."""
    response = await client.send(request, stream=True)
    try:
        yield response
    finally:
        await response.aclose()


def _next_hop(url: str, current: httpx.URL, location: str) -> httpx.URL:
    target = current.join(location)
    if target.scheme not in ("http", "https"):
        raise ToolError(f"`{url}` redirected to `{target}`; fetch_url only follows http(s) URLs")
    return target


async def _body(url: str, response: httpx.Response) -> str:
    _check_response(url, response)
    body, truncated = await _read_capped(url, response, MAX_FETCH_BYTES)
    text = _decode(body, response.encoding)
    if truncated:
        text += f"\n[truncated: the body is larger than {MAX_FETCH_BYTES} bytes]"
    return text


def _decode(body: bytes, encoding: str | None) -> str:
    try:
        return body.decode(encoding or "utf-8", errors="replace")
    except LookupError:  # an unknown charset in Content-Type
        return body.decode("utf-8", errors="replace")


def _check_response(url: str, response: httpx.Response) -> None:
    if response.status_code >= 400:
        raise ToolError(f"`{url}` returned HTTP {response.status_code} {response.reason_phrase}")
    content_type = response.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type and not _is_text(content_type):
        raise ToolError(
            f"`{url}` returned `{content_type}`, not text; fetch_url only returns text responses"
        )


def _is_text(content_type: str) -> bool:
    return (
        content_type.startswith("text/")
        or content_type in _TEXT_TYPES
        or content_type.endswith(("+json", "+xml"))
    )


async def _read_capped(url: str, response: httpx.Response, limit: int) -> tuple[bytes, bool]:
    """Up to `limit` decoded bytes of the body, and whether there was more."""
    decoders = [_Decoder(name) for name in reversed(_encodings(url, response))]
    body = bytearray()
    async for raw in response.aiter_raw():
        for piece in _decoded(decoders, raw):
            body += piece
            if len(body) > limit:
                return bytes(body[:limit]), True
    return bytes(body), False


def _encodings(url: str, response: httpx.Response) -> list[str]:
    """The body's encodings in the order they were applied; ToolError on one we cannot decode."""
    names = [n.strip().lower() for n in response.headers.get_list("content-encoding", split_commas=True)]
    for name in names:
        if name not in _ENCODINGS:
            raise ToolError(f"`{url}` sent `Content-Encoding: {name}`, which fetch_url cannot "
                            "decode (it accepts gzip and deflate)")
    return [n for n in names if n != "identity"]


def _decoded(decoders: list[_Decoder], data: bytes) -> Iterator[bytes]:
    """`data` through every decoder in turn, lazily: the caller stops pulling at its cap."""
    if not decoders:
        if data:
            yield data
        return
    for piece in decoders[0].feed(data):
        yield from _decoded(decoders[1:], piece)


class _Decoder:
    """One gzip or deflate layer, producing at most `_DECODE_STEP` bytes per step."""

    def __init__(self, name: str) -> None:
        self.name = name
        # deflate is zlib-wrapped by the standard, raw by some servers: try wrapped first
        self.wbits = zlib.MAX_WBITS | 16 if "gzip" in name else zlib.MAX_WBITS
        self.inflate = zlib.decompressobj(self.wbits)
        self.started = False

    def feed(self, data: bytes) -> Iterator[bytes]:
        while data and not self.inflate.eof:  # data after the end of the stream is ignored
            out = self._step(data)
            data = self.inflate.unconsumed_tail
            if out:
                yield out
            # a full step may have left output inside zlib: keep pulling until a short one
            while len(out) == _DECODE_STEP and not data and not self.inflate.eof:
                out = self._step(b"")
                if out:
                    yield out

    def _step(self, data: bytes) -> bytes:
        try:
            out = self.inflate.decompress(data, _DECODE_STEP)
        except zlib.error as exc:
            if self.name == "deflate" and not self.started:
                self.wbits, self.inflate = -zlib.MAX_WBITS, zlib.decompressobj(-zlib.MAX_WBITS)
                self.started = True
                return self._step(data)
            raise ToolError(f"The response's {self.name} body is corrupt: {exc}") from exc
        self.started = True
        return out
