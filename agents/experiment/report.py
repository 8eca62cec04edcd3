"""Per-variant statistics of an experiment, and paired comparisons of variants.

Failures, one rule (runner.FAILURE_RULE): a cell that timed out, passed its token or cost
limit, or ended in an error once its retries were spent is scored 0 on every scorer and
counted; `timed_out`, `limited` and `errors` say how many beside the score. The table, `--json`,
the web page (this very function's output) and the results file (runner.result_rows: `status`
is the outcome, the scores the counted ones) all follow it. A score of None (the scorer does not
apply to the sample, or a `model` grader gave no grade) is left out of that scorer's numbers.

Samples are the unit, repeats are not independent observations of the score:

    per-sample mean   each sample's mean over its repeats (cells) with a score
    score             the mean over samples of those per-sample means (first scorer; every
                      scorer in `scores`, computed the same way)
    ci95              Student's t interval over the per-sample means, `t_samples`:
                      mean ± t(0.975, k-1) · s/√k with k samples (as a cluster-robust
                      standard error by sample, what Inspect's epochs reduce to); clipped to
                      [0, 1] when every per-sample mean lies there; none under 2 samples
    n                 shown as samples × repeats

`compare` and `compare_variants` pair by sample: each side's per-sample mean (its repeats
averaged), the differences b - a, and their mean — the effect — with its paired t interval.
The test: McNemar's exact test (the binomial test of the samples that flipped, p = 1/2) when
every per-sample mean on both sides is 0 or 1 (one binary outcome a sample: one repeat, or
repeats that agree); otherwise the paired t test on the per-sample means, whose p agrees with
the interval shown. With 0/1 outcomes the exact test is the one to quote: the t interval beside
it is approximate there and may exclude 0 at a McNemar p a little above 0.05 (5 flips one way,
none the other: p = 0.0625). Likewise a variant right (or wrong) on every sample has an
interval of no width: the per-sample means show no spread. The computations are
agents.experiment.stats, checked against scipy.stats.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from agent_bus.agents.experiment import stats
from agent_bus.agents.experiment.runner import (
    FAILURE_RULE,
    IGNORED_WHY,
    Journal,
    SampleResult,
    money,
)
from agent_bus.tools.workspaces import RUNS_DIR

CI_METHOD = "t_samples"  # the t interval over per-sample means
CI_WHY = "t over per-sample means: samples are the unit, repeats averaged"


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (the smallest value with at least q% of them at or below it)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def natural(text: str) -> list[Any]:
    """Sort key: q2 before q10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def sample_stat(per_sample: Sequence[float], cells: int, score: bool = True) -> dict[str, Any]:
    """The mean over samples of per-sample means, its t interval, and the counts. A score's
    interval is kept in [0, 1] when every per-sample mean is there (a proportion's cannot
    leave it); another quantity's (cost, time: never negative) above 0."""
    if not per_sample:
        return {"mean": None, "ci95": None, "method": "", "samples": 0, "cells": cells,
                "n": cells}
    ci = stats.t_interval(per_sample)
    if ci is not None and score and all(0.0 <= v <= 1.0 for v in per_sample):
        ci = (max(0.0, ci[0]), min(1.0, ci[1]))
    elif ci is not None and not score:
        ci = (max(0.0, ci[0]), ci[1])
    return {"mean": stats.mean(per_sample), "ci95": list(ci) if ci else None,
            "method": CI_METHOD if ci else "", "samples": len(per_sample), "cells": cells,
            "n": cells}  # n: as before, the cells (`samples` is the interval's unit)


def by_sample(cells: Sequence[SampleResult]) -> dict[str, list[SampleResult]]:
    grouped: dict[str, list[SampleResult]] = {}
    for cell in sorted(cells, key=lambda c: (natural(c.sample), c.repeat)):
        grouped.setdefault(cell.sample, []).append(cell)
    return grouped


def sample_means(cells: Sequence[SampleResult], scorer: str) -> dict[str, float]:
    """Each sample's mean counted score over its repeats (samples with none left out)."""
    means = {}
    for sample, own in by_sample(cells).items():
        values = [v for c in own if (v := c.counted([scorer])[scorer]) is not None]
        if values:
            means[sample] = stats.mean(values)
    return means


