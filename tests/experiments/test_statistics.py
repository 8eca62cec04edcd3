"""Issue 48, items 1, 2 and 5: the report's statistics with samples as the unit, checked against
scipy.stats; the one failure rule in the report and the results file; the paired comparisons;
the spec's errors and a `python` scorer kept next to its spec; `--plot` with and without
matplotlib; costs printed with their digits."""

from __future__ import annotations

import json
import math
import os
import random
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from scipy import stats as sp

from agent_bus.agents.experiment import report as rep
from agent_bus.agents.experiment import stats
from agent_bus.agents.experiment.runner import Journal, Plan, SampleResult, money, result_rows
from tests.support import busctl


def test_t_distribution_matches_scipy() -> None:
    for df in [*range(1, 40), 57, 100, 1000, 100_000]:
        for q in (0.6, 0.9, 0.975, 0.995, 0.9999):
            assert stats.t_ppf(q, df) == pytest.approx(sp.t.ppf(q, df), rel=1e-9)
        for t in (-30.0, -2.1, -0.3, 0.0, 0.7, 2.0, 12.0):
            assert stats.t_cdf(t, df) == pytest.approx(sp.t.cdf(t, df), rel=1e-9, abs=1e-15)


def test_intervals_and_tests_match_scipy() -> None:
    rng = random.Random(48)
    for n in (2, 3, 5, 15, 60):
        values = [rng.gauss(0.5, 0.3) for _ in range(n)]
        want = sp.t.interval(0.95, n - 1, loc=sum(values) / n, scale=sp.sem(values))
        assert stats.t_interval(values) == pytest.approx(want, rel=1e-9)
        effect, ci, p = stats.paired_t(values)
        assert effect == pytest.approx(sum(values) / n)
        assert ci == pytest.approx(want, rel=1e-9)
        assert p == pytest.approx(sp.ttest_1samp(values, 0.0).pvalue, rel=1e-9)
    for k, n in ((0, 0), (2, 8), (6, 8), (0, 9), (5, 10), (1, 30), (40, 100)):
        want = sp.binomtest(k, n).pvalue if n else 1.0
        assert stats.binom_two_sided(k, n) == pytest.approx(want, rel=1e-12)
    assert stats.t_interval([0.5]) is None and stats.paired_t([1.0])[1:] == (None, None)
    assert stats.paired_t([0.0, 0.0, 0.0])[1:] == ((0.0, 0.0), 1.0)


# A journal as the runner writes it: per sample and repeat (status, stop reason, scores).
def cell(variant: str, sample: str, repeat: int, outcome: str, x: float | None,
         y: float | None = None) -> SampleResult:
    status, stop = {"ok": ("ok", "stop"), "timed_out": ("ok", "timeout"),
                    "limited": ("ok", "limit"), "error": ("error", "error")}[outcome]
    scores = {"x": x, "y": x if y is None else y}
    if outcome == "timed_out":  # the runner scores a timeout's empty answer: not what counts
        scores = {"x": 1.0, "y": 1.0}
    return SampleResult("e", variant, sample, repeat, status, stop_reason=stop,
                        score=scores["x"] if status == "ok" else None,
                        scores=scores if status == "ok" else {}, tokens=10 * repeat,
                        cost=0.00004 * repeat, wall=float(repeat), turns=1)


def mixed_journal() -> Journal:
    """4 samples x 3 repeats x 2 variants, repeats that disagree, every failure kind."""
    rows = {
        "a": {"s1": [("ok", 1), ("ok", 0), ("ok", 1)], "s2": [("ok", 1), ("timed_out", 1),
                                                               ("ok", 1)],
              "s10": [("ok", 0), ("ok", 0), ("error", None)],
              "s3": [("limited", 1), ("ok", 0.5), ("ok", None)]},
        "b": {"s1": [("ok", 1), ("ok", 1), ("ok", 1)], "s2": [("ok", 0), ("ok", 1), ("ok", 1)],
              "s10": [("ok", 1), ("ok", 0.5), ("ok", 1)],
              "s3": [("ok", 1), ("ok", 1), ("ok", 0)]},
    }
    cells = [cell(v, s, r, o, x) for v, samples in rows.items()
             for s, reps in samples.items() for r, (o, x) in enumerate(reps, 1)]
    plan = Plan("e", "d", "spec.toml", samples=4, variants=["a", "b"], repeats=3, planned=24,
                scorers=["x", "y"])
    return Journal(plan, {c.key: c for c in cells}, ok_entries=sum(c.status == "ok"
                                                                   for c in cells))


