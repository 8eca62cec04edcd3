"""Where a topology keeps its state (event log, conversations, logs), and how tools recognise it.

The state directory holds what the bus trusts: the event log, stored conversations, the running
topology. A model's tools must never reach it, so by default it lives outside the project, under
`$BUSCTL_STATE_HOME` (else `$XDG_STATE_HOME/agent-bus`, else `~/.local/state/agent-bus`), one
folder per project directory. Every state directory carries a marker file; the tools' path
confinement refuses any path inside a folder that has one, whatever the workspace is.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

STATE_HOME_ENV = "BUSCTL_STATE_HOME"
STATE_MARKER = ".agent-bus-state"
_MARKER_TEXT = ("agent-bus state directory: the event log, conversations and logs of a topology.\n"
                "Tools refuse every path inside a folder holding this file.\n")


def state_home() -> Path:
    """The folder that holds the default state directories of every project."""
    explicit = os.environ.get(STATE_HOME_ENV)
    if explicit:
        return Path(explicit).expanduser().resolve()
    xdg = os.environ.get("XDG_STATE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".local" / "state"
    return (base / "agent-bus").resolve()


def default_state_dir(project: Path | str | None = None) -> Path:
    """The state directory of `project` (default: the current directory), outside the project.

    Named `<folder>-<hash of its absolute path>` so two projects never share one and a person can
    still tell which is which.
    """
    root = Path(project or os.getcwd()).resolve()
    digest = hashlib.sha256(str(root).encode()).hexdigest()[:12]
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", root.name) or "root"
    return state_home() / f"{name}-{digest}"


def ensure_state_dir(path: Path | str) -> Path:
    """Create `path` (and parents) and mark it as a state directory; returns it resolved."""
    state = Path(path).resolve()
    state.mkdir(parents=True, exist_ok=True)
    marker = state / STATE_MARKER
    if not marker.exists():
        marker.write_text(_MARKER_TEXT)
    return state


def inside_state_dir(path: Path) -> Path | None:
    """The state directory that `path` (resolved) lies in, or None.

    Walks up from `path`: a handful of `stat` calls, cheap next to the file operation it guards.
    """
    for folder in (path, *path.parents):
        if (folder / STATE_MARKER).is_file():
            return folder
    return None


def overlaps(a: Path, b: Path) -> bool:
    """True when one of the two resolved folders contains the other (or they are the same)."""
    return a == b or a in b.parents or b in a.parents
