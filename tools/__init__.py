"""The tool API: turn typed Python functions into tools that models can call over the bus.

    from tools import tool, ToolContext

    @tool(timeout=30)
    def count_words(text: str, ctx: ToolContext) -> int:
        \"\"\"Count the words in a text.\"\"\"
        return len(text.split())

A tool worker finds tools with `load_tools("pkg.module")`, publishes each `Tool.info`, and answers
each call with `await run_tool(t, request, workspace=..., allow_shell=...)`.
"""

from bus.messages import ImagePart, TextPart, ToolInfo, ToolResult
from tools._context import ProgressCallback, ToolContext
from tools._exceptions import (
    ArgumentsError,
    ToolDefinitionError,
    ToolError,
    ToolLoadError,
    WorkspaceError,
)
from tools._loader import load_tools
from tools._results import Done, Image, TaskComplete, to_result
from tools._runner import CANCEL_GRACE, run_tool
from tools._schema import check_provider_schema
from tools._tool import Tool, tool

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
