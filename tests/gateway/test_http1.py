"""`agents.gateway.http1.Http1Transport` against real local sockets: a raw server that sends
scripted bytes (well-formed, quirky, hostile), plain and over TLS, and the engine over it."""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

import anyio
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent_bus.agents.gateway.engine import (
    LlmEngine,
    ModelConfig,
    _LeanClient,
    _new_client,
    environment_names_a_proxy,
)
from agent_bus.agents.gateway.fakellm import FakeLLMServer
from agent_bus.agents.gateway.http1 import MAX_HEAD, MAX_IDLE_PER_ORIGIN, Http1Transport, _chunk_size
from tests.support import busctl, running, until

from .conftest import engine_for, request

pytestmark = pytest.mark.anyio

Mode = Literal["keep", "close", "stall"]  # after the reply: keep the connection, close it, or
# answer nothing more


class RawServer:
    """Answers each request with the next scripted reply (the last one repeats), as raw bytes."""

    def __init__(self, replies: list[tuple[bytes, Mode]], *, tls: ssl.SSLContext | None = None,
                 barrier: int = 0) -> None:
        self.replies = list(replies)
        self.request_lines: list[bytes] = []
        self.heads: list[bytes] = []  # each request's line and headers
        self.connections = 0
        self.client_closed = 0  # connections the client closed (EOF seen while waiting)
        self.server_closed = 0  # connections closed after a "close" reply
        self.sni: list[str | None] = []
        self._tls = tls
        self._barrier = threading.Barrier(barrier) if barrier else None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        if tls is not None:
            tls.sni_callback = lambda s, name, c: self.sni.append(name)
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, host: str = "127.0.0.1", scheme: str = "http") -> str:
        return f"{scheme}://{host}:{self.port}/v1/x"

    def close(self) -> None:
        self._stop.set()
        self._sock.close()

    def __enter__(self) -> RawServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, raw: socket.socket) -> None:
        try:
            conn = self._tls.wrap_socket(raw, server_side=True) if self._tls else raw
        except (ssl.SSLError, OSError):  # the client refused our certificate
            raw.close()
            return
        with self._lock:
            self.connections += 1
        with conn:
            buf = b""
            while True:
                while b"\r\n\r\n" not in buf:
                    data = self._recv(conn)
                    if not data:
                        with self._lock:
                            self.client_closed += 1
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                while len(buf) < length:
                    buf += self._recv(conn)
                buf = buf[length:]
                with self._lock:
                    self.request_lines.append(head.split(b"\r\n")[0])
                    self.heads.append(head)
                    reply, mode = self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]
                if self._barrier is not None:
                    self._barrier.wait(timeout=5)
                conn.sendall(reply)
                if mode == "close":
                    conn.close()
                    with self._lock:
                        self.server_closed += 1
                    return
                if mode == "stall":  # answer nothing more; see when the client gives up
                    while self._recv(conn):
                        pass
                    with self._lock:
                        self.client_closed += 1
                    return

    def _recv(self, conn: socket.socket) -> bytes:
        try:
            return conn.recv(65536)
        except OSError:
            return b""


@pytest.fixture
def raw_server() -> Iterator[Callable[..., RawServer]]:
    servers: list[RawServer] = []

    def start(replies: list[tuple[bytes, Mode]], **kwargs: object) -> RawServer:
        server = RawServer(replies, **kwargs)  # type: ignore[arg-type]
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


def client(ctx: ssl.SSLContext | None = None, *,
           max_idle_per_origin: int = MAX_IDLE_PER_ORIGIN) -> httpx.AsyncClient:
    transport = Http1Transport(ctx or ssl.create_default_context(),
                               max_idle_per_origin=max_idle_per_origin)
    return httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(5.0))


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
CHUNKED = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
           b"5\r\nhello\r\n1;ext=1\r\n \r\n5\r\nworld\r\n0\r\nX-Trailer: 1\r\n\r\n")


# --- well-formed responses ----------------------------------------------------------------


