"""Fault-injection suite (issue 8). Tests marked `slow` are the full-size versions (skipped by
the root conftest unless selected); a short version of each always runs."""

from __future__ import annotations

import os
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures"
FAULT_TOOLS = str(FIXTURES / "fault_tools.py")


def proc_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def proc_rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")
