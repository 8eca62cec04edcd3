"""The tool worker: serve each loaded tool as service `tool.<name>` until SIGINT/SIGTERM.

    busctl worker --hub tcp://127.0.0.1:7400 --tools mypkg.tools --concurrency 4

One worker process loads the `@tool`s of its modules, refuses to start if a schema is not
provider-safe, registers `tool.<name>` for each (capacity = concurrency, idempotent and the
`ToolInfo` as service metadata) and prints one JSON ready line on stdout. Calls run concurrently,
at most `concurrency` at once across all tools (a worker-wide semaphore, plus a worker-wide thread
limiter for sync tools). On SIGINT/SIGTERM it unregisters, lets in-flight calls finish for up to
`shutdown_grace` seconds, cancels the rest (their callers get a `peer_lost` error) and leaves.

Wire format of a `tool.<name>` call (body frames; the hub never decodes them):
    request body   msgpack `ToolCallRequest`
    partial reply  msgpack array `["progress", ToolResult]` (one per `ctx.progress(...)`)
    final reply    msgpack `ToolResult` map
    error reply    `bad_request` for an undecodable body; `peer_lost` when the worker shut down
Progress goes to the caller only: the coordinator publishes it as `tool_execution_update` with
the call's other events (docs/protocol.md, "Tool services").
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, Literal, Union

import anyio
import anyio.abc
import msgspec
import zmq

from agent_bus.bus import protocol as p
from agent_bus.bus.client import Handler, IncomingRequest, Peer, connect
from agent_bus.bus.errors import HubLost, RequestError
from agent_bus.bus.messages import ToolCallRequest, ToolInfo, ToolResult, error_result
from agent_bus.bus.paths import inside_state_dir
from agent_bus.bus.security import CurveClient
from agent_bus.bus.toolnames import STRUCTURED_META
from agent_bus.tools._calls import decode_call, service_name
from agent_bus.tools._exceptions import ToolLoadError, WorkspaceError
from agent_bus.tools._loader import load_tools
from agent_bus.tools._runner import CANCEL_GRACE, run_tool
from agent_bus.tools._schema import check_provider_schema
from agent_bus.tools._tool import Tool
from agent_bus.tools.mcp import McpServerSpec, serve_mcp_servers
from agent_bus.tools.sandbox import SandboxInfo, SandboxMode, SandboxPolicy, describe
from agent_bus.tools.workspaces import WORKSPACES_META, RunFolders, workspace_key

log = logging.getLogger("tools.worker")

#: Seconds in-flight calls get to finish after SIGINT/SIGTERM before they are cancelled.
SHUTDOWN_GRACE = 2.0

#: A partial reply body: `("progress", partial ToolResult)`.
Progress = tuple[Literal["progress"], ToolResult]
_reply_decoder = msgspec.msgpack.Decoder(Union[ToolResult, Progress])


class WorkerSettings(msgspec.Struct, kw_only=True):
    """What `busctl worker` passes to `run_worker`."""

    hub: str
    tool_modules: list[str] = msgspec.field(default_factory=lambda: ["agent_bus.tools.builtin"])
    concurrency: int = 8
    workspace: str = "."
    name: str = ""  # default: worker-<pid>
    allow_shell: bool = False
    curve: CurveClient | None = None
    shutdown_grace: float = SHUTDOWN_GRACE
    # MCP servers whose tools this worker also serves (tools/mcp.py); `--mcp` / `--mcp-url`.
    mcp: list[McpServerSpec] = msgspec.field(default_factory=list)
    # Paths tools may not write, besides the bus's Python environment and `.git` (tools.sandbox):
    # `--read-only`, how `busctl up` passes the topology file in use and a group's `read_only`.
    read_only: list[str] = msgspec.field(default_factory=list)
    sandbox: SandboxInfo | None = None  # what `busctl worker` runs in (tools.sandbox.enter)
    # The worker's `--sandbox` mode, which its run_shell calls follow ("off": process group only),
    # whether they have the network (`--shell-network`) and the folders they do not see (a local
    # hub's socket folder, `tools.sandbox.hub_folders`): with `read_only`, its `SandboxPolicy`.
    sandbox_mode: SandboxMode = "auto"
    shell_network: bool = False
    shell_hide: list[str] = msgspec.field(default_factory=list)


def sandbox_policy(settings: WorkerSettings) -> SandboxPolicy:
    """The worker's sandbox policy, from its settings: what its tools may not write (`read_only`),
    how its run_shell calls are contained. Built once, passed to every call's `ToolContext`."""
    return SandboxPolicy.build(settings.read_only, settings.sandbox_mode, settings.shell_network,
                               settings.shell_hide)


