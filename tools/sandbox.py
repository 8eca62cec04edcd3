"""What tools may never write, and the OS sandbox (bubblewrap) that enforces it.

Two layers, so that the first holds where the second cannot be set up:

1. `check_writable()` (called by `confine()` for every path a tool writes): refuses the paths
   whose content runs as code outside the tools' control — the Python environment that runs the
   bus (every `sys.path` entry, `sys.prefix`, the directories of the modules this process loaded:
   an editable install's sources too), any `.git` directory (hooks run at the user's next
   commit), the topology file in use and a worker group's `read_only` list. A `.pth` file
   written into the venv's site-packages would otherwise run in the next gateway, with its keys.
2. `bwrap_argv()`: the worker process itself runs under bubblewrap — the root file system
   read-only, the workspace writable with the protected paths bound read-only over it, the state
   directories hidden, a private /tmp, its own PID namespace (it sees no other process's
   /proc/PID/environ) and user namespace, no capabilities. MCP servers and `run_shell` are its
   children, so they inherit it; each `run_shell` call gets a nested sandbox of its own
   (`shell_argv()`: new PID namespace, no network unless the group allows it), so nothing a
   call starts outlives it.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

import msgspec

log = logging.getLogger("tools.sandbox")

SandboxMode = Literal["auto", "required", "off"]
SANDBOX_MODES: tuple[str, ...] = ("auto", "required", "off")

#: Set in a sandboxed worker's environment (by `exec_in_sandbox`): the sandbox it runs in, as JSON.
SANDBOX_ENV = "BUSCTL_SANDBOX"

#: The uid a root worker runs as inside its user namespace (mapped to root outside, so the
#: workspace stays writable): a non-zero uid is what lets it make a nested namespace for each
#: `run_shell` call without CAP_SETFCAP (the kernel refuses to map uid 0 without it).
ROOT_INNER_UID = 1000

_reasons: dict[Path, str] = {}  # protected path -> why (added to by `protect`)


class SandboxInfo(msgspec.Struct, omit_defaults=True):
    """What a worker reports of its sandbox (ready line, registration meta, `busctl ps`)."""

    kind: str  # "bwrap" or "none"
    writable: list[str] = msgspec.field(default_factory=list)
    network: bool = True  # whether the worker (not its shell calls) has the network
    shell: str = ""  # how run_shell calls are contained: "bwrap" (own PID ns) or "process-group"
    shell_network: bool = False
    reason: str = ""  # kind "none": why


# --- layer 1: the path filter ---------------------------------------------------------------


def protect(paths: Iterable[str | os.PathLike[str]], why: str) -> None:
    """Add paths tools may not write (the topology file in use, a group's `read_only` list)."""
    for path in paths:
        _reasons.setdefault(_resolved(path), why)
    _bus_roots.cache_clear()


def protected_paths() -> dict[Path, str]:
    """Every protected path (resolved) and why it is protected."""
    return {**_bus_roots(), **_reasons}


@functools.lru_cache(maxsize=1)
def _bus_roots() -> dict[Path, str]:
    """The Python environment of this process: what a later bus process would run.

    Computed once (the modules a worker loads come before its first call); `protect` renews it.
    """
    env = ("part of the Python environment that runs the bus (a file written there runs as code "
           "in the next bus process)")
    roots: dict[Path, str] = {}
    for entry in (sys.prefix, sys.exec_prefix, *sys.path):
        if entry and os.path.isdir(entry):
            roots.setdefault(_resolved(entry), env)
    for name, module in list(sys.modules.items()):
        where = _module_root(name, module)
        if where is not None:
            roots.setdefault(where, f"the code of module `{name}`, loaded by the bus")
    return roots


def _module_root(name: str, module: object) -> Path | None:
    """A top-level package's directory, or a top-level module's file (an editable install's
    sources are found this way: they are not on sys.path when a finder maps them)."""
    if "." in name:
        return None
    file = getattr(module, "__file__", None)
    if not isinstance(file, str) or not file:
        return None
    path = Path(file)
    return _resolved(path.parent if getattr(module, "__path__", None) else path)


def _resolved(path: str | os.PathLike[str]) -> Path:
    return Path(os.path.abspath(os.path.expanduser(os.fspath(path)))).resolve()


def check_writable(workspace: Path, resolved: Path, raw: str) -> str:
    """Why a tool may not write `resolved` ("" when it may). `workspace` is resolved.

    Protected paths that contain the workspace do not count: a project whose own folder is on
    sys.path (`python -m` from it) would otherwise have no writable file at all.
    """
    inner = resolved.relative_to(workspace) if resolved.is_relative_to(workspace) else resolved
    if ".git" in inner.parts:
        return (f"Path `{raw}` is inside a `.git` directory, which tools may not write (its hooks "
                "run at the user's next git command); write elsewhere in the workspace")
    for root, why in protected_paths().items():
        if workspace.is_relative_to(root):
            continue
        if resolved == root or resolved.is_relative_to(root):
            return (f"Path `{raw}` is read-only for tools: `{root}` is {why}; write elsewhere in "
                    "the workspace")
    return ""


def protected_inside(workspace: Path) -> list[Path]:
    """The protected paths that exist inside `workspace` (what the sandbox binds read-only)."""
    found = {root for root in protected_paths() if root != workspace
             and root.is_relative_to(workspace) and root.exists()}
    git = workspace / ".git"
    if git.exists():
        found.add(git)
    # an inner path under an outer one is covered by it
    return sorted(p for p in found if not any(p != q and p.is_relative_to(q) for q in found))
