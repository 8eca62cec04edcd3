"""`BusToolExecutor`: the agent loop's `ToolExecutor` over the bus (services `tool.<name>`).

    async with connect(hub, name="coordinator") as peer:
        tools = BusToolExecutor(peer)
        specs = [t.spec() for t in await tools.catalog()]
        result = await tools.execute(ToolCallRequest(call_id="c1", name="read_file",
                                                     arguments='{"path": "README.md"}'))

Calls with a run `workspace` stick to one worker: the first call of a workspace is answered by
some worker, and its later calls (of any tool it serves; other tools stick to the worker of
their first call) `prefer` that one, which the hub honours while it serves the tool and has a
free slot (docs/protocol.md, "Run workspaces"), so a file one call writes is there for the next
even when the tool's workers have different workspaces.

A call waits at the hub for a worker of its tool at most `server_wait` (header `wait`; 30 s)
while none serves it: a call made from the cached catalog after the tool's last worker left ends
as an unknown tool then, not at the tool's timeout; a worker restarting within it serves it.

Tool failures never raise: they come back as `is_error` results (unknown tool, bad arguments,
worker lost, timeout, hub lost, an exception in the tool). Only anyio cancellation propagates;
leaving the request cancels it at the hub, which tells the worker, which cancels the tool.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Any, Literal

import anyio
import msgspec

from agent_bus.bus import protocol as p
from agent_bus.bus.client import Peer
from agent_bus.bus.errors import (
    DeadlineExceeded,
    HubLost,
    NoService,
    Overloaded,
    PeerLost,
    RequestError,
)
from agent_bus.bus.messages import ToolCallRequest, ToolInfo, ToolResult, error_result
from agent_bus.bus.rpc import Replies
from agent_bus.bus.toolnames import STRUCTURED_META, tool_meta_fault, tool_name_fault
from agent_bus.tools._calls import SERVICE_PREFIX, service_name
from agent_bus.tools.worker import decode_reply

log = logging.getLogger("tools.executor")

#: How long a fetched catalog is reused.
CATALOG_TTL = 1.0
#: Request timeout for tools that declare none.
DEFAULT_TIMEOUT = 600.0
#: Added to a tool's own timeout (the worker enforces that one and answers with a result).
TIMEOUT_MARGIN = 5.0
#: How long a call waits at the hub for a worker of its tool when none serves it (header `wait`):
#: long enough for a supervised worker to restart, and the bound on a call made from a catalog
#: fetched before the tool's last worker left (it fails as an unknown tool, not at its timeout).
SERVER_WAIT = 30.0
#: Workspaces whose worker is remembered while no run holds them (`hold_workspace`; an executor
#: used outside a coordinator): at most this many, the oldest forgotten first.
AFFINITY_LIMIT = 4096
#: Workers remembered per workspace (its first, then one per set of tools the others lack).
MAX_WORKSPACE_WORKERS = 8

UpdateSink = Callable[[Any], Awaitable[None]]
BatchMode = Literal["parallel", "sequential"]


class BusToolExecutor:
    """Runs tool calls on whichever workers serve them; see the module docstring."""

    def __init__(
        self,
        peer: Peer,
        *,
        catalog_ttl: float = CATALOG_TTL,
        default_timeout: float = DEFAULT_TIMEOUT,
        timeout_margin: float = TIMEOUT_MARGIN,
        affinity_limit: int = AFFINITY_LIMIT,
        server_wait: float = SERVER_WAIT,
    ) -> None:
        self.peer = peer
        self.catalog_ttl = catalog_ttl
        self.server_wait = server_wait
        self.default_timeout = default_timeout
        self.timeout_margin = timeout_margin
        self.affinity_limit = affinity_limit
        self._catalog: dict[str, ToolInfo] = {}
        self._fetched = -math.inf
        self._lock = anyio.Lock()
        #: Live tools left out of the catalog (name -> why), as of the last fetch.
        self.skipped: dict[str, str] = {}
        #: Live tools whose map `details` is structured output for clients (`STRUCTURED_META`).
        self.structured: set[str] = set()
        self._logged: set[tuple[str, str]] = set()
        # Run workspaces: for each, the peer ids of its workers (the first that answered one
        # of its calls; then, for tools none of those serve, the first that answered one of
        # them); the runs holding each; the calls in flight that prefer no worker (a call that
        # would prefer none waits for it, so a turn's parallel first calls land on one worker
        # too); the live peers' services, as of the last catalog fetch.
        self._affinity: dict[str, list[str]] = {}
        self._holds: dict[str, int] = {}
        self._first: dict[str, anyio.Event] = {}
        self._serves: dict[str, set[str]] = {}

    # --- catalog -------------------------------------------------------------------------

    async def catalog(self) -> list[ToolInfo]:
        """The live tools, sorted by name (fetched from the hub at most every `catalog_ttl` s).

        Raises a bus error only when the hub cannot be asked and nothing was fetched before.
        """
        return sorted((await self._tools()).values(), key=lambda t: t.name)

    async def _tools(self, *, refresh: bool = False) -> dict[str, ToolInfo]:
        if not refresh and time.monotonic() - self._fetched < self.catalog_ttl:
            return self._catalog  # fresh: no lock (taking it yields to the loop once per call)
        async with self._lock:
            fresh = time.monotonic() - self._fetched < self.catalog_ttl
            if fresh and not refresh:
                return self._catalog
            try:
                status = await self.peer.status()
            except RequestError:
                if self._fetched == -math.inf:
                    raise
                return self._catalog  # stale beats nothing while the hub is away
            self._catalog, self.skipped = {}, {}
            self.structured = {s.name[len(SERVICE_PREFIX):] for s in status.services
                               if s.name.startswith(SERVICE_PREFIX)
                               and s.meta.get(STRUCTURED_META) is True}
            self._serves = {peer.peer: {load.name for load in peer.services}
                            for peer in status.peers}
            for service in status.services:
                info = _tool_info(service)
                if isinstance(info, ToolInfo):
                    self._catalog[info.name] = info
                elif info is not None:
                    self._skip(service.name[len(SERVICE_PREFIX):], info)
            self._fetched = time.monotonic()
            return self._catalog

    def _skip(self, name: str, why: str) -> None:
        self.skipped[name] = why
        if (name, why) not in self._logged:  # once per tool and reason, not per fetch
            self._logged.add((name, why))
            log.warning("live tool %r is not offered to models: %s", name, why)

    async def _lookup(self, name: str) -> ToolInfo | None:
        tools = await self._tools()
        if name not in tools and time.monotonic() - self._fetched > 0.05:
            tools = await self._tools(refresh=True)  # a worker may just have attached
        return tools.get(name)

    # --- one call ------------------------------------------------------------------------

    async def execute(
        self, request: ToolCallRequest, on_update: UpdateSink | None = None
    ) -> ToolResult:
        """Run one call; partial results (ToolResult) go to `on_update`. Never raises but for
        cancellation (see the module docstring)."""
        name = request.name
        try:
            info = await self._lookup(name)
        except RequestError as exc:
            return error_result(f"Error: cannot reach the hub to run '{name}': {exc}")
        if info is None:
            return unknown_tool(name)
        problem = arguments_problem(request)
        if problem is not None:
            return problem
        timeout = self.timeout_for(info)
        try:
            return await self._call_with_retry(request, timeout, on_update)
        except NoService:
            return unknown_tool(name)
        except PeerLost as exc:
            return error_result(f"Error: worker lost while running '{name}': {exc}")
        except (DeadlineExceeded, TimeoutError):
            return error_result(f"Tool '{name}' timed out after {timeout:g}s")
        except HubLost as exc:
            return error_result(f"Error: lost the hub while running '{name}' (the call may "
                                f"or may not have run): {exc}")
        except Overloaded as exc:
            return error_result(f"Error: tool '{name}' is overloaded: {exc}")
        except RequestError as exc:
            return error_result(f"Error: {exc}")

    async def _call_with_retry(
        self, request: ToolCallRequest, timeout: float, on_update: UpdateSink | None
    ) -> ToolResult:
        """`_call`, once more if a worker that was leaving refused it (`no_service`: it never ran)
        while the tool is still served elsewhere."""
        try:
            return await self._call(request, timeout, on_update)
        except NoService:
            if request.name not in await self._tools(refresh=True):
                raise
        return await self._call(request, timeout, on_update)

    def timeout_for(self, info: ToolInfo) -> float:
        if info.timeout is None:
            return self.default_timeout
        return info.timeout + self.timeout_margin

    async def _call(
        self, request: ToolCallRequest, timeout: float, on_update: UpdateSink | None
    ) -> ToolResult:
        if request.workspace is not None:
            return await self._call_in_workspace(request, request.workspace.id, timeout,
                                                 on_update)
        body = p.encode(request)
        # keyed: a call the hub lost mid-way is sent again on the next hub, and the worker
        # answers the repeat from the call it ran (never run twice there; bus/keyed.py)
        async with self.peer.stream(service_name(request.name), body, timeout=timeout,
                                    wait=self.server_wait, key=p.new_id()) as replies:
            return await self._result(request, replies, on_update)

    async def _result(self, request: ToolCallRequest, replies: Replies,
                      on_update: UpdateSink | None) -> ToolResult:
        async for reply in replies:
            try:
                decoded = decode_reply(reply)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                return error_result(f"Error: the worker for '{request.name}' sent an "
                                    f"unreadable reply: {exc}")
            if isinstance(decoded, ToolResult):
                return decoded
            if on_update is not None:
                await on_update(decoded[1])
        return error_result(f"Error: the worker for '{request.name}' sent no result")

    # --- run workspaces: one worker per workspace ----------------------------------------

    async def _call_in_workspace(self, request: ToolCallRequest, workspace: str, timeout: float,
                                 on_update: UpdateSink | None) -> ToolResult:
        """`_call` preferring the worker that serves `workspace` (see `_prefer`). A call that
        would prefer none picks one: calls in need of one meanwhile wait for its answer."""
        service = service_name(request.name)
        prefer = self._prefer(workspace, service)
        while not prefer and workspace in self._first:
            await self._first[workspace].wait()
            prefer = self._prefer(workspace, service)
        mine = None
        if not prefer:
            mine = self._first[workspace] = anyio.Event()
        try:
            async with self.peer.stream(service, p.encode(request), timeout=timeout,
                                        prefer=prefer, wait=self.server_wait,
                                        key=p.new_id()) as replies:
                result = await self._result(request, replies, on_update)
                self._served(workspace, prefer, replies.served_by)
                return result
        finally:
            if mine is not None:
                del self._first[workspace]
                mine.set()

    def _prefer(self, workspace: str, service: str) -> str:
        """The first of `workspace`'s workers that serves `service` (or that joined since the
        last catalog fetch: the hub ignores a `prefer` that does not serve it); "" when none."""
        serves = self._serves
        for peer in self._affinity.get(workspace, ()):
            served = serves.get(peer)
            if served is None or service in served:
                return peer
        return ""

    def _served(self, workspace: str, prefer: str, server: str) -> None:
        """`server` answered a call of `workspace` that preferred `prefer`: a worker of the
        workspace from now on when it preferred none; in place of the preferred one when that
        one is gone; nothing when that one is live (it was only full: the workspace stays)."""
        if not server or server == prefer or (prefer and prefer in self._serves):
            return
        affinity = self._affinity
        peers = affinity.get(workspace)
        if peers is None:
            affinity[workspace] = [server]
            if len(affinity) > self.affinity_limit + len(self._holds):
                for name in affinity:  # the oldest no run holds
                    if name not in self._holds:
                        del affinity[name]
                        break
        elif prefer:  # gone (unless another call has dealt with it already)
            if prefer in peers and server in peers:
                peers.remove(prefer)
            elif prefer in peers:
                peers[peers.index(prefer)] = server
        elif server not in peers and len(peers) < MAX_WORKSPACE_WORKERS:
            peers.append(server)

    def worker_of(self, workspace: str, tool: str = "") -> str:
        """The peer id of the worker `workspace`'s calls prefer (of `tool`, given; else its
        first worker); "" when none yet."""
        if tool:
            return self._prefer(workspace, service_name(tool))
        return next(iter(self._affinity.get(workspace, ())), "")

    def hold_workspace(self, workspace: str) -> None:
        """A run with this workspace starts: keep its worker until `release_workspace`."""
        self._holds[workspace] = self._holds.get(workspace, 0) + 1

    def release_workspace(self, workspace: str) -> None:
        """A run with this workspace ended: the last one forgets its worker."""
        held = self._holds.get(workspace, 0) - 1
        if held > 0:
            self._holds[workspace] = held
            return
        self._holds.pop(workspace, None)
        self._affinity.pop(workspace, None)

    # --- batches -------------------------------------------------------------------------

    async def execute_batch(
        self,
        requests: Sequence[ToolCallRequest],
        mode: BatchMode = "parallel",
        on_update: Callable[[int, Any], Awaitable[None]] | None = None,
    ) -> AsyncGenerator[tuple[int, ToolResult], None]:
        """Yield `(index, result)` as calls complete: all started at once ("parallel", in call
        order) or one after the other ("sequential").

        Consume it to the end, or close it in the task that iterates it
        (`async with contextlib.aclosing(...)`): leaving early cancels the calls still running.
        """
        if mode == "sequential":
            for index, request in enumerate(requests):
                yield index, await self.execute(request, _bind(on_update, index))
            return
        if mode != "parallel":
            raise ValueError(f"mode must be 'parallel' or 'sequential', got {mode!r}")
        send, receive = anyio.create_memory_object_stream[tuple[int, ToolResult]](len(requests))

        async def run_one(index: int, request: ToolCallRequest) -> None:
            result = await self.execute(request, _bind(on_update, index))
            send.send_nowait((index, result))  # buffer holds one per request: never blocks

        async with send, receive, anyio.create_task_group() as tg:
            for index, request in enumerate(requests):
                tg.start_soon(run_one, index, request)
            for _ in requests:
                yield await receive.receive()

    async def execute_all(
        self,
        requests: Sequence[ToolCallRequest],
        mode: BatchMode = "parallel",
        on_update: Callable[[int, Any], Awaitable[None]] | None = None,
    ) -> list[ToolResult]:
        """Like `execute_batch`, but return the results in call order."""
        results: list[ToolResult | None] = [None] * len(requests)
        batch = self.execute_batch(requests, mode, on_update)
        try:
            async for index, result in batch:
                results[index] = result
        finally:
            await batch.aclose()
        return [r if r is not None else error_result("Error: no result") for r in results]


# --- helpers ---------------------------------------------------------------------------------


def unknown_tool(name: str) -> ToolResult:
    return error_result(f"Error: Unknown tool '{name}'")


def arguments_problem(request: ToolCallRequest) -> ToolResult | None:
    """An error result when `arguments` is not JSON (checked before dispatch), else None."""
    text = request.arguments.strip() or "{}"
    try:
        msgspec.json.decode(text)
    except msgspec.DecodeError as exc:
        return error_result(f"Error: Invalid tool arguments JSON for {request.name}: {exc}")
    return None


def _tool_info(service: p.ServiceInfo) -> ToolInfo | str | None:
    """The live tool `service` is; None when it is none (not `tool.<name>`, or no peer serves it);
    a string saying why it is left out when no model API would take it (a name or schema from an
    older hub that did not check them, bus/toolnames.py) or its `meta` is not a ToolInfo: never
    offered with a made-up empty schema. The service name wins over `meta.name`."""
    if not service.name.startswith(SERVICE_PREFIX) or service.peers < 1:
        return None
    name = service.name[len(SERVICE_PREFIX):]
    why = tool_name_fault(name) or tool_meta_fault(service.meta)
    if why:
        return why
    try:
        return msgspec.convert({**service.meta, "name": name}, ToolInfo)
    except msgspec.ValidationError as exc:  # (tool_meta_fault checked the same fields)
        return f"its `meta` is not a ToolInfo: {exc}"


def _bind(
    on_update: Callable[[int, Any], Awaitable[None]] | None, index: int
) -> UpdateSink | None:
    if on_update is None:
        return None

    async def sink(partial: Any) -> None:
        await on_update(index, partial)

    return sink
