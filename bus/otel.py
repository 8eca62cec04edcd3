"""`busctl otel`: the event stream as OpenTelemetry GenAI spans (semantic conventions), OTLP/HTTP.

A subscriber beside `busctl watch` (same replay-then-live stream, no hole, no duplicate) that
rebuilds each run after the fact from its events' hub timestamps:

    invoke_agent {agent}     one per run (a sub-agent's run: under the tool call that asked it)
    ├── chat {model}         one per model call (assistant message_start .. message_end)
    └── execute_tool {tool}  one per tool call (tool_execution_start .. tool_execution_end)

A trace is exported when its top-level run ends: only then is every sub-agent run's place known
(the `ask_<agent>` tool result names the callee's run id). Ids are derived from run ids and tool
call ids, so a trace exported twice (after a restart) has the same trace and span ids.

Delivery: spans wait in a bounded buffer while the collector is down (the oldest traces are dropped
past `max_spans`, and counted); the exporter runs in a thread, so a slow collector never slows the
subscription. The seq up to which every event is either exported or irrelevant is saved in the
state file after each successful export; a restart subscribes from there.
Needs the optional extra `otel` (`pip install 'agent-bus[otel]'`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import msgspec

from agent_bus.bus import events as ev
from agent_bus.bus import protocol as p
from agent_bus.bus.client import Peer, connect
from agent_bus.bus.messages import AssistantMessage, ToolCall, UserMessage
from agent_bus.bus.security import CurveClient
from agent_bus.bus.tracecontext import chat_span_id, span_id, tool_span_id, trace_id
from agent_bus.bus.ui import Drops, count_gap, serve_drops

try:  # the optional extra `otel`; the error below says how to install it
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("busctl otel needs the OpenTelemetry SDK: pip install 'agent-bus[otel]'") \
        from exc

log = logging.getLogger("busctl.otel")

DEFAULT_ENDPOINT = "http://localhost:4318/v1/traces"
MAX_SPANS = 10_000       # buffered while the collector is down; the oldest traces go first
MAX_OPEN_RUNS = 10_000   # runs that never end (a crashed coordinator) must not grow memory forever
SCOPE = InstrumentationScope("agent-bus", "0.1.0")


# Shared with the gateway's and the tool worker's `traceparent` (bus.tracecontext): a provider's
# spans and an instrumented tool's join our trace.
_span_id = span_id
_trace_id = trace_id


def _ns(ts: float) -> int:
    return int(ts * 1e9)


@dataclass
class Chat:
    index: int
    start: float
    model: str
    end: float = 0.0
    message: AssistantMessage | None = None


@dataclass
class ToolSpan:
    call_id: str
    name: str
    start: float
    args: Any = None
    end: float = 0.0
    result: Any = None
    is_error: bool = False
    child_run: str = ""


@dataclass
class Run:
    run: str
    agent: str
    session: str
    experiment: str
    parent: str
    first_seq: int
    start: float
    last: float
    prompt: str = ""
    chats: list[Chat] = field(default_factory=list)
    tools: dict[str, ToolSpan] = field(default_factory=dict)
    end: ev.AgentEnd | None = None
    children: list[str] = field(default_factory=list)


class TraceBuilder:
    """Runs under construction; `add` returns a finished trace's spans when its root run ends."""

    def __init__(self, capture_content: bool, resource: Resource,
                 max_open_runs: int = MAX_OPEN_RUNS) -> None:
        self.capture = capture_content
        self.resource = resource
        self.max_open_runs = max_open_runs
        self.runs: dict[str, Run] = {}
        self.last_seq = 0
        self.evicted_runs = 0
        self.bad_events = 0

    def safe_seq(self) -> int:
        """Every event up to this seq is in an exported trace or in none (resume point)."""
        if not self.runs:
            return self.last_seq
        return min(r.first_seq for r in self.runs.values()) - 1

    def add(self, header: p.Header, event: ev.Event) -> list[ReadableSpan]:
        self.last_seq = max(self.last_seq, header.seq)
        if isinstance(event, ev.AgentStart):
            self._start(header, event)
            return []
        run = self.runs.get(header.run)
        if run is None:  # a run that started before our resume point, or no run at all
            return []
        run.last = max(run.last, header.ts)
        self._record(run, event, header.ts)
        if not isinstance(event, ev.AgentEnd):
            return []
        run.end = event
        root = self._root(run)
        return self._export(root) if root.end is not None else []

    def _start(self, header: p.Header, event: ev.AgentStart) -> None:
        parent = event.parent_run_id or header.parent
        run = Run(header.run, header.agent, event.session or header.session, header.experiment,
                  parent if parent in self.runs else "", header.seq, header.ts, header.ts)
        self.runs[run.run] = run
        if run.parent:
            self.runs[run.parent].children.append(run.run)
        if len(self.runs) > self.max_open_runs:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        oldest = self._root(next(iter(self.runs.values())))
        for run in self._tree(oldest):
            self.runs.pop(run.run, None)
            self.evicted_runs += 1
        log.warning("otel: more than %d open runs; dropped the oldest run tree (%s)",
                    self.max_open_runs, oldest.run)

    def _root(self, run: Run) -> Run:
        while run.parent and run.parent in self.runs:
            run = self.runs[run.parent]
        return run

    def _tree(self, root: Run) -> list[Run]:
        out, todo = [], [root]
        while todo:
            run = todo.pop()
            out.append(run)
            todo.extend(self.runs[c] for c in run.children if c in self.runs)
        return out

    def _record(self, run: Run, event: ev.Event, ts: float) -> None:
        if isinstance(event, ev.MessageStart):
            if isinstance(event.message, AssistantMessage):
                run.chats.append(Chat(len(run.chats), ts, event.message.model))
            elif isinstance(event.message, UserMessage) and not run.prompt:
                run.prompt = "".join(getattr(c, "text", "") for c in event.message.content)
        elif isinstance(event, ev.MessageEnd) and isinstance(event.message, AssistantMessage):
            open_chats = [c for c in run.chats if c.message is None]
            if open_chats:
                open_chats[-1].end, open_chats[-1].message = ts, event.message
        elif isinstance(event, ev.ToolExecutionStart):
            run.tools[event.tool_call_id] = ToolSpan(event.tool_call_id, event.tool_name, ts,
                                                     event.args)
        elif isinstance(event, ev.ToolExecutionEnd):
            tool = run.tools.get(event.tool_call_id)
            if tool is None:
                return
            tool.end, tool.is_error, tool.result = ts, event.is_error, event.result.text
            details = event.result.details
            if isinstance(details, dict) and isinstance(details.get("run_id"), str):
                tool.child_run = details["run_id"]

    def _export(self, root: Run) -> list[ReadableSpan]:
        tree = self._tree(root)
        for run in tree:
            self.runs.pop(run.run, None)
        by_run = {r.run: r for r in tree}
        tool_of_child = {t.child_run: (r, t) for r in tree for t in r.tools.values() if t.child_run}
        trace_id = _trace_id(root.run)
        spans: list[ReadableSpan] = []
        for run in tree:
            parent: SpanContext | None = None
            if run.parent in by_run:
                caller, tool = tool_of_child.get(run.run, (by_run[run.parent], None))
                parent = self._ctx(trace_id, tool_span_id(caller.run, tool.call_id) if tool
                                   else _span_id(caller.run))
            spans.extend(self._run_spans(run, trace_id, parent))
        return spans

    def _ctx(self, trace_id: int, span_id: int) -> SpanContext:
        return SpanContext(trace_id, span_id, is_remote=False,
                           trace_flags=TraceFlags(TraceFlags.SAMPLED))

    def _span(self, name: str, trace_id: int, span_id: int, parent: SpanContext | None,
              start: float, end: float, attributes: dict[str, Any], kind: SpanKind,
              error: str = "") -> ReadableSpan:
        status = Status(StatusCode.ERROR, error) if error else Status(StatusCode.UNSET)
        attrs = {k: v for k, v in attributes.items() if v not in ("", None)}
        return ReadableSpan(name, context=self._ctx(trace_id, span_id), parent=parent,
                            resource=self.resource, attributes=attrs, kind=kind, status=status,
                            start_time=_ns(start), end_time=_ns(max(end, start)),
                            instrumentation_scope=SCOPE)

    def _run_spans(self, run: Run, trace_id: int, parent: SpanContext | None) -> list[ReadableSpan]:
        run_id = _span_id(run.run)
        end = run.end
        usage = {"input": 0, "output": 0}
        for chat in run.chats:
            if chat.message is not None:
                usage["input"] += chat.message.usage.input
                usage["output"] += chat.message.usage.output
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": run.agent,
            "gen_ai.conversation.id": run.session, "agent_bus.run.id": run.run,
            "agent_bus.parent_run.id": run.parent, "agent_bus.experiment.id": run.experiment,
            "agent_bus.stop_reason": end.stop_reason if end else "unfinished",
            "gen_ai.usage.input_tokens": usage["input"],
            "gen_ai.usage.output_tokens": usage["output"],
        }
        if self.capture:
            final = end.final_text if end else ""
            attrs["gen_ai.input.messages"] = _messages("user", run.prompt)
            attrs["gen_ai.output.messages"] = _messages("assistant", final)
            # OpenInference's plain input/output: what Phoenix shows in its agent rows (it does
            # not read the GenAI messages there)
            attrs.update({"input.value": run.prompt, "input.mime_type": "text/plain",
                          "output.value": final, "output.mime_type": "text/plain"})
        error = (end.error or end.stop_reason) if end and end.stop_reason in ("error", "aborted") \
            else ""
        spans = [self._span(f"invoke_agent {run.agent}", trace_id, run_id, parent, run.start,
                            run.last, attrs, SpanKind.INTERNAL, error)]
        me = self._ctx(trace_id, run_id)
        spans += [self._chat_span(run, c, trace_id, me) for c in run.chats]
        spans += [self._tool_span(run, t, trace_id, me) for t in run.tools.values()]
        return spans

    def _chat_span(self, run: Run, chat: Chat, trace_id: int, parent: SpanContext) -> ReadableSpan:
        msg = chat.message
        # The run names the topology's alias (`[models.x]`); the provider's model id, which
        # tracing backends price and group by, arrives with the reply.
        model = (msg.model if msg is not None else "") or chat.model
        attrs: dict[str, Any] = {"gen_ai.operation.name": "chat",
                                 "gen_ai.request.model": model, "agent_bus.model.alias": chat.model,
                                 "gen_ai.conversation.id": run.session,
                                 "agent_bus.experiment.id": run.experiment}
        error = ""
        if msg is not None:
            attrs.update({"gen_ai.response.model": msg.model, "gen_ai.provider.name": msg.provider,
                          "gen_ai.usage.input_tokens": msg.usage.input,
                          "gen_ai.usage.output_tokens": msg.usage.output,
                          "gen_ai.response.finish_reasons": [msg.stop_reason]})
            error = msg.error or ""
            if self.capture:
                attrs["gen_ai.output.messages"] = json.dumps([_assistant_json(msg)])
                attrs.update(_chat_output(msg))
        if self.capture:
            attrs["gen_ai.input.messages"] = json.dumps(_history(run, chat.index))
            attrs.update({"input.value": attrs["gen_ai.input.messages"],
                          "input.mime_type": "application/json"})
        name = f"chat {model}".rstrip()
        end = chat.end if msg is not None else run.last
        return self._span(name, trace_id, chat_span_id(run.run, chat.index), parent,
                          chat.start, end, attrs, SpanKind.CLIENT, error)

    def _tool_span(self, run: Run, tool: ToolSpan, trace_id: int,
                   parent: SpanContext) -> ReadableSpan:
        attrs: dict[str, Any] = {"gen_ai.operation.name": "execute_tool",
                                 "gen_ai.tool.name": tool.name, "gen_ai.tool.call.id": tool.call_id,
                                 "gen_ai.tool.type": "function",
                                 "gen_ai.conversation.id": run.session,
                                 "agent_bus.experiment.id": run.experiment}
        if self.capture:
            result = tool.result if isinstance(tool.result, str) else ""
            attrs["gen_ai.tool.call.arguments"] = json.dumps(tool.args)
            attrs["gen_ai.tool.call.result"] = result
            # OpenInference's input/output: what Phoenix shows for a tool span
            attrs.update({"input.value": attrs["gen_ai.tool.call.arguments"],
                          "input.mime_type": "application/json",
                          "output.value": result, "output.mime_type": "text/plain"})
        error = "tool error" if tool.is_error else ""
        return self._span(f"execute_tool {tool.name}", trace_id,
                          tool_span_id(run.run, tool.call_id), parent, tool.start,
                          tool.end or run.last, attrs, SpanKind.INTERNAL, error)


