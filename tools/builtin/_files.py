"""File tools confined to the worker's workspace: read_file, write_file, list_dir, search_files.

Every path goes through `ToolContext.resolve_path`, which resolves `..` and symlinks and refuses
anything outside the workspace; writes (write_file) also refuse the protected paths of
`tools.sandbox` (the bus's Python environment, `.git`, the topology file in use).
"""

from __future__ import annotations

import contextlib
import fnmatch
import itertools
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, NamedTuple, TextIO

import msgspec
import re2  # no stubs (pyproject's [tool.mypy] overrides); used through `_grep.Matcher`

from agent_bus.bus.messages import ImagePart
from agent_bus.tools._context import ToolContext
from agent_bus.tools._exceptions import ToolError, WorkspaceError
from agent_bus.tools._tool import tool
from agent_bus.tools.builtin import _grep

MAX_READ_CHARS = 256 * 1024
MAX_LINE_CHARS = 2000
MAX_IMAGE_BYTES = 5 * 1024 * 1024
MAX_DIR_ENTRIES = 1000
MAX_MATCHES = 200
SKIP_DIRS = frozenset({".git", ".hg", ".svn", "node_modules", "__pycache__", ".venv", "venv",
                       ".mypy_cache", ".pytest_cache", ".ruff_cache", ".tox"})
#: Seconds a search (or a read) may run; it then stops and says so. Enforced by the tool itself
#: (checked between lines, or by killing the `re` child process), not by abandoning a thread.
SEARCH_TIME_LIMIT = 10.0
READ_TIME_LIMIT = 10.0
#: Characters a long line is read in: memory stays bounded, whatever the line's length.
READ_CHUNK_CHARS = 64 * 1024
_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False  # a refused pattern is reported to the model, not to stderr
IMAGE_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg",
               ".gif": "image/gif", ".webp": "image/webp"}

PathArg = Annotated[
    str,
    msgspec.Meta(
        min_length=1,
        description="Path relative to the workspace root (absolute paths must lie inside it).",
    ),
]


@tool(idempotent=True, timeout=READ_TIME_LIMIT + 5)
def read_file(
    path: PathArg,
    ctx: ToolContext,
    offset: Annotated[int, msgspec.Meta(ge=1, description="First line to return (1-based).")] = 1,
    limit: Annotated[
        int, msgspec.Meta(ge=1, le=5000, description="Maximum number of lines to return.")
    ] = 2000,
    column: Annotated[
        int,
        msgspec.Meta(
            ge=1, description="First character of each line to show (1-based): to read on in a "
            "line that was cut."
        ),
    ] = 1,
) -> str | ImagePart:
    """Read a text file from the workspace, optionally a range of lines.
    Output is capped at 256 KiB; lines over 2000 characters are cut, with a note giving the
    `column` to read on from. When more lines follow, the text ends with a note giving the
    `offset` to continue from. PNG, JPEG, GIF and WebP files are returned as images.
    """
    target = _existing(ctx, path)
    if target.is_dir():
        raise ToolError(f"`{path}` is a directory; use list_dir to see its contents")
    mime = IMAGE_TYPES.get(target.suffix.lower())
    if mime is not None:
        return _read_image(target, path, mime)
    _refuse_binary(target, path)
    deadline = time.monotonic() + READ_TIME_LIMIT
    return _read_lines(target, offset, limit, column,
                       lambda: ctx.cancelled or time.monotonic() >= deadline)


def _read_image(target: Path, path: str, mime: str) -> ImagePart:
    size = target.stat().st_size
    if size > MAX_IMAGE_BYTES:
        raise ToolError(f"Image `{path}` is {size} bytes; the limit is {MAX_IMAGE_BYTES} bytes")
    return ImagePart(target.read_bytes(), mime_type=mime)


class _Line(NamedTuple):
    shown: str  # characters [column-1, column-1+MAX_LINE_CHARS) of the line, without its end
    length: int  # characters in the line, without its end
    end: str  # "\n", "\r\n", "\r", or "" for a last line without one


class _OutOfTime(Exception):
    """The read passed READ_TIME_LIMIT (or the call was cancelled)."""


