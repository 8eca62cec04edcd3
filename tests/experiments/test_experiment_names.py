"""Issue 48, item 3 and acceptance 2: a whole experiment has one name. The shipped example (two
variants, three repeats, its scripted model) is run as `wc-1`; then `busctl export --experiment
wc-1`, `replay --experiment wc-1`, `watch --experiment wc-1 --no-follow` and `experiment report
wc-1` with the hub down each cover every cell; the journal's types are known to `watch --type`;
and `busctl diff` pairs runs by sample, whatever order they started in."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from agent_bus.agents.experiment.runner import Journal, SampleResult
from agent_bus.agents.experiment.selection import pair, trees
from agent_bus.agents.replay import RecordedRun
from agent_bus.bus.messages import TextPart, UserMessage
from tests.examples.test_examples import ENV, example, free_port
from tests.experiments.test_experiment_workflow import journal_of, run_cli
from tests.support import ROOT, Proc, busctl, wait_for

VARIANTS, REPEATS, SAMPLES = ("solo", "team"), 3, 3
CELLS = {f"wc-1.{v}.r{r}" for v in VARIANTS for r in range(1, REPEATS + 1)}


def cli(cwd: Path, *args: str, env: dict[str, str] | None = None,
        timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(busctl(*args), capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, env={**os.environ, **ENV, **(env or {})})


def lines(out: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    assert out.returncode == 0, out.stdout + out.stderr
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def covers_every_cell(events: list[dict[str, Any]], journal: Journal) -> None:
    """Every cell's tag, every cell's run, the journal's own entries: all there."""
    assert {e.get("experiment") for e in events} == CELLS | {"wc-1"}
    runs = {e["run_id"] for e in events if e["type"] == "agent_start"}
    assert {c.run_id for c in journal.results.values()} <= runs
    samples = [e for e in events if e["type"] == "experiment_sample"]
    assert len(samples) == len(VARIANTS) * REPEATS * SAMPLES


