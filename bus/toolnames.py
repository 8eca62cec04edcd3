"""What a tool service must look like for a model API to accept it (docs/protocol.md, section 5,
"Tool services"): the hub refuses a `register` of a `tool.<name>` service that breaks it, and an
agent leaves such a tool out of what it offers a model (a tool from an older hub, or a catalog
that changed), so one bad peer cannot break every model call of the agents with `tools = ["*"]`.

    tool_service_fault("tool.bad name!", {})   # -> "register refused: tool name `bad name!` ..."
    tool_service_fault("tool.read", meta)      # -> "" when acceptable

The rules are the intersection of what the model APIs take (OpenAI-compatible, Anthropic, Gemini:
its names start with a letter or `_`): a name of 1-64 of `A-Z a-z 0-9 _ -`, the first a letter or
`_`, and `parameters` a flattened JSON Schema object (root `"type": "object"`, no `title`). One
rule for the hub, `@tool` (tools/_tool.py) and docs/protocol.md.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

TOOL_PREFIX = "tool."
# A tool service's `meta` key: true when a map `details` of its results is structured output
# meant for clients (an MCP server's `structuredContent`), which `busctl mcp serve` passes on;
# any other tool's `details` stays hidden from models and MCP clients (docs/protocol.md §5).
STRUCTURED_META = "structured_content"
NAME_RULE = r"^[A-Za-z_][A-Za-z0-9_-]{0,63}$"
NAME_WORDS = "1-64 letters, digits, `_` or `-`, the first a letter or `_`"
_NAME = re.compile(NAME_RULE)
# JSON Schema keywords whose value is one subschema, a list of them, or a name -> subschema map:
# where a `title` could hide (a property *named* `title` is a key of `properties`, not a keyword).
_ONE = ("items", "additionalProperties", "not", "contains", "propertyNames")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "patternProperties")


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
            f"({NAME_WORDS})")


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
    where = _title_at(schema, "$")
    if where:
        return (f"its `meta.parameters` has a `title` at `{where}`: remove every `title` keyword "
                "(flattened schemas carry none; `@tool` and the MCP bridge drop them)")
    return ""


_MAX_DEPTH = 64  # a register is untrusted input: no recursion as deep as it likes


def _title_at(node: dict[str, Any], path: str, depth: int = 0) -> str:
    """The path of the first `title` keyword in the schema `node` ("" when none); a schema
    nested deeper than `_MAX_DEPTH` is not looked into further."""
    if "title" in node:
        return path
    if depth >= _MAX_DEPTH:
        return ""
    subs: list[tuple[str, Any]] = [(f"{path}.{k}", node.get(k)) for k in _ONE]
    subs += [(f"{path}.{k}[{i}]", sub) for k in _LIST if isinstance(node.get(k), list)
             for i, sub in enumerate(node[k])]
    subs += [(f"{path}.{k}.{name}", sub) for k in _MAP if isinstance(node.get(k), dict)
             for name, sub in node[k].items()]
    for where, sub in subs:
        found = _title_at(sub, where, depth + 1) if isinstance(sub, dict) else ""
        if found:
            return found
    return ""


def tool_service_fault(service: str, meta: Any) -> str:
    """Why the hub refuses to register `service` with `meta`; "" for an acceptable tool service
    and for any service that is not `tool.<name>`."""
    if not service.startswith(TOOL_PREFIX):
        return ""
    why = tool_name_fault(service[len(TOOL_PREFIX):]) or tool_meta_fault(meta)
    return f"register refused: service {service!r}: {why}" if why else ""


__all__ = ["NAME_RULE", "NAME_WORDS", "STRUCTURED_META", "TOOL_PREFIX", "parameters_fault",
           "tool_meta_fault", "tool_name_fault", "tool_service_fault"]