def by_hand(journal: Journal, variant: str, scorer: str) -> dict[str, float]:
    """Per-sample means by the documented rule, written out independently of report.py."""
    sums: dict[str, list[float]] = {}
    for c in journal.results.values():
        if c.variant != variant:
            continue
        if c.status != "ok" or c.stop_reason in ("timeout", "limit"):
            value: float | None = 0.0
        else:
            value = c.scores.get(scorer)
        if value is not None:
            sums.setdefault(c.sample, []).append(value)
    return {s: sum(v) / len(v) for s, v in sums.items()}


def interval(values: list[float]) -> list[float]:
    lo, hi = sp.t.interval(0.95, len(values) - 1, loc=sum(values) / len(values),
                           scale=sp.sem(values))
    return [max(0.0, lo), min(1.0, hi)]


def test_report_counts_samples_as_the_unit_and_failures_as_zero() -> None:
    journal = mixed_journal()
    data = rep.report(journal, "e")
    a, b = data["variants"]
    assert (a["samples"], a["repeats"], a["cells"], a["planned"]) == (4, 3, 12, 12)
    assert (a["timed_out"], a["limited"], a["errors"], a["failures"]) == (1, 1, 1, 3)
    assert (data["done"], data["counted"]) == (23, 24)  # the error runs again on --resume
    assert (b["timed_out"], b["limited"], b["errors"]) == (0, 0, 0)
    for v in (a, b):
        for scorer in ("x", "y"):
            means = by_hand(journal, v["name"], scorer)
            got = v["scores"][scorer]
            assert got["mean"] == pytest.approx(sum(means.values()) / len(means))
            assert got["ci95"] == pytest.approx(interval(list(means.values())))
            assert (got["method"], got["samples"]) == ("t_samples", len(means))
        assert v["score"] == v["scores"]["x"]["mean"] and v["ci95"] == v["scores"]["x"]["ci95"]
    # s3 of a: limited (0), 0.5, no score: (0 + 0.5) / 2
    s3 = next(r for r in a["per_sample"] if r["sample"] == "s3")
    assert s3 == {"sample": "s3", "mean": 0.25, "means": {"x": 0.25, "y": 0.25},
                  "scores": [0.0, 0.5, None],
                  "statuses": ["limited", "ok", "ok"], "cells": 3, "cost": pytest.approx(0.00024),
                  "tokens": 60, "wall_mean": 2.0}
    assert [r["sample"] for r in a["per_sample"]] == ["s1", "s2", "s3", "s10"]  # natural order
    assert a["scores"]["x"]["cells"] == 11  # one ok cell had no score
    assert a["stop_reasons"] == {"stop": 9, "timeout": 1, "limit": 1, "error": 1}
    assert data["duplicates"] == 0
    assert {f["status"] for f in a["failed"]} == {"timed_out", "limited", "error"}
    # wall time per cell (1, 2, 3 s by repeat): every sample's mean is 2 s, with no spread
    assert a["time_per_cell"]["mean"] == 2.0 and a["time_per_cell"]["ci95"] == [2.0, 2.0]


def test_cost_and_time_intervals_are_not_clipped_to_scores() -> None:
    cells = [SampleResult("e", "v", f"s{i}", 1, "ok", wall=w, cost=w / 1000)
             for i, w in enumerate((0.2, 0.9, 0.95, 0.4))]
    [v] = rep.report(Journal(None, {c.key: c for c in cells}), "e")["variants"]
    walls = [0.2, 0.9, 0.95, 0.4]
    lo, hi = sp.t.interval(0.95, 3, loc=sum(walls) / 4, scale=sp.sem(walls))
    assert hi > 1 and v["time_per_cell"]["ci95"] == pytest.approx([max(0.0, lo), hi])


