"""The headline lines every bench ends with: one ratio a line, in a form a script reads.

    == headline ==
    roundtrip_p50_tcp: 1.22x (target <= 1.15x: NOT met) [groups 1.07-1.46, n=15]

`NAME: VALUE (target OP GOAL: met|NOT met) [UNIT LOW-HIGH, n=N]`: VALUE is the median of the
n alternated groups' (or rounds', runs') ratios, LOW-HIGH their spread. Printed after a line
`== headline ==`, so `sed -n '/== headline ==/,$p'` (or `HEADLINE_RE`) picks them out; the
detailed lines above are what a profile starts from. `tests/bench/test_smoke.py` reads them.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence

MARK = "== headline =="
# name, value, op, goal, verdict, unit, low, high, n
HEADLINE_RE = re.compile(
    r"^(?P<name>[a-z0-9_]+): (?P<value>\d+(?:\.\d+)?)x? \(target (?P<op><=|>=) "
    r"(?P<goal>\d+(?:\.\d+)?)x?: (?P<verdict>met|NOT met)\) \[(?P<unit>[a-z]+) "
    r"(?P<low>\d+(?:\.\d+)?)-(?P<high>\d+(?:\.\d+)?), "
    r"n=(?P<n>\d+)\]$")


class Headlines:
    """Collects a bench's headline ratios as it measures them; `print()` them at the end."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def add(self, name: str, ratios: Sequence[float], op: str, goal: float,
            unit: str = "groups") -> float:
        """One headline from the per-group `ratios` (their median); `op` is "<=" or ">="."""
        if op not in ("<=", ">="):
            raise ValueError(f"op must be <= or >=, not {op!r}")
        if not ratios:
            raise ValueError(f"{name}: no ratios measured")
        # judged as printed (two decimals): no "1.10x (target <= 1.1x: NOT met)"
        value = round(statistics.median(ratios), 2)
        met = value <= goal if op == "<=" else value >= goal
        self.lines.append(f"{name}: {value:.2f}x (target {op} {goal:g}x: "
                          f"{'met' if met else 'NOT met'}) [{unit} {min(ratios):.2f}-"
                          f"{max(ratios):.2f}, n={len(ratios)}]")
        return value

    def add_count(self, name: str, counts: Sequence[int], most: int = 0,
                  unit: str = "rounds") -> int:
        """A count that must stay at or under `most` in every round (e.g. events lost): the
        largest of `counts` is the value, no `x` (not a ratio)."""
        value = max(counts)
        self.lines.append(f"{name}: {value} (target <= {most}: "
                          f"{'met' if value <= most else 'NOT met'}) [{unit} {min(counts)}-"
                          f"{value}, n={len(counts)}]")
        return value

    def print(self) -> None:
        print(MARK)
        for line in self.lines:
            print(line)
        print(flush=True, end="")
