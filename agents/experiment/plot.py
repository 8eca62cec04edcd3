"""`busctl experiment report E --plot DIR`: three PNGs for a paper, with matplotlib (the `plot`
extra), drawn from the report's JSON alone (what the table and the page show):

    score.png   mean score by scorer and variant (0-1), 95% interval on every bar
    cost.png    mean cost per cell (USD) by variant, 95% interval
    time.png    mean wall time per cell (s) by variant, 95% interval; p95 marked

Every interval is the report's: a t interval over per-sample means (report.py). 1200 px wide
(12 in at 100 dpi), each variant in the same colour in every plot (its place in the plan).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agent_bus.agents.experiment.spec import SpecError

WIDTH, HEIGHT, DPI = 12, 6, 100  # inches, inches, dots an inch: 1200 × 600 px
# matplotlib's default cycle (tab10), fixed here so a variant's colour never depends on a plot
COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf"]


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only backend; a SpecError naming the extra without it."""
    try:
        import matplotlib
    except ImportError:
        raise SpecError("needs matplotlib: pip install 'agent-bus[plot]'") from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 13, "axes.spines.top": False,
                         "axes.spines.right": False})
    return plt


def colour(index: int) -> str:
    return COLOURS[index % len(COLOURS)]


def _errors(stats: list[dict[str, Any]]) -> list[list[float]]:
    """matplotlib's yerr: distances below and above each mean (0 where there is none)."""
    low, high = [], []
    for s in stats:
        mean, ci = s["mean"] or 0.0, s["ci95"] or [s["mean"] or 0.0] * 2
        # clamped: a bound equal to the mean may differ from it by a rounding error
        low.append(max(0.0, mean - ci[0]))
        high.append(max(0.0, ci[1] - mean))
    return [low, high]


def _n(data: dict[str, Any]) -> str:
    return f"n = {data['samples']} samples × {data['repeats']} repeats a variant"


def plot(data: dict[str, Any], folder: Path) -> list[Path]:
    """Write the PNGs of `report(...)`'s `data` into `folder`; their paths."""
    plt = pyplot()
    folder.mkdir(parents=True, exist_ok=True)
    variants = list(enumerate(data["variants"]))  # the index fixes the colour
    return [_scores(plt, data, variants, folder / "score.png"),
            _per_cell(plt, data, variants, "cost_per_cell", "mean cost per cell (USD)",
                      "cost", folder / "cost.png"),
            _per_cell(plt, data, variants, "time_per_cell", "mean wall time per cell (s)",
                      "time", folder / "time.png")]


def _scores(plt: Any, data: dict[str, Any], variants: list[tuple[int, dict[str, Any]]],
            path: Path) -> Path:
    """Grouped bars: one group a scorer, one bar a variant."""
    fig, ax = plt.subplots(figsize=(WIDTH, HEIGHT), layout="constrained")
    scorers = data["scorers"] or ["-"]
    width = 0.8 / max(1, len(variants))
    for k, (index, v) in enumerate(variants):
        stats = [v["scores"].get(s, {"mean": None, "ci95": None}) for s in scorers]
        xs = [i + (k - (len(variants) - 1) / 2) * width for i in range(len(scorers))]
        ax.bar(xs, [s["mean"] or 0.0 for s in stats], width, yerr=_errors(stats), capsize=6,
               color=colour(index), label=v["name"])
    ax.set_xticks(range(len(scorers)), scorers)
    ax.set_xlabel("scorer")
    ax.set_ylabel("mean score (0 to 1), 95% CI")
    ax.set_ylim(0, 1.05)
    ax.legend(title="variant", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(f"{data['experiment']}: score by scorer and variant ({_n(data)}; "
                 f"failures scored 0)", fontsize=12)
    return _save(plt, fig, path)


def _per_cell(plt: Any, data: dict[str, Any], variants: list[tuple[int, dict[str, Any]]],
              key: str, label: str, what: str, path: Path) -> Path:
    """One bar a variant: a per-cell quantity's mean over samples, with its interval."""
    fig, ax = plt.subplots(figsize=(WIDTH, HEIGHT), layout="constrained")
    stats = [v[key] for _, v in variants]
    names = [v["name"] for _, v in variants]
    ax.bar(names, [s["mean"] or 0.0 for s in stats], yerr=_errors(stats), capsize=8,
           color=[colour(i) for i, _ in variants])
    if what == "time":
        p95 = [v["time_p95"] for _, v in variants]
        ax.scatter([n for n, t in zip(names, p95, strict=True) if t is not None],
                   [t for t in p95 if t is not None], marker="_", s=900, color="black",
                   label="p95 of cells", zorder=3)
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_xlabel("variant")
    ax.set_ylabel(label + ", 95% CI")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{data['experiment']}: {what} per cell ({_n(data)})", fontsize=12)
    return _save(plt, fig, path)


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path
