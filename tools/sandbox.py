"""What tools may never write, and the OS sandbox (bubblewrap) that enforces it.

Two layers, so that the first holds where the second cannot be set up:

1. `check_writable()` (called by `confine()` for every path a tool writes): refuses the paths
   whose content runs as code outside the tools' control — the Python environment that runs the
   bus (every `sys.path` entry, `sys.prefix`, the directories of the modules this process loaded,
   every editable install's sources), any `.git` directory (hooks run at the user's next
   commit), any other Python environment in the workspace, the start-up files of the home
   folder (`HOME_STARTUP_FILES`), the topology file in use and a worker group's `read_only`
   list. A `.pth` file
   written into the venv's site-packages would otherwise run in the next gateway, with its keys.
2. `enter()` (`worker_prefix()`): the worker process itself runs under bubblewrap — the root
   file system read-only, a private empty /tmp, the workspace writable with the protected paths
   bound read-only over it (nested `.git`s and Python environments included, and the start-up
   files that do not exist yet kept from being made), the state directories hidden, its own PID
   namespace (it sees no other process's /proc/PID/environ) and user namespace, no
   capabilities. MCP servers and `run_shell` are its
   children, so they inherit it; each `run_shell` call gets a nested sandbox of its own
   (`shell_prefix()`: new PID namespace, no network unless the group allows it), so nothing a
   call starts outlives it. The threat model: docs/security.md.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import shlex
import shutil
import signal
import stat
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import msgspec

log = logging.getLogger("tools.sandbox")

SandboxMode = Literal["auto", "required", "off"]

#: Set in a sandboxed worker's environment (by `enter`, before it re-runs itself under bwrap):
#: the sandbox it runs in, as JSON; taken out of the environment again inside.
SANDBOX_ENV = "BUSCTL_SANDBOX"

#: The uid a root worker runs as inside its user namespace (mapped to root outside, so the
#: workspace stays writable): a non-zero uid is what lets it make a nested namespace for each
#: `run_shell` call without CAP_SETFCAP (the kernel refuses to map uid 0 without it).
ROOT_INNER_UID = 1000

#: In the user's home folder: files and folders that run (or are trusted) at the next login
#: or command, whether they exist yet or not: the shells' start-up files (bash, zsh, sh/dash,
#: fish), git's and ssh's configuration (`core.fsmonitor`, hooks paths, `authorized_keys`).
#: sandbox-runtime's DANGEROUS_FILES, plus the ones its list misses (docs/security.md).
HOME_STARTUP_FILES = (".bashrc", ".bash_profile", ".bash_login", ".bash_logout", ".profile",
                      ".zshrc", ".zprofile", ".zshenv", ".zlogin", ".zlogout", ".config/fish",
                      ".gitconfig", ".config/git", ".ssh")

READ_ONLY_WHY = ("listed as read-only for tools (the topology file in use, or the worker group's "
                 "`read_only`)")


@dataclass(frozen=True)
class SandboxPolicy:
    """What a worker's tools may write and how its `run_shell` calls are contained: built once
    by the worker from its settings (`tools.worker.sandbox_policy`) and passed to what enforces
    it (`ToolContext.policy`: `confine`, `run_shell`; the worker's own sandbox in `enter`).

    Nothing here changes after it is made; what it derives from the process (`protected`: the
    bus's Python environment, taken at the first write, with the tools' modules loaded;
    `shell_prefix`: bwrap probed once) is computed on first use and kept with it.
    """

    #: Paths tools may not write besides the built-in ones (the topology file in use, a
    #: group's `read_only` list), resolved: `READ_ONLY_WHY`.
    read_only: frozenset[Path] = frozenset()
    #: The worker's `--sandbox` mode, for its `run_shell` calls ("off": process group only).
    mode: SandboxMode = "auto"
    #: Whether `run_shell` calls have the network (`network = true` in the group,
    #: `--shell-network`).
    shell_network: bool = False
    #: Folders `run_shell` calls do not see (a local hub's socket folder: `hub_folders`).
    shell_hide: tuple[str, ...] = ()

    @classmethod
    def build(cls, read_only: Iterable[str | os.PathLike[str]] = (), mode: SandboxMode = "auto",
              shell_network: bool = False, shell_hide: Iterable[str] = ()) -> SandboxPolicy:
        """A policy from settings as given (the `read_only` paths resolved here)."""
        return cls(read_only=frozenset(map(_resolved, read_only)), mode=mode,
                   shell_network=shell_network, shell_hide=tuple(shell_hide))

    @functools.cached_property
    def protected(self) -> dict[Path, str]:
        """Every protected path (resolved) and why it is protected."""
        return {**_bus_roots(), **dict.fromkeys(self.read_only, READ_ONLY_WHY)}

    @functools.cached_property
    def shell_prefix(self) -> tuple[str, ...]:
        """The bubblewrap command line a `run_shell` call runs under (`shell_prefix`)."""
        return shell_prefix(self)


#: The policy of a process that was given none: nothing listed read-only, `run_shell` in a
#: sandbox of its own where one can be set up, without the network.
DEFAULT_POLICY = SandboxPolicy()


class SandboxInfo(msgspec.Struct, omit_defaults=True):
    """What a worker reports of its sandbox (ready line, registration meta, `busctl ps`)."""

    kind: str  # "bwrap" or "none"
    writable: list[str] = msgspec.field(default_factory=list)
    network: bool = True  # whether the worker (not its shell calls) has the network
    shell: str = ""  # how run_shell calls are contained: "bwrap" (own PID ns) or "process-group"
    shell_network: bool = False
    reason: str = ""  # kind "none": why
    pid: int = 0  # the sandbox's own pid outside it (what a parent sees and signals)
    # the hub address as resolved outside (a local alias's folder is hidden inside)
    hub: str = ""


# --- layer 1: the path filter ---------------------------------------------------------------


def _bus_roots() -> dict[Path, str]:
    """The Python environment of this process: what a later bus process would run.

    Taken once per policy (`SandboxPolicy.protected`), at its first use: the modules a worker
    loads come before its first call.
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
            for place in (where, *_linked_in(where)):
                roots.setdefault(place, f"the code of module `{name}`, loaded by the bus")
    for name, where in _editable_sources():
        for place in (where, *_linked_in(where)):
            roots.setdefault(place, f"the source of `{name}`, installed in editable mode")
    for path in {*home_startup_paths(), *map(_resolved, home_startup_paths())}:
        # they matter when the workspace is (or holds) the home folder; as named and, where
        # one is a link (dotfiles), where it leads
        roots.setdefault(path, "a start-up file of the user's shell, git, ssh or Python (it runs, "
                         "or is trusted, at their next login or command)")
    return roots


def home_startup_paths() -> list[Path]:
    """`HOME_STARTUP_FILES` in this user's home folder, and the user's own site-packages (a
    `.pth` or `usercustomize.py` there runs in every Python of the user): the home folder
    resolved, the names not (a link there can be swapped for a file)."""
    import site

    home = _resolved(Path.home())
    user_site = Path(site.getusersitepackages())
    user_site = home / user_site.relative_to(Path.home()) \
        if user_site.is_relative_to(Path.home()) else _resolved(user_site)
    return [home / name for name in HOME_STARTUP_FILES] + [user_site]


def _editable_sources() -> list[tuple[str, Path]]:
    """The top-level packages of every editable install in this environment (agent-bus's own
    when developed in place): the gateway imports them at its next start, loaded here or not."""
    import importlib.metadata
    import importlib.util

    found: list[tuple[str, Path]] = []
    for dist in importlib.metadata.distributions():
        url = dist.read_text("direct_url.json") or ""
        if '"editable": true' not in url.replace("'", '"'):
            continue
        for name in (dist.read_text("top_level.txt") or "").split():
            try:
                spec = importlib.util.find_spec(name)
            except (ImportError, ValueError):
                continue
            if spec is None:
                continue
            places = list(spec.submodule_search_locations or []) or \
                ([spec.origin] if spec.origin else [])
            found += [(name, _resolved(p)) for p in places if os.path.exists(p)]
    return found


def _linked_in(package: Path) -> list[Path]:
    """Where the links inside a package folder lead: agent-bus's own checkout links bus/, agents/,
    tools/, commands/ and cli.py into agent_bus/ (pyproject.toml), so its sources live outside
    that folder."""
    if not package.is_dir():
        return []
    return [_resolved(entry) for entry in package.iterdir() if entry.is_symlink()]


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


def check_writable(workspace: Path, resolved: Path, raw: str, policy: SandboxPolicy) -> str:
    """Why a tool may not write `resolved` ("" when it may) under `policy`. `workspace` is
    resolved.

    Protected paths that contain the workspace do not count: a project whose own folder is on
    sys.path (`python -m` from it) would otherwise have no writable file at all.
    """
    inner = resolved.relative_to(workspace) if resolved.is_relative_to(workspace) else resolved
    if ".git" in inner.parts:
        return (f"Path `{raw}` is inside a `.git` directory, which tools may not write (its hooks "
                "run at the user's next git command); write elsewhere in the workspace")
    env = _python_env_of(workspace, inner)
    if env:
        return (f"Path `{raw}` is read-only for tools: `{env}` is a Python environment (a "
                "`.pth` file there runs in its next Python process); write elsewhere in the "
                "workspace")
    for root, why in policy.protected.items():
        if workspace.is_relative_to(root):
            continue
        if resolved == root or resolved.is_relative_to(root):
            return (f"Path `{raw}` is read-only for tools: `{root}` is {why}; write elsewhere in "
                    "the workspace")
    return ""


#: Folder names that hold a Python environment's code: a `.pth` or `sitecustomize.py` written
#: there runs in each of its next Python processes.
SITE_DIRS = ("site-packages", "dist-packages")


def _python_env_of(workspace: Path, inner: Path) -> str:
    """The Python environment (a venv: a folder with `pyvenv.cfg`; or a site-packages) that
    `workspace / inner` is in, "" when none (`inner` relative to the workspace)."""
    for i, part in enumerate(inner.parts):
        if part in SITE_DIRS:
            return str(Path(*inner.parts[:i + 1]))
    if inner.is_absolute():
        return ""
    here = workspace
    for part in inner.parts[:-1]:
        here = here / part
        if (here / "pyvenv.cfg").is_file():
            return str(here)
    return ""


def _git_paths(root: Path) -> set[Path]:
    """`root/.git`, and where it is a pointer file (a worktree, a submodule), the repository it
    points to (as Codex does): hooks live there."""
    git = root / ".git"
    if git.is_dir():
        return {git}
    if not git.is_file():
        return set()
    try:
        line = git.read_text(errors="replace").strip()
    except OSError:
        return {git}
    target = Path(line.removeprefix("gitdir:").strip()) if line.startswith("gitdir:") else None
    if target is None:
        return {git}
    target = (root / target).resolve()
    common = target.parent.parent if target.parent.name == "worktrees" else target
    return {git, target, common} if target.exists() else {git}


def protected_inside(roots: list[Path], workspace: Path, policy: SandboxPolicy) -> list[Path]:
    """The protected paths that exist inside the writable `roots` (what the sandbox binds
    read-only again): every `.git` and Python environment under them (nested ones too, as far
    as `walk_protected` looks), and as in `check_writable`, not those that contain the
    workspace."""
    # a link is left as it is: its folder is closed (`closed_folders`), and where it leads is
    # protected under its own name (a bind would follow it, maybe to where the sandbox hides)
    found = {path for path in policy.protected if path.exists() and not path.is_symlink()
             and not workspace.is_relative_to(path)
             and any(path != root and path.is_relative_to(root) for root in roots)}
    for root in roots:
        found |= walk_protected(root)
    found = {p for p in found if any(p.is_relative_to(root) for root in roots)}
    return _outermost(found)


def _outermost(paths: set[Path]) -> list[Path]:
    """`paths` without those under another one of them (the outer bind covers them)."""
    return sorted(p for p in paths if not any(p != q and p.is_relative_to(q) for q in paths))


#: How far `walk_protected` looks: folder depth under a writable root, and folders read in all
#: (a workspace holding a huge tree costs a fraction of a second at the worker's start, not more).
WALK_DEPTH = 6
WALK_BUDGET = 20_000
#: Folders not looked into: caches and dependency trees (no repository or venv of the user's
#: own lives there; they are the huge trees).
WALK_SKIP = frozenset({"node_modules", "__pycache__", ".mypy_cache", ".ruff_cache",
                       ".pytest_cache", ".tox", ".nox", ".cache", "target", ".runs"})


def walk_protected(root: Path) -> set[Path]:
    """Every `.git` (and where one is a pointer file, the repository it points to) and every
    Python environment (a folder with `pyvenv.cfg`, a `site-packages`) in `root`, by a walk
    that follows no link, bounded by `WALK_DEPTH` and `WALK_BUDGET`. The walk starts with
    the sandbox: a repository the model makes later is not in it (docs/security.md)."""
    found = set(_git_paths(root))
    # breadth first: where the budget runs out, the folders near the top were all looked at
    queue, budget = collections.deque([(root, 0)]), WALK_BUDGET
    while queue and budget > 0:
        folder, depth = queue.popleft()
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        budget -= len(entries)
        if any(e.name == "pyvenv.cfg" for e in entries) and folder != root:
            found.add(Path(folder))
            continue
        for entry in entries:
            found |= _protected_entry(Path(folder), entry, depth, queue)
    if budget <= 0:
        log.warning("the sandbox looked at %d entries of %s and stopped: a `.git` or venv "
                    "deeper in is not made read-only for shells", WALK_BUDGET, root)
    return found


def _protected_entry(folder: Path, entry: os.DirEntry[str], depth: int,
                     queue: collections.deque[tuple[Path, int]]) -> set[Path]:
    """What of one folder entry is protected; its folder is queued for the walk otherwise."""
    if entry.name == ".git":
        return _git_paths(folder)
    if not entry.is_dir(follow_symlinks=False):
        return set()
    if entry.name in SITE_DIRS:
        return {Path(entry.path)}
    if entry.name not in WALK_SKIP and depth + 1 < WALK_DEPTH:
        queue.append((Path(entry.path), depth + 1))
    return set()


def closed_folders(roots: list[Path], workspace: Path, policy: SandboxPolicy) -> list[Path]:
    """The folders in which a protected path (a start-up file, a `read_only` path) inside the
    writable `roots` could be made, or swapped for a link: the sandbox binds each read-only and
    its entries writable again (`_close_args`), so nothing new can be made in it, and nothing
    else changes. Outer ones first.

    Why not a placeholder mounted over the missing path (as Codex does): bwrap would make the
    placeholder in the host's folder, and an empty `~/.bash_profile` there, for as long as the
    worker runs (for good if it is killed), makes bash skip `~/.profile` at every login."""
    found: set[Path] = set()
    for path in {*home_startup_paths(), *policy.read_only}:  # the rest exists: it runs the bus
        root = next((r for r in roots if path.is_relative_to(r)), None)
        if root is not None and not workspace.is_relative_to(path):
            folder = _open_end(root, path)
            if folder is not None:
                found.add(folder)
    return sorted(found, key=lambda p: len(p.parts))


def _open_end(root: Path, path: Path) -> Path | None:
    """The folder holding the first component of `path` (under `root`) that is missing or a
    link, looked at without following links; None when every component is a real one."""
    folder = root
    for part in path.relative_to(root).parts:
        here = folder / part
        try:
            mode = os.lstat(here).st_mode
        except FileNotFoundError:
            return folder
        except NotADirectoryError:  # `folder` is a file: it can be removed and made a folder
            return folder.parent
        except OSError:
            return None
        if stat.S_ISLNK(mode):
            return folder
        folder = here
    return None


def _close_args(folder: Path) -> list[str]:
    """bwrap arguments: `folder` read-only, its entries (not links: a link's target may be
    outside the writable roots) writable again."""
    args = ["--ro-bind", str(folder), str(folder)]
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError:
        return args
    for entry in entries:
        if not entry.is_symlink():
            args += ["--bind", entry.path, entry.path]
    return args


# --- run_shell: one nested sandbox per call ---------------------------------------------------

def shell_prefix(policy: SandboxPolicy) -> tuple[str, ...]:
    """The bubblewrap command line a `run_shell` call runs under `policy`, or () where none can
    be set up (probed each time: `SandboxPolicy.shell_prefix` keeps it, probed once).

    The call's shell is the first process of a new PID namespace: when it exits, bwrap's init
    exits and the kernel kills everything left in the namespace (`setsid`, double fork, `nohup`
    included); `--die-with-parent` does the same if the worker dies. `--dev-bind / /` keeps the
    worker's own view (read-only binds stay read-only: they are locked in the nested namespace),
    `--new-session` keeps the shell off the worker's terminal, `--unshare-net` takes the network
    unless the group allows it. A fresh /proc shows the call's own processes only (a worker
    run as root needs `_proc_anchor` for it); where the kernel still refuses one, the worker's
    /proc is kept: it shows the worker's own namespace, no other bus process, but the other
    calls' command lines, and the worker logs a warning.
    """
    bwrap = shutil.which("bwrap")
    if policy.mode == "off" or bwrap is None:
        return ()
    net = () if policy.shell_network else ("--unshare-net",)
    for proc in (("--proc", "/proc"), ()):
        hidden = [arg for folder in policy.shell_hide for arg in ("--tmpfs", folder)]
        prefix = (bwrap, "--dev-bind", "/", "/", *proc, *hidden, "--unshare-pid", *net,
                  "--die-with-parent", "--new-session", "--cap-drop", "ALL")
        try:
            probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=10,
                                   stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.warning("bwrap cannot run (%s): run_shell calls share the worker's namespaces", exc)
            return ()
        if probe.returncode == 0:
            if not proc:
                log.warning("bwrap cannot mount a /proc for each run_shell call here: "
                            "concurrent calls see each other's command lines")
            return prefix
        why = probe.stderr.decode(errors="replace").strip()
    log.warning("bwrap refused to start (%s): run_shell calls share the worker's namespaces", why)
    return ()


# --- the worker process: one sandbox for all its tools ----------------------------------------


class SandboxUnavailable(RuntimeError):
    """`sandbox = "required"` where no sandbox can be set up."""


def enter(mode: SandboxMode, workspace: str, hub: str, hide: Iterable[str] = (),
          read_only: Iterable[str] = ()) -> SandboxInfo:
    """First thing a `busctl worker` does: become the same command under bubblewrap (this
    does not return), or return why it runs without one (`mode` "off", or "auto" where bwrap is
    missing or fails its probe). Inside the sandbox, returns what the sandbox is.

    Raises SandboxUnavailable for "required" when no sandbox can be set up.
    """
    inside = os.environ.pop(SANDBOX_ENV, "")
    if inside:
        from agent_bus.bus.protocol import set_host_pid

        _leave_with_bwrap()
        info = msgspec.json.decode(inside, type=SandboxInfo)
        set_host_pid(info.pid)  # pid 1 in here: the hub and `busctl ps` show the sandbox's
        return info
    if mode == "off":
        return SandboxInfo(kind="none", reason='turned off (`sandbox = "off"`, `--sandbox off`)')
    given = _stdin_mcp_paths()  # before bwrap: the sandbox must show them
    prefix, info = worker_prefix(Path(workspace), hub, [Path(p) for p in hide], given,
                                 SandboxPolicy.build(read_only, mode))
    why = _probe(prefix)
    if why:
        if mode == "required":
            raise SandboxUnavailable(
                f"no sandbox can be set up here ({why}), and the worker group sets "
                '`sandbox = "required"` (`--sandbox required`); install bubblewrap (package '
                '`bubblewrap`), allow user namespaces, or set `sandbox = "auto"` to run without')
        return SandboxInfo(kind="none", reason=why)
    info.pid, info.hub = os.getpid(), hub  # exec keeps the pid: bwrap's
    os.environ[SANDBOX_ENV] = msgspec.json.encode(info).decode()
    os.execv(prefix[0], [*prefix, sys.executable, *sys.orig_argv[1:]])
    raise AssertionError("unreachable")  # pragma: no cover - execv does not return


_PR_SET_PDEATHSIG = 1


def _leave_with_bwrap() -> None:
    """Inside: stop cleanly when the bwrap process outside is told to stop.

    The worker is the first process of its PID namespace (`--as-pid-1`), and bwrap's own process
    outside is its parent. A SIGTERM (or Ctrl-C) to that process alone kills it at once (bwrap
    forwards nothing); `--die-with-parent` would then SIGKILL the worker. We replace that death
    signal with SIGTERM, which the worker handles like one sent to itself (unregister, finish
    calls, leave). A first process gets only the signals it has a handler for: SIGTERM gets
    Python's usual meaning (exit) until the worker's own handler takes over. A SIGHUP that was
    ignored when the worker started (`nohup`) stays ignored, as it does without a sandbox."""
    import ctypes
    import ctypes.util

    signal.signal(signal.SIGTERM, _exit_on_signal)
    if signal.getsignal(signal.SIGHUP) != signal.SIG_IGN:
        signal.signal(signal.SIGHUP, _exit_on_signal)
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError) as exc:  # then bwrap's SIGKILL stays: abrupt, not unsafe
        log.debug("cannot set the parent-death signal: %s", exc)


