"""A register the hub refuses reaches the caller of `serve` (not only a counter): a peer with a
tool worker's credential (`tool.*` only) that registers `agent.assistant` gets `RegisterRefused`
naming the service and the hub's reason, logged; its allowed services still register."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent_bus.bus.client import IncomingRequest, connect
from agent_bus.bus.errors import BusError, RegisterRefused
from agent_bus.bus.paths import CREDENTIAL_ENV
from tests.support import Proc, busctl

pytestmark = pytest.mark.anyio

SECRET = "worker-credential-for-this-test"


@pytest.fixture
def worker_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A hub on an ipc socket whose credentials table gives SECRET the roles of a tool worker;
    this process presents it (as `busctl up` has its workers do)."""
    folder = tmp_path / "run"
    folder.mkdir(mode=0o700)
    credential = folder / "worker-tools.cred"
    credential.write_text(SECRET)
    table = tmp_path / "credentials.json"
    table.write_text(json.dumps({hashlib.sha256(SECRET.encode()).hexdigest(): {"roles": ["tool.*"]}}))
    monkeypatch.setenv(CREDENTIAL_ENV, str(credential))
    proc = Proc(busctl("hub", "--hub", f"ipc://{folder}/hub.sock", "--state-dir",
                       str(tmp_path / "state"), "--credentials", str(table)))
    try:
        yield proc.wait_ready()["endpoint"]
    finally:
        proc.stop()


async def test_a_refused_register_raises_to_the_caller(worker_hub: str,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    async def answer(req: IncomingRequest) -> bytes:
        return b"{}"

    async with connect(worker_hub, name="w1", role="worker") as peer:
        with caplog.at_level(logging.ERROR, logger="bus.client"), \
                pytest.raises(RegisterRefused) as refused:
            await peer.serve("agent.assistant", answer)
        await peer.serve("tool.echo", answer)  # allowed: no error
        served = {s.name for s in (await peer.status()).services}
        counters = dict(peer.counters)
    error = refused.value
    assert isinstance(error, BusError)
    assert (error.service, error.code) == ("agent.assistant", "forbidden"), error
    assert "`agent.assistant`" in str(error) and "tool.*" in error.reason, error
    assert "tool.echo" in served and "agent.assistant" not in served, served
    assert counters.get("registers_refused") == 1 and not counters.get("stale_replies"), counters
    assert any("agent.assistant" in r.getMessage() and "tool.*" in r.getMessage()
               for r in caplog.records), caplog.records
