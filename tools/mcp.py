"""MCP servers' tools on the bus: a tool worker owns MCP client sessions and serves their tools.

    busctl worker --mcp "python -m mcp_server_time" --mcp "npx @modelcontextprotocol/server-git"

One `McpBridge` per server (optional extra `mcp`: the official SDK does the JSON-RPC):

    connect (stdio: spawn the server) -> initialize -> tools/list -> register `tool.<name>` each
      -> serve calls (one session, many concurrent calls; the worker's concurrency applies)
      -> `notifications/tools/list_changed`: list again, register/unregister the difference
    server gone -> unregister its tools (callers get `no_service`), restart with backoff

A call maps to `tools/call`; progress notifications become `tool_execution_update` events; a bus
cancel (or the hub's deadline) cancels the handler, the SDK sends `notifications/cancelled` for
that request and the call is answered `cancelled` at once. Results map to `ToolResult` (see
`to_tool_result`). Input schemas are made provider-safe as `@tool` schemas are (tools/_schema.py);
a tool whose schema cannot be (a recursive `$ref`) is left out with a warning.
Secrets passed in `env` never appear in logs, events or status (only the command is logged).
"""

from __future__ import annotations

import base64
import contextlib
import copy
import json
import logging
import os
import shlex
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TextIO

import anyio
import anyio.abc
import msgspec

from agent_bus.bus import protocol as p
from agent_bus.bus.backoff import Backoff
from agent_bus.bus.client import Handler, IncomingRequest
from agent_bus.bus.messages import (
    ImagePart,
    TextPart,
    ToolCallRequest,
    ToolInfo,
    ToolResult,
    error_result,
)
from agent_bus.bus.toolnames import tool_name_fault
from agent_bus.tools._calls import decode_call
from agent_bus.tools._exceptions import ToolDefinitionError
from agent_bus.tools._runner import traceparent_of
from agent_bus.tools._schema import _inline, _normalize, check_provider_schema

if TYPE_CHECKING:
    from mcp import ClientSession
    from mcp import types as mt

log = logging.getLogger("tools.mcp")

#: Restart delays of a server that exited: 0.5 s doubling to 30 s, back to 0.5 s after a server
#: stayed up for `STABLE_AFTER` seconds.
RESTART_BACKOFF = Backoff(first=0.5, factor=2.0, cap=30.0, jitter=0.0)
STABLE_AFTER = 30.0
#: How long the worker waits for a server's first connection before printing its ready line.
FIRST_CONNECT_WAIT = 30.0
#: How long a call waits for a re-initialized HTTP session before it fails.
RENEW_WAIT = 10.0
#: An HTTP server that refuses our credentials (401/403) is tried again this often, not at the
#: crash pace: a wrong token stays wrong until someone changes it (or the server's side).
AUTH_RETRY = 300.0
_AUTH_STATUSES = (401, 403)


def our_version() -> str:
    """agent-bus's installed version: how its MCP client and server introduce themselves."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("agent-bus")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "0+unknown"


class McpServerSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """One MCP server of a worker: a command (stdio) to start, its tools' prefix and filters."""

    name: str = ""  # in logs and error messages; default: derived from the command
    command: str = ""
    args: list[str] = msgspec.field(default_factory=list)
    env: dict[str, str] = msgspec.field(default_factory=dict)  # secrets: never logged
    cwd: str | None = None
    url: str = ""  # streamable HTTP instead of a command
    headers: dict[str, str] = msgspec.field(default_factory=dict)  # secrets: never logged
    prefix: str = ""  # prepended to every tool name (avoids clashes)
    allow: list[str] = msgspec.field(default_factory=list)  # only these tools (empty: all)
    deny: list[str] = msgspec.field(default_factory=list)  # never these tools

    def __post_init__(self) -> None:
        # msgspec reports a ValueError here as a validation error at this spec's path
        if bool(self.command) == bool(self.url):
            raise ValueError("an MCP server needs `command` (stdio) or `url` (streamable HTTP), "
                             "exactly one")

    def label(self) -> str:
        return self.name or self.url or _derive_name(self.command, self.args)

    def wants(self, tool: str) -> bool:
        return (not self.allow or tool in self.allow) and tool not in self.deny