def scorer_stat(cells: Sequence[SampleResult], scorer: str) -> dict[str, Any]:
    means = sample_means(cells, scorer)
    scored = sum(c.counted([scorer])[scorer] is not None for c in cells)
    return sample_stat(list(means.values()), scored)


def _per_cell(cells: Sequence[SampleResult],
              value: Callable[[SampleResult], float]) -> dict[str, Any]:
    """A per-cell quantity (cost, wall time) over samples: per-sample means, t interval."""
    grouped = by_sample(cells).values()
    return sample_stat([stats.mean([value(c) for c in own]) for own in grouped], len(cells),
                       score=False)


def per_sample_rows(cells: Sequence[SampleResult], scorers: Sequence[str],
                    repeats: int) -> list[dict[str, Any]]:
    """One row a sample: its first scorer's mean (`means`: every scorer's), and per repeat
    (1..repeats) the counted score and outcome (None: not run yet)."""
    rows = []
    for sample, own in by_sample(cells).items():
        means = {s: sample_means(own, s).get(sample) for s in scorers}
        at = {c.repeat: c for c in own}
        first = scorers[0] if scorers else ""
        scores = [at[r].counted([first])[first] if r in at and first else None
                  for r in range(1, repeats + 1)]
        values = [v for v in scores if v is not None]
        rows.append({"sample": sample, "mean": stats.mean(values) if values else None,
                     "means": means, "scores": scores,
                     "statuses": [at[r].outcome if r in at else None
                                  for r in range(1, repeats + 1)],
                     "cells": len(own), "cost": sum(c.cost for c in own),
                     "tokens": sum(c.tokens for c in own),
                     "wall_mean": stats.mean([c.wall for c in own])})
    return rows


def variant_report(name: str, cells: Sequence[SampleResult], scorers: Sequence[str],
                   samples: int, repeats: int) -> dict[str, Any]:
    """One variant's statistics (`samples` × `repeats` planned) by the module's rules."""
    outcomes = Counter(c.outcome for c in cells)
    times = [c.wall for c in cells]
    by_scorer = {s: scorer_stat(cells, s) for s in scorers}
    first = by_scorer[scorers[0]] if scorers else sample_stat([], 0)
    failed = [c for c in cells if c.outcome != "ok"]
    return {"name": name, "samples": len(by_sample(cells)), "repeats": repeats,
            "cells": len(cells), "n": len(cells), "planned": samples * repeats,
            "score": first["mean"], "ci95": first["ci95"], "ci_method": first["method"],
            "scores": by_scorer,
            "timed_out": outcomes["timed_out"], "limited": outcomes["limited"],
            "errors": outcomes["error"], "failures": len(failed),
            "tokens": sum(c.tokens for c in cells), "cost": sum(c.cost for c in cells),
            "turns_mean": stats.mean([c.turns for c in cells]) if cells else None,
            "time_p50": percentile(times, 50), "time_p95": percentile(times, 95),
            "cost_per_cell": _per_cell(cells, lambda c: c.cost),
            "time_per_cell": _per_cell(cells, lambda c: c.wall),
            "stop_reasons": dict(Counter(c.stop_reason or "error" for c in cells)),
            "failed": [{"sample": c.sample, "repeat": c.repeat, "status": c.outcome,
                        "error": c.error or c.stop_reason} for c in failed],
            "per_sample": per_sample_rows(cells, scorers, repeats)}


def journal_scorers(journal: Journal) -> list[str]:
    """The plan's scorers in order; with no plan, the ones the cells have."""
    if journal.plan is not None:
        return list(journal.plan.scorers)
    return sorted({name for c in journal.results.values() for name in c.scores})


