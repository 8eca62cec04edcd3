"""The few exact computations the experiment report needs, in the standard library.

    t_ppf / t_cdf     Student's t distribution (through the regularized incomplete beta
                      function, Numerical Recipes' continued fraction; the quantile by bisection)
    t_interval        the 95% t interval of a mean: mean ± t(0.975, n-1) · s/√n
    paired_t          the paired t test on differences: (mean, its 95% interval, two-sided p)
    binom_two_sided   the exact two-sided binomial test at p = 1/2: McNemar's exact test on the
                      discordant pairs, or the sign test on the signs of differences

Why not scipy.stats: it (with numpy) is ~80 MB to install for a handful of closed formulas, and
the bus's core installs nothing heavy (pyzmq, msgspec, anyio, httpx, click). These functions are
checked against scipy.stats to 1e-9 in tests/experiments/test_statistics.py (scipy is in the `test`
extra), so the numbers are scipy's without making every user install it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

EPS = 1e-15


def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz's method)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 1000):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < EPS:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                     + a * math.log(x) + b * math.log1p(-x))
    # the fraction converges fast on this side of the mean; the other side by symmetry
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _beta_fraction(a, b, x) / a
    return 1.0 - front * _beta_fraction(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom."""
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


@lru_cache(maxsize=256)
def t_ppf(q: float, df: float) -> float:
    """The q quantile of Student's t (0 < q < 1): bisection on t_cdf, to double precision."""
    if q == 0.5:
        return 0.0
    if q < 0.5:
        return -t_ppf(1.0 - q, df)
    high = 1.0
    while t_cdf(high, df) < q:
        high *= 2.0
    low = 0.0
    for _ in range(200):
        mid = (low + high) / 2.0
        if mid in (low, high):
            break
        low, high = (mid, high) if t_cdf(mid, df) < q else (low, mid)
    return (low + high) / 2.0


def mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


def sd(values: Sequence[float]) -> float:
    """The sample standard deviation (n - 1)."""
    m = mean(values)
    return math.sqrt(math.fsum((v - m) ** 2 for v in values) / (len(values) - 1))


def t_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float] | None:
    """The t interval of the mean of `values`; None under two values (no spread to measure)."""
    n = len(values)
    if n < 2:
        return None
    m = mean(values)
    half = t_ppf(0.5 + level / 2.0, n - 1) * sd(values) / math.sqrt(n)
    return (m - half, m + half)


def paired_t(diffs: Sequence[float]) -> tuple[float, tuple[float, float] | None, float | None]:
    """The paired t test on differences b - a: their mean, its 95% interval, the two-sided p
    (scipy.stats.ttest_rel's). Under two differences neither interval nor p; with no spread,
    p is 1 when they are all 0 and 0 otherwise (t is infinite: scipy says the same)."""
    effect = mean(diffs) if diffs else 0.0
    if len(diffs) < 2:
        return effect, None, None
    spread = sd(diffs)
    if spread == 0.0:
        return effect, (effect, effect), 1.0 if effect == 0.0 else 0.0
    t = effect / (spread / math.sqrt(len(diffs)))
    p = 2.0 * t_cdf(-abs(t), len(diffs) - 1)
    return effect, t_interval(diffs), min(1.0, p)


def binom_two_sided(k: int, n: int) -> float:
    """Exact two-sided binomial p-value of k successes in n at p = 1/2 (symmetric: twice the
    smaller tail, at most 1): McNemar's exact test with k, n - k the flips each way."""
    if n == 0:
        return 1.0
    low = min(k, n - k)
    tail = sum(math.comb(n, i) for i in range(low + 1)) / (1 << n)
    return min(1.0, 2.0 * tail)
