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
Each progress update is also published as a `ToolExecutionUpdate` event carrying the request's
agent, run and experiment.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Literal, Union

import anyio
import anyio.abc
import msgspec
import zmq

from bus import protocol as p
from bus.client import Handler, IncomingRequest, Peer, connect
from bus.errors import HubLost, RequestError
from bus.events import ToolExecutionUpdate
from bus.messages import ToolCallRequest, ToolResult
from bus.paths import inside_state_dir
from bus.security import CurveClient
from tools._exceptions import ToolLoadError
from tools._loader import load_tools
from tools._runner import CANCEL_GRACE, run_tool
from tools._schema import check_provider_schema
from tools._tool import Tool

log = logging.getLogger("tools.worker")

SERVICE_PREFIX = "tool."
#: Seconds in-flight calls get to finish after SIGINT/SIGTERM before they are cancelled.
SHUTDOWN_GRACE = 2.0

#: A partial reply body: `("progress", partial ToolResult)`.
Progress = tuple[Literal["progress"], ToolResult]
_reply_decoder = msgspec.msgpack.Decoder(Union[ToolResult, Progress])
_call_decoder = msgspec.msgpack.Decoder(ToolCallRequest)


class WorkerSettings(msgspec.Struct, kw_only=True):
    """What `busctl worker` passes to `run_worker`."""

    hub: str
    tool_modules: list[str] = msgspec.field(default_factory=lambda: ["tools.builtin"])
    concurrency: int = 8
    workspace: str = "."
    name: str = ""  # default: worker-<pid>
    allow_shell: bool = False
    curve: CurveClient | None = None
    shutdown_grace: float = SHUTDOWN_GRACE


# --- reply codec (shared with tools.executor) ----------------------------------------------


def service_name(tool_name: str) -> str:
    return SERVICE_PREFIX + tool_name


def encode_progress(partial: ToolResult) -> bytes:
    return p.encode(("progress", partial))


def decode_reply(body: bytes) -> ToolResult | Progress:
    """A reply body of a tool service: the final `ToolResult`, or a `("progress", partial)`.

    Raises msgspec.DecodeError / ValidationError for anything else.
    """
    return _reply_decoder.decode(body)


# --- loading -------------------------------------------------------------------------------


