"""Training-inference mismatch of stored log-probs: per-sequence k2/k3 and log-PPL gap against the
rollout engine, and the truncated IS weights per token (algorithms.md §3, §6.5)."""

from __future__ import annotations

import polars as pl
import torch

from otbflow import schemas
from otbflow.algorithms.rollout_is import rollout_is_weights
from otbflow.algorithms.tensors import padded


def mismatch_columns(df: pl.DataFrame) -> pl.DataFrame:
    """Trainer vs rollout engine, per token: log_ratio = log pi_trainer - log pi_rollout and
    k1 = -log_ratio, k2 = log_ratio^2 / 2, k3 = exp(log_ratio) - 1 - log_ratio (log_ratio clamped
    to +-20 for k3); per sequence: mean k1, max k2, mean k3 and the |log-PPL gap|."""
    lr = pl.element().cast(pl.Float64)
    df = df.with_columns((pl.col("logprobs") - pl.col("rollout_logprobs")).cast(schemas.F32L).alias("log_ratio"))
    df = df.with_columns(
        pl.col("log_ratio").list.eval(-lr).cast(schemas.F32L).alias("k1"),
        pl.col("log_ratio").list.eval(0.5 * lr**2).cast(schemas.F32L).alias("k2"),
        pl.col("log_ratio").list.eval(lr.clip(-20, 20).exp() - 1.0 - lr.clip(-20, 20)).cast(schemas.F32L).alias("k3"),
    )
    return df.with_columns(
        pl.col("k1").list.mean().cast(pl.Float64).fill_null(0.0).alias("seq_mean_k1"),
        pl.col("k2").list.max().cast(pl.Float64).fill_null(0.0).alias("seq_max_k2"),
        pl.col("k3").list.mean().cast(pl.Float64).fill_null(0.0).alias("seq_mean_k3"),
        (pl.col("logprobs").list.mean() - pl.col("rollout_logprobs").list.mean())
        .abs()
        .cast(pl.Float64)
        .fill_null(0.0)
        .alias("log_ppl_abs_diff"),
    )


def is_weights_column(
    logprobs: pl.Series, rollout_logprobs: pl.Series, level: str, threshold: float, rows_per_batch: int = 256
) -> pl.Series:
    """Per-token ``is_weights``: rollout_is_weights(log pi_old - log pi_rollout) of every row, from
    the stored fp32 log-probs, padded ``rows_per_batch`` rows at a time (the train stage computes
    the same weights from the same columns for its decoupled PPO loss)."""
    out: list[list[float]] = []
    lp_all, rp_all = logprobs.to_list(), rollout_logprobs.to_list()
    for start in range(0, len(lp_all), rows_per_batch):
        lp, rp = lp_all[start : start + rows_per_batch], rp_all[start : start + rows_per_batch]
        log_rho = padded(lp, 0.0, dtype=torch.float32) - padded(rp, 0.0, dtype=torch.float32)
        mask = padded([[1.0] * len(a) for a in lp], 0.0, dtype=torch.float32)
        w = rollout_is_weights(log_rho, mask, level, threshold)
        out += [w[i, : len(a)].tolist() for i, a in enumerate(lp)]
    return pl.Series("is_weights", out, dtype=schemas.F32L)