def test_results_rows_follow_the_rule_and_give_the_report() -> None:
    journal = mixed_journal()
    data = rep.report(journal, "e")
    rows = result_rows(journal.results.values(), ["x", "y"])
    assert {r["status"] for r in rows} == {"ok", "timed_out", "limited", "error"}
    for row in rows:
        if row["status"] != "ok":
            assert (row["score"], row["score_x"], row["score_y"]) == (0.0, 0.0, 0.0)
    # pandas' df.groupby(["variant", "sample"]).score_x.mean().groupby("variant").mean()
    for v in data["variants"]:
        per: dict[str, list[float]] = {}
        for row in rows:
            if row["variant"] == v["name"] and row["score_x"] is not None:
                per.setdefault(row["sample"], []).append(row["score_x"])
        means = [sum(x) / len(x) for x in per.values()]
        assert sum(means) / len(means) == pytest.approx(v["score"])


def test_paired_comparisons_by_sample() -> None:
    journal = mixed_journal()
    data = rep.compare_variants(journal, "a", journal, "b", ("e", "e"), "x")
    [v] = data["variants"]
    a, b = by_hand(journal, "a", "x"), by_hand(journal, "b", "x")
    diffs = [b[s] - a[s] for s in ("s1", "s2", "s3", "s10")]
    assert v["effect"] == pytest.approx(sum(diffs) / 4)
    assert v["ci95"] == pytest.approx(sp.t.interval(0.95, 3, loc=sum(diffs) / 4,
                                                    scale=sp.sem(diffs)))
    # repeats that disagree: per-sample means not 0/1, so the paired t test
    assert v["test"] == "paired_t"
    assert v["p_value"] == pytest.approx(sp.ttest_rel([b[s] for s in b], [a[s] for s in b]
                                                      ).pvalue)
    assert (v["samples"], v["better"], v["worse"], v["same"]) == (4, 3, 0, 1)  # s2 as it was

    # one 0/1 outcome a sample (one repeat): McNemar's exact test on the samples that flipped
    flips = [("s1", 1, 1), ("s2", 1, 0), ("s3", 0, 1), ("s4", 0, 1), ("s5", 0, 1), ("s6", 0, 0)]
    one = {c.key: c for s, x, y in flips for c in (cell("a", s, 1, "ok", x),
                                                     cell("b", s, 1, "ok", y))}
    j = Journal(None, one)
    [w] = rep.compare_variants(j, "a", j, "b", ("f", "f"))["variants"]
    assert (w["test"], w["better"], w["worse"], w["same"]) == ("mcnemar_exact", 3, 1, 2)
    assert w["p_value"] == pytest.approx(sp.binomtest(1, 4).pvalue)
    assert [c["sample"] for c in w["changed"]] == ["s2", "s3", "s4", "s5"]
    assert "effect +0.333 95% CI [" in rep.compare_text(rep.compare_variants(
        j, "a", j, "b", ("f", "f")))


def test_compare_two_experiments_pairs_variants_by_sample() -> None:
    """Issue 48's case: a deterministic model, 3 repeats that agree: 2 samples better and 6
    worse is McNemar p = 74/256, not the 6 and 18 of counting each repeat."""
    outcomes = [(1, 1)] * 5 + [(0, 1)] * 2 + [(1, 0)] * 6 + [(0, 0)] * 2
    first = {c.key: c for i, (x, _) in enumerate(outcomes) for r in (1, 2, 3)
             for c in [cell("v", f"q{i}", r, "ok", x)]}
    second = {c.key: c for i, (_, y) in enumerate(outcomes) for r in (1, 2, 3)
              for c in [cell("v", f"q{i}", r, "ok", y)]}
    data = rep.compare(Journal(None, first), Journal(None, second), ("e1", "e2"))
    [v] = data["variants"]
    assert (v["samples"], v["better"], v["worse"], v["test"]) == (15, 2, 6, "mcnemar_exact")
    assert v["p_value"] == pytest.approx(74 / 256)


def test_money_keeps_its_digits() -> None:
    assert [money(x) for x in (0, 0.00004, 0.0123, 0.5, 2.5, 1234.5)] == \
        ["$0", "$0.0000400", "$0.0123", "$0.500", "$2.50", "$1,234.50"]
    text = rep.report_text(rep.report(mixed_journal(), "e"))
    assert " $0.000960 " in text  # 4 samples x $0.00004 x (1 + 2 + 3), not $0.0010
    assert "4×3" in text and "timed out" in text


SPEC = """name = "qa"
[dataset]
path = "samples.jsonl"
[[variants]]
name = "solo"
agent = "a"
{extra}
"""


