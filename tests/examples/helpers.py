"""Helpers shared by the example and experiment tests."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

from tests.cli.conftest import pid_alive
from tests.support import Proc


def stop_up(proc: Proc) -> None:
    """Stop `busctl up`; its children live in their own sessions: kill any it left behind."""
    line = proc.wait_line(lambda s: s.startswith("processes"), 5)
    pids = [int(m) for m in re.findall(r"\S+\[(\d+)\]", line)]
    proc.stop(timeout=8)
    for pid in pids:
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


def corpus_word_count(folder: Path) -> int:
    """What the map-reduce example must find, computed independently of its tools."""
    return sum(len(re.findall(r"[a-z][a-z']*", f.read_text().lower()))
               for f in sorted(folder.glob("*.txt")))