def parse_mcp_command(text: str) -> McpServerSpec:
    """`--mcp "COMMAND ARGS…"` (shell quoting) as a spec; ValueError naming the flag if empty."""
    try:
        argv = shlex.split(text)
    except ValueError as exc:
        raise ValueError(f"--mcp {text!r}: {exc}; quote it like a shell command line") from None
    if not argv:
        raise ValueError('--mcp needs a command, e.g. --mcp "python -m mcp_server_time"')
    return McpServerSpec(command=argv[0], args=argv[1:])


def _derive_name(command: str, args: list[str]) -> str:
    """`python -m mcp_server_time` -> `mcp_server_time`; `/usr/bin/srv --x` -> `srv`."""
    if "-m" in args[:-1]:
        return args[args.index("-m") + 1]
    return Path(command).name or "mcp"


# --- schemas and results -------------------------------------------------------------------


def provider_safe(schema: dict[str, Any] | None, tool_name: str) -> dict[str, Any]:
    """An MCP input schema flattened like `@tool` schemas: `$ref`s inlined, no `$defs`/titles,
    objects closed. Raises ToolDefinitionError when it cannot be (recursive or dangling `$ref`)."""
    raw = copy.deepcopy(schema) if isinstance(schema, dict) else {}
    defs = {**raw.pop("definitions", {}), **raw.pop("$defs", {})}
    raw.pop("$schema", None)
    try:
        flat: dict[str, Any] = _inline(raw, defs, stack=(), tool_name=tool_name)
    except KeyError as exc:
        raise ToolDefinitionError(f"tool `{tool_name}`: `$ref` to {exc} which the schema does "
                                  f"not define") from None
    flat.setdefault("type", "object")
    flat.setdefault("properties", {})
    _normalize(flat)
    problems = check_provider_schema(flat)
    if problems:
        raise ToolDefinitionError(f"tool `{tool_name}`: " + "; ".join(problems))
    return flat


def to_tool_result(result: mt.CallToolResult) -> ToolResult:
    """MCP content -> bus parts: text as text, images as image parts, audio and blobs named by
    type and size (the bus has no part for them), embedded text resources as text; the
    `structuredContent` goes to `details` (and is the text when there is no content)."""
    parts: list[TextPart | ImagePart] = [_part(block) for block in result.content]
    structured = result.structured_content
    if not parts and structured is not None:
        parts = [TextPart(json.dumps(structured))]
    return ToolResult(content=parts or [TextPart("")], is_error=bool(result.is_error),
                      details=structured)


def _part(block: Any) -> TextPart | ImagePart:
    kind = getattr(block, "type", "")
    if kind == "text":
        return TextPart(block.text)
    if kind == "image":
        try:
            return ImagePart(base64.b64decode(block.data), mime_type=block.mime_type)
        except ValueError:
            return TextPart(f"[image {block.mime_type}: undecodable base64]")
    if kind == "audio":
        return TextPart(f"[audio {block.mime_type}, {_b64_size(block.data)} bytes]")
    if kind == "resource":
        res = block.resource
        text = getattr(res, "text", None)
        if text is not None:
            return TextPart(text)
        return TextPart(f"[resource {res.uri} ({res.mime_type or 'binary'}), "
                        f"{_b64_size(getattr(res, 'blob', ''))} bytes]")
    if kind == "resource_link":
        return TextPart(f"[resource {block.uri}]")
    return TextPart(f"[unsupported MCP content `{kind}`]")


def _b64_size(data: str) -> int:
    """Bytes a base64 text decodes to (without decoding what the bus cannot carry anyway)."""
    return len(data) * 3 // 4 - data[-2:].count("=")


def _progress_part(progress: float, total: float | None, message: str | None) -> ToolResult:
    done = f"{progress:g}/{total:g}" if total else f"{progress:g}"
    return ToolResult(content=[TextPart(f"{message} ({done})" if message else done)],
                      details={"progress": progress, "total": total})


# --- the bridge ------------------------------------------------------------------------------


class ToolHost(Protocol):
    """What a bridge needs of its worker (tools/worker.py `ToolWorker`)."""

    async def register(self, info: ToolInfo, handler: Handler, *, owner: str,
                       idempotent: bool = False) -> str | None: ...

    async def unregister(self, name: str, *, owner: str) -> None: ...

    async def guarded(self, name: str, req: IncomingRequest,
                      run: Callable[[], Awaitable[ToolResult]]) -> ToolResult: ...

    def progress_sink(self, tool_name: str, call: ToolCallRequest,
                      req: IncomingRequest) -> Callable[[ToolResult], Awaitable[None]]: ...


