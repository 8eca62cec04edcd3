"""Lint is part of the test run, so CI fails on it: `ruff check` with the rules in pyproject.toml
(ruff comes with the test extra)."""

from __future__ import annotations

import subprocess
import sys

from tests.support import ROOT


def test_ruff_finds_nothing() -> None:
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache",
                             "--output-format", "concise", str(ROOT)],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