def check(spec_dir: Path, cwd: Path, extra: str) -> subprocess.CompletedProcess[str]:
    (spec_dir / "samples.jsonl").write_text('{"id": 1, "input": "hi", "target": "x"}\n')
    (spec_dir / "spec.toml").write_text(SPEC.format(extra=extra))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(busctl("experiment", "check", str(spec_dir / "spec.toml")), cwd=cwd,
                          capture_output=True, text=True, timeout=30, env=env)


def test_python_scorer_next_to_the_spec_or_in_cwd(tmp_path: Path) -> None:
    spec_dir, elsewhere = tmp_path / "spec", tmp_path / "cwd"
    spec_dir.mkdir()
    elsewhere.mkdir()
    scorer = '[[scorers]]\nkind = "python"\nfn = "{}:grade"'
    (spec_dir / "near_scorers.py").write_text("def grade(answer, sample):\n    return 1.0\n")
    (elsewhere / "cwd_scorers.py").write_text("def grade(answer, sample):\n    return 1.0\n")
    for module in ("near_scorers", "cwd_scorers"):
        out = check(spec_dir, elsewhere, scorer.format(module))
        assert out.returncode == 0, out.stderr
    out = check(spec_dir, elsewhere, scorer.format("nowhere_scorers"))
    assert out.returncode == 2 and "looked for nowhere_scorers.py next to the spec and in " \
        "the current directory" in out.stderr, out.stderr


@pytest.mark.parametrize(("extra", "message"), [
    ('[[scorers]]\nkind = "fuzzy"', "scorers[0].kind: 'fuzzy' is not one of the values it "
     "takes: exact, includes, regex, number, json_field, python, model"),
    ('[run]\nrepeat = 3', "run.repeat: unknown key; [run] takes: repeats, concurrency,"),
    ('[[scorers]]\nkind = "exact"\ncase = 1', "scorers[0].case: unknown key; [[scorers]] "
     "takes: kind, name,"),
])
def test_spec_errors_say_what_would_do(tmp_path: Path, extra: str, message: str) -> None:
    out = check(tmp_path, tmp_path, extra)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert "config show" not in out.stderr


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG")
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_plots_for_a_paper(tmp_path: Path) -> None:
    from agent_bus.agents.experiment.plot import plot

    written = plot(rep.report(mixed_journal(), "e"), tmp_path / "plots")
    assert [p.name for p in written] == ["score.png", "cost.png", "time.png"]
    assert all(png_size(p) == (1200, 600) for p in written)


def test_plot_without_matplotlib_fails_before_the_report(tmp_path: Path) -> None:
    """A Python where `import matplotlib` fails (a module of that name that raises, first on
    the path): `report --plot` exits 2 naming the extra, and prints no report first (the hub
    it would read is never asked: there is none at this address)."""
    (tmp_path / "matplotlib.py").write_text("raise ImportError('no matplotlib here')\n")
    out = subprocess.run(busctl("experiment", "report", "e", "--plot", str(tmp_path / "p"),
                                "--hub", "tcp://127.0.0.1:9"), capture_output=True, text=True,
                         timeout=30, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert out.returncode == 2 and out.stdout == "", out.stdout + out.stderr
    assert "--plot: needs matplotlib: pip install 'agent-bus[plot]'" in out.stderr
    assert not (tmp_path / "p").exists()


def test_no_sample_twice_in_a_mean() -> None:
    """`samples` counts distinct samples; an empty variant has no score and no interval."""
    plan = Plan("e", "d", "s", samples=2, variants=["a", "b"], repeats=2, planned=8,
                scorers=["x"])
    cells = [cell("a", "s1", r, "ok", 1.0) for r in (1, 2)]
    data = rep.report(Journal(plan, {c.key: c for c in cells}), "e")
    a, b = data["variants"]
    assert (a["samples"], a["cells"], a["score"], a["ci95"]) == (1, 2, 1.0, None)
    assert (b["samples"], b["score"], b["ci95"], b["per_sample"]) == (0, None, None, [])
    assert json.loads(json.dumps(data)) == data and not math.isnan(a["score"])
    assert sys.modules.get("scipy") is not None  # what the numbers were checked against


def test_compare_needs_two_sides() -> None:
    out = subprocess.run(busctl("experiment", "compare", "e", "--hub", "tcp://127.0.0.1:9"),
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "FIRST --variants A B" in out.stderr, out.stderr
