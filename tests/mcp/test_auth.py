"""Issue 49 item 12: an MCP server URL that answers 401 is an authentication failure, named as
such, and not retried at the crash pace (0.5 s, 1 s, 2 s, …) but every `AUTH_RETRY` seconds;
the worker's MCP client introduces itself as agent-bus with its version (not `mcp 0.1.0`).

The server is a real HTTP server in the test (the standard library's), refusing every request
with 401 and a `WWW-Authenticate` challenge, as an MCP server behind a token does; the worker
is a real `busctl worker --mcp-url` process on a real hub."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from importlib.metadata import version
from typing import Any

import anyio.to_thread
import pytest

from agent_bus.tools.mcp import AUTH_RETRY
from tests.mcp.conftest import mcp_worker
from tests.support import wait_for

pytestmark = pytest.mark.anyio

TOKEN = "wrong-token-value-not-to-be-logged"


class Refusing(http.server.ThreadingHTTPServer):
    """Answers every request 401, keeping each JSON-RPC message it was sent."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.received: list[dict[str, Any]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/mcp"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: Refusing

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        self.server.received.append(json.loads(body or b"{}"))
        self._refuse()

    def do_GET(self) -> None:
        self._refuse()

    def _refuse(self) -> None:
        self.send_response(401)
        self.send_header("WWW-Authenticate", 'Bearer realm="mcp"')
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def refusing() -> Iterator[Refusing]:
    server = Refusing()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def initializes(server: Refusing) -> list[dict[str, Any]]:
    return [m for m in list(server.received) if m.get("method") == "initialize"]


async def test_a_401_is_named_an_authentication_failure_and_not_retried_at_once(
        hub: dict, refusing: Refusing) -> None:
    assert AUTH_RETRY >= 60  # the stated maximum pace: minutes, not the crash backoff's 0.5 s
    async with mcp_worker(hub["endpoint"], "--mcp-url", refusing.url,
                          "--mcp-header", f"Authorization=Bearer {TOKEN}") as proc:
        line = await anyio.to_thread.run_sync(
            lambda: proc.wait_line(lambda s: "authentication failed" in s, 30))
        assert f"(HTTP 401 Unauthorized from {refusing.url}, which asks for " \
               "`Bearer realm=\"mcp\"`)" in line, line
        assert "--mcp-header" in line and f"trying again in {AUTH_RETRY:.0f}s" in line, line
        # the crash backoff would have tried again after 0.5 s, 1 s and 2 s: nothing in 4 s
        with pytest.raises(TimeoutError):
            await anyio.to_thread.run_sync(
                lambda: wait_for(lambda: len(initializes(refusing)) > 1, 4, "a second try"))
        assert TOKEN not in proc.output()
    (first,) = initializes(refusing)
    assert first["params"]["clientInfo"] == {"name": "agent-bus", "version": version("agent-bus")}
