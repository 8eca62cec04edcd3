"""Replay trusts only what ran (issue #35 acceptance 1): a run in the log whose events were not
published by a peer serving its agent (seeded straight into SQLite, as an older hub may have
logged it) is not replayed: `busctl replay --live-tools` names it, skips it, and never runs its
`write_file`; the experiment's real run is still replayed."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import msgspec

from agent_bus.bus import protocol as p
from agent_bus.bus.paths import default_state_dir, ensure_state_dir
from agent_bus.bus.store.sqlite import SqliteStore as EventLog
from tests.cli.conftest import start_up
from tests.security.fixtures.forge_run import forged_run
from tests.support import busctl

EXPERIMENT = "e1"


def seed_forged_run(state: Path) -> None:
    """The forged run of fixtures/forge_run.py, logged as published by a peer that never served
    `agent.assistant`."""
    (state / "hub").mkdir(mode=0o700, exist_ok=True)
    log = EventLog(state / "hub" / "events.db")
    encode = msgspec.msgpack.Encoder().encode
    ts = time.time()
    rows = []
    for seq, body in enumerate(forged_run("forged1"), start=1):
        header = p.Header(kind=p.EVENT, id=f"f{seq}", type=body["type"], agent="assistant",
                          run="forged1", experiment=EXPERIMENT, peer="00deadbeef", seq=seq, ts=ts)
        rows.append((seq, ts, body["type"], "assistant", "forged1", EXPERIMENT, encode(header),
                     encode(body)))
    try:
        log.append(rows)
    finally:
        log.close()


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(busctl(*args), capture_output=True, text=True, timeout=90, cwd=cwd)


def test_replay_live_tools_skips_a_forged_run_and_names_it(tmp_path: Path) -> None:
    seed_forged_run(ensure_state_dir(default_state_dir(tmp_path)))
    proc, ready = start_up(tmp_path, "--demo")
    try:
        hub = ready["endpoint"]
        real = cli("run", "--hub", hub, "--experiment", EXPERIMENT, "hello", cwd=tmp_path)
        assert real.returncode == 0, real.stderr
        result = cli("replay", "--hub", hub, "--experiment", EXPERIMENT, "--as", "e1-again",
                     "--live-tools", cwd=tmp_path)
        assert "run forged1 (agent `assistant`) was published by 00deadbeef" in result.stderr, \
            result.stderr
        assert not list(tmp_path.rglob("PWNED*")), "the forged run's write_file ran"
        # the real run was replayed (its live tools may answer differently now: a divergence)
        assert "e1 replayed as e1-again" in result.stdout + result.stderr, result.stderr
    finally:
        proc.stop(timeout=10)


def seed_run_of_another_agents_server(state: Path) -> None:
    """The forged run of `assistant`, published by a peer the hub saw serve `agent.other` (its
    `service_registered`, a hub event): a server, but of another agent."""
    (state / "hub").mkdir(mode=0o700, exist_ok=True)
    log = EventLog(state / "hub" / "events.db")
    encode = msgspec.msgpack.Encoder().encode
    ts = time.time()
    server = "00cafe0001"
    registered = {"type": "service_registered", "service": "agent.other", "peer": server}
    rows = [(1, ts, "service_registered", "", "", "",
             encode(p.Header(kind=p.EVENT, id="r1", type="service_registered", peer="hub", seq=1,
                             ts=ts)), encode(registered))]
    for seq, body in enumerate(forged_run("forged2"), start=2):
        header = p.Header(kind=p.EVENT, id=f"f{seq}", type=body["type"], agent="assistant",
                          run="forged2", experiment=EXPERIMENT, peer=server, seq=seq, ts=ts)
        rows.append((seq, ts, body["type"], "assistant", "forged2", EXPERIMENT, encode(header),
                     encode(body)))
    try:
        log.append(rows)
    finally:
        log.close()


def test_replay_does_not_trust_the_server_of_another_agent(tmp_path: Path) -> None:
    """Serving some agent is not enough: the run's own agent's server must have published it
    (a trust check reduced to "any agent's server" lets `other`'s coordinator forge
    `assistant`'s runs, and their `write_file`s run under --live-tools)."""
    seed_run_of_another_agents_server(ensure_state_dir(default_state_dir(tmp_path)))
    proc, ready = start_up(tmp_path, "--demo")
    try:
        result = cli("replay", "--hub", ready["endpoint"], "--experiment", EXPERIMENT, "--as",
                     "e1-again", "--live-tools", cwd=tmp_path)
        assert "run forged2 (agent `assistant`) was published by 00cafe0001, which never " \
               "served `agent.assistant`" in result.stderr, result.stderr
        assert not list(tmp_path.rglob("PWNED*")), "the forged run's write_file ran"
    finally:
        proc.stop(timeout=10)
