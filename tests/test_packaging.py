"""A new user's install: `pip install .` into a fresh venv gives a working `busctl`."""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

from tests.support import ROOT


def test_plain_install_into_a_fresh_venv(tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    install = subprocess.run([str(python), "-m", "pip", "install", "-q", str(ROOT)],
                             capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr[-2000:]
    busctl = env_dir / "bin" / "busctl"
    help_ = subprocess.run([str(busctl), "--help"], capture_output=True, text=True, timeout=30)
    assert help_.returncode == 0 and "up" in help_.stdout
    # The installed package (not this checkout) carries the demo model's script.
    probe = "import agents.fakellm as f, agents; print(len(f.demo_script().rules), agents.__file__)"
    out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=30,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    count, location = out.stdout.split()
    assert int(count) >= 2 and str(env_dir) in location
    assert sys.version_info >= (3, 11)