def _chat_output(msg: AssistantMessage) -> dict[str, str]:
    """A model call's OpenInference output: its text, or, for a reply that only calls tools,
    those calls as JSON (an empty value would make Phoenix show the span's other attributes,
    e.g. `{"model": …}`, as its output)."""
    text = "".join(getattr(c, "text", "") for c in msg.content)
    calls = [{"id": c.id, "name": c.name, "arguments": _arguments(c.arguments)}
             for c in msg.content if isinstance(c, ToolCall)]
    if text or not calls:
        return {"output.value": text, "output.mime_type": "text/plain"}
    return {"output.value": json.dumps({"tool_calls": calls}),
            "output.mime_type": "application/json"}


def _messages(role: str, text: str) -> str:
    return json.dumps([{"role": role, "parts": [{"type": "text", "content": text}]}])


def _history(run: Run, index: int) -> list[dict[str, Any]]:
    """What model call `index` of `run` was sent, as GenAI input messages: the user's prompt, then
    each earlier reply with the results of the tools it called (role `tool`, `tool_call_response`
    parts). The agent's system prompt is not in the events, so it is not here either."""
    out = [{"role": "user", "parts": [{"type": "text", "content": run.prompt}]}]
    for chat in run.chats[:index]:
        if chat.message is None:
            continue
        out.append(_assistant_json(chat.message))
        calls = [p for p in chat.message.content if isinstance(p, ToolCall)]
        results = [{"type": "tool_call_response", "id": c.id,
                    "response": run.tools[c.id].result} for c in calls if c.id in run.tools]
        if results:
            out.append({"role": "tool", "parts": results})
    return out