def report(journal: Journal, experiment: str) -> dict[str, Any]:
    """`busctl experiment report --json`: the plan and one entry per variant."""
    plan = journal.plan
    results = list(journal.results.values())
    names = plan.variants if plan else sorted({r.variant for r in results})
    scorers = journal_scorers(journal)
    samples = plan.samples if plan else len({r.sample for r in results})
    repeats = plan.repeats if plan else max((r.repeat for r in results), default=0)
    variants = [variant_report(v, [r for r in results if r.variant == v], scorers, samples,
                               repeats) for v in names]
    journaled_ok = sum(r.status == "ok" for r in results)
    return {"experiment": experiment, "planned": plan.planned if plan else None,
            "samples": samples, "repeats": repeats,
            # done: the cells a resume will not run again (all but errors, which it retries);
            # counted: the cells in the statistics (errors too, scored 0)
            "done": sum(v["cells"] - v["errors"] for v in variants),
            "counted": sum(v["cells"] for v in variants), "scorers": scorers,
            "failure_rule": FAILURE_RULE, "ci_method": CI_METHOD, "variants": variants,
            "unreadable_entries": journal.bad,
            "ignored_entries": journal.ignored,  # not from an identity that may write it
            # entries read beyond one a cell (0 for a journal built in memory, as the runner's)
            "duplicates": max(0, journal.ok_entries - journaled_ok),
            **_workspaces(experiment, results)}


def _workspaces(experiment: str, results: list[SampleResult]) -> dict[str, str]:
    """Where the cells' own workspaces are kept (what the agents wrote is part of the
    result): on the tool workers' hosts, one folder a cell (its results row's `workspace`)."""
    if not any(r.workspace for r in results):
        return {}
    return {"workspaces": f"<each tool worker's workspace>/{RUNS_DIR}/{experiment}/"
                          f"<variant>.r<repeat>/<sample>/"}


# --- paired comparisons ---------------------------------------------------------------------


def paired(name: str, a: dict[str, float], b: dict[str, float]) -> dict[str, Any]:
    """Per-sample means of two sides, paired by sample (those both have): the effect b - a
    with its paired t interval, and the test (the module's text says which)."""
    shared = sorted(set(a) & set(b), key=natural)
    diffs = [b[s] - a[s] for s in shared]
    effect, ci, t_p = stats.paired_t(diffs)
    binary = all(v in (0.0, 1.0) for s in shared for v in (a[s], b[s]))
    better, worse = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
    test, p = ("mcnemar_exact", stats.binom_two_sided(better, better + worse)) if binary \
        else ("paired_t", t_p)
    return {"name": name, "samples": len(shared), "pairs": len(shared),
            "a_mean": stats.mean([a[s] for s in shared]) if shared else None,
            "b_mean": stats.mean([b[s] for s in shared]) if shared else None,
            "effect": effect if shared else None, "ci95": list(ci) if ci else None,
            "ci_method": "paired_t" if ci else "",
            "better": better, "worse": worse, "same": len(shared) - better - worse,
            "test": test, "p_value": p,
            "changed": [{"sample": s, "a": a[s], "b": b[s]} for s in shared if a[s] != b[s]],
            "only_a": sorted(set(a) - set(b), key=natural),
            "only_b": sorted(set(b) - set(a), key=natural)}


def _cells(journal: Journal, variant: str) -> list[SampleResult]:
    return [c for c in journal.results.values() if c.variant == variant]


def compare(a: Journal, b: Journal, names: tuple[str, str], scorer: str = "") -> dict[str, Any]:
    """Two experiments, each variant they share compared, paired by sample."""
    scorer = scorer or next(iter(journal_scorers(a)), "")
    shared = [v for v in variant_names(a) if v in set(variant_names(b))]
    return {"a": names[0], "b": names[1], "scorer": scorer,
            "variants": [paired(v, sample_means(_cells(a, v), scorer),
                                sample_means(_cells(b, v), scorer)) for v in shared]}


def compare_variants(a: Journal, va: str, b: Journal, vb: str, names: tuple[str, str],
                     scorer: str = "") -> dict[str, Any]:
    """Variant `va` of experiment a against `vb` of b (a and b may be one experiment)."""
    scorer = scorer or next(iter(journal_scorers(a)), "")
    return {"a": f"{names[0]}:{va}", "b": f"{names[1]}:{vb}", "scorer": scorer,
            "variants": [paired(f"{va} -> {vb}", sample_means(_cells(a, va), scorer),
                                sample_means(_cells(b, vb), scorer))]}


def variant_names(journal: Journal) -> list[str]:
    if journal.plan is not None:
        return list(journal.plan.variants)
    return sorted({c.variant for c in journal.results.values()})


