"""The tool API: turn typed Python functions into tools that models can call over the bus.

    from agent_bus.tools import tool, ToolContext

    @tool(timeout=30)
    def count_words(text: str, ctx: ToolContext) -> int:
        \"\"\"Count the words in a text.\"\"\"
        return len(text.split())

A tool worker finds tools with `load_tools("pkg.module")`, publishes each `Tool.info`, and answers
each call with `await run_tool(t, request, workspace=..., allow_shell=...)`.
"""

from agent_bus.bus.messages import ImagePart, TextPart, ToolInfo, ToolResult
from agent_bus.tools._context import ProgressCallback, ToolContext
from agent_bus.tools._exceptions import (
    ArgumentsError,
    ToolDefinitionError,
    ToolError,
    ToolLoadError,
    WorkspaceError,
)
from agent_bus.tools._loader import load_tools
from agent_bus.tools._results import Done, Image, TaskComplete, to_result
from agent_bus.tools._runner import CANCEL_GRACE, run_tool
from agent_bus.tools._schema import check_provider_schema
from agent_bus.tools._tool import Tool, tool

__all__ = [
    "ArgumentsError",
    "CANCEL_GRACE",
    "Done",
    "Image",
    "ImagePart",
    "ProgressCallback",
    "TaskComplete",
    "TextPart",
    "Tool",
    "ToolContext",
    "ToolDefinitionError",
    "ToolError",
    "ToolInfo",
    "ToolLoadError",
    "ToolResult",
    "WorkspaceError",
    "check_provider_schema",
    "load_tools",
    "run_tool",
    "to_result",
    "tool",
]
