"""`load_tools`: find the `@tool`s of a module given by dotted name or by `.py` path."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

from agent_bus.tools._exceptions import ToolLoadError
from agent_bus.tools._tool import Tool


def load_tools(spec: str) -> list[Tool]:
    """Import `spec` and return every `Tool` among its module attributes, in definition order.

    `spec` is a dotted module name (importable from the current directory, which is put on
    `sys.path`) or a path to a `.py` file. Raises ToolLoadError naming the module and the cause when
    the import fails, when it defines no tools, or when two of its tools share a name.
    """
    spec = _RENAMED.get(spec, spec)
    module = _import_file(spec) if _looks_like_path(spec) else _import_dotted(spec)
    found = _collect(module)
    if not found:
        raise ToolLoadError(f"Tool module `{spec}` defines no @tool functions")
    return found


# The built-ins' name before everything moved under `agent_bus` (issue 31): topology files and
# scripts written for it keep working, whatever a `tools` package in the current folder holds.
_RENAMED = {"tools.builtin": "agent_bus.tools.builtin"}


def _looks_like_path(spec: str) -> bool:
    return spec.endswith(".py") or os.sep in spec or (os.altsep is not None and os.altsep in spec)


def _import_dotted(name: str) -> ModuleType:
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(name)
    except Exception as exc:
        raise ToolLoadError(
            f"Cannot import tool module `{name}`: {type(exc).__name__}: {exc}{_old_import(exc)}"
        ) from exc


def _import_file(spec: str) -> ModuleType:
    path = Path(spec).resolve()
    if not path.is_file():
        raise ToolLoadError(f"Cannot import tool module `{spec}`: no such file `{path}`")
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:8]
    name = f"_agent_bus_tools_{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ToolLoadError(f"Cannot import tool module `{spec}`: not a Python source file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # before exec: dataclasses and type hints look the module up
    try:
        module_spec.loader.exec_module(module)
    except BaseException as exc:
        del sys.modules[name]
        if not isinstance(exc, Exception):
            raise
        raise ToolLoadError(
            f"Cannot import tool module `{spec}`: {type(exc).__name__}: {exc}{_old_import(exc)}"
        ) from exc
    return module


# The top-level names agent-bus had before everything moved under `agent_bus` (issue 31).
_OLD_PACKAGES = frozenset({"tools", "bus", "agents"})


def _old_import(exc: Exception) -> str:
    """What to import instead, when a tool module failed on an import written for the old
    layout (`from tools import tool`: no module named `tools`, or a project's own `tools`)."""
    if not isinstance(exc, ImportError) or (exc.name or "").partition(".")[0] not in _OLD_PACKAGES:
        return ""
    return (f"; if this is agent-bus's `{exc.name}` (its name before agent-bus moved under one "
            f"package), import it from `agent_bus`: `from agent_bus import tool` "
            f"(`agent_bus.{exc.name}` for the rest)")


def _collect(module: ModuleType) -> list[Tool]:
    found: dict[str, Tool] = {}
    for value in vars(module).values():
        if not isinstance(value, Tool) or found.get(value.name) is value:
            continue
        if value.name in found:
            raise ToolLoadError(
                f"Tool module `{module.__name__}` defines two tools named `{value.name}`; "
                f"rename one with @tool(name=...)"
            )
        found[value.name] = value
    return list(found.values())