class McpBridge:
    """One MCP server's session, kept alive, and its tools served through the host worker."""

    def __init__(self, spec: McpServerSpec, host: ToolHost) -> None:
        self.spec = spec
        self.host = host
        self.label = spec.label()
        self.owner = f"MCP server `{self.label}`"
        self.session: ClientSession | None = None
        self.tools: dict[str, str] = {}  # bus name -> MCP name
        self.restarts = 0
        self._changed = anyio.Event()
        self._gone = anyio.Event()  # set: end the current session (reconnect)
        self._connected = anyio.Event()  # set while a session serves
        self._renewing = False  # the session ends because it expired: reconnect at once
        self._refused = ""  # the HTTP server's last 401/403, named ("" when none)

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                  ) -> None:
        """Connect, serve, and reconnect with backoff forever (until cancelled).

        `task_status.started()` after the first attempt, successful or not."""
        delays = RESTART_BACKOFF.delays()
        started = False

        def ready() -> None:
            nonlocal started
            if not started:
                started = True
                task_status.started()

        while True:
            t0 = anyio.current_time()
            self._refused = ""
            try:
                await self._session_once(ready)
                why = "exited"
            except Exception as exc:  # noqa: BLE001 - any failure of the server: restart it
                why = f"failed: {_reason(exc)}"
            finally:
                with anyio.CancelScope(shield=True):
                    await self._unregister_all()
                self.session = None
            ready()  # the first attempt failed: the worker starts without these tools
            if self._renewing:  # not a failure: the server restarted and forgot us
                self._renewing = False
                continue
            if self._refused:
                log.error("%s: authentication failed (%s): check its headers (`--mcp-header "
                          "Authorization=Bearer …`, `headers` of [[workers.mcp]]); its tools "
                          "are not served; trying again in %.0fs", self.owner, self._refused,
                          AUTH_RETRY)
                await anyio.sleep(AUTH_RETRY)
                delays = RESTART_BACKOFF.delays()
                continue
            if anyio.current_time() - t0 > STABLE_AFTER:  # it ran well: not a crash loop
                delays = RESTART_BACKOFF.delays()
            delay = next(delays)
            log.warning("%s %s; restarting in %.1fs", self.owner, why, delay)
            await anyio.sleep(delay)
            self.restarts += 1

    async def _session_once(self, ready: Callable[[], None]) -> None:
        """Start the server, register its tools, serve until its stdout closes."""
        from mcp import ClientSession
        from mcp import types as mt

        gone = self._gone = anyio.Event()
        async with contextlib.AsyncExitStack() as stack:
            read, write = await self._transport(stack)
            tg = await stack.enter_async_context(anyio.create_task_group())
            stack.callback(tg.cancel_scope.cancel)  # however we leave: stop the forwarder
            inbox_send, inbox = anyio.create_memory_object_stream[Any](0)
            tg.start_soon(_forward_until_closed, read, inbox_send, gone)
            session = await stack.enter_async_context(
                ClientSession(inbox, write, message_handler=self._on_message,
                              client_info=mt.Implementation(name="agent-bus",
                                                            version=our_version())))
            await session.initialize()
            self.session = session
            await self._sync_tools()
            log.info("%s: serving %s", self.owner, ", ".join(self.tools) or "no tools")
            ready()
            tg.start_soon(self._watch_list_changed)
            self._connected.set()
            await gone.wait()
            self._connected = anyio.Event()
            tg.cancel_scope.cancel()

    async def _transport(self, stack: contextlib.AsyncExitStack) -> tuple[Any, Any]:
        """The server's message streams: a spawned process (stdio) or streamable HTTP."""
        from mcp import StdioServerParameters, stdio_client

        if self.spec.url:
            from mcp.client.streamable_http import streamable_http_client
            from mcp.shared._httpx_utils import create_mcp_http_client

            client = await stack.enter_async_context(
                create_mcp_http_client(headers=self.spec.headers or None))
            # the SDK turns every HTTP error into one JSON-RPC error ("Server returned an error
            # response"); the status is read here, so a refusal of our credentials is named
            client.event_hooks["response"].append(self._note_refusal)
            streams = await stack.enter_async_context(
                streamable_http_client(self.spec.url, http_client=client))
            return streams[0], streams[1]
        params = StdioServerParameters(command=self.spec.command, args=self.spec.args,
                                       env=self.spec.env or None, cwd=self.spec.cwd)
        errlog = await stack.enter_async_context(_stderr_to_log(self.label))
        streams = await stack.enter_async_context(stdio_client(params, errlog=errlog))
        return streams[0], streams[1]

    async def _note_refusal(self, response: Any) -> None:
        if response.status_code in _AUTH_STATUSES:
            asks = response.headers.get("www-authenticate", "")[:200]  # a scheme, no secret
            self._refused = (f"HTTP {response.status_code} {response.reason_phrase} from "
                             f"{self.spec.url}" + (f", which asks for `{asks}`" if asks else ""))

    async def _renew(self, session: ClientSession) -> ClientSession | None:
        """An HTTP server forgot our session (it restarted): reconnect now, and return the new
        session once it is up (None if it is not within `RENEW_WAIT`)."""
        if self.session is session:
            log.warning("%s: session expired; re-initializing", self.owner)
            self._renewing = True
            self._gone.set()
        with anyio.move_on_after(RENEW_WAIT):
            while self.session is None or self.session is session:
                await self._connected.wait()
                if self.session is session:
                    await anyio.sleep(0.05)  # the old session is still being torn down
            return self.session
        return None

    async def _on_message(self, message: Any) -> None:
        from mcp import types as mt

        if isinstance(message, mt.ToolListChangedNotification):
            self._changed.set()
        elif isinstance(message, Exception):
            log.warning("%s sent something unreadable: %s", self.owner, message)

    async def _watch_list_changed(self) -> None:
        while True:
            await self._changed.wait()
            self._changed = anyio.Event()
            try:
                await self._sync_tools()
            except Exception as exc:  # noqa: BLE001 - keep the old list; the next change retries
                log.warning("%s: re-reading tools failed: %s", self.owner, _reason(exc))

    async def _sync_tools(self) -> None:
        """tools/list (all pages); register new or changed tools, unregister vanished ones."""
        assert self.session is not None
        listed = await _list_all_tools(self.session)
        wanted = {info.name: (info, tool.name) for tool in listed
                  if (info := self._info(tool)) is not None}
        for name in [n for n in self.tools if n not in wanted]:
            await self.host.unregister(name, owner=self.owner)
            del self.tools[name]
        for name, (info, mcp_name) in wanted.items():
            refused = await self.host.register(info, self._handler(name), owner=self.owner)
            if refused:
                log.warning("%s", refused)
                continue
            self.tools[name] = mcp_name

    def _info(self, tool: mt.Tool) -> ToolInfo | None:
        if not self.spec.wants(tool.name):
            return None
        name = self.spec.prefix + tool.name
        bad_name = tool_name_fault(name)
        if bad_name:  # the hub would refuse it (bus/toolnames.py): say so here, by the server
            log.warning("%s: left out %s", self.owner, bad_name)
            return None
        try:
            schema = provider_safe(tool.input_schema, name)
        except ToolDefinitionError as exc:
            log.warning("%s: left out %s", self.owner, exc)
            return None
        return ToolInfo(name=name, description=tool.description or tool.title or "",
                        parameters=schema)

    def _handler(self, bus_name: str) -> Handler:
        async def handle(req: IncomingRequest) -> bytes:
            call = decode_call(bus_name, req.body)
            return p.encode(await self.host.guarded(bus_name, req,
                                                    lambda: self._call(bus_name, call, req)))

        return handle

    async def _call(self, bus_name: str, call: ToolCallRequest, req: IncomingRequest
                    ) -> ToolResult:
        """`tools/call` on the live session; every failure is an error result naming both."""
        from mcp import MCPError

        session = self.session
        mcp_name = self.tools.get(bus_name)
        if session is None or mcp_name is None:
            return error_result(f"{self.owner} is restarting; `{bus_name}` is not available now")
        try:
            args = json.loads(call.arguments or "{}")
        except ValueError as exc:
            return error_result(f"Error: arguments of `{bus_name}` are not JSON ({exc})")
        if not isinstance(args, dict):
            return error_result(f"Error: arguments of `{bus_name}` must be a JSON object")
        sink = self.host.progress_sink(bus_name, call, req)

        async def on_progress(progress: float, total: float | None, message: str | None) -> None:
            await sink(_progress_part(progress, total, message))

        # The call's trace context in the request's `_meta` (the key OpenTelemetry's MCP
        # instrumentations read): a traced server puts its spans under our `execute_tool` span.
        traceparent = traceparent_of(call)
        meta: Any = {"traceparent": traceparent} if traceparent else None
        try:
            try:
                result = await session.call_tool(mcp_name, args, progress_callback=on_progress,
                                                 meta=meta)
            except MCPError as exc:
                renewed = await self._renew(session) if _expired(exc, self.spec) else None
                if renewed is None:
                    raise
                result = await renewed.call_tool(mcp_name, args, progress_callback=on_progress,
                                                 meta=meta)
        except MCPError as exc:
            if self._refused:  # the token expired or was revoked mid-session
                return error_result(f"Error: {self.owner}, tool `{mcp_name}`: authentication "
                                    f"failed ({self._refused})")
            return error_result(f"Error: {self.owner}, tool `{mcp_name}`: {exc}")
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            return error_result(f"Error: {self.owner} exited during `{mcp_name}`")
        return to_tool_result(result)

    async def _unregister_all(self) -> None:
        for name in list(self.tools):
            await self.host.unregister(name, owner=self.owner)
        self.tools.clear()


