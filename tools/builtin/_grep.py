"""The search behind `search_files`: read the files it was given, match their lines.

The caller walks the workspace and confines each file (`ToolContext.resolve_path`); this module
only reads and matches, under a `stop()` condition.

Standard library only, because this file also runs on its own as a child process
(`python -I _grep.py`, the spec as JSON on stdin, one JSON match per stdout line): a pattern RE2
cannot compile (backreferences, lookarounds) is matched by Python's backtracking `re` there, where
a runaway match holds only the child's GIL and is killed at the deadline (`matches_in_child`).
The child also caps its own CPU time and memory, in case the worker dies without killing it.
"""

from __future__ import annotations

import json
import math
import os
import re
import select
import subprocess
import sys
from collections.abc import Callable, Generator, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

MAX_SEARCH_FILE_BYTES = 2 * 1024 * 1024
MAX_SHOWN_CHARS = 300
#: How often the parent wakes to check its deadline while the child is silent.
POLL_SECONDS = 0.05
CHILD_MEMORY_BYTES = 1024 * 1024 * 1024


class Matcher(Protocol):
    """A compiled pattern (an `re` or `re2` one): only `search` is used."""

    def search(self, string: str) -> Any: ...


# --- the search (in-process, or inside the child) ----------------------------------------------


def matches(files: Iterable[tuple[str, Path]], matcher: Matcher, stop: Callable[[], bool]
            ) -> Generator[str, None, None]:
    """Yield `rel:line: text` for every matching line of `files` (pairs of the name to show and
    the path, already confined to the workspace by the caller), until done or `stop()` is true.

    `stop` is asked before each file and each line, so the search ends within one line's match
    time of its deadline (with RE2, linear in the line, which is at most 2 MiB).
    """
    for rel, file in files:
        if stop():
            return
        text = _searchable_text(file)
        if text is None:
            continue
        for number, line in enumerate(text.splitlines(), start=1):
            if stop():
                return
            if matcher.search(line):
                yield f"{rel}:{number}: {line[:MAX_SHOWN_CHARS]}"


def _searchable_text(file: Path) -> str | None:
    """The text, or None to skip the file: not a regular file, big, binary or unreadable."""
    try:
        if not file.is_file() or file.stat().st_size > MAX_SEARCH_FILE_BYTES:
            return None
        data = file.read_bytes()
    except OSError:
        return None
    if b"\0" in data[:8192]:
        return None
    return data.decode("utf-8", errors="replace")


# --- the child process -------------------------------------------------------------------------


def matches_in_child(
    pattern: str, files: Iterable[tuple[str, Path]], stop: Callable[[], bool], cpu_seconds: float
) -> Generator[str, None, None]:
    """`matches` with Python's `re`, run in a child process that is killed when `stop()` is true
    or the caller stops iterating. Raises RuntimeError if the child fails."""
    listed = [(rel, str(file)) for rel, file in files]  # the child reads them all, then writes
    spec = {"pattern": pattern, "files": listed, "cpu_seconds": math.ceil(cpu_seconds) + 1}
    child = subprocess.Popen(
        [sys.executable, "-I", "-S", __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert child.stdin is not None and child.stdout is not None  # opened with PIPE
        child.stdin.write(json.dumps(spec).encode())
        child.stdin.close()
        yield from _child_lines(child.stdout.fileno(), stop)
        if not stop() and child.wait() != 0:
            assert child.stderr is not None
            error = child.stderr.read().decode(errors="replace").strip().splitlines()
            raise RuntimeError(error[-1] if error else f"exit code {child.returncode}")
    finally:
        child.kill()  # no-op once it exited; a runaway `re` is stopped here
        child.wait()
        for stream in (child.stdin, child.stdout, child.stderr):
            if stream is not None:
                stream.close()


def _child_lines(fd: int, stop: Callable[[], bool]) -> Iterator[str]:
    pending = b""
    while not stop():
        ready, _, _ = select.select([fd], [], [], POLL_SECONDS)
        if not ready:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            return
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            yield json.loads(line)


def _child_main() -> None:
    spec = json.load(sys.stdin)
    _limit_self(spec["cpu_seconds"])
    matcher = re.compile(spec["pattern"])
    files = [(rel, Path(file)) for rel, file in spec["files"]]
    for hit in matches(files, matcher, lambda: False):
        # JSON keeps every line on one stdout line, whatever separators the text holds.
        sys.stdout.write(json.dumps(hit) + "\n")
        sys.stdout.flush()


def _limit_self(cpu_seconds: int) -> None:
    """If the worker dies without killing us, the kernel ends a runaway match (SIGXCPU)."""
    import resource

    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY_BYTES, CHILD_MEMORY_BYTES))


if __name__ == "__main__":
    try:
        _child_main()
    except BrokenPipeError:  # the parent stopped reading: it has what it needs
        sys.exit(0)