def _exit_on_signal(signum: int, _frame: object) -> None:
    # Said on stderr: a worker in the background has no other way to tell why it is gone.
    log.warning("sandboxed worker stopping on %s (sent to it, or to its bwrap process outside, "
                "or that process ended)", signal.Signals(signum).name)
    raise SystemExit(128 + signum)


def worker_prefix(workspace: Path, hub: str, hide: list[Path], given: Iterable[str] = (),
                  policy: SandboxPolicy = DEFAULT_POLICY) -> tuple[list[str], SandboxInfo]:
    """The bwrap command line for a worker, and what it gives (after sandbox-runtime and Codex:
    read-only root, writable roots bound over it, protected paths bound read-only inside them,
    `policy`'s `read_only` among them)."""
    bwrap = shutil.which("bwrap") or "bwrap"
    ws = workspace.resolve()
    writable = [ws]
    # a private empty /tmp: nothing written there reaches another program of the user; what
    # the worker needs of the host's /tmp is bound back in read-only, then the workspace
    args = [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", *_proc_anchor(),
            "--perms", "1777", "--tmpfs", "/tmp"]
    for path in _reachable_in_tmp(ws, policy, given):
        args += ["--ro-bind", str(path), str(path)]
    args += ["--bind", str(ws), str(ws)]
    for folder in closed_folders(writable, ws, policy):  # before the binds over its entries below
        args += _close_args(folder)
    for secret in _state_dirs(hide):  # hidden: the event log, conversations, run files
        if not ws.is_relative_to(secret):
            args += ["--tmpfs", str(secret)]
    for path in protected_inside(writable, ws, policy):
        args += ["--ro-bind", str(path), str(path)]
    for path in _ipc_paths(hub):  # after the hiding: a local hub's socket stays reachable
        # read-only is enough to connect (sockets are exempt), and nothing can be put there
        args += ["--ro-bind", str(path), str(path)]
    for other in [*_others_credentials(hub), *_hidden_files(hide)]:  # the owner's full rights,
        args += ["--ro-bind", "/dev/null", str(other)]  # other processes' roles, CURVE keys
    # --as-pid-1: the worker is the namespace's first process (see `_leave_with_bwrap`)
    args += ["--unshare-user", "--unshare-pid", "--as-pid-1", "--unshare-ipc", "--unshare-uts",
             *_lifetime_args(), "--cap-drop", "ALL", "--chdir", os.getcwd()]
    if os.geteuid() == 0:
        args += ["--uid", str(ROOT_INNER_UID), "--gid", str(ROOT_INNER_UID)]
    return [*args, "--"], SandboxInfo(kind="bwrap", writable=[str(p) for p in writable])


