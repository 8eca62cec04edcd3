"""Ctrl-C while busctl is still loading: exit 130, as a Ctrl-C later does.

Its own module, importing nothing slow: `cli.py` puts the handler in place before it loads the
commands (their imports take a second or more on a busy machine).
"""

from __future__ import annotations

import signal


def exit_130(signum: int, frame: object) -> None:
    raise SystemExit(130)


def exit_130_while_loading(run_as_busctl: bool) -> None:
    """`BusctlGroup.main` puts Python's own handler back before any command runs: asyncio turns
    SIGINT into a clean cancel only when it finds that handler. An ignored SIGINT (a background
    job) stays ignored, and a program that only imports busctl (a test, a script) keeps its own."""
    if run_as_busctl and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, exit_130)
