"""Small-sample statistics of the experiment report: Student t quantiles and t-intervals.

The experiment compares runs over 3-5 seeds. A percentile bootstrap over so few values is the
sample's range or close to it (at 3 seeds the min-max, which covers the mean about 75% of the
time for a nominal 95%); a t-interval is exact for normal values and close for bounded, skewed
ones at these sizes (tests/test_experiment.py checks both by simulation). Permutation and sign
tests need at least 6 seeds to reach p < 0.05 at all (at 5 seeds their smallest two-sided p-value
is 2/2^5 = 0.0625), so the report does not use them.

Pure Python and numpy (the project has no scipy): the t distribution's two-sided CDF for integer
degrees of freedom has a closed form (Abramowitz & Stegun 26.7.3-26.7.4), inverted by bisection.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np


def t_two_sided_cdf(t: float, df: int) -> float:
    """P(|T| <= t) for Student's T with ``df`` (a positive integer) degrees of freedom, t >= 0:
    the closed form in theta = atan(t / sqrt(df)) (Abramowitz & Stegun 26.7.3-26.7.4)."""
    if df < 1 or int(df) != df:
        raise ValueError(f"degrees of freedom must be a positive integer (got {df})")
    theta = math.atan(abs(t) / math.sqrt(df))
    s, c = math.sin(theta), math.cos(theta)
    if df % 2 == 0:  # sin(theta) (1 + 1/2 c^2 + 1*3/(2*4) c^4 + ... ), terms up to c^(df-2)
        term, total = 1.0, 1.0
        for j in range(1, df // 2):
            term *= (2 * j - 1) / (2 * j) * c * c
            total += term
        return s * total
    if df == 1:
        return 2 * theta / math.pi
    term, total = 1.0, 1.0  # 2/pi (theta + s c (1 + 2/3 c^2 + 2*4/(3*5) c^4 + ... )), up to c^(df-3)
    for j in range(1, (df - 1) // 2):
        term *= (2 * j) / (2 * j + 1) * c * c
        total += term
    return 2 / math.pi * (theta + s * c * total)


@lru_cache(maxsize=256)
def t_quantile(confidence: float, df: int) -> float:
    """The t with P(|T| <= t) = ``confidence``: the two-sided critical value t_{1-alpha/2, df} of
    a ``confidence`` interval (t_quantile(0.95, 4) = 2.776), by bisection to 1e-12."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1) (got {confidence})")
    lo, hi = 0.0, 1.0
    while t_two_sided_cdf(hi, df) < confidence:
        lo, hi = hi, 2 * hi
    while hi - lo > 1e-12 * max(1.0, hi):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_two_sided_cdf(mid, df) < confidence else (lo, mid)
    return (lo + hi) / 2


def t_interval(values, confidence: float) -> tuple:
    """The t-interval of the mean of ``values``: mean +- t_{1-alpha/2, n-1} s / sqrt(n), with s the
    sample std (ddof 1). It assumes the values are independent draws from a normal distribution
    (seeds of one run, or per-seed differences of two runs); by simulation (tests/test_experiment.py)
    it keeps >= 90% coverage for a nominal 95% at n = 3 and 5 on moderately skewed bounded values
    (Beta(2, 8), avg@k-like proportions) but not on strongly skewed ones (Beta(0.5, 5): about 83-86%).
    (nan, nan) for fewer than 2 values; NaN values are not dropped (the caller decides what a
    missing value means). A 2-D array gives one interval per row (arrays of lower and upper ends)."""
    v = np.asarray(values, dtype=float)
    n = v.shape[-1]
    if n < 2:
        nan = np.full(v.shape[:-1], np.nan)
        return (float("nan"), float("nan")) if v.ndim == 1 else (nan, nan)
    half = t_quantile(confidence, n - 1) * v.std(axis=-1, ddof=1) / math.sqrt(n)
    mean = v.mean(axis=-1)
    if v.ndim == 1:
        return float(mean - half), float(mean + half)
    return mean - half, mean + half


def late_trend(lo: float, hi: float, margin: float) -> str:
    """How a run's late gain reads from its interval [lo, hi] and the plateau margin:
    'plateau' when the interval lies inside (-margin, +margin) (an equivalence test: both
    one-sided tests of the TOST at (1 - confidence)/2 each, i.e. with the same two-sided interval
    as the table shows); else 'rising' when it lies above 0, 'falling' when below 0, and
    'unresolved' when it holds 0 and reaches past a margin (no evidence either way); 'no
    interval' when there is none (fewer than 2 seeds with a late gain)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "no interval"
    if -margin < lo and hi < margin:
        return "plateau"
    if lo > 0:
        return "rising"
    if hi < 0:
        return "falling"
    return "unresolved"