def load_worker_tools(modules: list[str]) -> list[Tool]:
    """Load every module's tools; refuse duplicate names and schemas providers would reject.

    Raises ToolLoadError naming the module (import failure, no tools) or the tool (schema, clash).
    """
    if not modules:
        raise ToolLoadError("No tool modules given: pass at least one `--tools MODULE`")
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
    """Serves a fixed set of tools on one peer. `attach()`, then `leave()` when done."""

    def __init__(self, settings: WorkerSettings, tools: list[Tool]) -> None:
        if settings.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {settings.concurrency}")
        self.settings = settings
        self.tools = {t.name: t for t in tools}
        self.workspace = Path(settings.workspace).resolve()
        self.peer: Peer | None = None
        self._slots = anyio.Semaphore(settings.concurrency)
        self._threads = anyio.CapacityLimiter(settings.concurrency)
        self._inflight: dict[str, anyio.CancelScope] = {}
        self._idle = anyio.Event()
        self._idle.set()

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    async def attach(self, peer: Peer) -> None:
        """Register `tool.<name>` for every tool; returns once the hub has them."""
        self.peer = peer
        for t in self.tools.values():
            await peer.serve(service_name(t.name), self._handler(t),
                             capacity=self.settings.concurrency, idempotent=t.idempotent,
                             meta=msgspec.to_builtins(t.info))
        await peer.status()  # same connection, in order: the registrations are in place

    async def leave(self, grace: float | None = None) -> None:
        """Unregister, give in-flight calls `grace` s, cancel the rest, wait for their replies."""
        grace = self.settings.shutdown_grace if grace is None else grace
        await self._unregister()
        with anyio.move_on_after(grace):
            await self._idle.wait()
        if self._inflight:
            log.warning("%s: cancelling %d call(s) still running after %.1fs",
                        self.settings.name, len(self._inflight), grace)
            for scope in list(self._inflight.values()):
                scope.cancel()
            with anyio.move_on_after(CANCEL_GRACE + 0.5):
                await self._idle.wait()
        await self._flush()  # the last replies reach the hub before the socket closes

    async def _unregister(self) -> None:
        peer = self.peer
        if peer is None or peer.welcome is None:  # not connected: the hub forgot us anyway
            return
        with anyio.move_on_after(1):
            try:
                for t in self.tools.values():
                    await peer.unserve(service_name(t.name))
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
        call = _decode_call(t, req.body)
        scope = anyio.CancelScope()
        self._inflight[req.id] = scope
        self._idle = anyio.Event() if self._idle.is_set() else self._idle
        try:
            with scope:
                try:  # a free slot is taken at once (`acquire` would yield to the loop first)
                    self._slots.acquire_nowait()
                except anyio.WouldBlock:
                    await self._slots.acquire()
                try:
                    result = await run_tool(
                        t, call, workspace=self.workspace, allow_shell=self.settings.allow_shell,
                        on_progress=self._progress_sink(t, call, req), limiter=self._threads,
                    )
                finally:
                    self._slots.release()
                return p.encode(result)
        finally:
            del self._inflight[req.id]
            if not self._inflight:
                self._idle.set()
        # only reached when `leave()` cancelled the call
        raise RequestError(
            f"worker `{self.settings.name}` shut down while running `{t.name}`", p.PEER_LOST
        )

    def _progress_sink(
        self, t: Tool, call: ToolCallRequest, req: IncomingRequest
    ) -> Callable[[ToolResult], Awaitable[None]]:
        async def on_progress(partial: ToolResult) -> None:
            peer = self.peer
            if peer is None:
                return
            update = ToolExecutionUpdate(tool_call_id=call.call_id, tool_name=t.name,
                                         partial=partial)
            try:
                await req.partial(encode_progress(partial))
                await peer.publish(update, agent=call.agent, run=call.run_id,
                                   experiment=call.experiment)
            except (HubLost, zmq.ZMQError) as exc:  # the call's reply is lost too; drop it
                log.debug("progress of %s dropped: %s", call.call_id, exc)

        return on_progress


def _decode_call(t: Tool, body: bytes) -> ToolCallRequest:
    try:
        return _call_decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise RequestError(
            f"Malformed request to `{service_name(t.name)}`: expected a msgpack ToolCallRequest "
            f"({exc})", p.BAD_REQUEST,
        ) from None


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
    tools = load_worker_tools(list(settings.tool_modules))
    if not Path(settings.workspace).is_dir():
        raise ToolLoadError(f"Workspace `{settings.workspace}` is not a directory")
    state = inside_state_dir(Path(settings.workspace).resolve())
    if state is not None:
        raise ToolLoadError(f"Workspace `{settings.workspace}` is inside the bus's state directory "
                            f"`{state}`; choose a folder outside it (`--workspace`)")
    name = settings.name or f"worker-{os.getpid()}"
    settings = msgspec.structs.replace(settings, name=name)
    worker = ToolWorker(settings, tools)
    # Listen before the ready line: a signal right after it must still mean "leave cleanly".
    with (anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) if stop is None
          else contextlib.nullcontext()) as signals:
        async with connect(settings.hub, name=name, role="worker", curve=settings.curve) as peer:
            await worker.attach(peer)
            ready = {"ready": "worker", "name": name, "tools": list(worker.tools),
                     "pid": os.getpid(), "peer": peer.peer_id,
                     "concurrency": settings.concurrency}
            print(json.dumps(ready), flush=True)
            log.info("%s serving %s on %s", name, ", ".join(worker.tools), settings.hub)
            task_status.started(ready)
            if stop is not None:
                await stop.wait()
            else:
                async for signum in signals:
                    log.info("%s: got signal %d", name, signum)
                    break
            log.info("%s leaving (%d in flight)", name, worker.inflight)
            await worker.leave()