def _lifetime_args() -> list[str]:
    """`--die-with-parent` only for a worker whose launcher asked it to die with it (`busctl
    up`'s supervisor sets a parent-death signal, kept across exec): bwrap would otherwise SIGKILL
    itself, and so the worker, when the shell that started it exits — a worker started by hand
    (`nohup busctl worker … &`) must outlive its shell, as it does without a sandbox."""
    from agent_bus.bus.procsec import parent_death_signal

    return ["--die-with-parent"] if parent_death_signal() else []


TMP = Path("/tmp")
PROC_ANCHOR = "/dev/.agent-bus-proc"


def _proc_anchor() -> list[str]:
    """For a worker run as root: what lets each `run_shell` call have a /proc of its own.

    The kernel mounts a fresh /proc in a nested namespace only if a /proc already mounted in the
    sandbox is fully visible (nothing mounted over its contents). bwrap covers the sandbox's
    /proc/irq and /proc/bus with read-only binds where they are writable, which they are for a
    worker mapped to root: no /proc of the sandbox is fully visible then, and the nested
    sandbox had to keep the worker's /proc, where concurrent calls see each other's command
    lines. This binds one more /proc with nothing over it, under an empty tmpfs mounted after
    it: unreachable (the kernel locks the tmpfs over it in the nested namespaces), yet it
    satisfies the check."""
    if os.geteuid() != 0:
        return []
    return ["--bind", "/proc", f"{PROC_ANCHOR}/proc", "--tmpfs", PROC_ANCHOR]


