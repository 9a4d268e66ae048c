"""Fits of the scaling study: squared gradient norm and proxy energy against response length
(log-log slopes with bootstrap intervals, rank agreement)."""

from __future__ import annotations

import numpy as np
import polars as pl


def ols(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line y = intercept + slope x."""
    slope, intercept = np.polyfit(x, y, 1)
    return float(slope), float(intercept)


def bootstrap_slope(x: np.ndarray, y: np.ndarray, n_boot: int, seed: int, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap confidence interval of the OLS slope, resampling (x, y) pairs."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(x), size=(n_boot, len(x)))
    xs, ys = x[idx], y[idx]
    xm, ym = xs.mean(1, keepdims=True), ys.mean(1, keepdims=True)
    den = ((xs - xm) ** 2).sum(1)
    slopes = ((xs - xm) * (ys - ym)).sum(1)[den > 0] / den[den > 0]
    lo, hi = np.quantile(slopes, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman rank correlation (average ranks for ties)."""
    ra = pl.Series(a).rank("average").to_numpy()
    rb = pl.Series(b).rank("average").to_numpy()
    return float(np.corrcoef(ra, rb)[0, 1])


def spread_by_length(df: pl.DataFrame, n: int) -> pl.DataFrame:
    """At most ``n`` rows, evenly spaced over the sorted lengths (keeps the whole range)."""
    df = df.sort("response_length")
    if df.height <= n:
        return df
    return df[np.unique(np.linspace(0, df.height - 1, n).round().astype(int)).tolist()]


FIT_KEYS = [
    f"{name}_{k}" for name in ("grad_sq_norm", "w_hat") for k in ("slope", "intercept", "slope_ci_low", "slope_ci_high")
]
FIT_KEYS += ["alpha_blog", "pearson_w_hat_grad_sq_norm", "spearman_w_hat_grad_sq_norm", "pearson_log"]


def can_fit(lengths: np.ndarray) -> bool:
    """A slope against log T needs at least three responses of at least two lengths."""
    return len(lengths) >= 3 and len(np.unique(lengths)) >= 2


def fit_summary(lengths: np.ndarray, grad_sq: np.ndarray, w_hat: np.ndarray, n_boot: int, seed: int) -> dict:
    """Log-log fits of the exact squared gradient norm and of the proxy energy against the response
    length, with bootstrap intervals; every fit figure NaN when ``can_fit`` is false (e.g. every
    response cut at max_new_tokens)."""
    out = {"n_sequences": int(len(lengths)), "min_length": int(lengths.min()), "max_length": int(lengths.max())}
    if not can_fit(lengths):
        return out | dict.fromkeys(FIT_KEYS, float("nan"))
    logt = np.log(lengths)
    for name, y in (("grad_sq_norm", grad_sq), ("w_hat", w_hat)):
        keep = y > 0
        slope, intercept = ols(logt[keep], np.log(y[keep]))
        lo, hi = bootstrap_slope(logt[keep], np.log(y[keep]), n_boot, seed)
        out |= {
            f"{name}_slope": slope,
            f"{name}_intercept": intercept,
            f"{name}_slope_ci_low": lo,
            f"{name}_slope_ci_high": hi,
        }
    out["alpha_blog"] = out["grad_sq_norm_slope"] / 2
    out["pearson_w_hat_grad_sq_norm"] = float(np.corrcoef(w_hat, grad_sq)[0, 1])
    out["spearman_w_hat_grad_sq_norm"] = spearman(w_hat, grad_sq)
    out["pearson_log"] = float(np.corrcoef(np.log(np.maximum(w_hat, 1e-30)), np.log(np.maximum(grad_sq, 1e-30)))[0, 1])
    return out