def test_one_name_covers_every_cell_with_the_hub_up_and_down(tmp_path: Path) -> None:
    copy = tmp_path / "examples" / "experiment"
    shutil.copytree(ROOT / "examples" / "experiment", copy)
    with example(tmp_path, "experiment", copy=False) as ex:
        # a watch started before the experiment: its cells, started later, are followed too
        follower = Proc(busctl("watch", "--hub", ex.endpoint, "--experiment", "wc-1", "--since",
                               "0", "--json", "--type", "experiment_sample", "--type",
                               "agent_start"), env=ENV)
        try:
            out = run_cli(ex.cwd, ex.endpoint, "run", "examples/experiment/spec.toml", "--name",
                          "wc-1", "--limit", str(SAMPLES))
            assert out.returncode == 0, out.stdout + out.stderr
            wait_for(lambda: follower.output().count('"experiment_sample"') == len(CELLS) *
                     SAMPLES, 30, "every cell's journal entry, followed live")
        finally:
            follower.stop()
        followed = [json.loads(line) for line in follower.lines if line.startswith("{")]
        assert {e["experiment"] for e in followed if e["type"] == "agent_start"} == CELLS
        journal = journal_of(ex.endpoint, "wc-1")
        hub = ("--hub", ex.endpoint)

        watched = lines(cli(ex.cwd, "watch", *hub, "--experiment", "wc-1", "--no-follow",
                            "--since", "0", "--json"))
        covers_every_cell(watched, journal)
        assert [e["seq"] for e in watched] == sorted(e["seq"] for e in watched)
        # the journal's types are event types a filter may name
        entries = lines(cli(ex.cwd, "watch", *hub, "--experiment", "wc-1", "--no-follow",
                            "--since", "0", "--json", "--type", "experiment_sample",
                            "--type", "experiment_plan"))
        assert [e["type"] for e in entries].count("experiment_plan") == 1
        assert {(e["variant"], e["sample"], e["repeat"]) for e in entries
                if e["type"] == "experiment_sample"} == set(journal.results)
        human = cli(ex.cwd, "watch", *hub, "--experiment", "wc-1.team", "--no-follow",
                    "--since", "0", "--type", "experiment_sample")
        assert human.returncode == 0 and human.stdout.count(" experiment_sample ") == \
            REPEATS * SAMPLES and "team/q01/r2 ok score 1" in human.stdout, human.stdout

        exported = lines(cli(ex.cwd, "export", *hub, "--experiment", "wc-1"))
        covers_every_cell(exported, journal)
        # the same events as watch's, as JSON lines (watch adds nothing the log lacks)
        assert [e["seq"] for e in exported] == [e["seq"] for e in watched]

        replayed = cli(ex.cwd, "replay", *hub, "--experiment", "wc-1", "--as", "wc-again",
                       timeout=120)
        assert replayed.returncode == 0, replayed.stdout + replayed.stderr
        said = replayed.stdout.splitlines()
        for cell in CELLS:
            assert f"{cell} replayed as wc-again{cell[4:]}: identical" in said, said
        assert said[-1] == f"wc-1 replayed as wc-again: {len(CELLS)} cells, identical"

        # the replay has no plan of its own: its name still covers its cells (found in the log)
        again = lines(cli(ex.cwd, "export", *hub, "--experiment", "wc-again"))
        assert {e["experiment"] for e in again} == {f"wc-again{c[4:]}" for c in CELLS}
        watched_again = lines(cli(ex.cwd, "watch", *hub, "--experiment", "wc-again",
                                  "--no-follow", "--since", "0", "--json"))
        assert [e["seq"] for e in watched_again] == [e["seq"] for e in again]
        diffed = json.loads(cli(ex.cwd, "diff", *hub, "wc-1", "wc-again", "--json").stdout)
        assert diffed["identical"], diffed
        top = [r for r in diffed["runs"] if not r["a"]["parent"]]
        assert len(top) == len(CELLS) * SAMPLES  # every sample of every cell, paired
        assert {r["sample"] for r in top} == {f"{v}/q0{s}/r{r}" for v in VARIANTS
                                              for s in range(1, SAMPLES + 1)
                                              for r in range(1, REPEATS + 1)}
        assert all(r["a"]["final_text"] == r["b"]["final_text"] for r in diffed["runs"])
        # two repeats of a cell: whatever order their samples started in (8 cells at once),
        # each sample meets its own; the deterministic model answered both alike
        repeats = json.loads(cli(ex.cwd, "diff", *hub, "wc-1.solo.r1", "wc-1.solo.r2",
                                 "--json").stdout)
        assert repeats["identical"] and [r["sample"] for r in repeats["runs"]] == \
            sorted(r["sample"] for r in repeats["runs"]), repeats
        assert {r["sample"] for r in repeats["runs"]} == {f"solo/q0{s}/r1" for s in (1, 2, 3)}
        assert all(r["a"]["final_text"] == r["b"]["final_text"] for r in repeats["runs"])
        # two variants: paired by repeat and sample; the team fixes solo's wrong q03 sums
        variants = json.loads(cli(ex.cwd, "diff", *hub, "wc-1.solo", "wc-1.team",
                                  "--json").stdout)
        both = [r for r in variants["runs"] if r["a"] and r["b"]]
        assert {r["sample"] for r in both} == {f"solo/q0{s}/r{r}" for s in (1, 2, 3)
                                               for r in range(1, REPEATS + 1)}
        assert {(r["a"]["agent"], r["b"]["agent"]) for r in both} == {("solo", "solver")}
        # the critic runs the team asked have no counterpart in solo's: listed, never paired
        assert {r["b"]["agent"] for r in variants["runs"] if not r["a"]} == {"critic"}
        live_report = json.loads(run_cli(ex.cwd, ex.endpoint, "report", "wc-1", "--json").stdout)

    # The hub is down (nothing answers where BUSCTL_HUB points): the log on disk is read
    down = {"BUSCTL_HUB": f"tcp://127.0.0.1:{free_port()}"}
    report = cli(ex.cwd, "experiment", "report", "wc-1", "--json", env=down)
    assert report.returncode == 0, report.stderr
    assert "reading the event log on disk:" in report.stderr
    assert json.loads(report.stdout) == live_report
    assert [(v["name"], v["n"]) for v in live_report["variants"]] == \
        [(v, REPEATS * SAMPLES) for v in VARIANTS]
    exported_down = cli(ex.cwd, "export", "--experiment", "wc-1", env=down)
    assert [e["seq"] for e in lines(exported_down)] == [e["seq"] for e in exported]
    totals = json.loads(exported_down.stderr.splitlines()[-1])
    assert set(totals["experiments"]) == CELLS | {"wc-1"}
    # a cell's tag given to report: the error names the experiment's name to give instead
    wrong = cli(ex.cwd, "experiment", "report", "wc-1.solo.r1", env=down)
    assert wrong.returncode == 2 and "give the experiment's name, `wc-1`" in wrong.stderr, \
        wrong.stderr


def run(run_id: str, prompt: str, parent: str = "") -> RecordedRun:
    return RecordedRun(run_id, "solo", parent, messages=[UserMessage([TextPart(prompt)])])


def test_diff_pairs_by_sample_not_by_start_order() -> None:
    """The same three samples, started in two orders (cells run concurrently), one asking a
    helper: each pairs with its own sample, its helper with its helper."""
    journal = Journal(None, {})
    for i, sample in enumerate(("q1", "q2", "q3")):
        cell = SampleResult("e", "solo", sample, 1, "ok", run_id=f"a{i}", tag="e.solo.r1")
        journal.results[cell.key] = cell
    first = trees([run("a0", "one"), run("a1", "two"), run("h1", "help", "a1"),
                   run("a2", "three")], "e.solo.r1", journal)
    again = trees([run("b2", "three"), run("b1", "two"), run("k1", "help", "b1"),
                   run("b0", "one")], "e-again.solo.r1", None)
    paired = [(label, [r.run_id for r in x.runs] if x else [], [r.run_id for r in y.runs]
               if y else []) for label, x, y in pair(first, again)]
    assert paired == [("solo/q1/r1", ["a0"], ["b0"]), ("solo/q2/r1", ["a1", "h1"], ["b1", "k1"]),
                      ("solo/q3/r1", ["a2"], ["b2"])]
    # listed in the samples' order (numbers as numbers), whatever order they started in
    later = [run("c10", "ten"), run("c2", "two")]
    journal.results.update({c.key: c for c in (
        SampleResult("e", "solo", "q10", 2, "ok", run_id="c10", tag="e.solo.r2"),
        SampleResult("e", "solo", "q2", 2, "ok", run_id="c2", tag="e.solo.r2"))})
    assert [t.sample for t in trees(later, "e.solo.r2", journal)] == ["q2", "q10"]
