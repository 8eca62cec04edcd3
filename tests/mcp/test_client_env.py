"""Issue 49 item 9: `busctl mcp serve` started by an MCP client finds a local topology.

An MCP client starts its servers with the SDK's minimal environment (`get_default_environment`:
HOME, PATH, … and no XDG_RUNTIME_DIR), while the user started `busctl up` from a login shell that
has one. The server must still follow the README's `--hub tcp://127.0.0.1:PORT` to the topology's
private ipc:// sockets."""

from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.client.stdio import get_default_environment

from agent_bus.agents.gateway.fakellm import FakeLLMServer
from agent_bus.bus.paths import alias_homes
from tests.cli.conftest import start_up

pytestmark = pytest.mark.anyio


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def login_runtime_dir() -> Iterator[Path]:
    """A private XDG_RUNTIME_DIR such as a login shell has (short: socket paths have 107 bytes)."""
    folder = Path(tempfile.mkdtemp(prefix="xdg-"))
    os.chmod(folder, 0o700)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


async def test_mcp_serve_with_the_sdk_default_environment_finds_the_topology(
        tmp_path: Path, login_runtime_dir: Path) -> None:
    assert "XDG_RUNTIME_DIR" not in get_default_environment()  # what the client really passes
    port = free_port()
    with FakeLLMServer({"rules": [], "echo": True}) as llm:
        proc, ready = start_up(tmp_path, "--hub", f"tcp://127.0.0.1:{port}",
                               env={"XDG_RUNTIME_DIR": str(login_runtime_dir),
                                    "OPENAI_BASE_URL": llm.base_url, "OPENAI_API_KEY": ""})
        try:
            # the topology's sockets live under the login shell's runtime folder
            assert ready["endpoint"].startswith(f"ipc://{login_runtime_dir}/"), ready
            # exactly the README's client configuration; env=None: the SDK's default environment
            params = StdioServerParameters(
                command=sys.executable,
                args=["-m", "agent_bus.cli", "mcp", "serve", "--hub", f"tcp://127.0.0.1:{port}"])
            assert params.env is None
            with anyio.fail_after(60):
                async with stdio_client(params) as (r, w), ClientSession(r, w) as client:
                    await client.initialize()
                    names = {t.name for t in (await client.list_tools()).tools}
                    assert "ask_assistant" in names, names
                    result = await client.call_tool("ask_assistant", {"prompt": "hello there"})
            assert not result.is_error, result
            assert "hello there" in result.content[0].text  # type: ignore[union-attr]
        finally:
            proc.stop(timeout=8)
    # the alias is gone from every folder with the topology
    assert not any((home / f"tcp-{port}").exists() for home in alias_homes())
