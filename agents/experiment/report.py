"""Per-variant statistics of an experiment and a paired comparison of two.

The score of a variant is the mean, over its answered cells (sample × repeat, status `ok`), of
the first scorer's score. Its 95% interval: Wilson's score interval when every score is 0 or 1
(a proportion; it stays inside [0, 1] and behaves at 0/n and n/n, where the normal one does not),
else Student's t (mean ± t(0.975, n-1) · s/√n). Repeats of one sample count as separate cells:
the interval treats them as independent, which they are only as far as the model's sampling is.

`compare` pairs the cells two experiments share (variant, sample, repeat): the ones whose score
went up or down, and an exact two-sided paired test on them: McNemar's exact test (a binomial
test of the flips, p = 0.5) for binary scores; for other scores the same binomial test on the
signs of the differences (the sign test), ties dropped.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from agent_bus.agents.experiment.runner import IGNORED_WHY, Journal, SampleResult
from agent_bus.tools.workspaces import RUNS_DIR

Z95 = 1.959963984540054
#: t(0.975, df) for df 1-30; beyond, the values at 40, 60, 120 and the normal limit.
T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
       2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
       2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def t95(df: int) -> float:
    if df <= 30:
        return T95[df - 1]
    for bound, value in ((40, 2.021), (60, 2.000), (120, 1.980)):
        if df <= bound:
            return value
    return Z95


def wilson(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson's score interval for a proportion successes/n."""
    if n == 0:
        return (0.0, 1.0)
    phat = successes / n
    denom = 1 + z * z / n
    center = (phat + z * z / (2 * n)) / denom
    half = z * math.sqrt(phat * (1 - phat) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, center - half), min(1.0, center + half))


