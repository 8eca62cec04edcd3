"""Process hardening for the processes that hold secrets (the gateway, the supervisor).

`drop_root_powers()` is for the processes that run untrusted code (tool workers) when they run as
root: without it, CAP_SYS_PTRACE would let any tool read every process's environment.

`make_undumpable()` clears the process's "dumpable" flag on Linux: other processes of the same
user can then no longer read its `/proc/PID/environ` (where API keys live), its memory
(`/proc/PID/mem`, ptrace) or get a core dump of it. Processes with `CAP_SYS_PTRACE` (root, usually)
still can: this guards against a compromised tool or agent running as the same user, not root.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import sys

log = logging.getLogger("bus.procsec")

_PR_SET_DUMPABLE = 4  # <linux/prctl.h>
_PR_GET_DUMPABLE = 3


def make_undumpable() -> bool:
    """Best effort: True when the flag is now cleared; False (logged at debug) where unsupported.

    Call it early, before secrets are read. Children started afterwards are dumpable again
    (`execve` resets the flag), so each secret-holding process calls it itself."""
    libc = _libc()
    if libc is None:
        return False
    if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        log.debug("prctl(PR_SET_DUMPABLE, 0) failed: errno %d", ctypes.get_errno())
        return False
    return bool(libc.prctl(_PR_GET_DUMPABLE, 0, 0, 0, 0) == 0)


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    except OSError as exc:  # no loadable libc (static or unusual builds): stay as we are
        log.debug("cannot load libc for prctl: %s", exc)
        return None


_PR_CAPBSET_DROP = 24
_PR_SET_SECUREBITS = 28
_PR_SET_NO_NEW_PRIVS = 38
_CAP_LAST = 63  # drop every bit the kernel may know; unknown ones fail harmlessly
# SECBIT_NOROOT | SECBIT_NOROOT_LOCKED | SECBIT_NO_SETUID_FIXUP | its lock: uid 0 alone no
# longer grants capabilities on execve, so a shell a tool starts cannot win them back.
_SECUREBITS_NO_ROOT_POWERS = 0x01 | 0x02 | 0x04 | 0x08
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def drop_root_powers() -> bool:
    """For processes that run untrusted code (tool workers): keep no capabilities, for good.

    A process running as root can read any other process's `/proc/PID/environ` through
    CAP_SYS_PTRACE, undumpable or not. This empties the bounding set, locks the securebits that
    make uid 0 special on `execve`, sets no_new_privs (no setuid escalation) and clears every
    capability set. Nothing to do for an ordinary user. True when the process holds no
    capability afterwards (or never had any); False where unsupported.
    """
    libc = _libc()
    if libc is None:
        return False
    libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    if not _holds_capabilities(libc):
        return True
    for cap in range(_CAP_LAST + 1):
        libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)
    libc.prctl(_PR_SET_SECUREBITS, _SECUREBITS_NO_ROOT_POWERS, 0, 0, 0)
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    if libc.capset(ctypes.byref(header), data) != 0:
        log.warning("could not drop capabilities: errno %d", ctypes.get_errno())
        return False
    return not _holds_capabilities(libc)


def _holds_capabilities(libc: ctypes.CDLL) -> bool:
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    if libc.capget(ctypes.byref(header), data) != 0:
        return False
    return any(d.effective or d.permitted for d in data)


_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> bool:
    """Have the kernel send `sig` to this process when `parent_pid` (its parent) dies.

    How a supervised child never outlives a supervisor that was SIGKILLed (no handler runs
    then). The flag survives `execve`. False where unsupported. Exits at once when the parent is
    already gone: it died before the flag was set, so no signal would ever come."""
    libc = _libc()
    if libc is None:
        return False
    if libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        log.debug("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
        return False
    if os.getppid() != parent_pid:
        os._exit(1)
    return True


_PR_GET_PDEATHSIG = 2


def parent_death_signal() -> int:
    """The signal the kernel sends this process when its parent dies (0: none, or unknown).

    Set by whoever started it and asked for it (`busctl up`'s supervisor, `die_with_parent`),
    kept across `execve`: a process started by hand from a shell has none."""
    libc = _libc()
    if libc is None:
        return 0
    sig = ctypes.c_int(0)
    if libc.prctl(_PR_GET_PDEATHSIG, ctypes.byref(sig), 0, 0, 0) != 0:
        return 0
    return sig.value


def exec_with_parent_death(argv: list[str]) -> None:
    """`python -m agent_bus.bus.procsec PARENT_PID CMD…`: die with PARENT_PID, then become CMD.

    The supervisor starts every child through this, so the guard covers any command, busctl
    pieces and a topology's own processes alike (anyio's `open_process` has no `preexec_fn`)."""
    parent, *command = argv
    die_with_parent(int(parent))
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        sys.stderr.write(f"cannot run {command[0]!r}: {exc.strerror or exc}\n")
        os._exit(127)


__all__ = ["die_with_parent", "drop_root_powers", "exec_with_parent_death", "make_undumpable",
           "parent_death_signal"]


if __name__ == "__main__":
    exec_with_parent_death(sys.argv[1:])
