"""Issue 35 §3: `busctl run` ends when its result arrives, even when the hub's log refused the
run's `agent_end` (a full disk), and says so on stderr.

The hub runs in a private mount namespace with its state dir on a small tmpfs (root only; the
test is skipped elsewhere), filled to the last byte through `/proc/<hub pid>/root`; the gateway
and the coordinator keep their state on the ordinary disk.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import anyio
import pytest

from agent_bus.agents.gateway.fakellm import FakeLLMServer
from agent_bus.bus import events as ev
from agent_bus.bus.client import connect
from tests.coordinator.conftest import Stack, topology_text
from tests.fault.test_disk_full import fill, hub_on_tmpfs, tmpfs_namespaces_work
from tests.support import busctl, until

pytestmark = pytest.mark.anyio

AGENTS = """
[[agents]]
name = "p"
model = "x"
tools = []
"""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_run_returns_with_the_answer_and_a_warning_when_the_log_is_full(
        tmp_path: Path) -> None:
    state = tmp_path / "hub"
    state.mkdir()
    if not tmpfs_namespaces_work(state):
        pytest.skip("needs root and `unshare -m` to mount a private tmpfs")
    srv = FakeLLMServer({"rules": [{"reply": {"text": "the answer"}}]}).start()
    topology = tmp_path / "topology.toml"
    topology.write_text(topology_text(srv.base_url, AGENTS))
    stack = Stack(tmp_path, "", srv, topology, {"hub": hub_on_tmpfs(state, "2m")})
    try:
        ready = stack.procs["hub"].wait_ready()
        stack.endpoint = ready["endpoint"]
        stack.gateway()
        stack.coordinator("p")
        filler = fill(Path(f"/proc/{ready['pid']}/root") / str(state).lstrip("/"))
        async with connect(stack.endpoint, name="filler") as pub:

            async def refusing() -> bool:
                await pub.publish(ev.TopicMessage(topic="disk", text="full?"))
                return bool((await pub.status()).log_error)

            await until(refusing, 10, "the hub to refuse events (its disk is full)")

        def run() -> subprocess.CompletedProcess[str]:
            return subprocess.run(busctl("run", "--hub", stack.endpoint, "--agent", "p", "hi"),
                                  capture_output=True, text=True, timeout=30, check=False)

        out = await anyio.to_thread.run_sync(run)
        assert out.returncode == 0, out.stderr
        assert out.stdout == "the answer\n", out.stdout
        assert "warning: run " in out.stderr and "event log refused its events" in out.stderr \
            and "full" in out.stderr, out.stderr
        filler.unlink()
    finally:
        stack.close()
