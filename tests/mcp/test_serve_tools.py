"""`busctl mcp serve --tools` (issue 29, item 5), driven by the MCP SDK's own client over stdio,
with an MCP-backed bus tool (a `busctl worker --mcp` of the SDK demo server) on a real hub: a
direct tool call streams progress notifications and keeps the tool's `structuredContent`; an
unknown tool is a JSON-RPC error worded the same with and without `--tools`; `serverInfo`
carries the package version."""

from __future__ import annotations

import sys
from importlib.metadata import version

import anyio
import pytest
from mcp import ClientSession, MCPError, StdioServerParameters, stdio_client
from mcp.types import INVALID_PARAMS

from agent_bus.agents.client.remote import connect
from agent_bus.bus.toolnames import STRUCTURED_META
from tests.mcp.conftest import DEMO, mcp_worker

pytestmark = pytest.mark.anyio


def serve_params(endpoint: str, *extra: str) -> StdioServerParameters:
    return StdioServerParameters(command=sys.executable,
                                 args=["-m", "agent_bus.cli", "mcp", "serve", "--hub", endpoint,
                                       *extra])


async def unknown_tool_error(client: ClientSession) -> tuple[int, str]:
    with pytest.raises(MCPError) as caught:
        await client.call_tool("no_such_tool", {})
    return caught.value.error.code, caught.value.error.message


async def test_tools_stream_progress_keep_structured_content_and_unknown_is_an_error(
        hub: dict) -> None:
    endpoint = hub["endpoint"]
    async with mcp_worker(endpoint, "--mcp", DEMO):
        async with stdio_client(serve_params(endpoint, "--tools")) as (r, w), \
                ClientSession(r, w) as client:
            init = await client.initialize()
            assert (init.server_info.name, init.server_info.version) == (
                "agent-bus", version("agent-bus"))
            assert "progress" in {t.name for t in (await client.list_tools()).tools}
            progress: list[tuple[float, str]] = []

            async def on_progress(done: float, total: float | None, message: str | None
                                  ) -> None:
                progress.append((done, message or ""))

            with anyio.fail_after(20):
                result = await client.call_tool("progress", {"steps": 3},
                                                progress_callback=on_progress)
            assert not result.is_error and result.content[0].text == "done"
            assert result.structured_content == {"result": "done"}, result
            assert progress == [(1, "step 1 (1/3)"), (2, "step 2 (2/3)"), (3, "step 3 (3/3)")]
            with_tools = await unknown_tool_error(client)
        async with stdio_client(serve_params(endpoint)) as (r, w), \
                ClientSession(r, w) as client:
            await client.initialize()
            without = await unknown_tool_error(client)
    assert with_tools == without == (
        INVALID_PARAMS, "Unknown tool: no_such_tool (`tools/list` names the live ones)")


async def test_a_bus_tools_details_stay_hidden_from_mcp_clients(hub: dict) -> None:
    """Issue 49 item 14: `details` is documented as hidden from the model, and an MCP client is
    often a model's host: only an MCP-backed tool (its meta says `structured_content`) has its
    map `details`, the server's own `structuredContent`, passed on."""
    endpoint = hub["endpoint"]
    async with mcp_worker(endpoint, "--mcp", DEMO), \
            mcp_worker(endpoint, "--tools", "tests.mcp.fixtures.detail_tools"):
        async with connect(endpoint, name="test-meta") as bus:
            metas = {s.name: s.meta for s in (await bus.peer.status()).services}
        assert metas["tool.progress"].get(STRUCTURED_META) is True
        assert STRUCTURED_META not in metas["tool.noted"]
        async with stdio_client(serve_params(endpoint, "--tools")) as (r, w), \
                ClientSession(r, w) as client:
            await client.initialize()
            with anyio.fail_after(20):
                noted = await client.call_tool("noted", {})
                progress = await client.call_tool("progress", {"steps": 1})
    assert noted.content[0].text == "shown" and noted.structured_content is None, noted
    assert progress.structured_content == {"result": "done"}, progress
