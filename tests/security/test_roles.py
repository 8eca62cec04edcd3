"""Roles on identities (issue #28 item 6, issue #35 "at the door"): a peer whose CURVE key has
roles in the hub's `roles.toml` serves only the services they name and publishes `agent` events
only for the agents it serves. The forger is a raw peer written from docs/protocol.md
(fixtures/forge_run.py: plain pyzmq and msgspec, in its own interpreter)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.multihost.conftest import Keys, generate
from tests.support import Proc, busctl

FORGE = Path(__file__).parent / "fixtures" / "forge_run.py"


@pytest.fixture
def curve_hub(tmp_path: Path) -> Iterator[tuple[dict, Keys]]:
    generate(tmp_path / "keys", "owner", "worker", "coord")
    keys = Keys(tmp_path / "keys", tmp_path / "keys")
    (keys.authorized / "roles.toml").write_text(
        '[roles]\nowner = ["*"]\nworker = ["tool.*"]\ncoord = ["agent.assistant", "agent.assistant@*"]\n')
    proc = Proc(busctl("hub", "--hub", "tcp://127.0.0.1:0", "--state-dir", str(tmp_path / "state"),
                       *keys.hub_args()))
    try:
        yield proc.wait_ready(), keys
    finally:
        proc.stop()


def forge(info: dict, keys: Keys, key: str, *args: str) -> dict[str, str]:
    secret = (keys.dir / f"{key}.key_secret").read_text()
    server = (keys.dir / "hub.key").read_text()
    z85 = [line.split('"')[1] for text in (server, secret) for line in text.splitlines()
           if "-key = " in line]  # pyzmq certificate files: public-key (and secret-key) lines
    result = subprocess.run([sys.executable, str(FORGE), info["endpoint"], f"--curve={','.join(z85)}",
                             *args],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_tool_worker_key_cannot_serve_an_agent_nor_forge_its_run(curve_hub) -> None:
    info, keys = curve_hub
    answers = forge(info, keys, "worker", "--serve", "agent.assistant", "--serve", "tool.x")
    assert answers.pop("reg0") == "forbidden" and answers.pop("reg1") == "ok", answers
    assert set(answers.values()) == {"forbidden"}, answers  # every event of the forged run
    # the identity that serves `assistant` speaks for it, and only for it
    assert set(forge(info, keys, "coord", "--serve", "agent.assistant").values()) == {"ok"}
    other = forge(info, keys, "coord", "--serve", "agent.assistant", "--agent", "other")
    assert other.pop("reg0") == "ok" and set(other.values()) == {"forbidden"}, other
    # the owner's key keeps full rights
    assert set(forge(info, keys, "owner").values()) == {"ok"}
    status = subprocess.run(busctl("status", "--json", "--hub", info["endpoint"],
                                   *keys.cli_args("owner")),
                            capture_output=True, text=True, timeout=30)
    counters = json.loads(status.stdout)["counters"]
    assert counters["forbidden_registers"] == 1, counters
    assert counters["forbidden_events"] == 12, counters


@pytest.mark.anyio
async def test_the_bus_client_counts_a_forbidden_event_as_refused(curve_hub) -> None:
    """The `bus` client with a tool worker's key publishes an event of an agent it does not
    serve: the hub answers `forbidden`, and the client counts and logs it as a refused event
    (`events_refused`), not as a stale reply to some request."""
    from agent_bus.bus import events as ev
    from agent_bus.bus.client import connect
    from tests.support import until

    info, keys = curve_hub
    async with connect(info["endpoint"], name="w", curve=keys.client("worker")) as peer:
        await peer.publish(ev.AgentStart(), agent="assistant", run="r1")
        await until(lambda: peer.counters.get("events_refused", 0) == 1, 10,
                    "the hub's forbidden answer counted as a refused event")
        assert peer.counters.get("stale_replies", 0) == 0, peer.counters


def test_an_agents_server_does_not_speak_for_an_agent_its_name_starts(tmp_path: Path) -> None:
    """The role check matches the agent's service name whole: the server of `agent.bob2` (or an
    instance of it, `agent.bob2@...`) publishes `bob2`'s events, never `bob`'s."""
    generate(tmp_path / "keys", "bob2")
    keys = Keys(tmp_path / "keys", tmp_path / "keys")
    (keys.authorized / "roles.toml").write_text('[roles]\nbob2 = ["agent.bob2", "agent.bob2@*"]\n')
    proc = Proc(busctl("hub", "--hub", "tcp://127.0.0.1:0", "--state-dir", str(tmp_path / "state"),
                       *keys.hub_args()))
    try:
        info = proc.wait_ready()
        for serve in ("agent.bob2", "agent.bob2@1"):
            bob = forge(info, keys, "bob2", "--serve", serve, "--agent", "bob")
            assert bob.pop("reg0") == "ok" and set(bob.values()) == {"forbidden"}, (serve, bob)
        own = forge(info, keys, "bob2", "--serve", "agent.bob2", "--agent", "bob2")
        assert set(own.values()) == {"ok"}, own
    finally:
        proc.stop()
