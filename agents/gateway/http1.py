"""A lean HTTP/1.1 keep-alive transport for httpx: the gateway's model calls without httpcore + h11.

Why: httpcore + h11 cost about 2/3 of the gateway's CPU per model call, most of it per streamed
chunk (h11 makes an event object per chunk, httpcore wraps each read in a few layers). This
transport parses a response once per socket read and hands httpx every chunk that read
completed as one bytes object. httpx stays the client: URLs, headers, timeouts, content decoding
(gzip, deflate) and the error classes the engine maps are all httpx's.

It speaks to origins directly: when the environment names a proxy, the engine does not use it
(httpx's own transport applies HTTP(S)_PROXY, ALL_PROXY and NO_PROXY, as it always has; see
`engine._new_client`). Only http and https; never HTTP/2, never pipelining.

The server is untrusted input: the status line + headers, chunk-size lines and trailers are
bounded, and anything malformed raises `httpx.RemoteProtocolError` (never ValueError/IndexError)."""

from __future__ import annotations

import math
import re
import select
import socket
import ssl
import time
from collections.abc import AsyncIterator, Mapping
from typing import Final

import anyio
import anyio.abc
import httpx

MAX_HEAD: Final = 64 * 1024  # status line + headers, as h11's default max_incomplete_event_size
MAX_LINE: Final = 4 * 1024  # a chunk-size line (with extensions) or one trailer line
MAX_TRAILERS: Final = 16 * 1024
MAX_INTERIM: Final = 32  # 1xx responses skipped before the final one
MAX_CHUNK: Final = 1 << 40  # a chunk size past this is garbage, not data
READ_SIZE: Final = 64 * 1024
KEEPALIVE_EXPIRY: Final = 5.0  # s an idle connection is kept: httpcore's default
MAX_IDLE_PER_ORIGIN: Final = 8  # idle connections kept per origin; extras are closed

_TOKEN = rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+"
_FIELD_NAME = re.compile(_TOKEN)
# RFC 9110 field value (h11's rule): visible characters and obs-text, inner spaces/tabs only.
_FIELD_VALUE = re.compile(rb"(?:[\x21-\x7e\x80-\xff]+(?:[ \t]+[\x21-\x7e\x80-\xff]+)*)?")
_STATUS_LINE = re.compile(rb"HTTP/1\.([01]) ([0-9]{3})(?: ([^\x00-\x08\x0a-\x1f\x7f]*))?")
_HEAD_END = re.compile(rb"\r?\n\r?\n")
_CHUNK_SIZE = re.compile(rb"[ \t]*([0-9A-Fa-f]{1,16})[ \t]*(?:;.*)?")
_CONTENT_LENGTH = re.compile(rb"[0-9]{1,18}")
_HEX_DIGITS = b"0123456789abcdefABCDEF"
_EOF_ERRORS = (anyio.EndOfStream,)
_BROKEN_ERRORS = (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError)

Origin = tuple[str, str, int]  # scheme, host, port


class _Conn:
    """One socket and the bytes read from it that no response has consumed yet."""

    __slots__ = ("stream", "sock", "buf", "idle_since")

    def __init__(self, stream: anyio.abc.ByteStream) -> None:
        self.stream = stream
        # Looked up once: each `extra()` builds the stream's whole attribute table (~12 us).
        self.sock: socket.socket | None = stream.extra(anyio.abc.SocketAttribute.raw_socket, None)
        self.buf = b""
        self.idle_since = 0.0

    async def read(self, timeout: float | None) -> bytes:
        """The next bytes; b"" at EOF."""
        try:
            with anyio.CancelScope(deadline=_deadline(timeout)):
                return await self.stream.receive(READ_SIZE)
        except _EOF_ERRORS:
            return b""
        except _BROKEN_ERRORS as exc:
            raise httpx.ReadError(str(exc) or type(exc).__name__) from exc
        raise httpx.ReadTimeout("timed out reading from the server")  # the deadline passed

    async def close(self) -> None:
        with anyio.CancelScope(shield=True):  # a cancelled task must still release its socket
            await self.stream.aclose()

    def server_spoke(self) -> bool:
        """True when an idle connection is readable: the server closed it (or sent garbage)."""
        sock = self.sock
        if sock is None or sock.fileno() < 0:
            return True
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        return bool(poller.poll(0))