def _expired(exc: Exception, spec: McpServerSpec) -> bool:
    """An HTTP 404 on a session we had: the server no longer knows it. The SDK says "Session
    terminated"; servers that send a JSON-RPC error body say e.g. "Session not found"."""
    text = str(exc).lower()
    return bool(spec.url) and "session" in text and ("terminated" in text or "not found" in text)


async def _list_all_tools(session: ClientSession) -> list[mt.Tool]:
    from mcp import types as mt

    tools: list[mt.Tool] = []
    cursor: str | None = None
    for _ in range(100):  # a server that pages forever is cut off
        result = await session.list_tools(
            params=mt.PaginatedRequestParams(cursor=cursor) if cursor else None)
        tools += result.tools
        cursor = result.next_cursor
        if not cursor:
            break
    return tools


async def _forward_until_closed(source: Any, sink: Any, gone: anyio.Event) -> None:
    """Pass the transport's messages to the session; its end (server exited) sets `gone`."""
    try:
        async with sink:
            async for message in source:
                await sink.send(message)
    except (anyio.ClosedResourceError, anyio.BrokenResourceError):
        pass
    finally:
        gone.set()


@contextlib.asynccontextmanager
async def _stderr_to_log(label: str) -> AsyncIterator[TextIO]:
    """A pipe for the server's stderr; each line goes to the worker's log named `[label]`."""
    rfd, wfd = os.pipe()
    os.set_blocking(rfd, False)
    writer = os.fdopen(wfd, "w")
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_log_lines, rfd, label)
            try:
                yield writer
            finally:
                tg.cancel_scope.cancel()
    finally:
        writer.close()
        os.close(rfd)


