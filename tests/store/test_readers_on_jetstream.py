"""The experiment journal, its report, a killed runner's `--resume` and `busctl export` on a hub
whose log is a JetStream stream (`[hub] store` in the topology, through `busctl up`): they read
it as they read the SQLite log (tests/experiments/test_experiment_workflow.py is the SQLite
twin). Skipped, saying what to install, without the `nats` extra."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
from pathlib import Path

from tests.examples.test_examples import ENV, example
from tests.experiments.test_experiment_workflow import journal_of, run_cli
from tests.store_cluster import Cluster
from tests.support import ROOT, Proc, busctl, wait_for

SPEC = "examples/experiment/spec.toml"


def test_journal_report_resume_and_export_on_a_jetstream_log(tmp_path: Path,
                                                              jetstream: Cluster) -> None:
    copy = tmp_path / "examples" / "experiment"
    shutil.copytree(ROOT / "examples" / "experiment", copy)
    topology = copy / "topology.toml"
    topology.write_text(topology.read_text().replace(
        "[hub]\n", f'[hub]\nstore = "{jetstream.stream_url()}"\n', 1))
    with example(tmp_path, "experiment", copy=False) as ex:
        runner = Proc(busctl("experiment", "run", SPEC, "--name", "js-1", "--hub", ex.endpoint),
                      cwd=ex.cwd, env=ENV)
        try:
            wait_for(lambda: len(journal_of(ex.endpoint, "js-1").results) >= 10, 60,
                     "10 cells journaled")
            runner.signal(signal.SIGKILL)
            runner.popen.wait(5)
        finally:
            runner.stop()
        assert len(journal_of(ex.endpoint, "js-1").results) < 120, "the runner finished first"
        out = run_cli(ex.cwd, ex.endpoint, "run", SPEC, "--resume", "js-1")
        assert out.returncode == 0, out.stdout + out.stderr
        assert journal_of(ex.endpoint, "js-1").ok_entries == 120  # none twice, none lost
        data = json.loads(run_cli(ex.cwd, ex.endpoint, "report", "js-1", "--json").stdout)
        assert [(v["name"], v["n"], v["score"]) for v in data["variants"]] == \
            [("solo", 60, 0.75), ("team", 60, 1.0)]
        assert data["duplicates"] == 0
        export = tmp_path / "js-1.team.r1.jsonl"  # a cell tag: its runs' events
        done = subprocess.run(
            busctl("export", "--experiment", "js-1.team.r1", "-o", str(export), "--hub",
                   ex.endpoint),
            capture_output=True, text=True, timeout=60, cwd=ex.cwd)
        assert done.returncode == 0, done.stderr
        events = [json.loads(line) for line in export.read_text().splitlines()]
        # 20 solver + 20 critic runs, and any the killed runner left aborted (run again)
        assert sum(e["type"] == "agent_end" for e in events) >= 40
        # the cell's runs, and its journal entries (logged under the experiment's name)
        assert {e["experiment"] for e in events} == {"js-1.team.r1", "js-1"}
        assert {e["type"] for e in events if e["experiment"] == "js-1"} == {"experiment_sample"}
        seqs = [e["seq"] for e in events]
        assert seqs == sorted(set(seqs))