class Http1Transport(httpx.AsyncBaseTransport):
    """HTTP/1.1 over anyio sockets with a small idle pool per origin (safe for concurrent tasks:
    a connection is either in the pool or owned by exactly one response)."""

    def __init__(
        self,
        ssl_context: ssl.SSLContext,
        *,
        max_idle_per_origin: int = MAX_IDLE_PER_ORIGIN,
    ) -> None:
        ssl_context.set_alpn_protocols(["http/1.1"])  # what httpcore sets on it for HTTP/1.1
        self._ssl = ssl_context
        self._max_idle = max_idle_per_origin
        self._idle: dict[Origin, list[_Conn]] = {}
        self._closed = False

    # --- one exchange ------------------------------------------------------------------------

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.scheme not in ("http", "https") or not request.url.raw_host:
            raise httpx.UnsupportedProtocol(f"Request URL has an unsupported protocol or no host: "
                                            f"{request.url.scheme}://")
        timeouts: dict[str, float | None] = request.extensions.get("timeout", {})
        head = await _request_head(request)
        origin = _origin(request.url)
        conn = await self._take_idle(origin) or await self._connect(request, origin, timeouts)
        try:
            await _send(conn, head, timeouts.get("write"))
            return await self._receive(request, conn, origin, timeouts.get("read"))
        except BaseException:
            await conn.close()
            raise

    async def _connect(
        self, request: httpx.Request, origin: Origin, timeouts: Mapping[str, float | None]
    ) -> _Conn:
        scheme, host, port = origin
        stream: anyio.abc.ByteStream
        try:
            with anyio.fail_after(timeouts.get("connect")):  # TCP and the TLS handshake, as httpcore
                if scheme == "https":  # SNI and the certificate's name: the URL's host
                    sni = str(request.extensions.get("sni_hostname") or host)
                    stream = await anyio.connect_tcp(
                        host, port, tls=True, ssl_context=self._ssl, tls_hostname=sni,
                        tls_standard_compatible=False,  # servers often close without close_notify
                    )
                else:
                    stream = await anyio.connect_tcp(host, port)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"timed out connecting to {host}:{port}") from None
        except (OSError, anyio.BrokenResourceError, ssl.SSLError) as exc:
            raise httpx.ConnectError(str(exc) or type(exc).__name__) from exc
        return _Conn(stream)

    async def _receive(
        self, request: httpx.Request, conn: _Conn, origin: Origin, timeout: float | None
    ) -> httpx.Response:
        for _ in range(MAX_INTERIM):
            version, status, reason, headers = await _read_head(conn, timeout)
            if status >= 200:
                break
            if status < 100:
                raise httpx.RemoteProtocolError(f"status {status} is not an HTTP status")
            if status == 101:
                raise httpx.RemoteProtocolError("the server switched protocols unasked (101)")
            # 1xx interim (100 Continue, 103 Early Hints): the final response follows.
        else:
            raise httpx.RemoteProtocolError(f"more than {MAX_INTERIM} interim (1xx) responses")
        keep = version == b"1" and not _has_token(headers, b"connection", b"close") and not (
            _has_token(request.headers.raw, b"connection", b"close"))
        body: httpx.AsyncByteStream
        if request.method == "HEAD" or status in (204, 304):  # no body, whatever the headers say
            body = httpx.ByteStream(b"")
            if keep:
                await self._release(conn, origin)
            else:
                await conn.close()
        else:
            sized = _Body(self, conn, origin, timeout)
            sized.start(headers, keep)
            body = sized
        return httpx.Response(
            status, headers=headers, stream=body,
            extensions={"http_version": b"HTTP/1." + version, "reason_phrase": reason},
        )

    # --- the idle pool -----------------------------------------------------------------------

    async def _take_idle(self, origin: Origin) -> _Conn | None:
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if now - conn.idle_since < KEEPALIVE_EXPIRY and not conn.server_spoke():
                return conn
            await conn.close()
        return None

    async def _release(self, conn: _Conn, origin: Origin) -> None:
        """A connection whose response was read to its end: pool it, or close it if full."""
        idle = self._idle.setdefault(origin, [])
        if self._closed or conn.buf or len(idle) >= self._max_idle:
            await conn.close()  # unsolicited bytes after a response: it cannot be reused
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    async def aclose(self) -> None:
        self._closed = True
        idle = [conn for conns in self._idle.values() for conn in conns]
        self._idle.clear()
        for conn in idle:
            await conn.close()


