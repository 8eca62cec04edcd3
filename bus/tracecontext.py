"""W3C trace context (`traceparent`) for the bus's runs, with the standard library only.

`busctl otel` derives every trace and span id from run ids (so a trace exported twice has the same
ids); the gateway derives the `traceparent` it sends to the model provider with the same functions
from what the request's `LlmRequest.trace` says (the run tree's top-level run, the call's index in
its run), so a provider that traces its side puts its spans under the call's `chat` span. A tool
worker does the same for a tool call (`ToolCallRequest.trace`): the tool's `traceparent` names
the call's `execute_tool` span, so a tool instrumented with OpenTelemetry joins the trace under it.
"""

from __future__ import annotations

import hashlib
import re

TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


def span_id(*parts: str) -> int:
    """A span id from its identifying parts (never 0, which W3C calls invalid)."""
    return int.from_bytes(hashlib.blake2b("\x1f".join(parts).encode(), digest_size=8).digest()) or 1


def trace_id(run: str) -> int:
    """The trace id of the run tree whose top-level run is `run`."""
    return int.from_bytes(hashlib.blake2b(run.encode(), digest_size=16).digest()) or 1


def chat_span_id(run: str, call: int) -> int:
    """The span id of `run`'s model call number `call` (from 0): its `chat` span."""
    return span_id(run, "chat", str(call))


def tool_span_id(run: str, call_id: str) -> int:
    """The span id of `run`'s tool call `call_id`: its `execute_tool` span."""
    return span_id(run, "tool", call_id)


def tool_traceparent(run: str, call_id: str, root: str = "") -> str:
    """`00-<trace>-<span>-01` for the code a tool call runs: its parent is the call's
    `execute_tool` span, in the trace of `root` ("": `run` is its tree's top-level run)."""
    return f"00-{trace_id(root or run):032x}-{tool_span_id(run, call_id):016x}-01"


def traceparent(run: str, root: str = "", call: int | None = None) -> str:
    """`00-<trace>-<span>-01` for a model call made inside `run`: its parent is the call's `chat`
    span when `call` is given, else the run's `invoke_agent` span; its trace is that of `root`,
    the run tree's top-level run ("": `run` is the top). Sampled: we export every run."""
    parent = chat_span_id(run, call) if call is not None else span_id(run)
    return f"00-{trace_id(root or run):032x}-{parent:016x}-01"


def parse_traceparent(value: str) -> tuple[str, str] | None:
    """(trace id, parent span id) in hex, or None when `value` is not a valid version-00 header."""
    match = TRACEPARENT.fullmatch(value.strip())
    if match is None or set(match.group(1)) == {"0"} or set(match.group(2)) == {"0"}:
        return None
    return match.group(1), match.group(2)