def _reachable_in_tmp(workspace: Path, policy: SandboxPolicy,
                      given: Iterable[str] = ()) -> list[Path]:
    """What the worker was given under the host's /tmp, outside the workspace: its Python
    (prefix, `sys.path`), its current folder, the files and folders its command line names
    (`--tools FILE`, an `--mcp` server's script, `--read-only`) or `given` names (the MCP
    servers on stdin), the protected paths (the topology file) and a worktree's repository.
    Read-only in the sandbox; outer ones only."""
    # the protected paths hold the bus's own code: the modules it loaded and an editable
    # install's sources, which a finder maps without a `sys.path` entry (a checkout under /tmp)
    named = [sys.prefix, sys.exec_prefix, *sys.path, os.getcwd(), *map(str, policy.protected),
             *given,
             *(word for arg in sys.orig_argv for word in _words(arg))]
    named += [str(p) for p in _git_paths(workspace)]
    found: set[Path] = set()
    for text in named:
        path = Path(text) if text.startswith("/") else None
        if path is None or not os.path.exists(path):
            continue
        path = _resolved(path)
        if path.is_relative_to(TMP) and path != TMP and not path.is_relative_to(workspace):
            found.add(path)
    return _outermost(found)


def _stdin_mcp_paths() -> list[str]:
    """The words of the MCP servers `busctl up` passes on stdin (`--mcp-servers -`): their
    commands, arguments and folders. stdin is read here and replaced by a memory file holding the
    same bytes, which the worker reads once it runs (in the sandbox or, without one, here)."""
    argv = sys.orig_argv
    if "--mcp-servers" not in argv or argv[argv.index("--mcp-servers") + 1:][:1] != ["-"]:
        return []
    data = b"".join(iter(lambda: os.read(0, 1 << 16), b""))
    copy = os.memfd_create("mcp-servers")
    os.write(copy, data)  # a memory file takes it all at once
    os.lseek(copy, 0, os.SEEK_SET)
    os.dup2(copy, 0)
    os.close(copy)
    try:
        specs = msgspec.json.decode(data)
    except msgspec.DecodeError:  # the worker says what is wrong with it
        return []
    return [word for spec in (specs if isinstance(specs, list) else []) if isinstance(spec, dict)
            for word in (spec.get("command"), spec.get("cwd"), *(spec.get("args") or []))
            if isinstance(word, str)]