class _Body(httpx.AsyncByteStream):
    """A response body as it arrives; the connection goes back to the pool once it is read to
    its end, and is closed when the body is closed before that."""

    def __init__(self, pool: Http1Transport, conn: _Conn, origin: Origin, timeout: float | None):
        self._pool, self._conn, self._origin, self._timeout = pool, conn, origin, timeout
        self._keep = False
        self._length: int | None = None  # None: chunked, -1: until the server closes
        self._done = False

    def start(self, headers: list[tuple[bytes, bytes]], keep: bool) -> None:
        self._keep = keep
        encodings = [v for k, v in headers if k.lower() == b"transfer-encoding"]
        if encodings:
            if b", ".join(encodings).strip().lower() != b"chunked":
                raise httpx.RemoteProtocolError(f"unsupported Transfer-Encoding {encodings!r}")
            self._length = None  # chunked wins over any Content-Length (RFC 9112 6.3)
            return
        lengths = {v.strip() for k, v in headers if k.lower() == b"content-length"}
        lengths = {p.strip() for v in lengths for p in v.split(b",")}
        if not lengths:
            self._length, self._keep = -1, False  # the body ends when the server closes
        elif len(lengths) > 1 or not _CONTENT_LENGTH.fullmatch(next(iter(lengths))):
            raise httpx.RemoteProtocolError(f"bad Content-Length {sorted(lengths)!r}")
        else:
            self._length = int(next(iter(lengths)))

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self._done:
            raise httpx.StreamConsumed()
        if self._length is None:
            chunks = self._chunked()
        elif self._length < 0:
            chunks = self._until_eof()
        else:
            chunks = self._sized(self._length)
        async for data in chunks:
            yield data
        await self._finish()

    async def _sized(self, left: int) -> AsyncIterator[bytes]:
        conn = self._conn
        while left:
            if not conn.buf:
                conn.buf = await conn.read(self._timeout)
                if not conn.buf:
                    raise httpx.RemoteProtocolError(f"server closed with {left} bytes of the body unsent")
            data, conn.buf = conn.buf[:left], conn.buf[left:]
            left -= len(data)
            yield data

    async def _until_eof(self) -> AsyncIterator[bytes]:
        """Everything up to the server's close. The read that completed the head may have
        carried no body bytes: an empty buffer is not the end, only a read of b"" is."""
        conn = self._conn
        data, conn.buf = conn.buf, b""
        while True:
            if data:
                yield data
            data = await conn.read(self._timeout)
            if not data:
                return

    async def _chunked(self) -> AsyncIterator[bytes]:
        """Every chunk a read completes (or the part of a chunk it holds), joined per read."""
        conn = self._conn
        buf, conn.buf = conn.buf, b""
        left = 0  # bytes of the current chunk's data still to come
        crlf = False  # the CRLF after a chunk's data is still to come
        while True:
            out: list[bytes] = []
            pos = 0
            while True:
                if left:
                    data = buf[pos:pos + left]
                    if not data:
                        break
                    out.append(data)
                    pos += len(data)
                    left -= len(data)
                    if left:
                        break
                    crlf = True
                if crlf:
                    if len(buf) - pos < 2:
                        break
                    if buf[pos:pos + 2] != b"\r\n":
                        raise httpx.RemoteProtocolError("chunk data not followed by CRLF")
                    pos += 2
                    crlf = False
                nl = buf.find(b"\n", pos, pos + MAX_LINE)
                if nl < 0:
                    if len(buf) - pos >= MAX_LINE:
                        raise httpx.RemoteProtocolError("chunk-size line too long")
                    break
                left = _chunk_size(buf[pos:nl])
                pos = nl + 1
                if not left:
                    conn.buf = await self._trailers(buf[pos:])
                    if out:
                        yield b"".join(out)
                    return
            buf = buf[pos:]
            if out:
                yield b"".join(out) if len(out) > 1 else out[0]
            more = await conn.read(self._timeout)
            if not more:
                raise httpx.RemoteProtocolError("server closed in the middle of a chunked body")
            buf += more

    async def _trailers(self, buf: bytes) -> bytes:
        """Skip the trailer section (ignored, as httpx ignores h11's); what follows it."""
        while (end := _blank_line_end(buf)) < 0:
            if len(buf) > MAX_TRAILERS:
                raise httpx.RemoteProtocolError("trailer section too long")
            more = await self._conn.read(self._timeout)
            if not more:
                raise httpx.RemoteProtocolError("server closed in the middle of the trailers")
            buf += more
        return buf[end:]

    async def _finish(self) -> None:
        if self._done:
            return
        self._done = True
        if self._keep:
            await self._pool._release(self._conn, self._origin)
        else:
            await self._conn.close()

    async def aclose(self) -> None:
        if not self._done:  # read only in part (or not at all): the connection cannot be reused
            self._done = True
            await self._conn.close()


# --- parsing and framing ---------------------------------------------------------------------


