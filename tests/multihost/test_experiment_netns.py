"""`busctl experiment` across two hosts (issue 30 item 6): network namespaces and CURVE as in
test_netns.py, a coordinator of agent `a` on each host. An experiment of 40 samples spreads
over both (each runs at least 30%); then one with host A's coordinator SIGKILLed mid-run
completes with every sample exactly once. Needs root and `ip`; skips otherwise."""

from __future__ import annotations

import signal
import sys
from collections import Counter
from pathlib import Path

import anyio
import pytest

from agent_bus.agents.client.remote import connect as connect_agents
from agent_bus.agents.experiment.runner import Journal, Runner, read_journal
from agent_bus.agents.experiment.spec import load_spec
from tests.coordinator.conftest import topology_text
from tests.multihost.test_netns import Cluster, cluster, net  # noqa: F401 - the fixtures
from tests.support import Proc, until

pytestmark = pytest.mark.anyio

SCRIPT = {"rules": [{"contains": [], "delay": 0.15, "reply": {"text": "answer 7"}}]}


def spec(tmp: Path, name: str) -> Path:
    with (tmp / "samples.jsonl").open("w") as out:
        for i in range(40):
            out.write(f'{{"id": "s{i}", "input": "question {i}", "target": 7}}\n')
    path = tmp / f"{name}.toml"
    path.write_text(f'name = "{name}"\n[dataset]\npath = "samples.jsonl"\n'
                    f'[[variants]]\nname = "v"\nagent = "a"\n'
                    f'[run]\nconcurrency = 8\nresume_wait = 1\n[[scorers]]\nkind = "number"\n')
    return path


async def run(cluster: Cluster, path: Path, name: str) -> Journal:  # noqa: F811
    async with connect_agents(cluster.endpoint, name="driver", resume_wait=1,
                              curve=cluster.keys.client("driver")) as bus:
        return await Runner(bus, load_spec(path), name).run()


async def journal(cluster: Cluster, name: str) -> Journal:  # noqa: F811
    async with connect_agents(cluster.endpoint, name="driver",
                              curve=cluster.keys.client("driver")) as bus:
        return await read_journal(bus.peer, name)


async def test_experiment_spreads_over_hosts_and_survives_a_killed_coordinator(
        cluster: Cluster, tmp_path: Path) -> None:  # noqa: F811
    cluster.srv.set_script(SCRIPT)
    topology = tmp_path / "topology.toml"
    topology.write_text(topology_text(cluster.srv.base_url))
    local = Proc([sys.executable, "-m", "agent_bus.cli", "coordinator", "--hub", cluster.endpoint,
                  *cluster.keys.cli_args("driver"), "--topology", str(topology), "--agent", "a",
                  "--state-dir", str(tmp_path / "agents"), "--name", "local-coordinator"])
    try:
        local.wait_ready(20)
        with anyio.fail_after(60):
            spread = await run(cluster, spec(tmp_path, "spread"), "spread")
        hosts = Counter(r.session.partition(".")[0] for r in spread.results.values())
        assert sum(hosts.values()) == 40 and set(hosts) == {"local-coordinator",
                                                          "remote-coordinator"}, hosts
        assert min(hosts.values()) >= 12, hosts  # each host at least 30%

        at_kill: list[int] = []

        async def kill_after_ten() -> None:
            await until(lambda: _done(cluster, "killed"), 30, "10 cells journaled")
            local.signal(signal.SIGKILL)
            at_kill.append(len((await journal(cluster, "killed")).results))

        with anyio.fail_after(90):
            async with anyio.create_task_group() as tg:
                tg.start_soon(kill_after_ten)
                killed = await run(cluster, spec(tmp_path, "killed"), "killed")
        assert local.popen.poll() is not None and at_kill[0] < 40, at_kill  # killed mid-run
        # the runs it held failed over: retried on host B (errors, not answers)
        assert any(r.attempts > 1 for r in killed.results.values())
        final = await journal(cluster, "killed")
        assert len(final.results) == 40 and final.ok_entries == 40, final.results.keys()
        assert {r.status for r in final.results.values()} == {"ok"}
        assert {r.score for r in killed.results.values()} == {1.0}
    finally:
        local.stop()


async def _done(cluster: Cluster, name: str) -> bool:  # noqa: F811
    return len((await journal(cluster, name)).results) >= 10
