"""Issue 52's acceptance 1: the hub survives its host. Real servers only: a three-server NATS
JetStream cluster on loopback holds the log; two hubs (a primary and a standby on the lease); the
example experiment's topology (scripted model, gateway, a tool worker, coordinator) started by
`busctl up` with both hub endpoints; a `busctl watch` following both. The primary hub is
SIGKILLed mid-experiment: the standby takes over (the time printed), the experiment completes
with every cell exactly once, the watcher saw every seq once, and every acknowledged event is in
the log afterwards."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from agent_bus.agents.launch.supervisor import read_run_file
from agent_bus.bus.paths import default_state_dir
from tests.store_cluster import Cluster, free_ports
from tests.support import Proc, busctl, running, wait_for

pytestmark = [pytest.mark.timeout(300)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "experiment"
CELLS = 120  # 20 samples x 2 variants x 3 repeats


TTL = 3.0  # the lease's TTL (`[hub] lease_ttl`): a takeover within TTL + TTL/4 + a pass


def _project(root: Path, store: str) -> Path:
    """The example experiment in a folder of its own: its hub on the JetStream `store` with a
    standby, the scripted model slowed so that the run lasts several seconds, a tool worker."""
    folder = root / "exp"
    folder.mkdir()
    for file in ("spec.toml", "samples.jsonl"):
        shutil.copy(EXAMPLE / file, folder / file)
    script = json.loads((EXAMPLE / "fake_model.json").read_text())
    for rule in script["rules"]:
        rule["delay"] = 0.1
    (folder / "fake_model.json").write_text(json.dumps(script))
    model_port, = free_ports(1)
    text = (EXAMPLE / "topology.toml").read_text()
    text = text.replace('endpoint = "tcp://127.0.0.1:7400"',
                        f'store = "{store}"\nstandby = "tcp://127.0.0.1:0"\nlease_ttl = {TTL}')
    text = text.replace("7483", str(model_port)).replace("examples/experiment/fake_model.json",
                                                         "fake_model.json")
    text = text.replace("workers = []", "")
    text += '\n[[workers]]\nname = "tools"\ncount = 1\n'
    (folder / "topology.toml").write_text(text)
    return folder


def _ps(folder: Path) -> dict[str, dict[str, Any]]:
    done = subprocess.run(busctl("ps", "--json"), cwd=folder, capture_output=True, text=True,
                          timeout=60)
    return {row["name"]: row for row in map(json.loads, done.stdout.splitlines())}


def test_the_primary_hubs_host_lost_mid_experiment_loses_nothing(jetstream: Cluster,
                                                                  tmp_path: Path) -> None:
    store = jetstream.stream_url()
    folder = _project(tmp_path, store)
    with running(busctl("up", "--json", "-c", "topology.toml", "--hub", "tcp://127.0.0.1:0"),
                 cwd=folder) as up:
        primary = up.wait_ready(90)["endpoint"]
        info = read_run_file(default_state_dir(folder) / "up.json")
        assert info is not None and info.endpoint == f"{primary},{primary}-standby"  # both private
        hubs = info.endpoint  # what every process of the topology was given
        standby = hubs.split(",")[1]
        with running(busctl("watch", "--json", "--hub", hubs), cwd=folder) as watch, \
                running(busctl("experiment", "run", "spec.toml", "--name", "fo", "--hub", hubs),
                        cwd=folder) as run:

            def samples_seen() -> int:
                return sum('"experiment_sample"' in line for line in list(watch.lines))

            wait_for(lambda: samples_seen() >= CELLS // 6, 120, "a sixth of the cells done")
            leader = _ps(folder)["hub"]
            assert leader["role"].startswith("hub primary"), leader
            os.kill(leader["pid"], signal.SIGKILL)
            killed_at = time.monotonic()
            done_before = samples_seen()
            seen: list[dict[str, str]] = []

            def standby_leads() -> bool:
                roles = {name: row["role"] for name, row in _ps(folder).items()
                         if name.startswith("hub")}
                if not seen or seen[-1] != roles:
                    seen.append(roles)
                return roles.get("hub-standby", "").startswith("hub primary")

            try:
                wait_for(standby_leads, TTL + TTL / 4 + 30, "the standby to lead")
            except TimeoutError:
                raise AssertionError(f"the hubs' roles after the kill: {seen}") from None
            took = time.monotonic() - killed_at
            print(f"\nthe primary hub SIGKILLed after {done_before} of {CELLS} cells; the "
                  f"standby ({standby}) leads {took:.2f} s later (lease_ttl {TTL:g} s: bound "
                  f"TTL + TTL/4 = {TTL * 1.25:g} s and a check)")
            assert run.popen.wait(timeout=240) == 0, run.output()
            print("\n".join(line for line in run.lines if "journal entry" in line))
            cells = _cells(folder, "fo")
            assert len(cells) == CELLS
            # every acknowledged event is in the log, which has no hole
            logged = jetstream.stream_seqs(store)
            seqs = [seq for seq, _, _ in logged]
            assert seqs == list(range(1, len(seqs) + 1))
            journal = _journal_cells(logged)
            assert len(journal) == len(set(journal)) == CELLS, \
                f"{len(journal)} journal entries for {len(set(journal))} of {CELLS} cells"
            # the watcher saw every seq once, from its first to the log's head
            wait_for(lambda: (w := _watched(watch)) and w[-1] >= seqs[-1], 60,
                     "the watcher to reach the log's head")
            watched = _watched(watch)
            assert watched == list(range(watched[0], watched[-1] + 1)), "a hole or a duplicate"
        assert up.popen.poll() is None  # the supervisor lives on


def _cells(folder: Path, experiment: str) -> set[tuple[str, str, int]]:
    rows = [json.loads(line) for line in (folder / "results" / f"{experiment}.jsonl")
            .read_text().splitlines()]
    cells = {(r["variant"], r["sample"], r["repeat"]) for r in rows}
    assert len(cells) == len(rows), "a cell appears more than once in the results"
    return cells


def _journal_cells(logged: list[tuple[int, bytes, bytes]]) -> list[tuple[str, str, int]]:
    import msgspec

    out = []
    for _, header, body in logged:
        if msgspec.msgpack.decode(header).get("type") != "experiment_sample":
            continue
        sample = msgspec.msgpack.decode(body)
        out.append((sample["variant"], sample["sample"], sample["repeat"]))
    return out


def _watched(watch: Proc) -> list[int]:
    seqs = []
    for line in list(watch.lines):
        if line.startswith("{"):
            seq = json.loads(line).get("seq")
            if seq:
                seqs.append(int(seq))
    return seqs
