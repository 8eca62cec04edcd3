"""Fixtures of the MCP tests: real `busctl worker --mcp` processes on a real hub."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import anyio.to_thread
import pytest

from tests.support import Proc, busctl

pytest.importorskip("mcp", reason="the MCP tests need the `mcp` extra")

DEMO = f"{sys.executable} -m tests.mcp.fixtures.demo_server"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@asynccontextmanager
async def mcp_worker(endpoint: str, *args: str, env: dict[str, str] | None = None,
                     verbose: bool = False) -> AsyncIterator[Proc]:
    """`busctl worker ARGS` (its --mcp servers connected), stopped however the test ends;
    `verbose`: `busctl -v` (INFO and DEBUG lines logged too)."""
    proc = Proc(busctl(*(["-v"] if verbose else []), "worker", "--hub", endpoint, *args),
                env=env)
    try:
        proc.ready = await anyio.to_thread.run_sync(proc.wait_ready, 40.0)  # type: ignore[attr-defined]
        yield proc
    finally:
        await anyio.to_thread.run_sync(proc.stop)
