"""Types are part of the test run, so CI fails on them: `mypy` strict ([tool.mypy] in pyproject.toml)
on the whole product, the `agent_bus` package (mypy comes with the test extra). By hand:

    mypy agent_bus
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.support import ROOT

CHECKED = ["agent_bus"]  # bus/, agents/, tools/ and cli.py, linked in


def test_mypy_finds_nothing(tmp_path: Path) -> None:
    # A cache of its own: parallel runs sharing the checkout's .mypy_cache could read half-written
    # files. It starts as a copy of that cache when there is one (CI runs mypy just before the
    # suite): mypy checks every entry against the sources and options, and a warm start takes
    # ~1 s instead of ~10 s on the 2-core VM.
    cache = tmp_path / "cache"
    warm = ROOT / ".mypy_cache"
    if warm.is_dir():
        shutil.copytree(warm, cache, ignore_dangling_symlinks=True, dirs_exist_ok=True)
    result = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(cache),
                             "--no-error-summary", "--no-pretty", *CHECKED],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert result.returncode in (0, 1), result.stdout[-4000:] + result.stderr[-2000:]  # 2: mypy failed
    assert not errors, "\n".join(errors)
