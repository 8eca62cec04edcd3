"""`busctl mcp serve`: the bus's agents (and, with `--tools`, its tools) as an MCP server.

    {"mcpServers": {"bus": {"command": "busctl", "args": ["mcp", "serve"]}}}

An MCP client (Claude Desktop/Code, Cursor, VS Code, another agent) launches it over stdio. Each
live agent (or each `--agent`) is a tool `ask_<agent>` taking `prompt` and an optional `session`
(continue that conversation; the result's `structuredContent.session` names the one used). A
call runs the agent and returns the run's final text; the run's events stream as MCP progress
notifications (when the client asked for progress); a client-side cancel
(`notifications/cancelled`) aborts the run. With `--tools`, every live bus tool is exposed as
itself and called through the hub like an agent's tool call: its progress partials become
progress notifications, and an MCP-backed tool's `structuredContent` is passed on (any other
tool's `details` is not: it is hidden from models, and an MCP client is often a model's). A tool that
is neither is answered with a JSON-RPC error (invalid params), as the spec says. The tool list
is read from the hub at every `tools/list`, so agents that come and go are seen. The official
SDK (extra `mcp`) speaks the protocol; nothing here writes JSON-RPC.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import anyio
import msgspec

from agent_bus.agents.client.remote import AgentBus, Run
from agent_bus.bus import events as ev
from agent_bus.bus.client import Envelope
from agent_bus.bus.messages import ImagePart, ToolCallRequest, ToolResult
from agent_bus.tools.executor import BusToolExecutor

log = logging.getLogger("agents.client.mcp_server")

ASK = "ask_"
#: How long aborting a cancelled run may take before the handler gives up waiting.
ABORT_WAIT = 5.0
_PROMPT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "prompt": {"type": "string", "description": "What to ask the agent."},
        "session": {"type": "string",
                    "description": "A session id from an earlier answer, to continue that "
                                   "conversation (default: a new session)."},
    },
    "required": ["prompt"],
    "additionalProperties": False,
}


class BusMcpServer:
    """The MCP handlers over one bus connection. `agents`: only these (default: every live one)."""

    def __init__(self, bus: AgentBus, agents: list[str], with_tools: bool) -> None:
        self.bus = bus
        self.only = set(agents)
        self.with_tools = with_tools
        self.tools = BusToolExecutor(bus.peer)

    async def live_agents(self) -> list[str]:
        live = await self.bus.agents()
        return [a for a in live if not self.only or a in self.only]

    async def list_tools(self, ctx: Any, params: Any) -> Any:
        from mcp import types as mt

        tools = [mt.Tool(name=ASK + agent, description=f"Ask the agent `{agent}` on the bus; "
                         "returns its final answer.", input_schema=_PROMPT_SCHEMA)
                 for agent in await self.live_agents()]
        if self.with_tools:
            tools += [mt.Tool(name=info.name, description=info.description,
                              input_schema=info.parameters or {"type": "object"})
                      for info in await self.tools.catalog()]
        return mt.ListToolsResult(tools=tools)

    async def call_tool(self, ctx: Any, params: Any) -> Any:
        name: str = params.name
        args: dict[str, Any] = params.arguments or {}
        agents = await self.live_agents()
        if name.startswith(ASK) and name[len(ASK):] in agents:
            return await self._ask(ctx, name[len(ASK):], args)
        if self.with_tools and name in {info.name for info in await self.tools.catalog()}:
            return await self._bus_tool(ctx, name, args)
        # The spec's answer to an unknown tool is a JSON-RPC error, not a tool result.
        raise _unknown_tool(name)

    async def _ask(self, ctx: Any, agent: str, args: dict[str, Any]) -> Any:
        from mcp import types as mt

        prompt, session = args.get("prompt"), args.get("session") or ""
        if not isinstance(prompt, str) or not isinstance(session, str):
            return _error("`prompt` (and `session`, when given) must be strings")
        run = await self.bus.prompt(agent, prompt, session=session)
        try:
            end = await self._follow(ctx, run)
        except BaseException:
            with anyio.move_on_after(ABORT_WAIT, shield=True):
                await _abort(run, "cancelled by the MCP client")
            raise
        finally:
            with anyio.CancelScope(shield=True):
                await run.close()
        failed = end.stop_reason in ("error", "aborted")
        text = end.final_text or (end.error or end.stop_reason if failed else "")
        return mt.CallToolResult(
            content=[mt.TextContent(type="text", text=text)], is_error=failed,
            structured_content={"session": run.session, "run_id": run.run_id,
                                "stop_reason": end.stop_reason})

    async def _follow(self, ctx: Any, run: Run) -> ev.AgentEnd:
        """Each event of the run as a progress notification; returns its `agent_end`."""
        count = 0
        async for envelope in run.events():
            count += 1
            await ctx.session.report_progress(count, None, _describe(envelope))
            if isinstance(envelope.event, ev.AgentEnd):
                return envelope.event
        raise RuntimeError(f"the run {run.run_id} of `{run.agent}` ended without agent_end")

    async def _bus_tool(self, ctx: Any, name: str, args: dict[str, Any]) -> Any:
        """A bus tool called directly; its progress partials as MCP progress notifications
        (when the client asked for progress: `report_progress` is a no-op otherwise)."""
        request = ToolCallRequest(call_id=f"mcp-{uuid.uuid4().hex[:12]}", name=name,
                                  arguments=msgspec.json.encode(args).decode())
        count = 0

        async def on_update(partial: Any) -> None:
            nonlocal count
            count += 1
            text = partial.text if isinstance(partial, ToolResult) else str(partial)
            await ctx.session.report_progress(count, None, text)

        result = await self.tools.execute(request, on_update)
        return _to_mcp(result, structured=name in self.tools.structured)


async def _abort(run: Run, reason: str) -> None:
    try:
        await run.abort(reason)
    except Exception as exc:  # noqa: BLE001 - the run may have ended meanwhile: nothing to abort
        log.info("abort of %s: %s", run.run_id, exc)


def _describe(envelope: Envelope) -> str:
    """One line per event: its type, and the tool name or text where there is one."""
    event = envelope.event
    kind = envelope.header.type
    name = getattr(event, "tool_name", "")
    if name:
        return f"{kind}: {name}"
    if isinstance(event, ev.AgentEnd):
        return f"{kind}: {event.stop_reason}"
    return kind


def _to_mcp(result: ToolResult, structured: bool) -> Any:
    import base64

    from mcp import types as mt

    content: list[Any] = []
    for part in result.content:
        if isinstance(part, ImagePart):
            content.append(mt.ImageContent(type="image", mime_type=part.mime_type,
                                           data=base64.b64encode(part.data).decode()))
        else:
            content.append(mt.TextContent(type="text", text=part.text))
    # `details` is hidden from models, and so from MCP clients (often a model's host): only a
    # tool whose meta says its `details` is structured output (an MCP-backed tool's
    # `structuredContent`, tools/mcp.py) has a map `details` given back as such.
    out = result.details if structured and isinstance(result.details, dict) else None
    return mt.CallToolResult(content=content, is_error=result.is_error, structured_content=out)


def _unknown_tool(name: str) -> Exception:
    """The JSON-RPC error (invalid params, as the MCP spec says) for a tool nobody serves; the
    same words whether or not bus tools are exposed."""
    from mcp import MCPError
    from mcp.types import INVALID_PARAMS

    return MCPError(INVALID_PARAMS, f"Unknown tool: {name} (`tools/list` names the live ones)")


def _error(text: str) -> Any:
    from mcp import types as mt

    return mt.CallToolResult(content=[mt.TextContent(type="text", text=text)], is_error=True)


def _server(handlers: BusMcpServer) -> Any:
    from mcp.server.lowlevel import Server

    from agent_bus.tools.mcp import our_version

    server: Server[Any] = Server("agent-bus", version=our_version(),
                                 on_list_tools=handlers.list_tools,
                                 on_call_tool=handlers.call_tool)
    return server


async def serve_stdio(hub: str, curve: Any, agents: list[str], with_tools: bool) -> None:
    """Serve MCP on stdin/stdout until the client closes them."""
    from mcp.server.stdio import stdio_server

    from agent_bus.agents.client.remote import connect

    async with connect(hub, name="mcp-serve", curve=curve) as bus:
        handlers = BusMcpServer(bus, agents, with_tools)
        server = _server(handlers)
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())


def _host_guarded(app: Any, bind: str) -> Any:
    """`app` behind `bus.httpguard`'s Host/Origin check, the one every local HTTP surface uses
    (the SDK's own check for a loopback host stays on behind it)."""
    from agent_bus.bus.httpguard import refusal

    async def guarded(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            refused = refusal(bind, headers.get("host"), headers.get("origin"))
            if refused is not None:
                body = refused[1].encode()
                await send({"type": "http.response.start", "status": refused[0],
                            "headers": [(b"content-type", b"text/plain"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await app(scope, receive, send)

    return guarded


async def serve_http(hub: str, curve: Any, agents: list[str], with_tools: bool, host: str,
                     port: int) -> None:
    """Serve MCP over streamable HTTP at `http://host:port/mcp` until interrupted; prints a
    JSON ready line on stdout once listening."""
    import json

    import uvicorn

    from agent_bus.agents.client.remote import connect

    async with connect(hub, name="mcp-serve", curve=curve) as bus:
        handlers = BusMcpServer(bus, agents, with_tools)
        server = _server(handlers)
        app = _host_guarded(server.streamable_http_app(host=host), host)
        web = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                            lifespan="on"))
        async with anyio.create_task_group() as tg:
            tg.start_soon(web.serve)
            while not web.started:  # uvicorn has no readiness callback; bounded by its startup
                await anyio.sleep(0.02)
            print(json.dumps({"ready": "mcp", "url": f"http://{host}:{port}/mcp"}), flush=True)