# --- reply codec (shared with tools.executor) ----------------------------------------------


def encode_progress(partial: ToolResult) -> bytes:
    return p.encode(("progress", partial))


def decode_reply(body: bytes) -> ToolResult | Progress:
    """A reply body of a tool service: the final `ToolResult`, or a `("progress", partial)`.

    Raises msgspec.DecodeError / ValidationError for anything else.
    """
    return _reply_decoder.decode(body)


# --- loading -------------------------------------------------------------------------------


def load_worker_tools(modules: list[str], *, allow_none: bool = False) -> list[Tool]:
    """Load every module's tools; refuse duplicate names and schemas providers would reject.

    `allow_none`: no modules is fine (a worker that serves only MCP servers' tools).
    Raises ToolLoadError naming the module (import failure, no tools) or the tool (schema, clash).
    """
    if not modules and not allow_none:
        raise ToolLoadError("No tool modules given: pass at least one `--tools MODULE` or `--mcp`")
    found: dict[str, tuple[Tool, str]] = {}
    for module in modules:
        for t in load_tools(module):
            if t.name in found and found[t.name][0] is not t:
                raise ToolLoadError(
                    f"Tool `{t.name}` is defined by both `{found[t.name][1]}` and `{module}`; "
                    f"rename one with @tool(name=...)"
                )
            _check_schema(t, module)
            found[t.name] = (t, module)
    return [t for t, _ in found.values()]


def _check_schema(t: Tool, module: str) -> None:
    problems = check_provider_schema(t.parameters)
    if problems:
        raise ToolLoadError(
            f"Tool `{t.name}` (module `{module}`) has a parameter schema LLM providers reject: "
            + "; ".join(problems)
            + ". Simplify its parameter types (see tools/_schema.py)."
        )


# --- the worker ----------------------------------------------------------------------------


