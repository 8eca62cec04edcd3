"""From a function signature to an arguments Struct and a provider-ready JSON Schema.

Three stages: `parse_docstring` splits the description from the `Args:` section, `build_args_struct`
turns the typed parameters into a `msgspec.Struct` (the single source of truth for validation and
schema), and `provider_schema` flattens `msgspec.json.schema` output into what LLM providers accept:
root `"type": "object"`, no `$ref`/`$defs`, `additionalProperties: false` on every struct object, no
`title` noise. `check_provider_schema` lists what a schema still gets wrong.
"""

from __future__ import annotations

import copy
import inspect
import re
from collections.abc import Callable
from typing import Annotated, Any, get_args, get_origin, get_type_hints

import msgspec

from agent_bus.tools._exceptions import ToolDefinitionError

_SECTION_RE = re.compile(
    r"^(Args|Arguments|Parameters|Params|Keyword Args|Returns?|Yields?|Raises|Examples?|Notes?"
    r"|Attributes|See Also|Warnings?|Todo)\s*:\s*$"
)
_ARGS_SECTIONS = frozenset({"Args", "Arguments", "Parameters", "Params", "Keyword Args"})
_ARG_LINE_RE = re.compile(r"^\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")

# Keywords whose value is a single subschema, a list of subschemas, or a name -> subschema map.
_SUBSCHEMA_KEYS = ("items", "additionalProperties", "not", "contains", "propertyNames")
_SUBSCHEMA_LIST_KEYS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAP_KEYS = ("properties", "patternProperties")

_JSON_TYPES = {str: "string", bool: "boolean", int: "integer", float: "number"}


# --- docstrings ----------------------------------------------------------------------------


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """Return (first paragraph, {param: description}) of a Google-style docstring."""
    lines = inspect.cleandoc(doc or "").splitlines()
    summary: list[str] = []
    for line in lines:
        if not line.strip() or _SECTION_RE.match(line):
            break
        summary.append(line.strip())
    return " ".join(summary), _parse_args_section(lines)


def _parse_args_section(lines: list[str]) -> dict[str, str]:
    params: dict[str, str] = {}
    in_args = False
    entry_indent: int | None = None  # indentation of the `name: text` lines of this section
    current: str | None = None
    for line in lines:
        header = _SECTION_RE.match(line)
        if header or (line.strip() and not line[0].isspace()):  # a header or unindented text
            in_args = header is not None and header.group(1) in _ARGS_SECTIONS
            entry_indent = current = None
            continue
        if not in_args or not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        match = _ARG_LINE_RE.match(line.strip())
        if match and (entry_indent is None or indent <= entry_indent):
            entry_indent, current = indent, match.group(1)
            params[current] = match.group(2)
        elif current is not None:
            params[current] = f"{params[current]} {line.strip()}"
    return {name: text.strip() for name, text in params.items()}


# --- the arguments struct ------------------------------------------------------------------


def build_args_struct(
    fn: Callable[..., Any],
    tool_name: str,
    param_docs: dict[str, str],
    skip_type: type,
) -> tuple[type[msgspec.Struct], str | None]:
    """Build the arguments Struct from `fn`'s parameters.

    Returns the Struct type and the name of the parameter annotated `skip_type` (the ToolContext),
    which is left out of the Struct. Raises ToolDefinitionError for signatures a model cannot fill.
    """
    hints = _type_hints(fn, tool_name)
    fields: list[tuple[str, Any, Any] | tuple[str, Any]] = []
    context_param: str | None = None
    for param in inspect.signature(fn).parameters.values():
        hint = hints.get(param.name, inspect.Parameter.empty)
        if isinstance(hint, type) and issubclass(hint, skip_type):
            context_param = param.name
            continue
        _check_param(param, hint, tool_name)
        fields.append(_field(param, _describe(hint, param_docs.get(param.name))))
    struct_name = f"{tool_name}__Arguments"
    try:
        args_type = msgspec.defstruct(struct_name, fields, forbid_unknown_fields=True)
    except (TypeError, ValueError) as exc:  # e.g. a default msgspec refuses
        raise ToolDefinitionError(f"Cannot build the arguments of tool `{tool_name}`: {exc}") from exc
    return args_type, context_param


def _type_hints(fn: Callable[..., Any], tool_name: str) -> dict[str, Any]:
    try:
        return get_type_hints(fn, include_extras=True)
    except Exception as exc:  # NameError for a forward reference that does not resolve, mostly
        raise ToolDefinitionError(
            f"Cannot resolve the type hints of tool `{tool_name}`: {exc}"
        ) from exc


def _check_param(param: inspect.Parameter, hint: Any, tool_name: str) -> None:
    where = f"parameter `{param.name}` of tool `{tool_name}`"
    if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
        raise ToolDefinitionError(f"{where}: *args/**kwargs cannot be described by a schema")
    if param.kind is param.POSITIONAL_ONLY:
        raise ToolDefinitionError(f"{where}: positional-only parameters are not supported")
    if hint is inspect.Parameter.empty:
        raise ToolDefinitionError(f"{where} needs a type annotation (it becomes the schema)")


def _describe(hint: Any, description: str | None) -> Any:
    """Attach a docstring description unless the annotation already carries one."""
    if not description or _has_description(hint):
        return hint
    return Annotated[hint, msgspec.Meta(description=description)]


def _has_description(hint: Any) -> bool:
    if get_origin(hint) is not Annotated:
        return False
    return any(isinstance(m, msgspec.Meta) and m.description for m in get_args(hint)[1:])


