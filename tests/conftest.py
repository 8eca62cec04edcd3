from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import Proc, busctl

# Default state directories (bus.paths) go to a throwaway folder, not the user's home; every
# process a test starts inherits this.
_STATE_HOME = tempfile.mkdtemp(prefix="agent-bus-state-")
os.environ["BUSCTL_STATE_HOME"] = _STATE_HOME


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(_STATE_HOME, ignore_errors=True)


def _slow_selected(config: pytest.Config) -> bool:
    return "slow" in (config.getoption("-m") or "") or os.environ.get("AGENT_BUS_SLOW") == "1"


@pytest.fixture(autouse=True)
def _skip_slow_unless_selected(request: pytest.FixtureRequest) -> None:
    """Full-size soak/load tests (`@pytest.mark.slow`) run only with `-m slow` or
    AGENT_BUS_SLOW=1; CI runs their short versions."""
    if request.node.get_closest_marker("slow") and not _slow_selected(request.config):
        pytest.skip("slow: run with `pytest -m slow` (or AGENT_BUS_SLOW=1)")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[dict]:
    """A real hub process on a free loopback port; yields its ready line (endpoint, events, pid)."""
    proc = Proc(busctl("hub", "--hub", "tcp://127.0.0.1:0", "--state-dir", str(tmp_path / "state")))
    try:
        info = proc.wait_ready()
        info["proc"] = proc
        info["state"] = tmp_path / "state"
        yield info
    finally:
        proc.stop()