def _words(arg: str) -> list[str]:
    """An argument and, where it is a command line (`--mcp "python /tmp/x/server.py"`), its
    words."""
    try:
        return [arg, *shlex.split(arg)] if " " in arg else [arg]
    except ValueError:  # unbalanced quotes: not a command line
        return [arg]


def _state_dirs(hide: list[Path]) -> list[Path]:
    """Hidden from tools: the state directories, and the folder of local hubs' sockets,
    credentials and tcp aliases (the hub's own socket folder is bound back in, read-only)."""
    from agent_bus.bus.paths import alias_homes, runtime_home, state_home

    hidden = {state_home().resolve(), runtime_home().resolve(), *(h.resolve() for h in hide),
              *(home.resolve() for home in alias_homes())}
    return [p for p in hidden if p.is_dir()]


def _ipc_paths(address: str) -> list[Path]:
    """What of an `ipc://PATH` hub address the worker needs: the socket's folder (a restarted
    hub makes a new socket file there), or the socket alone when the folder is a state folder.
    A list of hub addresses (commas: a primary and its standby) needs each one's."""
    if "," in address:
        return [path for one in address.split(",") for path in _ipc_paths(one)]
    if not address.startswith("ipc://"):
        return []
    sock = Path(address[len("ipc://"):]).expanduser().resolve()
    folder = sock.parent
    from agent_bus.bus.paths import inside_state_dir

    if inside_state_dir(folder) is None and folder.is_dir():
        return [folder]
    return [sock] if sock.exists() else []


