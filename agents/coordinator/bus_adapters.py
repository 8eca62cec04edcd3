"""The loop's injected interfaces implemented over the bus: the model through `llm`, tools through
`tool.<name>` services (plus the agent's own built-in `tool_output`).

    llm = BusLlmClient(peer)                          # LlmClient over the gateway(s)
    tools = AgentTools(BusToolExecutor(peer), ["*"], store)   # ToolExecutor for one agent

Neither raises for bus or provider failures: a dead gateway, a lost hub, a deadline or a handler
error becomes an `AssistantMessage(stop_reason="error")` whose `error` names the gateway problem;
tool failures are error results (see `tools.executor`). Only anyio cancellation propagates, and
leaving a request cancels it at the hub, which tells the gateway (it closes the HTTP stream) or
the worker (the tool's cancellation signal fires).

The gateway publishes the streamed deltas (`message_update`) itself under the request's agent,
run and experiment, so `BusLlmClient` never calls `on_delta`. It also sends them to the requester
as partial replies: `BusLlmClient` keeps them (raw; assembled only on abort), so an aborted
call (`abort` set) returns what streamed so far — text, thinking, tool calls, under the model in
use — as the aborted message, and `context_window(model)` reports the window the gateway learned
from the server.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import anyio
import msgspec

from agent_bus.agents.gateway.providers.base import MessageBuilder
from agent_bus.agents.gateway.wire import LlmPartial
from agent_bus.agents.loop.abort import Abort
from agent_bus.agents.loop.context import TOOL_OUTPUT_TOOL, ToolOutputStore, estimate_usage
from agent_bus.agents.loop.run import ABORTED_TEXT, DeltaSink, ToolExecutor, UpdateSink
from agent_bus.bus import protocol as p
from agent_bus.bus.backoff import Backoff
from agent_bus.bus.client import Peer
from agent_bus.bus.errors import (
    DeadlineExceeded,
    HubLost,
    NoService,
    Overloaded,
    PeerLost,
    RequestError,
)
from agent_bus.bus.messages import (
    AssistantDelta,
    AssistantMessage,
    LlmRequest,
    LlmTrace,
    RunWorkspace,
    ToolCallRequest,
    ToolInfo,
    ToolResult,
    ToolTrace,
    error_result,
)
from agent_bus.bus.toolnames import parameters_fault, tool_name_fault
from agent_bus.tools.executor import BusToolExecutor

LLM_SERVICE = "llm"
#: Deadline of one model call; None = none. The call still always ends: the gateway bounds each
#: provider attempt (its own timeouts and retries), a dead gateway is answered by the hub with
#: `peer_lost`, a lost hub fails the request, and abort cancels it. Without a deadline the hub
#: also answers `no_service` at once when no gateway is attached (a request with a deadline
#: would wait in the hub's queue for one until the deadline).
LLM_TIMEOUT: float | None = None
#: When no gateway serves `llm`, wait this long for one to attach (e.g. one being restarted, or
#: started alongside the coordinator) before the call fails.
SERVICE_WAIT = 3.0
#: Polls of the hub's registry while waiting for the service: 0.05 s doubling to 0.5 s.
SERVICE_POLL = Backoff(first=0.05, factor=2.0, cap=0.5, jitter=0.0)


#: Told of a live tool an agent does not offer: (tool name, why).
SkipSink = Callable[[str, str], Awaitable[None]]

_encoder = msgspec.msgpack.Encoder()
_reply_decoder = msgspec.msgpack.Decoder(AssistantMessage | LlmPartial)
_partial_decoder = msgspec.msgpack.Decoder(LlmPartial)


class _Streamed:
    """What the gateway streamed of one call so far, kept as the raw partial replies.

    They are decoded and assembled only if the call is aborted: a finished call's reply holds
    all of it, so a streamed delta costs the coordinator a list append, not a decode and a
    builder step (~20 deltas per reply)."""

    def __init__(self, request: LlmRequest) -> None:
        self.request = request
        self.model = request.model
        self.bodies: list[bytes] = []

    def aborted(self) -> AssistantMessage:
        # Tool calls are kept: their arguments may be cut off, but the loop closes them with an
        # "aborted" result, and the record shows what the model was about to do.
        builder, model, provider = MessageBuilder(), self.model, ""
        for body in self.bodies:
            try:
                partial = _partial_decoder.decode(body)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue  # an unreadable partial of a call given up anyway: skipped
            if partial.reset:  # the gateway retried: what streamed before is void
                builder = MessageBuilder()
            model, provider = partial.model or model, partial.provider or provider
            _add_delta(builder, partial.delta)
        content = builder.content()
        # No usage came (the gateway sends it with the final reply): what streamed was billed
        return AssistantMessage(content=content, stop_reason="aborted",
                                usage=estimate_usage(self.request, content), model=model,
                                provider=provider, error=ABORTED_TEXT)


def _add_delta(builder: MessageBuilder, delta: AssistantDelta | None) -> None:
    if delta is None:
        return
    key = ("part", delta.index)
    if delta.kind == "tool_call" and not builder.has(key):
        builder.open(key, "tool_call", delta.tool_call_id, delta.tool_name)
    elif delta.kind == "tool_call":
        builder.update_call(key, delta.tool_call_id, delta.tool_name)
    builder.add(key, delta.kind, delta.delta)


def _gateway_error(exc: RequestError, hub: str, timeout: float | None) -> str:
    """A sentence a user can act on, naming the gateway problem."""
    detail = str(exc)
    if isinstance(exc, NoService):
        return (f"No LLM gateway is serving `{LLM_SERVICE}` on the hub at {hub} "
                f"(start one with `busctl gateway`, or `busctl up`): {detail}")
    if isinstance(exc, PeerLost):
        return f"The LLM gateway was lost while answering the request: {detail}"
    if isinstance(exc, HubLost):
        return f"Lost the hub at {hub} while waiting for the LLM gateway: {detail}"
    if isinstance(exc, DeadlineExceeded):
        return f"The LLM gateway did not answer in time ({timeout or 0:g}s): {detail}"
    if isinstance(exc, Overloaded):
        return f"The LLM gateway is overloaded: {detail}"
    return f"The LLM gateway failed to answer ({exc.code or 'error'}): {detail}"


class BusLlmClient:
    """`LlmClient` over the `llm` service.

    `agent`, `run_id` (normally set by the loop) and `experiment` are filled in on each request
    when empty, so the gateway tags the `message_update` events it publishes; `trace_root` (the
    top-level run of an asked run's tree) goes in the request's `trace`, so the gateway's
    `traceparent` puts the call in that run's trace.
    """

    def __init__(self, peer: Peer, *, agent: str = "", experiment: str = "",
                 timeout: float | None = LLM_TIMEOUT, service: str = LLM_SERVICE,
                 service_wait: float = SERVICE_WAIT) -> None:
        self.peer = peer
        self.agent = agent
        self.experiment = experiment  # the coordinator sets it per run
        self.trace_root = ""  # the coordinator sets it per run ("": the run is its tree's top)
        self.timeout = timeout
        self.service = service
        self.service_wait = service_wait
        self.windows: dict[str, int] = {}  # model alias ("" = default) -> window the gateway reported

    def context_window(self, model: str) -> int:
        """The context window of `model` as the gateway last reported it; 0 when not known yet."""
        return self.windows.get(model, 0)

    async def complete(self, request: LlmRequest, on_delta: DeltaSink | None = None, *,
                       abort: Abort | None = None) -> AssistantMessage:
        changes: dict[str, Any] = {}
        if not request.agent and self.agent:
            changes["agent"] = self.agent
        if not request.experiment and self.experiment:
            changes["experiment"] = self.experiment
        trace = request.trace or LlmTrace()
        if self.trace_root and not trace.root_run_id:
            changes["trace"] = msgspec.structs.replace(trace, root_run_id=self.trace_root)
        if changes:
            request = msgspec.structs.replace(request, **changes)
        streamed = _Streamed(request)
        body = _encoder.encode(request)
        if abort is None:
            return await self._call_with_wait(request, body, streamed)
        with abort.cancels():  # set: leave the stream (the hub cancels the call at the gateway)
            return await self._call_with_wait(request, body, streamed)
        return streamed.aborted()

    async def _call_with_wait(self, request: LlmRequest, body: bytes,
                              streamed: _Streamed) -> AssistantMessage:
        try:
            try:
                return await self._call(request, body, streamed)
            except NoService:
                if not await self._wait_for_service():
                    raise
                return await self._call(request, body, streamed)
        except RequestError as exc:
            return _error(request, _gateway_error(exc, self.peer.hub, self.timeout))

    async def _call(self, request: LlmRequest, body: bytes, streamed: _Streamed) -> AssistantMessage:
        bodies = streamed.bodies
        bodies.clear()  # a resend after `no_service`: nothing streamed on the first try
        # keyed: a call the hub lost mid-way is sent again on the next hub, and the gateway
        # answers the repeat from the call it made (no second model call; bus/keyed.py)
        async with self.peer.stream(self.service, body, timeout=self.timeout,
                                    key=p.new_id()) as replies:
            async for item in replies:
                # Only the first partial is read now: it describes the model (its context
                # window); the rest wait in `streamed` (see `_Streamed`).
                if not bodies:
                    problem = self._first(request, item)
                    if problem is not None:
                        return problem
                bodies.append(item)
        if not bodies:
            return _error(request, "The LLM gateway ended the call without a reply")
        try:  # the stream ended with the final reply
            decoded = _reply_decoder.decode(bodies.pop())
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return _error(request, f"The LLM gateway sent an unreadable reply: {exc}")
        if isinstance(decoded, AssistantMessage):
            return decoded
        return _error(request, "The LLM gateway ended the call without a reply")

    def _first(self, request: LlmRequest, item: bytes) -> AssistantMessage | None:
        """Check the first reply of a call and learn the model's window from it; an error
        message when it is unreadable."""
        try:
            decoded = _reply_decoder.decode(item)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return _error(request, f"The LLM gateway sent an unreadable reply: {exc}")
        if isinstance(decoded, LlmPartial) and decoded.context_window:
            self.windows[request.model] = decoded.context_window
        return None

    async def _wait_for_service(self) -> bool:
        """Poll the hub's registry until a peer serves the service, up to `service_wait` s."""
        with anyio.move_on_after(self.service_wait):  # bounds the status requests too
            for delay in SERVICE_POLL.delays():
                await anyio.sleep(delay)
                try:
                    status = await self.peer.status()
                except RequestError:
                    continue
                if any(s.name == self.service and s.peers > 0 for s in status.services):
                    return True
        return False


def _error(request: LlmRequest, text: str) -> AssistantMessage:
    return AssistantMessage(content=[], stop_reason="error", error=text, model=request.model)


class LocalTools(Protocol):
    """Tools served inside the coordinator (e.g. `ask_<agent>`, `publish`; see `multiagent`)."""

    def handles(self, name: str) -> bool: ...

    async def catalog(self) -> list[ToolInfo]: ...

    async def execute(self, request: ToolCallRequest) -> ToolResult: ...


class AgentTools:
    """One agent's view of the tools: its allowed subset of the live bus tools, its local tools
    (`local`: other agents as `ask_<agent>`, the `publish` tool) and `tool_output`.

    `allowed` is the agent's `tools` list: `["*"]` offers every live tool, otherwise only the
    named ones (a named tool that no worker serves is simply not offered). Local tools are
    always offered and shadow a worker tool of the same name. The built-in `tool_output` tool
    (full text of truncated or trimmed outputs) is served from the agent's `ToolOutputStore` in
    this process whenever the agent has any tools at all. Calls get the run's `experiment` so
    workers tag their progress events with it, and `trace_root` (the top-level run of an asked
    run's tree) in their `trace`, so the worker's `traceparent` puts the tool in that run's trace,
    and the run's `workspace` (if its prompt gave one), so the worker runs them in its folder and
    `ask_<agent>` prompts the callee with it.

    Progress: partial results go to the loop, which emits each as a `tool_execution_update`
    and the coordinator publishes it with the call's other events: so the progress of any tool,
    ours or a foreign peer's, is in the log, and no tool service publishes it itself.

    A live tool whose name or schema no model API takes (bus/toolnames.py; from an older hub
    that did not check them, or a foreign peer's malformed `meta`) is never offered: `on_skipped`
    (the coordinator publishes a `tool_skipped` event) hears of it once per name and reason
    (`told` may be shared by the sessions of one agent).
    """

    def __init__(self, inner: ToolExecutor, allowed: Sequence[str], store: ToolOutputStore, *,
                 experiment: str = "", local: Sequence[LocalTools] = (),
                 on_skipped: SkipSink | None = None,
                 told: set[tuple[str, str]] | None = None) -> None:
        self.inner = inner
        self.on_skipped = on_skipped
        self.told = told if told is not None else set()
        self.allowed = list(allowed)
        self.store = store
        self.local = list(local)
        self.experiment = experiment  # the coordinator sets it per run
        self.trace_root = ""  # the coordinator sets it per run ("": the run is its tree's top)
        self.workspace: RunWorkspace | None = None  # the run's own folder (set per run)
        self._all = "*" in self.allowed
        self._names = frozenset(self.allowed)

    @property
    def offers_tool_output(self) -> bool:
        return bool(self.allowed) or bool(self.local)

    def _local_for(self, name: str) -> LocalTools | None:
        for provider in self.local:
            if provider.handles(name):
                return provider
        return None

    def allows(self, name: str) -> bool:
        if name == TOOL_OUTPUT_TOOL:
            return self.offers_tool_output
        return self._local_for(name) is not None or self._all or name in self._names

    async def catalog(self) -> list[ToolInfo]:
        if not self.offers_tool_output:
            return []
        local: list[ToolInfo] = []
        for provider in self.local:
            local.extend(await provider.catalog())
        shadowed = {t.name for t in local} | {TOOL_OUTPUT_TOOL}
        live: list[ToolInfo] = []
        if self.allowed:
            skipped = dict(self.inner.skipped) if isinstance(self.inner, BusToolExecutor) else {}
            for t in await self.inner.catalog():
                if t.name in shadowed or not (self._all or t.name in self._names):
                    continue
                why = tool_name_fault(t.name) or parameters_fault(t.parameters)
                if why:
                    skipped[t.name] = why
                else:
                    live.append(t)
            await self._tell_skipped(skipped)
        return [*live, *local, self.store.tool_info()]

    async def _tell_skipped(self, skipped: dict[str, str]) -> None:
        for name, why in skipped.items():
            if (name, why) in self.told or not (self._all or name in self._names):
                continue
            self.told.add((name, why))
            if self.on_skipped is not None:
                await self.on_skipped(name, why)

    async def execute(self, request: ToolCallRequest, on_update: UpdateSink | None = None) -> ToolResult:
        if not self.allows(request.name):
            return error_result(f"Error: Unknown tool '{request.name}'")
        if request.name == TOOL_OUTPUT_TOOL:
            return await self.store.handle(request)
        if not request.experiment and self.experiment:
            request = msgspec.structs.replace(request, experiment=self.experiment)
        if self.trace_root and not (request.trace and request.trace.root_run_id):
            request = msgspec.structs.replace(request, trace=ToolTrace(self.trace_root))
        if self.workspace is not None and request.workspace is None:
            request = msgspec.structs.replace(request, workspace=self.workspace)
        provider = self._local_for(request.name)
        if provider is not None:
            return await provider.execute(request)
        return await self.inner.execute(request, on_update)


__all__ = ["LLM_SERVICE", "LLM_TIMEOUT", "AgentTools", "BusLlmClient", "LocalTools"]
