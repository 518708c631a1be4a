"""Student's t intervals for `megarl bench learning`: of one arm's mean over seeds, and Welch's of the
difference of two arms' means (docs/learning.md says why these and not the bootstrap at n = 8).

Student's t at any real number of degrees of freedom, because Welch's are not whole: its two-sided
tail P(|T| > t) is the regularized incomplete beta function I_x(df/2, 1/2) at x = df / (df + t^2),
evaluated by its continued fraction (Lentz's method, Numerical Recipes 6.4) and inverted by
bisection. scipy.stats.t would do both, but scipy is not among megarl's dependencies and the bench
needs only this; tests/unit/test_bench_learning_stats.py checks it against the t table, against
mpmath's incomplete beta and the Welch-Satterthwaite degrees of freedom against a hand computation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

LEVEL = 0.95


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    tiny, eps = 1e-300, 1e-15
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 1000):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),  # the even step
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),  # the odd step
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            return h
    raise ArithmeticError(f"incomplete beta: no convergence at a={a}, b={b}, x={x}")


def incomplete_beta(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), for a, b > 0 and 0 <= x <= 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):  # the continued fraction converges fast here; else by symmetry
        return math.exp(log_front) * _beta_continued_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_continued_fraction(b, a, 1.0 - x) / b


def t_two_sided_tail(t: float, df: float) -> float:
    """P(|T| > t) for Student's t with ``df`` (any real > 0) degrees of freedom."""
    return incomplete_beta(df / 2.0, 0.5, df / (df + t * t))


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile (0.5 < p < 1) of Student's t with ``df`` > 0 degrees of freedom."""
    if not 0.5 < p < 1.0:
        raise ValueError(f"t_quantile: p must be in (0.5, 1), got {p}")
    if not df > 0:
        raise ValueError(f"t_quantile: degrees of freedom must be > 0, got {df}")
    tail = 2.0 * (1.0 - p)
    lo, hi = 0.0, 1.0
    while t_two_sided_tail(hi, df) > tail:
        lo, hi = hi, 2.0 * hi
    for _ in range(200):  # bisection to the last bit (the tail falls as t grows)
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        if t_two_sided_tail(mid, df) > tail:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _variance(x: Sequence[float]) -> float:
    m = sum(x) / len(x)
    return sum((v - m) ** 2 for v in x) / (len(x) - 1)


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float  # NaN where there is no interval (one value, or no spread to estimate from)
    high: float
    df: float  # degrees of freedom of the t quantile (NaN: none)
    se: float  # the standard error the half-width is t x se of


def mean_interval(values: Sequence[float], level: float = LEVEL) -> Interval:
    """The mean of ``values`` with its ``level`` Student's t interval (n - 1 degrees of freedom)."""
    n = len(values)
    if n == 0:
        raise ValueError("mean_interval: no values")
    mean = sum(values) / n
    if n < 2:
        return Interval(mean, math.nan, math.nan, math.nan, math.nan)
    se = math.sqrt(_variance(values) / n)
    half = t_quantile(0.5 + level / 2, n - 1) * se
    return Interval(mean, mean - half, mean + half, float(n - 1), se)


def welch_df(var_a: float, n_a: int, var_b: float, n_b: int) -> float:
    """The Welch-Satterthwaite degrees of freedom of mean(a) - mean(b) from the two sample variances."""
    ua, ub = var_a / n_a, var_b / n_b
    if ua + ub == 0.0:
        return math.nan
    return (ua + ub) ** 2 / (ua**2 / (n_a - 1) + ub**2 / (n_b - 1))


def welch_interval(a: Sequence[float], b: Sequence[float], level: float = LEVEL) -> Interval:
    """mean(a) - mean(b) with Welch's ``level`` t interval: each arm's own variance, the
    Welch-Satterthwaite degrees of freedom. Seeds of two arms are independent runs, and nothing says
    the arms vary alike (an async arm's seeds spread more than a sync arm's), so the variances are
    not pooled. Needs 2 or more values on each side; with no spread on either, the interval is the
    difference itself."""
    if len(a) < 2 or len(b) < 2:
        diff = sum(a) / len(a) - sum(b) / len(b)
        return Interval(diff, math.nan, math.nan, math.nan, math.nan)
    diff = sum(a) / len(a) - sum(b) / len(b)
    va, vb = _variance(a), _variance(b)
    se = math.sqrt(va / len(a) + vb / len(b))
    df = welch_df(va, len(a), vb, len(b))
    if se == 0.0:
        return Interval(diff, diff, diff, df, 0.0)
    half = t_quantile(0.5 + level / 2, df) * se
    return Interval(diff, diff - half, diff + half, df, se)