@pytest.mark.parametrize(("reply", "body"), [
    (OK, b"ok"),
    (CHUNKED, b"hello world"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", b""),
    (b"HTTP/1.1 200 OK\nContent-Length: 2\n\nok", b"ok"),  # bare LF line ends
    (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" + OK, b"ok"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nok", b"ok"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 99\r\n\r\n2\r\nok\r\n0\r\n\r\n",
     b"ok"),
])
async def test_a_kept_alive_response_is_read_and_its_connection_reused(
        raw_server: Callable[..., RawServer], reply: bytes, body: bytes) -> None:
    server = raw_server([(reply, "keep")])
    async with client() as c:
        for _ in range(3):
            response = await c.get(server.url())
            assert (response.status_code, response.content) == (200, body)
    assert server.connections == 1


@pytest.mark.parametrize("reply", [
    b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok",
    b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok",
    b"HTTP/1.1 200 OK\r\n\r\nok",  # no length, not chunked: the body ends at EOF
    b"HTTP/1.0 200 OK\r\n\r\nok",
])
async def test_a_response_that_ends_its_connection_is_read_and_not_reused(
        raw_server: Callable[..., RawServer], reply: bytes) -> None:
    server = raw_server([(reply, "close")])
    async with client() as c:
        for _ in range(2):
            response = await c.get(server.url())
            assert (response.status_code, response.content) == (200, b"ok")
    assert server.connections == 2


@pytest.mark.parametrize(("method", "status"), [("HEAD", 200), ("GET", 204), ("GET", 304)])
async def test_a_response_without_a_body_ignores_its_content_length(
        raw_server: Callable[..., RawServer], method: str, status: int) -> None:
    server = raw_server([(b"HTTP/1.1 %d X\r\nContent-Length: 5\r\n\r\n" % status, "keep")])
    async with client() as c:
        for _ in range(2):
            response = await c.request(method, server.url())
            assert (response.status_code, response.content) == (status, b"")
    assert server.connections == 1


async def test_a_keep_alive_connection_the_server_closed_while_idle_is_not_used(
        raw_server: Callable[..., RawServer]) -> None:
    # The server promises keep-alive, then closes (its idle timeout): the pooled connection is
    # found dead before use, so the next request goes out on a fresh one without an error.
    server = raw_server([(OK, "close")])
    async with client() as c:
        assert (await c.get(server.url())).content == b"ok"
        await until(lambda: server.server_closed == 1, what="server.server_closed == 1")
        assert (await c.get(server.url())).content == b"ok"
    assert server.connections == 2


async def test_the_engine_survives_a_server_closing_idle_keep_alive_connections(
        fake_server: Callable[..., FakeLLMServer]) -> None:
    server = fake_server({"close_idle_after": 0.05})
    async with engine_for(server) as engine:
        first = await engine.complete(request("one"))
        await until(lambda: server.idle_closed >= 1, what="server.idle_closed >= 1")
        second = await engine.complete(request("two"))
        stats = engine.stats().models["fake-openai"]
    assert [first.stop_reason, second.stop_reason] == ["stop", "stop"]
    assert (stats.attempts, stats.retries, stats.resent) == (2, 0, 0)


async def test_a_dead_pooled_connection_fails_before_any_byte_so_the_engine_resends(
        raw_server: Callable[..., RawServer]) -> None:
    # The failure the engine resends on: the server accepted the request, then closed unanswered.
    server = raw_server([(OK, "keep"), (b"", "close"), (OK, "keep")])
    async with client() as c:
        assert (await c.get(server.url())).content == b"ok"
        with pytest.raises(httpx.RemoteProtocolError, match="without sending a response"):
            await c.get(server.url())
        assert (await c.get(server.url())).content == b"ok"


# --- hostile or broken servers -----------------------------------------------------------

MALFORMED = [
    b"",  # EOF before the status line
    b"garbage\r\n\r\n",
    b"HTTP/1.1 2OO OK\r\n\r\n",
    b"HTTP/2 200 OK\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nBad Name: x\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nX: a\x00b\r\n\r\n",
    b"HTTP/1.1 200 OK\r\n folded first\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nX: " + b"a" * (MAX_HEAD + 10) + b"\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nX: " + b"a" * (MAX_HEAD + 10),  # never ends
    b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: abc\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 1, 2\r\n\r\nok",
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok",
    b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999999999999999\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",  # cut short
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n",
    b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n\r\n",
    b"HTTP/1.1 099 Too Low\r\n\r\n",
    b"HTTP/1.1 100 Continue\r\n\r\n" * 40,
    b"HTTP/1.1 100 Continue\r\n\r\n",  # then EOF
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nab\r\n0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-5\r\nab\r\n0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n\r\n",  # empty size
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"f" * 17 + b"\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nfffffffffff\r\nab",  # 2**44: huge
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1;" + b"x" * 5000 + b"\r\na\r\n0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nokXX0\r\n\r\n",  # no CRLF after data
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab",  # cut short in a chunk
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n",  # no last chunk
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nX: " + b"t" * 20000,  # trailers
]


@pytest.mark.parametrize("reply", MALFORMED, ids=range(len(MALFORMED)))
async def test_a_malformed_response_raises_remote_protocol_error(
        raw_server: Callable[..., RawServer], reply: bytes) -> None:
    server = raw_server([(reply, "close")])
    async with client() as c:
        with pytest.raises(httpx.RemoteProtocolError):
            await c.get(server.url())


VALID = [OK, CHUNKED, b"HTTP/1.1 404 Nope\r\nContent-Type: text/plain\r\n\r\nnot found"]


def test_any_mangled_response_is_read_or_refused_with_remote_protocol_error() -> None:
    """Byte flips, cuts and splices of valid responses: a response or RemoteProtocolError,
    never another exception (ValueError, IndexError...)."""
    server = RawServer([(OK, "close")])

    async def fetch() -> None:
        async with client() as c:
            try:
                await c.get(server.url(), timeout=2.0)
            except httpx.RemoteProtocolError:
                pass

    @settings(max_examples=150, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(VALID), st.data())
    def check(valid: bytes, data: st.DataObject) -> None:
        mangled = bytearray(valid)
        for _ in range(data.draw(st.integers(1, 4))):
            at = data.draw(st.integers(0, len(mangled)))
            op = data.draw(st.sampled_from(["flip", "cut", "insert"]))
            if op == "cut":
                del mangled[at:at + data.draw(st.integers(1, 8))]
            elif op == "insert":
                mangled[at:at] = data.draw(st.binary(min_size=1, max_size=8))
            elif at < len(mangled):
                mangled[at] = data.draw(st.integers(0, 255))
        server.replies = [(bytes(mangled), "close")]
        anyio.run(fetch)

    try:
        check()
    finally:
        server.close()


# --- timeouts, aborts, the idle pool -------------------------------------------------------


async def test_a_server_that_stalls_before_or_within_a_body_times_out(
        raw_server: Callable[..., RawServer]) -> None:
    server = raw_server([(b"", "stall"),
                         (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n", "stall")])
    async with client() as c:
        with pytest.raises(httpx.ReadTimeout):
            await c.get(server.url(), timeout=0.5)
        async with c.stream("GET", server.url(), timeout=0.5) as response:
            with pytest.raises(httpx.ReadTimeout):
                async for _ in response.aiter_raw():
                    pass


async def test_a_tls_handshake_that_never_comes_is_a_connect_timeout(
        raw_server: Callable[..., RawServer]) -> None:
    server = raw_server([(OK, "keep")])  # plain TCP: it waits for a request, never says hello
    async with client() as c:
        with pytest.raises(httpx.ConnectTimeout):
            await c.get(server.url(scheme="https"), timeout=httpx.Timeout(5.0, connect=0.3))


async def test_a_server_that_stops_reading_is_a_write_timeout() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:  # never accepts, never reads
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/v1/x"
        async with client() as c:
            with pytest.raises(httpx.WriteTimeout):  # more than the kernel's buffers hold
                await c.post(url, content=b"x" * (32 << 20), timeout=httpx.Timeout(5.0, write=0.3))


async def test_an_aborted_stream_closes_its_connection(raw_server: Callable[..., RawServer]) -> None:
    server = raw_server([(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n", "keep"),
                         (OK, "keep")])
    async with client() as c:
        async with c.stream("GET", server.url()) as response:
            async for chunk in response.aiter_raw():
                assert chunk == b"ok"
                break
        await until(lambda: server.client_closed == 1, what="server.client_closed == 1")
        assert (await c.get(server.url())).content == b"ok"
    assert server.connections == 2


async def test_a_cancelled_request_closes_its_connection(raw_server: Callable[..., RawServer]) -> None:
    server = raw_server([(b"", "stall")])
    async with client() as c:
        with anyio.move_on_after(0.1):
            await c.get(server.url())
        await until(lambda: server.client_closed == 1, what="server.client_closed == 1")


async def test_idle_connections_per_origin_are_capped(raw_server: Callable[..., RawServer]) -> None:
    server = raw_server([(OK, "keep")], barrier=4)  # four requests in flight at once
    async with client(max_idle_per_origin=2) as c:
        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(c.get, server.url())
        await until(lambda: server.client_closed == 2, what="server.client_closed == 2")  # two kept idle, the extras closed
        assert server.connections == 4
    await until(lambda: server.client_closed == 4, what="server.client_closed == 4")


# --- TLS -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for DNS:localhost only, made with the openssl CLI."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl CLI to make a test certificate")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost"], check=True, capture_output=True)
    return cert, key


def tls_server(raw_server: Callable[..., RawServer], certificate: tuple[Path, Path],
               replies: list[tuple[bytes, Mode]]) -> RawServer:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(*certificate)
    return raw_server(replies, tls=ctx)


async def test_https_verifies_the_certificate_sends_sni_and_reuses_the_connection(
        raw_server: Callable[..., RawServer], certificate: tuple[Path, Path]) -> None:
    server = tls_server(raw_server, certificate, [(OK, "keep"), (CHUNKED, "keep"),
                                                  (b"HTTP/1.1 200 OK\r\n\r\nto eof", "close")])
    async with client(ssl.create_default_context(cafile=str(certificate[0]))) as c:
        url = server.url("localhost", "https")
        bodies = [(await c.get(url)).content for _ in range(3)]
    assert bodies == [b"ok", b"hello world", b"to eof"]  # the last closed without close_notify
    assert server.connections == 1 and server.sni == ["localhost"]


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1"])
async def test_https_refuses_an_untrusted_or_misnamed_certificate(
        raw_server: Callable[..., RawServer], certificate: tuple[Path, Path], host: str) -> None:
    server = tls_server(raw_server, certificate, [(OK, "keep")])
    # localhost: signed by nobody the default CA bundle trusts; 127.0.0.1: trusted, wrong name.
    ctx = httpx.create_ssl_context() if host == "localhost" else ssl.create_default_context(
        cafile=str(certificate[0]))
    async with client(ctx) as c:
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED|match"):
            await c.get(server.url(host, "https"))


# --- the engine's streamed calls (`_LeanClient.open_stream`) ----------------------------------

SETS_COOKIE = (b"HTTP/1.1 200 OK\r\nSet-Cookie: lb=node-2; Path=/\r\nContent-Length: 2\r\n\r\nok")


async def test_a_streamed_call_sends_what_httpx_sends_and_keeps_cookies_as_it_does(
        raw_server: Callable[..., RawServer]) -> None:
    """`open_stream` skips `AsyncClient.send`: the same bytes must go out, cookies included (a
    load balancer's sticky cookie set by the first reply goes back with the next request)."""
    server = raw_server([(SETS_COOKIE, "keep"), (OK, "keep")] * 2)
    url = httpx.URL(server.url())
    headers = {"content-type": "application/json", "authorization": "Bearer sk-test"}
    for lean in (True, False):
        async with _new_client() if lean else client() as c:
            assert isinstance(c, _LeanClient) == lean
            for _ in range(2):
                if isinstance(c, _LeanClient):
                    response = await c.open_stream(url, headers, b"{}", httpx.Timeout(5.0))
                else:
                    response = await c.send(c.build_request("POST", url, headers=headers,
                                                            content=b"{}"), stream=True)
                assert await response.aread() == b"ok"
                assert response.request.url == url
    lean_heads, httpx_heads = server.heads[:2], server.heads[2:]
    assert lean_heads == httpx_heads
    assert b"\r\nCookie: lb=node-2" in lean_heads[1] and b"Cookie" not in lean_heads[0]


async def test_a_streamed_call_on_a_closed_client_fails_as_httpx_fails_it() -> None:
    c = _new_client()
    await c.aclose()
    assert isinstance(c, _LeanClient)
    with pytest.raises(RuntimeError, match="client has been closed"):
        await c.open_stream(httpx.URL("http://127.0.0.1:9/"), {}, b"", httpx.Timeout(1.0))


async def test_a_failed_streamed_call_names_its_request(raw_server: Callable[..., RawServer]) -> None:
    server = raw_server([(b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", "close")])
    url = httpx.URL(server.url())
    async with _new_client() as c:
        assert isinstance(c, _LeanClient)
        with pytest.raises(httpx.RemoteProtocolError) as failure:
            await c.open_stream(url, {}, b"{}", httpx.Timeout(5.0))
    assert failure.value.request.url == url


# --- proxies and other schemes ---------------------------------------------------------


def test_only_a_named_proxy_turns_the_lean_transport_off(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    assert not environment_names_a_proxy()
    monkeypatch.setenv("NO_PROXY", "localhost")  # says where not to proxy: no proxy named
    assert not environment_names_a_proxy()
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    assert environment_names_a_proxy()


async def test_an_environment_proxy_is_used_as_httpx_would(
        raw_server: Callable[..., RawServer], monkeypatch: pytest.MonkeyPatch) -> None:
    proxy = raw_server([(OK, "keep")])
    for name in ("HTTP_PROXY", "http_proxy"):
        monkeypatch.setenv(name, f"http://127.0.0.1:{proxy.port}")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    async with _new_client() as c:
        assert (await c.get("http://model.invalid/v1/models")).content == b"ok"
    assert proxy.request_lines == [b"GET http://model.invalid/v1/models HTTP/1.1"]  # absolute form


async def test_an_unsupported_scheme_fails_as_httpx_fails_it() -> None:
    async with _new_client() as c:
        with pytest.raises(httpx.UnsupportedProtocol):
            await c.get("ftp://example.com/file")


async def test_a_header_value_with_a_newline_is_refused_before_sending(
        raw_server: Callable[..., RawServer]) -> None:
    server = raw_server([(OK, "keep")])
    async with client() as c:
        with pytest.raises(httpx.LocalProtocolError):
            await c.get(server.url(), headers={"Authorization": "Bearer sk-1\r\nX-Evil: 1"})
    assert server.request_lines == []



# --- every framing, at concurrency (issue 34, acceptance 0) -----------------------------------

# A stream whose head goes out alone (the fake flushes it before the first event, and each event
# waits a little): the read that completes the head carries no body byte.
STREAM = {"text": "every word of this answer must arrive, in order, whole.", "chunk_size": 8,
          "chunk_delay": 0.001}


@pytest.mark.parametrize("close_delimited", [True, False], ids=["close-delimited", "keep-alive"])
async def test_streams_of_every_framing_arrive_whole_at_any_concurrency(
        fake_server: Callable[..., FakeLLMServer], close_delimited: bool) -> None:
    server = fake_server({"rules": [{"contains": [], "reply": STREAM}],
                          "close_delimited": close_delimited})
    async with engine_for(server, max_concurrency=64) as engine:
        for concurrency in (8, 64):
            limit = anyio.Semaphore(concurrency)
            texts: list[str] = []

            async def one() -> None:
                async with limit:
                    message = await engine.complete(request("go"))
                texts.append(message.text if message.stop_reason == "stop" else repr(message))

            async with anyio.create_task_group() as tg:
                for _ in range(200):
                    tg.start_soon(one)
            assert texts == [STREAM["text"]] * 200, concurrency
        stats = engine.stats().models["fake-openai"]
    assert (stats.retries, stats.resent, stats.errors, stats.attempts) == (0, 0, 0, 400)
    assert server.max_in_flight > 8  # the calls did overlap


async def test_eight_concurrent_close_delimited_runs_take_about_as_long_as_one(tmp_path: Path) -> None:
    """A one-second stream (100 events 10 ms apart), alone then 8 at once: <= 1.5x (no retry, no
    backoff, no serialisation). The server is `busctl fake-llm --close-delimited` in its own
    process: in this one, its threads and the client would queue on one GIL."""
    slow = {"text": "x" * 100, "chunk_size": 1, "chunk_delay": 0.01}
    script = tmp_path / "s.json"
    script.write_text(json.dumps({"rules": [{"contains": ["warm"], "reply": {"text": "up"}},
                                            {"contains": [], "reply": slow}]}))
    with running(busctl("fake-llm", "--script", str(script), "--close-delimited")) as proc:
        config = ModelConfig(alias="m", provider="openai", model="m",
                             base_url=proc.wait_ready()["base_url"])
        async with LlmEngine([config]) as engine:
            async def one(text: str = "go") -> None:
                message = await engine.complete(request(text))
                assert message.text == (slow["text"] if text == "go" else "up"), message

            async with anyio.create_task_group() as tg:  # the server's threads, the client pool
                for _ in range(8):
                    tg.start_soon(one, "warm")
            start = anyio.current_time()
            await one()
            alone = anyio.current_time() - start
            start = anyio.current_time()
            async with anyio.create_task_group() as tg:
                for _ in range(8):
                    tg.start_soon(one)
            together = anyio.current_time() - start
            assert engine.stats().models["m"].retries == 0
    assert together <= 1.5 * alone, (together, alone)


@pytest.mark.parametrize(("line", "size"), [
    (b"1a\r", 26), (b"FF", 255), (b"0\r", 0), (b" 1a\t;name=value\r", 26), (b"1A;x", 26),
    (b"0x1a", None), (b"1_0", None), (b"+1", None), (b"", None), (b"g", None),
    (b"f" * 17, None), (b"f" * 11, None),  # 17 digits; 2**44: over MAX_CHUNK
])
def test_chunk_size_lines(line: bytes, size: int | None) -> None:
    """The usual line (hex digits only) is read without the regex, with the same answers."""
    if size is None:
        with pytest.raises(httpx.RemoteProtocolError):
            _chunk_size(line)
    else:
        assert _chunk_size(line) == size