def _others_credentials(address: str) -> list[Path]:
    """The credentials beside a local hub's socket that are not this worker's own (named by
    $BUSCTL_CREDENTIAL_FILE): hidden in its sandbox, so neither its tools nor a shell can
    present the owner's (full rights) or another process's credential to the hub."""
    from agent_bus.bus.paths import CREDENTIAL_ENV

    if "," in address:  # a list of hub addresses (bus/endpoints.py)
        return sorted({p for one in address.split(",") for p in _others_credentials(one)})
    if not address.startswith("ipc://"):
        return []
    own = os.environ.get(CREDENTIAL_ENV, "")
    folder = Path(address[len("ipc://"):]).expanduser().resolve().parent
    return sorted(p for p in folder.glob("*.cred") if str(p) != own and p.resolve() != Path(own))


def _hidden_files(hide: list[Path]) -> list[Path]:
    """The files among `hide`: CURVE key files a worker was given (and the secrets beside them,
    `bus.security.key_hiding`; the worker holds its own keys in memory), masked like the
    credentials of other processes. Folders among `hide` are hidden whole (`_state_dirs`)."""
    return sorted({p.resolve() for p in hide if p.is_file()})


def hub_folders(address: str) -> tuple[str, ...]:
    """What a `run_shell` call must not see of a local hub: its socket folder (the socket and
    the worker's credential: a shell is not a peer of the bus)."""
    return tuple(str(p) for p in _ipc_paths(address) if p.is_dir())