def t_interval(values: Sequence[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return (mean, mean)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t95(n - 1) * sd / math.sqrt(n)
    return (mean - half, mean + half)


def interval(values: Sequence[float]) -> tuple[tuple[float, float] | None, str]:
    """The 95% interval of the mean of `values` and the method's name."""
    if not values:
        return None, ""
    if all(v in (0.0, 1.0) for v in values):
        return wilson(sum(values), len(values)), "wilson"
    return t_interval(values), "t"


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (the smallest value with at least q% of them at or below it)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _stat(values: Sequence[float]) -> dict[str, Any]:
    ci, method = interval(values)
    return {"n": len(values), "mean": sum(values) / len(values) if values else None,
            "ci95": list(ci) if ci else None, "method": method}


def variant_report(name: str, cells: Sequence[SampleResult], scorers: Sequence[str],
                   planned: int) -> dict[str, Any]:
    ok = [c for c in cells if c.status == "ok"]
    main = [c.score for c in ok if c.score is not None]
    times = [c.wall for c in ok]
    by_scorer = {s: _stat([v for c in ok if (v := c.scores.get(s)) is not None]) for s in scorers}
    first = _stat(main)
    return {"name": name, "n": len(ok), "planned": planned, "score": first["mean"],
            "ci95": first["ci95"], "ci_method": first["method"], "scores": by_scorer,
            "tokens": sum(c.tokens for c in ok), "cost": sum(c.cost for c in ok),
            "turns_mean": sum(c.turns for c in ok) / len(ok) if ok else None,
            "time_p50": percentile(times, 50), "time_p95": percentile(times, 95),
            "stop_reasons": dict(Counter(c.stop_reason for c in ok)),
            "failures": len(cells) - len(ok),
            "failed": [{"sample": c.sample, "repeat": c.repeat, "error": c.error}
                       for c in cells if c.status != "ok"],
            "per_sample": per_sample(cells)}


def _outcome(cell: SampleResult) -> str:
    """A cell's outcome in one word: ok, error, or the stop that ended it early."""
    return cell.stop_reason if cell.stop_reason in ("timeout", "limit") else cell.status


def per_sample(cells: Sequence[SampleResult]) -> list[dict[str, Any]]:
    """One entry per sample, its repeats folded (in repeat order): the page's roll-up."""
    by_sample: dict[str, list[SampleResult]] = {}
    for c in sorted(cells, key=lambda c: (c.sample, c.repeat)):
        by_sample.setdefault(c.sample, []).append(c)
    out = []
    for sample, repeats in by_sample.items():
        scores = [c.score if c.status == "ok" else None for c in repeats]
        known = [s for s in scores if s is not None]
        out.append({"sample": sample, "mean": sum(known) / len(known) if known else None,
                    "scores": scores, "statuses": [_outcome(c) for c in repeats],
                    "cost": sum(c.cost for c in repeats),
                    "tokens": sum(c.tokens for c in repeats)})
    return out


def report(journal: Journal, experiment: str) -> dict[str, Any]:
    """`busctl experiment report --json`: the plan and one entry per variant."""
    plan = journal.plan
    results = list(journal.results.values())
    names = plan.variants if plan else sorted({r.variant for r in results})
    scorers = plan.scorers if plan else []
    per_variant = (plan.samples * plan.repeats) if plan else 0
    variants = [variant_report(v, [r for r in results if r.variant == v], scorers, per_variant)
                for v in names]
    return {"experiment": experiment, "planned": plan.planned if plan else None,
            "done": sum(v["n"] for v in variants), "scorers": scorers, "variants": variants,
            "unreadable_entries": journal.bad,
            "ignored_entries": journal.ignored,  # not from an identity that may write it
            "duplicates": journal.ok_entries - sum(v["n"] for v in variants),
            **_workspaces(experiment, results)}


def _workspaces(experiment: str, results: list[SampleResult]) -> dict[str, str]:
    """Where the cells' own workspaces are kept (what the agents wrote is part of the
    result): on the tool workers' hosts, one folder a cell (its results row's `workspace`)."""
    if not any(r.workspace for r in results):
        return {}
    return {"workspaces": f"<each tool worker's workspace>/{RUNS_DIR}/{experiment}/"
                          f"<variant>.r<repeat>/<sample>/"}


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value: b and c are the discordant pairs (the flips each way)."""
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / (1 << n)
    return min(1.0, 2 * tail)


def compare(a: Journal, b: Journal, names: tuple[str, str]) -> dict[str, Any]:
    """Pair the cells of two experiments by (variant, sample, repeat); per variant the flips."""
    shared = sorted(set(a.results) & set(b.results))
    variants: dict[str, list[tuple[SampleResult, SampleResult]]] = {}
    for key in shared:
        x, y = a.results[key], b.results[key]
        if x.status == "ok" and y.status == "ok" and x.score is not None \
                and y.score is not None:
            variants.setdefault(key[0], []).append((x, y))
    return {"a": names[0], "b": names[1],
            "variants": [_paired(name, pairs) for name, pairs in variants.items()]}


def _paired(name: str, pairs: Iterable[tuple[SampleResult, SampleResult]]) -> dict[str, Any]:
    pairs = list(pairs)
    xs = [x.score or 0.0 for x, _ in pairs]
    ys = [y.score or 0.0 for _, y in pairs]
    binary = all(v in (0.0, 1.0) for v in xs + ys)
    up = [(x, y) for x, y in pairs if (y.score or 0.0) > (x.score or 0.0)]
    down = [(x, y) for x, y in pairs if (y.score or 0.0) < (x.score or 0.0)]
    n = len(pairs)
    return {"name": name, "pairs": n, "a_mean": sum(xs) / n, "b_mean": sum(ys) / n,
            "better": len(up), "worse": len(down),
            "test": "mcnemar_exact" if binary else "sign_exact",
            "p_value": mcnemar_exact(len(up), len(down)),
            "flipped": [{"sample": x.sample, "repeat": x.repeat, "a": x.score, "b": y.score}
                        for x, y in sorted(up + down, key=lambda p: (p[0].sample, p[0].repeat))]}


def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def report_text(data: dict[str, Any]) -> str:
    lines = [f"experiment {data['experiment']}: {data['done']}/{data['planned']} cells answered"]
    lines.append(f"{'variant':<16} {'n':>5} {'score':>7} {'95% CI':>17} {'tokens':>9} "
                 f"{'cost':>9} {'p50 s':>7} {'p95 s':>7} {'fail':>5}  stop reasons")
    for v in data["variants"]:
        ci = f"[{_num(v['ci95'][0])}, {_num(v['ci95'][1])}]" if v["ci95"] else "-"
        stops = ", ".join(f"{k} {n}" for k, n in sorted(v["stop_reasons"].items()))
        lines.append(f"{v['name']:<16} {v['n']:>5} {_num(v['score']):>7} {ci:>17} "
                     f"{v['tokens']:>9} {v['cost']:>9.4f} {_num(v['time_p50'], 2):>7} "
                     f"{_num(v['time_p95'], 2):>7} {v['failures']:>5}  {stops}")
    methods = sorted({v["ci_method"] for v in data["variants"] if v["ci_method"]})
    if methods:
        lines.append(f"(95% CI: {', '.join(methods)}; score = the first scorer's mean)")
    if data.get("ignored_entries"):
        lines.append(f"{data['ignored_entries']} journal entries ignored: {IGNORED_WHY}")
    if data.get("workspaces"):
        lines.append(f"each cell's files, as its tools left them: {data['workspaces']} "
                     f"(on the hosts of the tool workers it used)")
    return "\n".join(lines)


def compare_text(data: dict[str, Any]) -> str:
    lines = [f"{data['a']} -> {data['b']}"]
    for v in data["variants"]:
        lines.append(f"{v['name']}: {v['pairs']} pairs, mean {v['a_mean']:.3f} -> "
                     f"{v['b_mean']:.3f}, {v['better']} better, {v['worse']} worse, "
                     f"{v['test']} p = {v['p_value']:.4g}")
        for f in v["flipped"]:
            lines.append(f"  {f['sample']} r{f['repeat']}: {f['a']} -> {f['b']}")
    if not data["variants"]:
        lines.append("no cells in common (the same variant, sample and repeat)")
    return "\n".join(lines)