def _read_lines(
    target: Path, offset: int, limit: int, column: int, stop: Callable[[], bool]
) -> str:
    out: list[str] = []
    size = 0
    number = 0
    last: _Line | None = None
    with target.open(encoding="utf-8", errors="replace", newline="") as f:
        try:
            while (line := _read_line(f, column - 1, stop)) is not None:
                number += 1
                if number < offset:
                    last = line
                    continue
                text = _shown(line, number, column)
                if out and size + len(text) > MAX_READ_CHARS:
                    return "".join(out) + _more_note(offset, number)
                out.append(text)
                size += len(text)
                if len(out) == limit:
                    return "".join(out) + (_more_note(offset, number + 1) if f.read(1) else "")
        except _OutOfTime:
            return _out_of_time(out, offset, number + 1)
    if not out and offset > 1:
        return _past_the_end(offset, number, last, column)
    return "".join(out)


def _past_the_end(offset: int, lines: int, last: _Line | None, column: int) -> str:
    """Where the file ends, and its last line: a model that guessed an offset (a small one
    often does, asked about a file's end) gets what it was after instead of only a refusal."""
    if last is None:
        return f"[offset {offset} is past the end of the file: it is empty]"
    return (f"[offset {offset} is past the end of the file: it has {lines} lines; the last one "
            f"is]\n{_shown(last, lines, column)}")


def _read_line(f: TextIO, start: int, stop: Callable[[], bool]) -> _Line | None:
    """The next line, read in chunks that are dropped once seen: memory stays bounded however
    long the line is. Keeps MAX_LINE_CHARS characters from `start` on. None at end of file."""
    kept: list[str] = []
    length = 0
    while True:
        if stop():
            raise _OutOfTime
        chunk = f.readline(READ_CHUNK_CHARS)
        if not chunk:
            return _Line("".join(kept), length, "") if length else None
        body, end = _split_end(f, chunk)
        lo = start - length
        kept.append(body[max(lo, 0):max(lo + MAX_LINE_CHARS, 0)])
        length += len(body)
        if end or len(chunk) < READ_CHUNK_CHARS:  # a line end, or the end of the file
            return _Line("".join(kept), length, end)


def _split_end(f: TextIO, chunk: str) -> tuple[str, str]:
    for end in ("\r\n", "\n"):
        if chunk.endswith(end):
            return chunk[: -len(end)], end
    if not chunk.endswith("\r"):
        return chunk, ""
    if len(chunk) == READ_CHUNK_CHARS:  # the chunk limit may have split a "\r\n"
        position = f.tell()
        if f.read(1) == "\n":
            return chunk[:-1], "\r\n"
        f.seek(position)
    return chunk[:-1], "\r"


def _shown(line: _Line, number: int, column: int) -> str:
    if column == 1 and len(line.shown) == line.length:
        return line.shown + line.end
    if not line.shown:
        return f"[line {number} has {line.length} characters; column {column} is past its end]\n"
    last = column - 1 + len(line.shown)
    more = (f"; call read_file with offset={number}, limit=1, column={last + 1} to read on"
            if last < line.length else "")
    return (f"{line.shown}…[line {number} cut: showing characters {column}-{last} "
            f"of {line.length}{more}]\n")


def _more_note(offset: int, next_line: int) -> str:
    return (f"\n[Showing lines {offset}-{next_line - 1}; more follow: call read_file with "
            f"offset={next_line}]")


def _out_of_time(out: list[str], offset: int, number: int) -> str:
    if not out:
        raise ToolError(
            f"read_file stopped at its {READ_TIME_LIMIT:g}s time limit while reading line "
            f"{number}, before reaching offset {offset}; the file is too large to read this far "
            f"by lines"
        )
    return "".join(out) + (
        f"\n[Showing lines {offset}-{number - 1}; read_file stopped at its {READ_TIME_LIMIT:g}s "
        f"time limit in line {number}: call read_file with offset={number} to continue]"
    )


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


