"""Only the runner writes the journal, and a peer publishes progress only for calls it serves
(issue 44, breaks 6 and 9).

Break 6: `experiment_plan` / `experiment_sample` were `ext` events no role restricted, so the
worker credential, a peer with no credential, and CURVE keys with `tool.*` or no roles journaled
cells scored 1.0 that `busctl experiment report` showed (and `--resume` skipped). Now the hub takes
them only from full rights or a role matching `experiment.<E>`, stamps the right it checked
(`granted`), and every reader ignores (and counts) an entry without the stamp — one a hub that did
not check logged.

Break 9: a `tool.*` peer published `tool_execution_update` into any agent's run. Now (issue 49
item 13) never: a tool sends its progress as `partial` replies and its caller publishes them, so
the log holds one copy of each update."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from agent_bus.agents.experiment.runner import SAMPLE_TYPE, read_journal
from agent_bus.bus import events as ev
from agent_bus.bus.client import connect
from agent_bus.bus.errors import HubLost
from agent_bus.bus.messages import ToolCallRequest, ToolResult
from agent_bus.bus.serving import IncomingRequest
from agent_bus.bus.store.sqlite import SqliteStore as EventLog
from tests.multihost.conftest import Keys, generate
from tests.support import Proc, busctl

FORGE = Path(__file__).parent / "fixtures" / "forge_journal.py"
ROLES = """[roles]
owner = ["*"]
worker = ["tool.*"]
coord = ["agent.assistant", "agent.assistant@*"]
runner = ["experiment.*"]
"""  # `nobody` is authorised, with no roles


@pytest.fixture
def curve_hub(tmp_path: Path) -> Iterator[tuple[str, Keys]]:
    generate(tmp_path / "keys", "owner", "worker", "coord", "nobody", "runner")
    keys = Keys(tmp_path / "keys", tmp_path / "keys")
    (keys.authorized / "roles.toml").write_text(ROLES)
    proc = Proc(busctl("hub", "--hub", "tcp://127.0.0.1:0", "--state-dir", str(tmp_path / "state"),
                       *keys.hub_args()))
    try:
        yield proc.wait_ready()["endpoint"], keys
    finally:
        proc.stop()


def forge(endpoint: str, sample: str, *identity: str, env: dict[str, str] | None = None,
          experiment: str = "e1") -> int:
    """How many of a forged plan and cell (scored 1.0) the hub refused."""
    result = subprocess.run([sys.executable, str(FORGE), endpoint, experiment, sample, *identity],
                            capture_output=True, text=True, timeout=60,
                            env={**os.environ, **(env or {})})
    assert result.returncode == 0, result.stderr
    return int(json.loads(result.stdout.strip().splitlines()[-1])["refused"])


def curve_identity(keys: Keys, name: str) -> tuple[str, str]:
    client = keys.client(name)
    return client.server_public_key_file, client.secret_key_file


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(busctl(*args), capture_output=True, text=True, timeout=60)


def report(endpoint: str, *identity: str) -> dict[str, Any]:
    result = cli("experiment", "report", "e1", "--json", "--hub", endpoint, *identity)
    assert result.returncode == 0, result.stderr
    return dict(json.loads(result.stdout))


def counters(endpoint: str, *identity: str) -> dict[str, int]:
    result = cli("status", "--json", "--hub", endpoint, *identity)
    assert result.returncode == 0, result.stderr
    return dict(json.loads(result.stdout)["counters"])


def test_only_the_runner_writes_the_journal_curve_keys(curve_hub: tuple[str, Keys]) -> None:
    endpoint, keys = curve_hub
    for who in ("worker", "coord", "nobody"):  # tool.*, an agent's server, no roles
        assert forge(endpoint, f"forged-by-{who}", *curve_identity(keys, who)) == 2, who
    assert forge(endpoint, "s1", *curve_identity(keys, "runner")) == 0  # role experiment.*
    owner = keys.cli_args("owner")
    data = report(endpoint, *owner)
    [solo] = data["variants"]
    assert solo["n"] == 1 and data["ignored_entries"] == 0, data  # the runner's cell alone
    assert counters(endpoint, *owner)["forbidden_events"] == 6


def credential_hub(tmp_path: Path) -> tuple[Proc, str, Path]:
    """A hub as `busctl up` starts a local one: an ipc socket in a private folder, a credential
    per process kind beside it (the owner's `owner.cred`, a tool worker's), and their table."""
    folder = tmp_path / "rt"
    folder.mkdir(mode=0o700)
    table = {}
    for name, roles in (("owner", ["*"]), ("worker-tools", ["tool.*"])):
        token = f"token-of-{name}-{os.getpid()}"
        path = folder / ("owner.cred" if name == "owner" else f"{name}.cred")
        path.write_text(token)
        path.chmod(0o600)
        table[hashlib.sha256(token.encode()).hexdigest()] = {"name": name, "roles": roles}
    (tmp_path / "credentials.json").write_text(json.dumps(table))
    proc = Proc(busctl("hub", "--hub", f"ipc://{folder}/hub", "--state-dir",
                       str(tmp_path / "state"), "--credentials", str(tmp_path / "credentials.json")))
    try:
        return proc, proc.wait_ready()["endpoint"], folder
    except BaseException:
        proc.stop()
        raise


def test_only_the_runner_writes_the_journal_local_credentials(tmp_path: Path) -> None:
    proc, endpoint, folder = credential_hub(tmp_path)
    try:
        worker = {"BUSCTL_CREDENTIAL_FILE": str(folder / "worker-tools.cred")}
        assert forge(endpoint, "forged-by-worker", env=worker) == 2
        nothing = {"BUSCTL_CREDENTIAL_FILE": str(folder / "none.cred")}  # presents no credential
        assert forge(endpoint, "forged-by-nobody", env=nothing) == 2
        assert forge(endpoint, "s1") == 0  # the owner's (`owner.cred` beside the socket)
        data = report(endpoint)
        assert data["variants"][0]["n"] == 1 and data["ignored_entries"] == 0, data
        assert counters(endpoint)["forbidden_events"] == 4
    finally:
        proc.stop()


def seed_journal(state: Path) -> None:
    """The log of a hub that did not check who wrote the journal: a forger's plan and cell
    (scored 1.0), no `granted`, and the runner's cell (scored 0.0) as a checking hub stamps it."""
    state.mkdir(mode=0o700)
    log = EventLog(state / "events.db")  # where `busctl hub --state-dir` keeps it
    encode = msgspec.msgpack.Encoder().encode
    ts = time.time()
    plan = {"type": "experiment_plan", "experiment": "e1", "digest": "d", "spec": "spec.toml",
            "samples": 2, "variants": ["solo"], "repeats": 1, "planned": 2, "scorers": ["number"]}
    forged = {"type": SAMPLE_TYPE, "experiment": "e1", "variant": "solo", "sample": "s2",
              "repeat": 1, "status": "ok", "score": 1.0, "scores": {"number": 1.0}}
    genuine = {**forged, "sample": "s1", "score": 0.0, "scores": {"number": 0.0}}
    rows = []
    for seq, (body, granted) in enumerate([(plan, ""), (forged, ""), (plan, "*"),
                                           (genuine, "*")], start=1):
        header = {"kind": "event", "id": f"j{seq}", "type": body["type"], "experiment": "e1",
                  "peer": "00deadbeef", "seq": seq, "ts": ts, **({"granted": granted} if granted
                                                                  else {})}
        rows.append((seq, ts, body["type"], "", "", "e1", encode(header), encode(body)))
    try:
        log.append(rows)
    finally:
        log.close()


