"""`busctl experiment report E --plot DIR`: three PNGs, with matplotlib (the `plot` extra).

    score.png   mean score by variant, with its 95% interval (report.py's method)
    cost.png    mean cost per cell against mean score, one point per variant
    time.png    wall time per cell, a histogram per variant
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agent_bus.agents.experiment.runner import Journal
from agent_bus.agents.experiment.spec import SpecError


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise SpecError("--plot needs matplotlib: pip install 'agent-bus[plot]'") from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def plot(data: dict[str, Any], journal: Journal, folder: Path) -> list[Path]:
    """Write the PNGs of `report(...)`'s `data` into `folder`; their paths."""
    plt = _pyplot()
    folder.mkdir(parents=True, exist_ok=True)
    variants = [v for v in data["variants"] if v["n"]]
    names = [v["name"] for v in variants]
    written = []

    fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(names) + 2), 3.5))
    means = [v["score"] or 0.0 for v in variants]
    # clamped: a bound equal to the mean may differ from it by a rounding error
    low = [max(0.0, m - (v["ci95"] or [m, m])[0]) for m, v in zip(means, variants, strict=True)]
    high = [max(0.0, (v["ci95"] or [m, m])[1] - m) for m, v in zip(means, variants, strict=True)]
    ax.bar(names, means, yerr=[low, high], capsize=6, color="#4c72b0")
    ax.set_ylabel("mean score (95% CI)")
    ax.set_title(f"{data['experiment']}: score by variant")
    written.append(_save(fig, folder / "score.png", plt))

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for v in variants:
        ax.scatter(v["cost"] / v["n"], v["score"] or 0.0, label=v["name"])
    ax.set_xlabel("mean cost per cell")
    ax.set_ylabel("mean score")
    ax.legend()
    ax.set_title(f"{data['experiment']}: cost vs score")
    written.append(_save(fig, folder / "cost.png", plt))

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for name in names:
        times = [r.wall for r in journal.results.values()
                 if r.variant == name and r.status == "ok"]
        ax.hist(times, bins=20, alpha=0.6, label=name)
    ax.set_xlabel("wall time per cell (s)")
    ax.set_ylabel("cells")
    ax.legend()
    ax.set_title(f"{data['experiment']}: time")
    written.append(_save(fig, folder / "time.png", plt))
    return written


def _save(fig: Any, path: Path, plt: Any) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
