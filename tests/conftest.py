from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import Proc, py


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[dict]:
    """A real hub process on a free loopback port; yields its ready line (endpoint, events, pid)."""
    proc = Proc(py("-m", "bus.hub", "tcp://127.0.0.1:0", str(tmp_path / "state")))
    try:
        info = proc.wait_ready()
        info["proc"] = proc
        info["state"] = tmp_path / "state"
        yield info
    finally:
        proc.stop()
