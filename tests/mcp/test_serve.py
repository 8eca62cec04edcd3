"""`busctl mcp serve`, driven by the MCP SDK's own client over stdio against a running
`busctl up` topology whose model is the scripted fake LLM."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import ClientSession, MCPError, StdioServerParameters, stdio_client

from agent_bus.agents.gateway.fakellm import FakeLLMServer
from agent_bus.bus import events as ev
from agent_bus.bus.client import connect
from tests.cli.conftest import Topology, start_up

pytestmark = pytest.mark.anyio

# "slow" streams its long answer in 4-character chunks every 100 ms (about 10 s): a run to
# cancel mid-way; anything else is echoed.
SCRIPT = {"rules": [{"contains": ["slow"], "tool_result": False,
                     "reply": {"text": "tick " * 80, "chunk_size": 4, "chunk_delay": 0.1}}],
          "echo": True}


@pytest.fixture
def topology(tmp_path: Path) -> Iterator[Topology]:
    with FakeLLMServer(SCRIPT) as llm:
        proc, ready = start_up(tmp_path, env={"OPENAI_BASE_URL": llm.base_url,
                                              "OPENAI_API_KEY": ""})
        try:
            yield Topology(proc, tmp_path, ready)
        finally:
            proc.stop(timeout=8)


def serve_params(endpoint: str, *extra: str) -> StdioServerParameters:
    return StdioServerParameters(command=sys.executable,
                                 args=["-m", "agent_bus.cli", "mcp", "serve", "--hub", endpoint,
                                       *extra])


async def test_sdk_client_lists_asks_and_continues_an_agent(topology: Topology) -> None:
    async with stdio_client(serve_params(topology.endpoint)) as (r, w), \
            ClientSession(r, w) as client:
        await client.initialize()
        listed = {t.name: t for t in (await client.list_tools()).tools}
        assert "ask_assistant" in listed
        assert listed["ask_assistant"].input_schema["required"] == ["prompt"]
        progress: list[str] = []

        async def on_progress(done: float, total: float | None, message: str | None) -> None:
            progress.append(message or "")

        with anyio.fail_after(30):
            result = await client.call_tool("ask_assistant", {"prompt": "hello there"},
                                            progress_callback=on_progress)
        assert not result.is_error and result.content[0].text == "echo: hello there"
        assert progress[0] == "agent_start" and progress[-1] == "agent_end: stop", progress
        session = result.structured_content["session"]
        with anyio.fail_after(30):
            again = await client.call_tool("ask_assistant",
                                           {"prompt": "and again", "session": session})
        assert again.structured_content["session"] == session
        assert again.content[0].text == "echo: and again"
        with pytest.raises(MCPError, match="Unknown tool: ask_nobody"):  # a JSON-RPC error
            await client.call_tool("ask_nobody", {"prompt": "hi"})


async def test_client_cancel_aborts_the_run(topology: Topology) -> None:
    async with connect(topology.endpoint, name="watcher") as peer, \
            peer.subscribe(["agent/assistant/"]) as events, \
            stdio_client(serve_params(topology.endpoint, "--agent", "assistant")) as (r, w), \
            ClientSession(r, w) as client:
        await client.initialize()
        first = anyio.Event()

        async def on_progress(done: float, total: float | None, message: str | None) -> None:
            first.set()

        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: client.call_tool("ask_assistant", {"prompt": "slow"},
                                                       progress_callback=on_progress))
                with anyio.fail_after(30):
                    await first.wait()
                scope.cancel()
        t0 = anyio.current_time()
        end: Any = None
        with anyio.fail_after(15):
            async for envelope in events:
                if isinstance(envelope.event, ev.AgentEnd):
                    end = envelope.event
                    break
        assert end.stop_reason == "aborted", end
        assert anyio.current_time() - t0 < 8  # not the ~10 s the answer takes to stream


async def test_sdk_client_over_streamable_http(topology: Topology) -> None:
    from mcp.client.streamable_http import streamable_http_client

    from tests.mcp.test_bridge import _free_port
    from tests.support import Proc, busctl

    port = _free_port()
    server = Proc(busctl("mcp", "serve", "--hub", topology.endpoint, "--http",
                         f"127.0.0.1:{port}"))
    try:
        ready = await anyio.to_thread.run_sync(server.wait_ready, 20.0)
        async with streamable_http_client(ready["url"]) as (r, w), ClientSession(r, w) as client:
            await client.initialize()
            assert "ask_assistant" in {t.name for t in (await client.list_tools()).tools}
            with anyio.fail_after(30):
                result = await client.call_tool("ask_assistant", {"prompt": "over http"})
            assert result.content[0].text == "echo: over http"
        # the Host/Origin check every local HTTP surface shares (bus.httpguard)
        from tests.ui.test_access import get
        for headers, status in (({"Host": "attacker.example"}, 421),
                                ({"Origin": "http://attacker.example"}, 403)):
            answer = await anyio.to_thread.run_sync(get, ready["url"], headers)
            assert answer.status == status, headers
    finally:
        server.stop()
    refused = Proc(busctl("mcp", "serve", "--hub", topology.endpoint, "--http", "0.0.0.0:1"))
    try:
        code = await anyio.to_thread.run_sync(refused.popen.wait, 20)
        assert code == 2 and "loopback only" in refused.output(), refused.output()
    finally:
        refused.stop()