class ToolWorker:
    """Serves a fixed set of tools on one peer. `attach()`, then `leave()` when done.

    `policy`: the worker's `SandboxPolicy` (default: built from `settings`), given to every call.
    """

    def __init__(self, settings: WorkerSettings, tools: list[Tool],
                 policy: SandboxPolicy | None = None) -> None:
        if settings.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {settings.concurrency}")
        self.settings = settings
        self.policy = sandbox_policy(settings) if policy is None else policy
        self.tools = {t.name: t for t in tools}
        self.workspace = Path(settings.workspace).resolve()
        self.folders = RunFolders()
        self.peer: Peer | None = None
        self._slots = anyio.Semaphore(settings.concurrency)
        self._threads = anyio.CapacityLimiter(settings.concurrency)
        self._inflight: dict[str, anyio.CancelScope] = {}
        # Set when the last call in flight ends; made only while `_wait_idle` waits (not one
        # per call: a call that ends the worker's busy spell would otherwise make the next).
        self._idle: anyio.Event | None = None
        # The next scopes straight from their class (the event loop's backend's): the public
        # constructor looks the backend up on every call.
        self._new_scope: Callable[[], anyio.CancelScope] = anyio.CancelScope
        # tool name -> (who serves it, its ToolInfo): @tools and MCP servers' tools alike.
        self.served: dict[str, tuple[str, ToolInfo]] = {}

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    async def attach(self, peer: Peer) -> None:
        """Register `tool.<name>` for every tool; returns once the hub has them."""
        self.peer = peer
        for t in self.tools.values():
            await self.register(t.info, self._handler(t), owner="@tool", idempotent=t.idempotent,
                                confirm=False)
        # one round trip for them all (same connection, in order): in place, or refused
        await peer.confirm_registers()

    async def register(self, info: ToolInfo, handler: Handler, *, owner: str,
                       idempotent: bool = False, confirm: bool = True) -> str | None:
        """Serve `tool.<info.name>`; None when done, else why it was refused (a clash).

        `owner` names where the tool comes from (`@tool`, `MCP server `git``) for that message.
        The same owner re-registering a tool (MCP `list_changed`) replaces it.
        """
        assert self.peer is not None, "register() before attach()"
        held = self.served.get(info.name)
        if held is not None and held[0] != owner and held[1].parameters != info.parameters:
            return (f"tool `{info.name}` of {owner} clashes with `{info.name}` of {held[0]} "
                    f"(different schema); give one a prefix (`--mcp-prefix` / `prefix`)")
        if held is None and owner != "@tool":  # @tools: a rolling upgrade may change a schema
            clash = await self._live_clash(info)
            if clash:
                return (f"tool `{info.name}` of {owner} clashes with the live `{info.name}` of "
                        f"{clash} (different schema); give one a prefix (`--mcp-prefix` / "
                        f"`prefix`)")
        # the worker's sandbox rides along, for `busctl status` (ToolInfo ignores the key)
        jail = self.settings.sandbox
        meta = {**msgspec.to_builtins(info), **({"sandbox": describe(jail)} if jail else {}),
                # calls with a `workspace` run in it (a requester may refuse workers without)
                WORKSPACES_META: workspace_key(self.workspace),
                # an MCP server's `structuredContent` (its results' `details`) is for clients
                **({STRUCTURED_META: True} if owner != "@tool" else {})}
        await self.peer.serve(service_name(info.name), handler, capacity=self.settings.concurrency,
                              idempotent=idempotent, meta=meta, confirm=confirm)
        self.served[info.name] = (owner, info)
        return None

    async def _live_clash(self, info: ToolInfo) -> str:
        """The peers already serving `tool.<name>` with another schema ("" when none)."""
        assert self.peer is not None
        status = await self.peer.status()
        service = service_name(info.name)
        if not any(s.name == service and s.meta.get("parameters", info.parameters)
                   != info.parameters for s in status.services):
            return ""
        return ", ".join(f"`{x.name}`" for x in status.peers
                         if any(load.name == service for load in x.services)) or "another peer"

    async def unregister(self, name: str, *, owner: str) -> None:
        """Stop serving `tool.<name>` if `owner` serves it (calls then get `no_service`)."""
        held = self.served.get(name)
        if held is None or held[0] != owner or self.peer is None:
            return
        del self.served[name]
        with contextlib.suppress(HubLost, zmq.ZMQError):
            await self.peer.unserve(service_name(name))

    async def leave(self, grace: float | None = None) -> None:
        """Unregister, give in-flight calls `grace` s, cancel the rest, wait for their replies."""
        grace = self.settings.shutdown_grace if grace is None else grace
        await self._unregister()
        with anyio.move_on_after(grace):
            await self._wait_idle()
        if self._inflight:
            log.warning("%s: cancelling %d call(s) still running after %.1fs",
                        self.settings.name, len(self._inflight), grace)
            for scope in list(self._inflight.values()):
                scope.cancel()
            with anyio.move_on_after(CANCEL_GRACE + 0.5):
                await self._wait_idle()
        await self._flush()  # the last replies reach the hub before the socket closes

    async def _wait_idle(self) -> None:
        """Return once no call is in flight."""
        while self._inflight:
            if self._idle is None or self._idle.is_set():
                self._idle = anyio.Event()
            await self._idle.wait()

    async def _unregister(self) -> None:
        peer = self.peer
        if peer is None or peer.welcome is None:  # not connected: the hub forgot us anyway
            return
        with anyio.move_on_after(1):
            try:
                for name in list(self.served):
                    await peer.unserve(service_name(name))
                    del self.served[name]
            except (HubLost, zmq.ZMQError):
                return
        await self._flush()  # no new call is routed here once this returns

    async def _flush(self) -> None:
        """A round trip on the peer's connection: everything sent before it reached the hub."""
        if self.peer is None or self.peer.welcome is None:
            return
        with anyio.move_on_after(1):
            try:
                await self.peer.status(timeout=1)
            except RequestError:
                pass

    def _handler(self, t: Tool) -> Handler:
        async def handle(req: IncomingRequest) -> bytes:
            return await self._call(t, req)

        return handle

    async def _call(self, t: Tool, req: IncomingRequest) -> bytes:
        call = decode_call(t.name, req.body)

        async def run() -> ToolResult:
            # Progress reaches the caller only through a ToolContext: none, no sink.
            sink = self.progress_sink(t.name, call, req) if t.context_param is not None else None
            workspace = self.workspace
            if call.workspace is not None:  # the run's own folder (tools.workspaces)
                try:
                    workspace = self.folders.get(self.workspace, call.workspace)
                except (WorkspaceError, OSError) as exc:
                    return error_result(f"Error: cannot prepare this run's workspace on worker "
                                        f"`{self.settings.name}`: {exc}")
            return await run_tool(t, call, workspace=workspace,
                                  allow_shell=self.settings.allow_shell, on_progress=sink,
                                  limiter=self._threads, policy=self.policy)

        return p.encode(await self.guarded(t.name, req, run))

    async def guarded(self, name: str, req: IncomingRequest,
                      run: Callable[[], Awaitable[ToolResult]]) -> ToolResult:
        """Run one call within the worker's concurrency, tracked so that `leave()` can wait."""
        scope = self._new_scope()
        self._new_scope = type(scope)
        self._inflight[req.id] = scope
        try:
            with scope:
                try:  # a free slot is taken at once (`acquire` would yield to the loop first)
                    self._slots.acquire_nowait()
                except anyio.WouldBlock:
                    await self._slots.acquire()
                try:
                    return await run()
                finally:
                    self._slots.release()
        finally:
            del self._inflight[req.id]
            if not self._inflight and self._idle is not None:
                self._idle.set()
        # only reached when `leave()` cancelled the call
        raise RequestError(
            f"worker `{self.settings.name}` shut down while running `{name}`", p.PEER_LOST
        )

    def progress_sink(
        self, tool_name: str, call: ToolCallRequest, req: IncomingRequest
    ) -> Callable[[ToolResult], Awaitable[None]]:
        # Only to the caller: the side that publishes the call's other events (the
        # coordinator) publishes its progress as `tool_execution_update`, as for any tool.
        async def on_progress(partial: ToolResult) -> None:
            try:
                await req.partial(encode_progress(partial))
            except (HubLost, zmq.ZMQError) as exc:  # the call's reply is lost too; drop it
                log.debug("progress of %s dropped: %s", call.call_id, exc)

        return on_progress


