"""What a tool service must look like for a model API to accept it (docs/protocol.md, section 5,
"Tool services"): the hub refuses a `register` of a `tool.<name>` service that breaks it, and an
agent leaves such a tool out of what it offers a model (a tool from an older hub, or a catalog
that changed), so one bad peer cannot break every model call of the agents with `tools = ["*"]`.

    tool_service_fault("tool.bad name!", {})   # -> "register refused: tool name `bad name!` ..."
    tool_service_fault("tool.read", meta)      # -> "" when acceptable

The rules are the intersection of what OpenAI-compatible and Anthropic APIs take: a name of 1-64
of `A-Z a-z 0-9 _ -`, and `parameters` a JSON Schema object (root `"type": "object"`).
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

TOOL_PREFIX = "tool."
NAME_RULE = r"^[A-Za-z0-9_-]{1,64}$"
_NAME = re.compile(NAME_RULE)


class _Meta(msgspec.Struct):
    """The typed fields of a tool service's `meta` (`ToolInfo` in bus/messages.py, with `name`
    optional: the service name is the tool's name whatever `meta.name` says)."""

    name: str = ""
    description: str = ""
    parameters: dict[str, Any] = msgspec.field(default_factory=dict)  # (null: refused, as by ToolInfo)
    sequential: bool = False
    idempotent: bool = False
    timeout: float | None = None


def tool_name_fault(name: str) -> str:
    """Why `name` (the part after `tool.`) is no model API's tool name; "" when it is fine."""
    if _NAME.match(name):
        return ""
    return (f"tool name {name!r} is not accepted by model APIs: it must match {NAME_RULE} "
            "(1-64 letters, digits, `_` or `-`)")


def tool_meta_fault(meta: Any) -> str:
    """Why `meta` is not a tool's metadata (ToolInfo fields, `parameters` a JSON Schema object);
    "" when it is fine. An empty `meta` is fine: a tool without description or arguments."""
    try:
        info = msgspec.convert(meta, _Meta)
    except msgspec.ValidationError as exc:
        return f"its `meta` is not a ToolInfo: {exc}"
    if info.timeout is not None and info.timeout <= 0:
        return f"its `meta.timeout` is {info.timeout:g}; it must be > 0 seconds (or absent)"
    return parameters_fault(info.parameters)


def parameters_fault(schema: dict[str, Any] | None) -> str:
    """Why `schema` is not tool parameters a model API takes; "" when it is fine. None or `{}`:
    a tool without arguments (offered as an empty object schema)."""
    if not schema:
        return ""
    if schema.get("type") != "object":
        return ("its `meta.parameters` is not a JSON Schema object: the root `type` must be "
                f"\"object\", got {schema.get('type')!r}")
    if not isinstance(schema.get("properties", {}), dict):
        return "its `meta.parameters.properties` must be a map (property name -> JSON Schema)"
    return ""


def tool_service_fault(service: str, meta: Any) -> str:
    """Why the hub refuses to register `service` with `meta`; "" for an acceptable tool service
    and for any service that is not `tool.<name>`."""
    if not service.startswith(TOOL_PREFIX):
        return ""
    why = tool_name_fault(service[len(TOOL_PREFIX):]) or tool_meta_fault(meta)
    return f"register refused: service {service!r}: {why}" if why else ""


__all__ = ["NAME_RULE", "TOOL_PREFIX", "parameters_fault", "tool_meta_fault", "tool_name_fault",
           "tool_service_fault"]