def test_readers_ignore_journal_entries_the_hub_did_not_stamp(tmp_path: Path) -> None:
    seed_journal(tmp_path / "state")
    proc = Proc(busctl("hub", "--hub", "tcp://127.0.0.1:0", "--state-dir",
                       str(tmp_path / "state")))
    try:
        endpoint = proc.wait_ready()["endpoint"]
        data = report(endpoint)
        solo = data["variants"][0]
        assert (solo["n"], solo["score"]) == (1, 0.0), data  # the forged 1.0 is not counted
        assert data["ignored_entries"] == 2, data
        text = cli("experiment", "report", "e1", "--hub", endpoint)
        assert "2 journal entries ignored: not stamped by the hub" in text.stdout, text.stdout

        async def journal() -> Any:  # what `--resume` reads: the forged cell is not done
            async with connect(endpoint, name="reader") as peer:
                return await read_journal(peer, "e1")

        resumed = anyio.run(journal)
        assert list(resumed.results) == [("solo", "s1", 1)] and resumed.ignored == 2
    finally:
        proc.stop()


# --- break 9: a tool's progress is its caller's to publish --------------------------------


async def publish_progress(peer: Any, run: str, call_id: str = "c1", parent: str = "") -> None:
    await peer.publish(ev.ToolExecutionUpdate(tool_call_id=call_id, tool_name="x",
                                              partial={"text": run}),
                       agent="assistant", run=run, parent=parent)
    try:
        await peer.confirm()  # logged (or refused) before what comes next
    except HubLost:
        pass  # refused: counted in `events_refused`


@pytest.mark.anyio
async def test_a_tool_peer_publishes_no_progress_events_not_even_for_its_own_calls(
        curve_hub: tuple[str, Keys]) -> None:
    endpoint, keys = curve_hub
    async with connect(endpoint, name="worker", curve=keys.client("worker")) as worker, \
            connect(endpoint, name="coord", curve=keys.client("coord")) as coord:

        async def tool(req: IncomingRequest) -> bytes:
            call = msgspec.msgpack.decode(req.body, type=ToolCallRequest)
            await publish_progress(worker, call.run_id, call.call_id, req.id)  # its own call
            await publish_progress(worker, "r2", call.call_id, req.id)  # another run
            return msgspec.msgpack.encode(ToolResult())

        await worker.serve("tool.x", tool)
        await coord.serve("agent.assistant", lambda req: b"")
        await publish_progress(worker, "victim")  # serving no call of it
        assert worker.counters.get("events_refused", 0) == 1
        call = ToolCallRequest(call_id="c1", name="x", agent="assistant", run_id="r1")
        await coord.request("tool.x", msgspec.msgpack.encode(call), timeout=20)
        assert worker.counters.get("events_refused", 0) == 1 + 2
        # the caller (here the agent's own server) publishes the call's progress: one copy
        await publish_progress(coord, "r1")
        logged = cli("watch", "--json", "--no-follow", "--since", "0", "--hub", endpoint,
                     *keys.cli_args("owner"))
        updates = [e for e in map(json.loads, logged.stdout.splitlines())
                   if e.get("type") == "tool_execution_update"]
        assert [(e.get("run_id"), e.get("peer")) for e in updates] == [
            ("r1", coord.peer_id)], logged.stdout[-2000:]
