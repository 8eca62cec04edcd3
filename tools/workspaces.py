"""Run workspaces: the folder of one run (and the runs it asks) inside a worker's workspace.

A tool call whose `ToolCallRequest.workspace` is set runs confined to
`<the worker's workspace>/.runs/<id>/` instead of the worker's workspace. The folder is made the
first time a call names `id` on this host, with the workspace's `files` in it; later calls (of
the same run, or of another worker sharing the folder) use it as it is, so what one call wrote
the next one sees. It is made under a temporary name and renamed into place: calls racing to make
it (parallel calls, or two workers on one workspace) all get one complete folder. The folders
are kept: what the agent wrote is part of an experiment's result.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import socket
import tempfile
from pathlib import Path

from agent_bus.bus.messages import RunWorkspace, workspace_problem
from agent_bus.tools._context import confine
from agent_bus.tools._exceptions import WorkspaceError

RUNS_DIR = ".runs"
#: The key a worker adds to its tool services' registration meta: it honours
#: `ToolCallRequest.workspace`. A worker without it predates run workspaces and would run such
#: a call in its own workspace: `busctl experiment run` refuses to start while one is live. Its
#: value names where the worker's `.runs` is (`workspace_key`; 1 from the first workers that
#: had it): workers with different values do not see each other's run folders.
WORKSPACES_META = "workspaces"


def workspace_key(workspace: Path) -> str:
    """Which `.runs` a worker's calls use, as 12 hex digits of the host's name and the
    workspace's resolved path (not the path itself: the hub shows meta to every peer). Equal
    for workers sharing one workspace on one host; different across hosts, even on a shared
    filesystem (which a host name and path cannot tell apart from a copy)."""
    text = f"{socket.gethostname()}\0{workspace.resolve()}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def run_folder(workspace: Path, spec: RunWorkspace) -> Path:
    """The run's folder in `workspace` (resolved), made with its files if it is new.

    Raises WorkspaceError when the spec is not acceptable or the folder would not be inside the
    workspace (a `.runs` that is a symlink out of it, say)."""
    problem = workspace_problem(spec)
    if problem:
        raise WorkspaceError(problem)
    # not `write`: no protected path can be in `.runs/<id>` (its segments start with no dot)
    target = confine(workspace, f"{RUNS_DIR}/{spec.id}", write=False)
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fresh = Path(tempfile.mkdtemp(prefix=".new-", dir=target.parent))
    try:
        for name, data in spec.files.items():
            path = fresh / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        with contextlib.suppress(FileExistsError, OSError):
            os.rename(fresh, target)  # fails when another call made it first: theirs is kept
    finally:
        if fresh.exists():
            shutil.rmtree(fresh, ignore_errors=True)
    if not target.is_dir():
        raise WorkspaceError(f"the run workspace `{target}` could not be made")
    return target


class RunFolders:
    """The folders this worker made or found, by id: a run's later calls skip the checks and
    the path resolution (a third of a trivial call's cost). The most recent `keep` are kept;
    a folder is made or found again (as it is) once forgotten."""

    def __init__(self, keep: int = 4096) -> None:
        self.keep = keep
        self._known: dict[tuple[Path, str], Path] = {}

    def get(self, workspace: Path, spec: RunWorkspace) -> Path:
        key = (workspace, spec.id)
        folder = self._known.pop(key, None)
        if folder is None:
            folder = run_folder(workspace, spec)
            if len(self._known) >= self.keep:
                del self._known[next(iter(self._known))]
        self._known[key] = folder  # (re)inserted last: the oldest go first
        return folder


__all__ = ["RUNS_DIR", "WORKSPACES_META", "RunFolders", "run_folder", "workspace_key"]