# --- the process ---------------------------------------------------------------------------


async def run_worker(
    settings: WorkerSettings,
    *,
    stop: anyio.Event | None = None,
    task_status: anyio.abc.TaskStatus[dict[str, Any]] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Load, attach, print the ready line, serve until SIGINT/SIGTERM (or `stop`), leave.

    Raises ToolLoadError (before connecting) when a module does not import, defines no tools or
    has a tool whose schema is not provider-safe; HubUnreachable when the hub does not answer.
    `stop` replaces the signal handlers (for running a worker inside another program).
    """
    tools = load_worker_tools(list(settings.tool_modules), allow_none=bool(settings.mcp))
    if not settings.allow_shell:  # a tool the worker cannot run is not offered to the model
        tools = [t for t in tools if t.name != "run_shell"]
    if not Path(settings.workspace).is_dir():
        raise ToolLoadError(f"Workspace `{settings.workspace}` is not a directory")
    state = inside_state_dir(Path(settings.workspace).resolve())
    if state is not None:
        raise ToolLoadError(f"Workspace `{settings.workspace}` is inside the bus's state directory "
                            f"`{state}`; choose a folder outside it (`--workspace`)")
    name = settings.name or f"worker-{os.getpid()}"
    # after loading: the tool modules' own files are protected too (taken at the first write)
    policy = sandbox_policy(settings)
    jail = _sandbox_report(settings, policy)
    settings = msgspec.structs.replace(settings, name=name, sandbox=jail)
    worker = ToolWorker(settings, tools, policy)
    # Listen before the ready line: a signal right after it must still mean "leave cleanly".
    with _stop_waiter(name, stop) as wait_for_stop:
        async with (connect(settings.hub, name=name, role="worker", curve=settings.curve) as peer,
                    anyio.create_task_group() as servers):
            await worker.attach(peer)
            await serve_mcp_servers(settings.mcp, worker, servers)
            await peer.status()  # the MCP tools' registrations are in place too
            ready = {"ready": "worker", "name": name, "tools": list(worker.served),
                     # the pid outside the sandbox's PID namespace (what a parent signals)
                     "pid": jail.pid or os.getpid(), "peer": peer.peer_id,
                     "concurrency": settings.concurrency, "sandbox": msgspec.to_builtins(jail)}
            print(json.dumps(ready), flush=True)
            log.info("%s serving %s on %s; sandbox: %s", name, ", ".join(worker.served),
                     settings.hub, describe(jail))
            task_status.started(ready)
            await wait_for_stop()
            log.info("%s leaving (%d in flight)", name, worker.inflight)
            await worker.leave()
            servers.cancel_scope.cancel()  # stops the MCP servers (their calls ended in leave())


def _sandbox_report(settings: WorkerSettings, policy: SandboxPolicy) -> SandboxInfo:
    """The worker's sandbox, with how its shell calls are contained (probed now, not at the
    first call): a shell without a sandbox of its own has the worker's network, whatever the
    group's `network` says, and is shown so."""
    jail = settings.sandbox or SandboxInfo(kind="none", reason="not started by `busctl worker`")
    if not settings.allow_shell:
        return jail
    nested = bool(policy.shell_prefix)
    return msgspec.structs.replace(jail, shell="bwrap" if nested else "process-group",
                                   shell_network=policy.shell_network or not nested)


@contextlib.contextmanager
def _stop_waiter(name: str, stop: anyio.Event | None) -> Iterator[Callable[[], Awaitable[None]]]:
    """A wait for `stop`; without one, for the first SIGINT/SIGTERM (listened for from here on)."""
    if stop is not None:
        yield stop.wait
        return
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:

        async def first_signal() -> None:
            async for signum in signals:
                log.info("%s: got signal %d", name, signum)
                return

        yield first_signal
