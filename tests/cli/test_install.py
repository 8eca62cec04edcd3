"""`pip install .` (the README's first command) leaves the checkout as it was."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support import ROOT


def test_no_build_files_are_left_in_the_checkout(tmp_path: Path) -> None:
    """`pip install .` from this checkout (the README's first command) leaves neither build/ nor
    *.egg-info in it: the build runs on a copy of the tree (build_backend.py)."""
    leftovers = ("build", "agent_bus.egg-info")
    before = {name for name in leftovers if (ROOT / name).exists()}
    # --no-index, --no-deps, --no-build-isolation: no package index; setuptools comes from the
    # test environment, the files go to a folder of the test's own (--target).
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
         "--no-build-isolation", "--target", str(tmp_path / "site"), str(ROOT)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert install.returncode == 0, install.stderr[-2000:]
    assert (tmp_path / "site" / "cli.py").exists() and (tmp_path / "site" / "bus").is_dir()
    assert not (tmp_path / "site" / "build_backend.py").exists()  # a build tool, not installed
    assert {name for name in leftovers if (ROOT / name).exists()} == before
