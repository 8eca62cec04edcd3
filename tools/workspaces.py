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
import stat
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

    Raises WorkspaceError when the spec is not acceptable, the folder would not be inside the
    workspace, or a component of `.runs/<id>` is a link (`real_folders`)."""
    problem = workspace_problem(spec)
    if problem:
        raise WorkspaceError(problem)
    # not `write`: no protected path can be in `.runs/<id>` (its segments start with no dot)
    confine(workspace, f"{RUNS_DIR}/{spec.id}", write=False)
    # as named, not resolved: each component is checked without following links (a link
    # planted by an earlier run would otherwise move this run's confinement)
    root = workspace.resolve()
    target = root / RUNS_DIR / spec.id
    if real_folders(root, target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    real_folders(root, target.parent)  # no link made in the meantime either
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
    if not real_folders(root, target):
        raise WorkspaceError(f"the run workspace `{target}` could not be made")
    return target


def real_folders(workspace: Path, target: Path) -> bool:
    """Whether `target` exists as a folder whose components under `workspace` (resolved) are
    all real folders (False when one is missing: it is to be made).

    Raises WorkspaceError naming the first component that is a link or not a folder."""
    here = workspace
    for part in target.relative_to(workspace).parts:
        here = here / part
        try:
            mode = os.lstat(here).st_mode
        except FileNotFoundError:
            return False
        if stat.S_ISLNK(mode) or not stat.S_ISDIR(mode):
            what = "a symbolic link" if stat.S_ISLNK(mode) else "not a folder"
            raise WorkspaceError(
                f"`{here}` is {what}: a run's workspace is made of real folders only (an "
                f"earlier run may have planted it to move this run's files elsewhere); remove "
                f"it (`rm {here}`) and run again")
    return True


class RunFolders:
    """The folders this worker made or found, by id: a run's later calls skip the making and
    the path resolution (a third of a trivial call's cost); only the components are looked at
    again. The most recent `keep` are kept;
    a folder is made or found again (as it is) once forgotten."""

    def __init__(self, keep: int = 4096) -> None:
        self.keep = keep
        self._known: dict[tuple[Path, str], Path] = {}

    def get(self, workspace: Path, spec: RunWorkspace) -> Path:
        key = (workspace, spec.id)
        folder = self._known.pop(key, None)
        # a known folder is checked again (a few lstat calls): a link may have replaced it
        if folder is None or not real_folders(workspace, folder):
            folder = run_folder(workspace, spec)
            if len(self._known) >= self.keep:
                del self._known[next(iter(self._known))]
        self._known[key] = folder  # (re)inserted last: the oldest go first
        return folder


__all__ = ["RUNS_DIR", "WORKSPACES_META", "RunFolders", "real_folders", "run_folder",
           "workspace_key"]