# --- text -----------------------------------------------------------------------------------


def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _ci(ci: list[float] | None) -> str:
    return f"[{_num(ci[0])}, {_num(ci[1])}]" if ci else "-"


def _n(v: dict[str, Any]) -> str:
    """n as samples × repeats; the cells when some are missing (a run under way)."""
    n = f"{v['samples']}×{v['repeats']}"
    return n if v["cells"] == v["samples"] * v["repeats"] else f"{n} ({v['cells']} cells)"


def report_text(data: dict[str, Any]) -> str:
    errors = sum(v["errors"] for v in data["variants"])
    retried = f", {errors} in error (`run --resume` runs them again)" if errors else ""
    lines = [f"experiment {data['experiment']}: {data['done']}/{data['planned']} cells done "
             f"({data['samples']} samples × {data['repeats']} repeats × "
             f"{len(data['variants'])} variants){retried}"]
    lines.append(f"{'variant':<14} {'scorer':<10} {'n':>8} {'score':>6} {'95% CI':>15} "
                 f"{'timed out':>9} {'limited':>7} {'errors':>6} {'tokens':>9} {'cost':>10} "
                 f"{'p50 s':>6} {'p95 s':>6}  stop reasons")
    for v in data["variants"]:
        stops = ", ".join(f"{k} {n}" for k, n in sorted(v["stop_reasons"].items()))
        first = data["scorers"][0] if data["scorers"] else "-"
        lines.append(f"{v['name']:<14} {first:<10} {_n(v):>8} {_num(v['score']):>6} "
                     f"{_ci(v['ci95']):>15} {v['timed_out']:>9} {v['limited']:>7} "
                     f"{v['errors']:>6} {v['tokens']:>9} {money(v['cost']):>10} "
                     f"{_num(v['time_p50'], 2):>6} {_num(v['time_p95'], 2):>6}  {stops}")
        for name in data["scorers"][1:]:
            s = v["scores"][name]
            lines.append(f"{'':<14} {name:<10} {_n(v):>8} {_num(s['mean']):>6} "
                         f"{_ci(s['ci95']):>15}")
    lines.append(f"score: the mean over samples of each sample's mean over its repeats; "
                 f"95% CI: {CI_WHY}")
    lines.append(f"failures: {data['failure_rule']}")
    if data.get("duplicates"):
        lines.append(f"{data['duplicates']} journal entries of cells done twice (the latest "
                     f"counts)")
    if data.get("ignored_entries"):
        lines.append(f"{data['ignored_entries']} journal entries ignored: {IGNORED_WHY}")
    if data.get("workspaces"):
        lines.append(f"each cell's files, as its tools left them: {data['workspaces']} "
                     f"(on the hosts of the tool workers it used)")
    return "\n".join(lines)


TESTS = {"mcnemar_exact": "McNemar exact", "paired_t": "paired t"}


def compare_text(data: dict[str, Any]) -> str:
    lines = [f"{data['a']} -> {data['b']}, scorer `{data['scorer']}`, paired by sample "
             f"(repeats averaged), effect = b - a"]
    for v in data["variants"]:
        if not v["samples"]:
            lines.append(f"{v['name']}: no sample scored on both sides")
            continue
        p = "-" if v["p_value"] is None else f"{v['p_value']:.3g}"
        lines.append(f"{v['name']}: {v['samples']} samples, mean {_num(v['a_mean'])} -> "
                     f"{_num(v['b_mean'])}, effect {v['effect']:+.3f} 95% CI {_ci(v['ci95'])} "
                     f"(paired t); {v['better']} better, {v['worse']} worse, {v['same']} same; "
                     f"{TESTS[v['test']]} p = {p}")
        for c in v["changed"]:
            lines.append(f"  {c['sample']}: {c['a']:.3f} -> {c['b']:.3f}")
        for side in ("only_a", "only_b"):
            if v[side]:
                lines.append(f"  unpaired, scored only in {data[side[-1]]}: "
                             f"{', '.join(v[side])}")
    if not data["variants"]:
        lines.append("no variant in common (compare two variants with --variants A B)")
    return "\n".join(lines)
