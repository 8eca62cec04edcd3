"""File tools confined to the worker's workspace: read_file, write_file, list_dir, search_files.

Every path goes through `ToolContext.resolve_path`, which resolves `..` and symlinks and refuses
anything outside the workspace.
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import msgspec

from bus.messages import ImagePart
from tools._context import ToolContext
from tools._exceptions import ToolError, WorkspaceError
from tools._tool import tool

MAX_READ_CHARS = 256 * 1024
MAX_LINE_CHARS = 2000
MAX_IMAGE_BYTES = 5 * 1024 * 1024
MAX_DIR_ENTRIES = 1000
MAX_MATCHES = 200
MAX_SEARCH_FILE_BYTES = 2 * 1024 * 1024
SKIP_DIRS = frozenset({".git", ".hg", ".svn", "node_modules", "__pycache__", ".venv", "venv",
                       ".mypy_cache", ".pytest_cache", ".ruff_cache", ".tox"})
IMAGE_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg",
               ".gif": "image/gif", ".webp": "image/webp"}

PathArg = Annotated[
    str,
    msgspec.Meta(
        min_length=1,
        description="Path relative to the workspace root (absolute paths must lie inside it).",
    ),
]


@tool(idempotent=True)
def read_file(
    path: PathArg,
    ctx: ToolContext,
    offset: Annotated[int, msgspec.Meta(ge=1, description="First line to return (1-based).")] = 1,
    limit: Annotated[
        int, msgspec.Meta(ge=1, le=5000, description="Maximum number of lines to return.")
    ] = 2000,
) -> str | ImagePart:
    """Read a text file from the workspace, optionally a range of lines.
    Output is capped at 256 KiB (lines over 2000 characters are cut); when more lines follow, the
    text ends with a note giving the `offset` to continue from. PNG, JPEG, GIF and WebP files are
    returned as images.
    """
    target = _existing(ctx, path)
    if target.is_dir():
        raise ToolError(f"`{path}` is a directory; use list_dir to see its contents")
    mime = IMAGE_TYPES.get(target.suffix.lower())
    if mime is not None:
        return _read_image(target, path, mime)
    _refuse_binary(target, path)
    return _read_lines(target, offset, limit)


def _read_image(target: Path, path: str, mime: str) -> ImagePart:
    size = target.stat().st_size
    if size > MAX_IMAGE_BYTES:
        raise ToolError(f"Image `{path}` is {size} bytes; the limit is {MAX_IMAGE_BYTES} bytes")
    return ImagePart(target.read_bytes(), mime_type=mime)


def _read_lines(target: Path, offset: int, limit: int) -> str:
    lines: list[str] = []
    size = 0
    with target.open(encoding="utf-8", errors="replace", newline="") as f:
        for number, line in enumerate(f, start=1):
            if number < offset:
                continue
            if len(lines) == limit or size + len(line) > MAX_READ_CHARS:
                shown = f"lines {offset}-{number - 1}" if lines else "no lines"
                return "".join(lines) + f"\n[Showing {shown}; more follow: call read_file with offset={number}]"
            line = line if len(line) <= MAX_LINE_CHARS else line[:MAX_LINE_CHARS] + "…[line cut]\n"
            lines.append(line)
            size += len(line)
    if not lines and offset > 1:
        return f"[offset {offset} is past the end of the file]"
    return "".join(lines)


@tool(idempotent=True)
def write_file(
    path: PathArg,
    content: Annotated[str, msgspec.Meta(description="The complete new content of the file (UTF-8).")],
    ctx: ToolContext,
) -> str:
    """Create or overwrite a text file in the workspace with the given content.
    Missing parent directories are created.
    """
    target = ctx.resolve_path(path)
    if target.is_dir():
        raise ToolError(f"`{path}` is a directory; give a file path")
    target.parent.mkdir(parents=True, exist_ok=True)
    data = content.encode("utf-8")
    target.write_bytes(data)
    return f"Wrote {len(data)} bytes to {_rel(ctx, target)}"


@tool(idempotent=True)
def list_dir(
    ctx: ToolContext,
    path: Annotated[
        str, msgspec.Meta(description="Directory relative to the workspace root; default: the root.")
    ] = ".",
) -> str:
    """List a workspace directory, one entry per line, sorted by name.
    Directories end in `/`, symlinks in `@`, and files show their size in bytes.
    """
    target = _existing(ctx, path)
    if not target.is_dir():
        raise ToolError(f"`{path}` is not a directory; use read_file to read a file")
    entries = sorted(os.scandir(target), key=lambda e: e.name)
    lines = [_describe_entry(entry) for entry in entries[:MAX_DIR_ENTRIES]]
    if len(entries) > MAX_DIR_ENTRIES:
        lines.append(f"[{len(entries) - MAX_DIR_ENTRIES} more entries not shown]")
    return "\n".join(lines) if lines else f"[`{path}` is empty]"


def _describe_entry(entry: os.DirEntry[str]) -> str:
    if entry.is_symlink():
        return f"{entry.name}@"
    if entry.is_dir():
        return f"{entry.name}/"
    return f"{entry.name}  ({entry.stat().st_size} bytes)"


@tool(idempotent=True)
def search_files(
    pattern: Annotated[
        str, msgspec.Meta(min_length=1, description="Python regular expression searched in each line.")
    ],
    ctx: ToolContext,
    path: Annotated[
        str, msgspec.Meta(description="File or directory to search, relative to the workspace root.")
    ] = ".",
    glob: Annotated[
        str | None,
        msgspec.Meta(
            description="Only search files matching this glob (e.g. `*.py`); matched against the "
            "file name, or the relative path when it contains `/`."
        ),
    ] = None,
) -> str:
    """Search workspace text files for lines matching a regular expression.
    Returns one `path:line: text` per match, stopping after 200 matches. Skips binary files,
    files over 2 MiB and directories such as `.git` and `node_modules`.
    """
    try:
        regex = re.compile(pattern)
    except re.error as exc:
        raise ToolError(f"Invalid regular expression `{pattern}`: {exc}") from exc
    root = _existing(ctx, path)
    matches: list[str] = []
    for file in _walk(ctx, root, glob):
        if ctx.cancelled:
            break
        matches.extend(_grep(ctx, file, regex, MAX_MATCHES + 1 - len(matches)))
        if len(matches) > MAX_MATCHES:
            return "\n".join(matches[:MAX_MATCHES]) + f"\n[stopped after {MAX_MATCHES} matches]"
    return "\n".join(matches) if matches else f"No matches for `{pattern}`"


def _walk(ctx: ToolContext, root: Path, glob: str | None) -> Iterator[Path]:
    if root.is_file():
        yield root
        return
    for directory, dirs, files in os.walk(root):  # does not follow symlinked directories
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        for name in sorted(files):
            file = Path(directory, name)
            if glob is None or _glob_match(glob, _rel(ctx, file), name):
                yield file


def _glob_match(glob: str, rel: str, name: str) -> bool:
    return fnmatch.fnmatch(rel if "/" in glob else name, glob)


def _grep(ctx: ToolContext, file: Path, regex: re.Pattern[str], room: int) -> list[str]:
    rel = _rel(ctx, file)
    try:
        file = ctx.resolve_path(file)  # a symlink may point outside
        if not file.is_file() or file.stat().st_size > MAX_SEARCH_FILE_BYTES or _is_binary(file):
            return []
        text = file.read_text(encoding="utf-8", errors="replace")
    except (WorkspaceError, OSError):
        return []
    found: list[str] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if regex.search(line):
            found.append(f"{rel}:{number}: {line[:300]}")
            if len(found) >= room:
                break
    return found


# --- helpers ---------------------------------------------------------------------------------


def _existing(ctx: ToolContext, path: str) -> Path:
    target = ctx.resolve_path(path)
    if not target.exists():
        raise ToolError(f"`{path}` does not exist in the workspace")
    return target


def _is_binary(file: Path) -> bool:
    with file.open("rb") as f:
        return b"\0" in f.read(8192)


def _refuse_binary(target: Path, path: str) -> None:
    if _is_binary(target):
        raise ToolError(f"`{path}` looks like a binary file (it contains NUL bytes); not shown")


def _rel(ctx: ToolContext, target: Path) -> str:
    try:
        return target.relative_to(ctx.workspace).as_posix() or "."
    except ValueError:
        return str(target)
