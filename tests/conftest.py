from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.store_cluster import Cluster, jetstream_cluster
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


@pytest.fixture(scope="session")
def jetstream() -> Iterator[Cluster]:
    """One real three-server JetStream cluster for the session's store tests (each test takes a
    stream of its own); skipped, saying what to install, without the `nats` extra."""
    with jetstream_cluster() as cluster:
        yield cluster


@pytest.fixture
def store(request: pytest.FixtureRequest) -> str:
    """The hub's `--store`: "" (SQLite in the state dir), or with
    `@pytest.mark.parametrize("store", STORES, indirect=True)` each of SQLite and a fresh
    stream on the session's JetStream cluster."""
    if getattr(request, "param", "sqlite") == "sqlite":
        return ""
    cluster: Cluster = request.getfixturevalue("jetstream")
    return cluster.stream_url()


@pytest.fixture
def hub(tmp_path: Path, store: str) -> Iterator[dict]:
    """A real hub process on a free loopback port; yields its ready line (endpoint, events, pid)."""
    proc = Proc(busctl("hub", "--hub", "tcp://127.0.0.1:0", "--state-dir", str(tmp_path / "state"),
                       *(["--store", store] if store else [])))
    try:
        info = proc.wait_ready()
        info["proc"] = proc
        info["state"] = tmp_path / "state"
        yield info
    finally:
        proc.stop()