def _arguments(text: str) -> Any:
    """A tool call's arguments as the object the conventions show (the raw text if not JSON)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _assistant_json(msg: AssistantMessage) -> dict[str, Any]:
    parts: list[dict[str, Any]] = []
    for part in msg.content:
        if isinstance(part, ToolCall):
            parts.append({"type": "tool_call", "id": part.id, "name": part.name,
                          "arguments": _arguments(part.arguments)})
        elif getattr(part, "text", ""):
            parts.append({"type": "text", "content": part.text})  # type: ignore[union-attr]
    return {"role": "assistant", "parts": parts, "finish_reason": msg.stop_reason}


class OtelState(msgspec.Struct):
    """The state file: where to resume, and what was delivered or lost so far."""

    seq: int = 0
    exported_spans: int = 0
    dropped_spans: int = 0


def load_state(path: Path) -> OtelState:
    try:
        return msgspec.json.decode(path.read_bytes(), type=OtelState)
    except FileNotFoundError:
        return OtelState()
    except (msgspec.DecodeError, OSError) as exc:
        log.warning("otel: ignoring the unreadable state file %s (%s); starting at seq 0",
                    path, exc)
        return OtelState()


def save_state(path: Path, state: OtelState) -> None:
    """Best effort: an unwritable state file (disk full) is logged, and the export goes on
    (a restart then resends from the older resume point, with the same ids)."""
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_bytes(msgspec.json.encode(state))
        os.replace(tmp, path)  # atomic: a crash mid-write keeps the previous resume point
    except OSError as exc:
        log.warning("otel: cannot save the resume point to %s: %s (check --state-file)",
                    path, exc)


class Delivery:
    """The bounded buffer between the subscription and the (blocking) OTLP exporter."""

    def __init__(self, exporter: SpanExporter, state: OtelState, state_file: Path | None,
                 safe_seq: Callable[[], int], max_spans: int = MAX_SPANS,
                 batch_spans: int = 512) -> None:
        self.exporter = exporter
        self.state = state
        self.state_file = state_file
        self.safe_seq = safe_seq
        self.max_spans = max_spans
        self.batch_spans = batch_spans
        self.queue: deque[tuple[list[ReadableSpan], int]] = deque()
        self.buffered = 0
        self.failures = 0
        self.wake = anyio.Event()

    def put(self, spans: Sequence[ReadableSpan], mark: int) -> None:
        if not spans:
            return
        self.queue.append((list(spans), mark))
        self.buffered += len(spans)
        self._bound()
        self.wake.set()

    def _bound(self) -> None:
        """Drop the oldest waiting traces past `max_spans` (a batch in flight is not waiting)."""
        while self.buffered > self.max_spans and len(self.queue) > 1:
            dropped, _ = self.queue.popleft()
            self.buffered -= len(dropped)
            self.state.dropped_spans += len(dropped)
            log.warning("otel: buffer full (%d spans); dropped a trace of %d spans",
                        self.max_spans, len(dropped))

    async def run(self, interval: float = 0.5) -> None:
        backoff = interval
        while True:
            with anyio.move_on_after(backoff):
                await self.wake.wait()
            self.wake = anyio.Event()
            if await self.flush_once():
                backoff = interval
            else:
                backoff = min(backoff * 2, 5.0)

    async def flush_once(self) -> bool:
        """Export the oldest traces (up to a batch); False when the collector refused them."""
        if not self.queue:
            self._commit(self.safe_seq())
            return True
        # Taken out of the queue while in flight: `put` may drop waiting traces meanwhile.
        items = [self.queue.popleft()]
        while self.queue and sum(len(s) for s, _ in items) + len(self.queue[0][0]) \
                <= self.batch_spans:
            items.append(self.queue.popleft())
        batch = [span for spans, _ in items for span in spans]
        result = await anyio.to_thread.run_sync(self.exporter.export, batch)
        if result is not SpanExportResult.SUCCESS:
            self.failures += 1
            self.queue.extendleft(reversed(items))
            self._bound()
            return False
        self.buffered -= len(batch)
        self.state.exported_spans += len(batch)
        mark = items[-1][1]
        self._commit(mark if self.queue else max(mark, self.safe_seq()))
        if self.queue:
            self.wake.set()
        return True

    def _commit(self, seq: int) -> None:
        if seq <= self.state.seq and self.state_file is not None and self.state_file.exists():
            return
        self.state.seq = max(self.state.seq, seq)
        if self.state_file is not None:
            save_state(self.state_file, self.state)


def _spans_of(builder: TraceBuilder, header: p.Header, event: ev.Event) -> list[ReadableSpan]:
    """The builder's answer to one event; an event it cannot use is counted, logged and skipped
    (one odd event from some peer must not end the export of everyone's traces)."""
    try:
        return builder.add(header, event)
    except Exception:  # noqa: BLE001 - logged with its traceback, then the stream goes on
        builder.bad_events += 1
        log.exception("otel: skipped event seq %d (%s)", header.seq, header.type)
        return []


async def _stop_on_signal(scope: anyio.CancelScope) -> None:
    """SIGTERM (a supervisor, `busctl down`) ends the stream cleanly: the buffer is flushed and
    the resume point saved, instead of the process dying mid-export."""
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            scope.cancel()
            return


def parse_headers(items: Sequence[str]) -> dict[str, str]:
    """`K=V` items (and OTEL_EXPORTER_OTLP_HEADERS' `k=v,k2=v2`) as a dict; bad ones named."""
    headers: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--header {item!r}: expected KEY=VALUE (e.g. "
                             f"--header 'Authorization=Bearer abc')")
        headers[key.strip()] = value.strip()
    return headers


def default_endpoint(env: Mapping[str, str] = os.environ) -> str:
    """OTEL_EXPORTER_OTLP_TRACES_ENDPOINT as is, else OTEL_EXPORTER_OTLP_ENDPOINT + /v1/traces."""
    if env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
    return base.rstrip("/") + "/v1/traces" if base else DEFAULT_ENDPOINT


async def export_otel(hub: str, curve: CurveClient | None, endpoint: str,
                      headers: dict[str, str], capture_content: bool, state_file: Path | None,
                      since: int | None, max_spans: int = MAX_SPANS, timeout: float = 5.0) -> None:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    state = load_state(state_file) if state_file is not None else OtelState()
    start = since if since is not None else state.seq
    resource = Resource.create({"service.name": "agent-bus", "agent_bus.hub": hub})
    builder = TraceBuilder(capture_content, resource)
    builder.last_seq = start
    # typed as the SDK base: its shutdown() is annotated, the OTLP subclass's override is not
    exporter: SpanExporter = OTLPSpanExporter(endpoint=endpoint, headers=headers, timeout=timeout)
    delivery = Delivery(exporter, state, state_file, builder.safe_seq, max_spans)
    tally = ev.EventTally("busctl otel", log.warning)  # events that do not decode: skipped
    async with connect(hub, name="busctl-otel", role="watcher", curve=curve) as peer:
        try:
            await _follow(peer, builder, delivery, endpoint, start, tally)
        finally:
            with anyio.move_on_after(timeout, shield=True):
                await delivery.flush_once()
            exporter.shutdown()
            print(f"otel: exported {state.exported_spans} spans, dropped {state.dropped_spans}, "
                  f"{delivery.buffered} unsent, resume at seq {state.seq}; runs evicted "
                  f"unfinished {builder.evicted_runs}, events skipped {builder.bad_events}, "
                  f"undecodable {tally.bad}", file=sys.stderr)


async def _follow(peer: Peer, builder: TraceBuilder, delivery: Delivery, endpoint: str,
                  start: int, tally: ev.EventTally) -> None:
    async with anyio.create_task_group() as tg:
        tg.start_soon(delivery.run)
        tg.start_soon(_stop_on_signal, tg.cancel_scope)
        # The full stream (no topic filter) so every jump in seq is a loss the
        # subscription fills from the log, exactly as `busctl watch` does.
        async with peer.subscribe([], since=start, fill_gaps=True) as sub:
            sub.tally = tally
            drops = Drops(f"otel-{os.getpid()}", "otel")
            await serve_drops(peer, drops, sub, lambda: {
                "undecodable": tally.bad, "dropped_spans": delivery.state.dropped_spans,
                "exported_spans": delivery.state.exported_spans,
                "buffered_spans": delivery.buffered, "export_failures": delivery.failures})
            print(json.dumps({"ready": "otel", "endpoint": endpoint, "since": start}), flush=True)
            async for envelope in sub:
                count_gap(drops, envelope.event)
                drops.seq = max(drops.seq, envelope.header.seq)
                delivery.put(_spans_of(builder, envelope.header, envelope.event),
                             builder.safe_seq())
