"""How a tool call travels on the bus: its service name and its request's decoding.

Shared by the worker (tools/worker.py) and the MCP bridge it hosts (tools/mcp.py), which serve
tool calls alike; kept below both so neither imports the other for it (no import circle)."""

from __future__ import annotations

import msgspec

from agent_bus.bus import protocol as p
from agent_bus.bus.errors import RequestError
from agent_bus.bus.messages import ToolCallRequest

SERVICE_PREFIX = "tool."

_call_decoder = msgspec.msgpack.Decoder(ToolCallRequest)


def service_name(tool_name: str) -> str:
    return SERVICE_PREFIX + tool_name


def decode_call(name: str, body: bytes) -> ToolCallRequest:
    """The `ToolCallRequest` of a call to `tool.<name>`; a `bad_request` error otherwise."""
    try:
        return _call_decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise RequestError(
            f"Malformed request to `{service_name(name)}`: expected a msgpack ToolCallRequest "
            f"({exc})", p.BAD_REQUEST,
        ) from None