def _field(param: inspect.Parameter, hint: Any) -> tuple[str, Any, Any] | tuple[str, Any]:
    if param.default is inspect.Parameter.empty:
        return (param.name, hint)
    default = param.default
    # msgspec refuses shared mutable defaults (non-empty collections, mutable Structs): copy per call
    if isinstance(default, (list, dict, set, bytearray, msgspec.Struct)) and (
        default or isinstance(default, msgspec.Struct)
    ):
        return (param.name, hint, msgspec.field(default_factory=lambda: copy.deepcopy(default)))
    return (param.name, hint, default)


# --- the provider schema -------------------------------------------------------------------


def provider_schema(args_type: type[msgspec.Struct], tool_name: str) -> dict[str, Any]:
    """msgspec's JSON Schema for `args_type`, flattened for LLM providers."""
    try:
        raw = msgspec.json.schema(args_type)
    except Exception as exc:  # TypeError for a type msgspec cannot describe
        raise ToolDefinitionError(f"Cannot build a JSON Schema for tool `{tool_name}`: {exc}") from exc
    defs = raw.pop("$defs", {})
    schema: dict[str, Any] = _inline(raw, defs, stack=(), tool_name=tool_name)
    _normalize(schema)
    schema.pop("description", None)  # the Struct's docstring; the tool description covers it
    return schema


def _inline(node: Any, defs: dict[str, Any], stack: tuple[str, ...], tool_name: str) -> Any:
    if isinstance(node, list):
        return [_inline(item, defs, stack, tool_name) for item in node]
    if not isinstance(node, dict):
        return node
    ref = node.get("$ref")
    if isinstance(ref, str):
        name = ref.rsplit("/", 1)[-1]
        if name in stack:
            raise ToolDefinitionError(
                f"Tool `{tool_name}` has a recursive argument type `{name}`; providers accept no "
                f"`$ref`, so it cannot be inlined. Use a non-recursive type (e.g. a `dict`)."
            )
        merged = {**defs[name], **{k: v for k, v in node.items() if k != "$ref"}}
        return _inline(merged, defs, (*stack, name), tool_name)
    return {key: _inline(value, defs, stack, tool_name) for key, value in node.items()}


def _normalize(schema: dict[str, Any]) -> None:
    """Drop `title`, close struct objects and give enums a `type`, recursively (in place)."""
    schema.pop("title", None)
    if "properties" in schema:
        schema.setdefault("type", "object")
        schema.setdefault("additionalProperties", False)
    if "enum" in schema and "type" not in schema:
        kinds = {_JSON_TYPES.get(type(value)) for value in schema["enum"]}
        if len(kinds) == 1 and None not in kinds:
            schema["type"] = kinds.pop()
    for sub in _subschemas(schema):
        _normalize(sub)


def _subschemas(schema: dict[str, Any]) -> list[dict[str, Any]]:
    subs: list[Any] = [schema.get(key) for key in _SUBSCHEMA_KEYS]
    for key in _SUBSCHEMA_LIST_KEYS:
        subs.extend(schema.get(key) or ())
    for key in _SUBSCHEMA_MAP_KEYS:
        subs.extend((schema.get(key) or {}).values())
    return [sub for sub in subs if isinstance(sub, dict)]


def check_provider_schema(schema: dict[str, Any]) -> list[str]:
    """List what keeps `schema` from being accepted as tool parameters by LLM providers.

    Checks: root `"type": "object"` with `properties`; no `$ref`/`$defs` anywhere; every object with
    `properties` has `additionalProperties: false` and a `required` list naming only its properties;
    no `title` keys. Returns [] for a good schema; never raises.
    """
    problems: list[str] = []
    if not isinstance(schema, dict):
        return [f"schema must be a JSON object, got `{type(schema).__name__}`"]
    if schema.get("type") != "object":
        problems.append(f"root `type` must be \"object\", got {schema.get('type')!r} - at `$`")
    if not isinstance(schema.get("properties"), dict):
        problems.append("root must have a `properties` object - at `$`")
    _check_node(schema, "$", problems)
    return problems


def _check_node(node: dict[str, Any], path: str, problems: list[str]) -> None:
    for key in ("$ref", "$defs", "definitions", "title"):
        if key in node:
            problems.append(f"`{key}` is not allowed - at `{path}`")
    if isinstance(node.get("properties"), dict):
        _check_object(node, path, problems)
    for key in _SUBSCHEMA_KEYS:
        if isinstance(node.get(key), dict):
            _check_node(node[key], f"{path}.{key}", problems)
    for key in _SUBSCHEMA_LIST_KEYS:
        for i, sub in enumerate(node.get(key) or ()):
            if isinstance(sub, dict):
                _check_node(sub, f"{path}.{key}[{i}]", problems)
    for key in _SUBSCHEMA_MAP_KEYS:
        for name, sub in (node.get(key) or {}).items():
            if isinstance(sub, dict):
                _check_node(sub, f"{path}.{key}.{name}", problems)


def _check_object(node: dict[str, Any], path: str, problems: list[str]) -> None:
    if node.get("type") != "object":
        problems.append(f"an object with `properties` needs `\"type\": \"object\"` - at `{path}`")
    if node.get("additionalProperties") is not False:
        problems.append(f"`additionalProperties` must be false - at `{path}`")
    required = node.get("required", [])
    if not isinstance(required, list):
        problems.append(f"`required` must be a list - at `{path}`")
        return
    for name in required:
        if name not in node["properties"]:
            problems.append(f"`required` names `{name}`, which is not a property - at `{path}`")
