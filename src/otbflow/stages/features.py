"""Features: one teacher-forced forward pass of the training model over stored rollouts.

Per response token it stores, from the temperature-scaled logits z (the rollout's temperature):

- ``logprobs``  log pi(y_t)                      (pi_old for the policy update)
- ``entropy``   -sum_v p_v log p_v
- ``sum_pi_sq`` sum_v p_v^2 = exp(logsumexp(2z) - 2 logsumexp(z))
- ``proxy``     max(0, 1 - 2 pi + sum_pi_sq) = ||e_y - p||^2, the Logit-Gradient Proxy energy
- ``log_ratio`` logprobs - rollout_logprobs, k1, k2, k3; per sequence mean k1, max k2, mean k3
  and the |log-PPL gap| (the mismatch between trainer and rollout engine)
- with ``features.exact_grad_norm``: ``grad_sq_norm`` = ||grad_theta sum_t log pi(y_t)||^2, one
  backward pass per sequence (the EOB oracle; small models only)
- with ``train.rollout_is`` token or sequence: ``is_weights``, the truncated rollout IS weights of
  rho = pi_old / pi_rollout (``otbflow.rollout_is``, the train stage's definition), which the OTB
  baseline and the variance-proxy diagnostics weight by (algorithms.md §1.3, §1.8)

Precision: the policy runs at the train stage's precision (fp32, or bf16 with ``train.bf16``, cast
as DeepSpeed casts it), not ``model.dtype``, and in eval mode as the train stage does, so that
``logprobs`` is the log pi_old the first optimizer step reproduces.

Memory: the transformer body runs once per batch; the output projection and the statistics run
over chunks of ``features.chunk_size`` response positions. Per chunk only two chunk x V fp32
tensors are alive (the logits, scaled in place, and their exponentials in a buffer reused across
chunks), as in a log-prob-only pass; never a vocabulary-sized tensor for every token.
``benchmarks/bench_features.py`` measures time and peak memory against a log-prob-only pass.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import polars as pl
import torch
from omegaconf import DictConfig

from otbflow import schemas
from otbflow.io import read_table, write_parquet
from otbflow.logits import STAT_COLUMNS, exact_grad_sq_norms, sequence_token_stats
from otbflow.model import cast_parameters, load_policy, set_threads, trainer_dtype
from otbflow.progress import Progress
from otbflow.rollout_is import rollout_is_weights

log = logging.getLogger("otbflow.features")
SECTIONS = ("features", "rollout", "train")


@dataclass
class Args:
    rollouts: str
    """Rollouts Parquet (table 'rollouts')."""
    policy: str
    """HF folder of the training model (the policy that sampled these rollouts)."""
    out: str
    """Output features Parquet."""


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
        width = max((len(x) for x in lp), default=0)
        log_rho = torch.zeros(len(lp), width)
        mask = torch.zeros(len(lp), width)
        for i, (a, b) in enumerate(zip(lp, rp)):
            log_rho[i, : len(a)] = torch.tensor(a, dtype=torch.float32) - torch.tensor(b, dtype=torch.float32)
            mask[i, : len(a)] = 1.0
        w = rollout_is_weights(log_rho, mask, level, threshold)
        out += [w[i, : len(a)].tolist() for i, a in enumerate(lp)]
    return pl.Series("is_weights", out, dtype=schemas.F32L)


def run(cfg: DictConfig, args: Args) -> None:
    set_threads()
    df = read_table(args.rollouts, schemas.ROLLOUTS)
    # pi_old at the trainer's precision (fp32, or DeepSpeed's bf16 cast with train.bf16), so that
    # the first PPO ratio of the train stage is 1; model.dtype is the rollout/evaluate dtype
    model, tok = load_policy(args.policy, "float32")
    cast_parameters(model, trainer_dtype(cfg.train))
    f = cfg.features
    stats: list[dict[str, list[float]]] = []
    progress = Progress(log, "features", df.height, "sequences")
    for start in range(0, df.height, f.batch_size):
        part = df[start : start + f.batch_size]
        stats += sequence_token_stats(
            model,
            part["prompt_ids"].to_list(),
            part["response_ids"].to_list(),
            cfg.rollout.temperature,
            f.chunk_size,
            tok.pad_token_id,
            f.vocab_chunk_size,
        )
        progress.update(part.height)
    df = df.with_columns(*(pl.Series(k, [s[k] for s in stats], dtype=schemas.F32L) for k in STAT_COLUMNS))
    if f.exact_grad_norm:
        df = df.with_columns(
            pl.Series(
                "grad_sq_norm",
                exact_grad_sq_norms(
                    model,
                    df["prompt_ids"].to_list(),
                    df["response_ids"].to_list(),
                    cfg.rollout.temperature,
                    tok.pad_token_id,
                    Progress(log, "exact gradient norms", df.height, "sequences"),
                ),
                dtype=pl.Float64,
            )
        )
    tc = cfg.train
    if tc.rollout_is != "none":
        df = df.with_columns(
            is_weights_column(df["logprobs"], df["rollout_logprobs"], tc.rollout_is, tc.rollout_is_threshold)
        )
    df = mismatch_columns(df).select(schemas.FEATURES.present(df.columns))
    meta = {"temperature": cfg.rollout.temperature, "policy": args.policy}
    if tc.rollout_is != "none":
        meta |= {"rollout_is": tc.rollout_is, "rollout_is_threshold": tc.rollout_is_threshold}
    write_parquet(df, args.out, metadata=meta)
    log.info(
        "%d sequences, %d tokens; mean proxy %.4f, mean k3 %.2e, max k2 %.2e",
        df.height,
        df["response_length"].sum(),
        df["proxy"].explode().mean(),
        df["seq_mean_k3"].mean(),
        df["seq_max_k2"].max(),
    )
