"""The exceptions of the `tools` package.

    ToolError                  root of everything raised by the tool API
     ├── ToolDefinitionError   a function cannot become a tool (raised by `@tool`, at import time)
     ├── ToolLoadError         `load_tools` could not import a module or found no tools in it
     ├── ArgumentsError        a call's JSON arguments are malformed or fail validation
     └── WorkspaceError        a path names something outside the worker's workspace

`run_tool` never lets these escape: `ArgumentsError` and `WorkspaceError` (like any exception a tool
raises) become error `ToolResult`s. Only caller mistakes, `ToolDefinitionError` and `ToolLoadError`,
are raised to the caller. `TaskComplete` (in `_results`) is a control-flow signal, not an error.
"""

from __future__ import annotations

from agent_bus.bus.errors import AgentBusError


class ToolError(AgentBusError):
    """Root of the tool API's exceptions."""


class ToolDefinitionError(ToolError, TypeError):
    """A function cannot be turned into a tool (bad signature, unsupported type, bad name)."""


class ToolLoadError(ToolError):
    """`load_tools` failed: the module did not import, or it defines no tools."""


class ArgumentsError(ToolError):
    """A call's arguments are not valid JSON or do not match the tool's schema."""


class WorkspaceError(ToolError):
    """A path resolves (through `..` or symlinks) to somewhere outside the workspace."""