def required_problem(workspace: Path, hub: str) -> str:
    """Why a worker's sandbox could not start here ("" when it can): `busctl up`'s check of
    `sandbox = "required"` before it starts anything."""
    return _probe(worker_prefix(workspace, hub, [])[0])


def _probe(prefix: list[str]) -> str:
    """Why the sandbox cannot start here ("" when it can): bwrap runs `true` inside it."""
    if not sys.platform.startswith("linux"):
        return f"no sandbox on {sys.platform} (bubblewrap is Linux only)"
    if shutil.which(prefix[0]) is None:
        return "bubblewrap (`bwrap`) is not installed"
    try:
        probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=10,
                               stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bwrap did not run: {exc}"
    if probe.returncode != 0:
        return "bwrap failed: " + (probe.stderr.decode(errors="replace").strip() or
                                   f"exit {probe.returncode}")
    return ""


def describe(info: SandboxInfo) -> str:
    """One line for `busctl up`'s console, `ps` and `status`."""
    shell = (f"; run_shell: {info.shell}, network {'on' if info.shell_network else 'off'}"
             if info.shell else "")
    if info.kind == "none":
        return f"none ({info.reason}); the file tools still refuse the protected paths{shell}"
    return f"{info.kind}, writable {', '.join(info.writable)}, a private /tmp{shell}"
