"""What a tool returns (or raises), mapped to the `ToolResult` that goes on the wire.

    str                          -> one text part
    None                         -> one empty text part ""
    bytes                        -> one image part (MIME type sniffed from the magic bytes)
    Image / TextPart / ImagePart -> that part; a list of only such parts -> those parts
    ToolResult                   -> as is (to set `details` or `is_error` yourself)
    Done(message)                -> done=True, done_message=message, text "Task complete"
    anything msgspec encodes     -> its JSON text (falling back to `str(value)`)

    raise TaskComplete(message)  -> same as Done(message)
    raise <any other Exception>  -> is_error=True, text "Error: <message>"
"""

from __future__ import annotations

from typing import Any

import msgspec

from agent_bus.bus.messages import ImagePart, TextPart, ToolResult, error_result

#: An image returned by a tool: `Image(data, mime_type="image/png")`. Same type as `ImagePart`.
Image = ImagePart

TASK_COMPLETE_TEXT = "Task complete"

_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
)


class TaskComplete(Exception):
    """Raise from a tool to end the agent's run; `message` becomes the run's final answer."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or TASK_COMPLETE_TEXT)
        self.message = message


class Done(msgspec.Struct, frozen=True):
    """Return from a tool to end the agent's run; `message` becomes the run's final answer."""

    message: str | None = None


def done_result(message: str | None) -> ToolResult:
    return ToolResult(content=[TextPart(TASK_COMPLETE_TEXT)], done=True, done_message=message)


def to_result(value: Any) -> ToolResult:
    """Map a tool's return value to a ToolResult (see the module docstring). Never raises."""
    if isinstance(value, ToolResult):
        return value
    if isinstance(value, Done):
        return done_result(value.message)
    return ToolResult(content=to_content(value))


def to_content(value: Any) -> list[TextPart | ImagePart]:
    """Map a return value (or a progress update) to content parts. Never raises."""
    if value is None:
        return [TextPart("")]
    if isinstance(value, str):
        return [TextPart(value)]
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        return [ImagePart(data, mime_type=sniff_image_type(data))]
    if isinstance(value, (TextPart, ImagePart)):
        return [value]
    if isinstance(value, (list, tuple)) and value and all(
        isinstance(item, (TextPart, ImagePart)) for item in value
    ):
        return list(value)
    return [TextPart(_json_text(value))]


def exception_result(exc: Exception) -> ToolResult:
    """`TaskComplete` ends the run; any other exception becomes `Error: <message>`."""
    if isinstance(exc, TaskComplete):
        return done_result(exc.message)
    return error_result(f"Error: {str(exc) or type(exc).__name__}")


def sniff_image_type(data: bytes) -> str:
    """The MIME type of an image from its magic bytes; "image/png" when unknown."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    for magic, mime in _MAGIC:
        if data.startswith(magic):
            return mime
    return "image/png"


def _json_text(value: Any) -> str:
    try:
        return msgspec.json.encode(value).decode()
    except (TypeError, ValueError, OverflowError):
        return str(value)