@tool(idempotent=True, timeout=SEARCH_TIME_LIMIT + 5)
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
    Returns one `path:line: text` per match, stopping after 200 matches or 10 seconds. Skips
    binary files, files over 2 MiB and directories such as `.git` and `node_modules`. Patterns
    run on RE2 (linear time; `\\d`, `\\w`, `\\b` match ASCII only); ones RE2 lacks, such as
    backreferences and lookarounds, run on Python's `re` in a separate process.
    """
    regex, re2_refusal = _compile(pattern)
    root = _existing(ctx, path)
    deadline = time.monotonic() + SEARCH_TIME_LIMIT

    def stop() -> bool:
        return ctx.cancelled or time.monotonic() >= deadline

    files = _searchable_files(ctx, root, glob, stop)
    if regex is not None:
        hits = _grep.matches(files, regex, stop)
    else:
        hits = _grep.matches_in_child(pattern, files, stop, SEARCH_TIME_LIMIT)
    with contextlib.closing(hits):  # closing stops (kills) a child search
        try:
            found = list(itertools.islice(hits, MAX_MATCHES + 1))
        except RuntimeError as exc:
            raise ToolError(f"Searching for `{pattern}` failed in the `re` process: {exc}") from exc
    timed_out = time.monotonic() >= deadline and len(found) <= MAX_MATCHES
    return _search_report(pattern, found, timed_out, re2_refusal)


def _searchable_files(
    ctx: ToolContext, root: Path, glob: str | None, stop: Callable[[], bool]
) -> Iterator[tuple[str, Path]]:
    """(name to show, confined path) of each file to search; a symlink leading out is skipped."""
    for file in _walk(ctx, root, glob):
        if stop():
            return
        try:
            yield _rel(ctx, file), ctx.resolve_path(file, write=False)
        except WorkspaceError:
            continue


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


def _compile(pattern: str) -> tuple[_grep.Matcher | None, str]:
    """RE2's compiled pattern, or None and RE2's reason when only Python's `re` can run it."""
    try:
        re.compile(pattern)  # the tool promises Python syntax: its errors are the ones to show
    except re.error as exc:
        raise ToolError(f"Invalid regular expression `{pattern}`: {exc}") from exc
    try:
        return re2.compile(pattern, _RE2_OPTIONS), ""
    except re2.error as exc:
        reason = exc.args[0] if exc.args else exc
        return None, reason.decode(errors="replace") if isinstance(reason, bytes) else str(reason)


def _search_report(pattern: str, found: list[str], timed_out: bool, re2_refusal: str) -> str:
    if len(found) > MAX_MATCHES:
        return "\n".join(found[:MAX_MATCHES]) + f"\n[stopped after {MAX_MATCHES} matches]"
    if timed_out and found:
        return "\n".join(found) + (
            f"\n[stopped at the {SEARCH_TIME_LIMIT:g}s time limit; narrow `path` or `glob` to "
            f"search the rest]"
        )
    if timed_out:
        why = (f" The pattern needs Python's backtracking `re` (RE2: {re2_refusal}), which can "
               f"take exponential time; simplify it." if re2_refusal else "")
        raise ToolError(
            f"search_files stopped at its {SEARCH_TIME_LIMIT:g}s time limit before finding "
            f"`{pattern}`; narrow `path` or `glob`.{why}"
        )
    return "\n".join(found) if found else f"No matches for `{pattern}`"


# --- helpers ---------------------------------------------------------------------------------


def _existing(ctx: ToolContext, path: str) -> Path:
    """An existing path to read (reading the protected paths is fine: writing them is not)."""
    target = ctx.resolve_path(path, write=False)
    if not target.exists():
        raise ToolError(f"`{path}` does not exist in the workspace")
    return target


def _rel(ctx: ToolContext, target: Path) -> str:
    try:
        return target.relative_to(ctx.workspace).as_posix() or "."
    except ValueError:
        return str(target)


def _is_binary(file: Path) -> bool:
    with file.open("rb") as f:
        return b"\0" in f.read(8192)


def _refuse_binary(target: Path, path: str) -> None:
    if _is_binary(target):
        raise ToolError(f"`{path}` looks like a binary file (it contains NUL bytes); not shown")