async def _log_lines(fd: int, label: str) -> None:
    server_log = logging.getLogger(f"tools.mcp.{label}")
    pending = b""
    while True:
        await anyio.wait_readable(fd)
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            continue
        if not chunk:
            return
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            # INFO: servers write their routine chatter there (startup banners, requests);
            # the worker's own warnings say when a server fails (`busctl -v` shows these)
            server_log.info("[%s] %s", label, line.decode(errors="replace").rstrip())
        pending = pending[-65536:]  # a server that never ends a line cannot grow this forever


def _reason(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_reason(e) for e in exc.exceptions)
    if isinstance(exc, FileNotFoundError):
        return f"command not found ({exc.filename}); check the `--mcp` command"
    return f"{type(exc).__name__}: {exc}"


# --- the worker's part -----------------------------------------------------------------------


async def serve_mcp_servers(specs: list[McpServerSpec], host: ToolHost, tg: anyio.abc.TaskGroup
                            ) -> list[McpBridge]:
    """Start a bridge per server in `tg`; returns once each made its first attempt (bounded)."""
    bridges = [McpBridge(spec, host) for spec in specs]
    with anyio.move_on_after(FIRST_CONNECT_WAIT):
        async with anyio.create_task_group() as starting:
            for bridge in bridges:
                starting.start_soon(_start, tg, bridge)
    return bridges


async def _start(tg: anyio.abc.TaskGroup, bridge: McpBridge) -> None:
    await tg.start(bridge.run)


__all__ = ["McpBridge", "McpServerSpec", "our_version", "parse_mcp_command", "provider_safe",
           "serve_mcp_servers", "to_tool_result"]