async def _request_head(request: httpx.Request) -> bytes:
    """The request line, headers and body as one buffer (one send, one syscall)."""
    body = b"".join([part async for part in request.stream])  # type: ignore[union-attr]
    target = request.url.raw_path
    if not target.startswith(b"/") or not _FIELD_VALUE.fullmatch(target):
        raise httpx.LocalProtocolError(f"invalid request target {target!r}")
    lines = [b"%s %s HTTP/1.1\r\n" % (request.method.encode("ascii"), target)]
    chunked = False
    for name, value in request.headers.raw:
        if not _FIELD_NAME.fullmatch(name) or not _FIELD_VALUE.fullmatch(value):
            raise httpx.LocalProtocolError(f"illegal header {name!r}")  # the value may be a key
        chunked = chunked or (name.lower() == b"transfer-encoding" and b"chunked" in value.lower())
        lines.append(b"%s: %s\r\n" % (name, value))
    lines.append(b"\r\n")
    if chunked:  # httpx asked for chunked framing (a body of unknown length): one chunk
        body = (b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)) if body else b"0\r\n\r\n"
    return b"".join(lines) + body


async def _send(conn: _Conn, data: bytes, timeout: float | None) -> None:
    try:
        with anyio.CancelScope(deadline=_deadline(timeout)):
            await conn.stream.send(data)
            return
    except _BROKEN_ERRORS as exc:
        raise httpx.WriteError(str(exc) or type(exc).__name__) from exc
    raise httpx.WriteTimeout("timed out sending the request")  # the deadline passed


def _deadline(timeout: float | None) -> float:
    """The deadline of a cancel scope used as `fail_after(timeout)`, which costs twice as much
    CPU (~18 us; it runs around every read and send)."""
    return math.inf if timeout is None else anyio.current_time() + timeout


async def _read_head(
    conn: _Conn, timeout: float | None
) -> tuple[bytes, int, bytes, list[tuple[bytes, bytes]]]:
    """(minor version, status, reason, headers) of the next response on `conn`."""
    buf = conn.buf
    while (end := _blank_line_end(buf)) < 0:
        if len(buf) > MAX_HEAD:
            raise httpx.RemoteProtocolError(f"response head longer than {MAX_HEAD} bytes")
        more = await conn.read(timeout)
        if not more:
            raise httpx.RemoteProtocolError(
                "Server disconnected without sending a response." if not buf
                else "server closed in the middle of the response head")
        buf += more
    if end > MAX_HEAD:
        raise httpx.RemoteProtocolError(f"response head longer than {MAX_HEAD} bytes")
    conn.buf = buf[end:]
    lines = buf[:end].rstrip(b"\r\n").split(b"\n")
    status = _STATUS_LINE.fullmatch(lines[0].rstrip(b"\r"))
    if status is None:
        raise httpx.RemoteProtocolError(f"malformed status line {lines[0][:100]!r}")
    return status[1], int(status[2]), status[3] or b"", _parse_headers(lines[1:])


def _parse_headers(lines: list[bytes]) -> list[tuple[bytes, bytes]]:
    headers: list[tuple[bytes, bytes]] = []
    for raw in lines:
        line = raw.rstrip(b"\r")
        if line[:1] in (b" ", b"\t"):  # obsolete line folding: part of the previous value
            if not headers:
                raise httpx.RemoteProtocolError("continuation line before any header")
            name, value = headers[-1]
            headers[-1] = (name, value + b" " + line.strip(b" \t"))
            continue
        name, colon, value = line.partition(b":")
        value = value.strip(b" \t")
        if not colon or not _FIELD_NAME.fullmatch(name) or not _FIELD_VALUE.fullmatch(value):
            raise httpx.RemoteProtocolError(f"malformed header line {line[:100]!r}")
        headers.append((name, value))
    return headers


def _chunk_size(line: bytes) -> int:
    line = line.rstrip(b"\r")
    if 0 < len(line) <= 16 and not line.strip(_HEX_DIGITS):  # the usual line: hex digits only
        size = int(line, 16)
    else:
        match = _CHUNK_SIZE.fullmatch(line)
        if match is None:
            raise httpx.RemoteProtocolError(f"malformed chunk size {line[:40]!r}")
        size = int(match[1], 16)
    if size > MAX_CHUNK:
        raise httpx.RemoteProtocolError(f"chunk size {size} too large")
    return size


def _blank_line_end(buf: bytes) -> int:
    """The offset just past the first empty line in `buf`, or -1."""
    if buf.startswith(b"\r\n"):
        return 2
    if buf.startswith(b"\n"):
        return 1
    match = _HEAD_END.search(buf)
    return match.end() if match else -1


def _has_token(headers: list[tuple[bytes, bytes]], name: bytes, token: bytes) -> bool:
    return any(
        k.lower() == name and token in (t.strip().lower() for t in v.split(b","))
        for k, v in headers
    )


def _origin(url: httpx.URL) -> Origin:
    # raw_host: the IDNA (ASCII) form, IPv6 without brackets; what httpcore connects to and
    # sends as SNI.
    host = url.raw_host.decode("ascii")
    return url.scheme, host, url.port or (443 if url.scheme == "https" else 80)

