"""Variance: the offline variance study of the baselines on the ``variance_pool`` stage's pool (the
study is ``otbflow.studies.variance_study``); writes summary.parquet, summary.json and variance.png.
Formulas and choices: docs/estimators.md, "Offline variance study"."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import polars as pl
from omegaconf import DictConfig

from otbflow import schemas
from otbflow.io import pyplot, read_table, save_figure, write_json, write_parquet
from otbflow.models.logits import check_head_logits, sequence_token_stats
from otbflow.models.policy import load_policy, set_threads
from otbflow.seeds import derive_seed
from otbflow.studies.variance_study import (
    CountSketch,
    pool_gradients,
    study,
)

log = logging.getLogger("otbflow.variance")


@dataclass
class Args:
    rollouts: list[str]
    """Rollout Parquets of the pool (several responses per prompt, sampled by ``policy``)."""
    policy: str
    """HF folder of the policy that sampled the pool (its gradients are measured)."""
    out_dir: str
    """Output folder: summary.parquet, summary.json, variance.png."""


def plot(path: Path, summary: pl.DataFrame) -> None:
    plt = pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    names = summary["estimator"].to_list()
    colors = ["grey" if n in ("none", "eob") else "tab:blue" for n in names]
    ax.bar(
        names,
        summary["trace_cov_diff"].to_numpy(),
        yerr=summary["trace_cov_diff_se"].to_numpy(),
        capsize=3,
        color=colors,
    )
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.set_ylabel("tr Cov(g_hat) - tr Cov(g_hat of REINFORCE)")
    ax.set_title(
        f"paired difference to REINFORCE (tr Cov {summary['trace_cov'][0]:.3g}), +- s.e. over prompts", fontsize=9
    )
    ax2.bar(names, summary["noise_to_signal"].to_numpy(), color=colors)
    ax2.set_ylabel("tr Cov(g_hat) / ||E g_hat||^2")
    ax2.set_title("noise-to-signal (scale-free)", fontsize=9)
    for a in (ax, ax2):
        a.grid(alpha=0.3, axis="y")
        a.tick_params(axis="x", labelrotation=30)
    fig.suptitle(
        "within-prompt variance of the group-mean policy gradient (grey: REINFORCE and the EOB oracle)", fontsize=9
    )
    save_figure(fig, path)


def run(cfg: DictConfig, args: Args) -> None:
    set_threads()
    v = cfg.variance
    pool = pl.concat([read_table(p, schemas.ROLLOUTS) for p in args.rollouts])
    model, tok = load_policy(args.policy, "float32")
    check_head_logits(model)
    t = cfg.rollout.temperature
    stats = sequence_token_stats(
        model,
        pool["prompt_ids"].to_list(),
        pool["response_ids"].to_list(),
        t,
        cfg.features.chunk_size,
        tok.pad_token_id,
    )
    dim = sum(p.numel() for p in model.parameters() if p.requires_grad)
    sketch = CountSketch(dim, v.sketch_dim, derive_seed(cfg.seed, "variance-sketch")) if v.sketch_dim else None
    token_grads = pool_gradients(model, pool, t, tok.pad_token_id, sketch)
    summary = study(cfg, pool, token_grads, stats)
    out = Path(args.out_dir)
    meta = {
        "policy": args.policy,
        "parameters": dim,
        "sketch_dim": v.sketch_dim,
        "group_size": v.group_size,
        "resamples_per_prompt": v.resamples,
        "prompts": pool["prompt_id"].n_unique(),
        "pool_rows": pool.height,
        "pool_tokens": int(pool["response_length"].sum()),
        "mean_reward": float(pool["reward"].mean()),
    }
    write_parquet(summary, out / "summary.parquet", metadata=meta)
    write_json({"meta": meta, "estimators": summary.to_dicts()}, out / "summary.json")
    plot(out / "variance.png", summary)
    for r in summary.iter_rows(named=True):
        log.info(
            "%-16s tr Cov %.4g (x%.3f of REINFORCE; paired difference %+.3g +- %.2g), noise/signal %.3g, "
            "sq bias %.3g (noise %.2g)",
            r["estimator"],
            r["trace_cov"],
            r["ratio_to_none"],
            r["trace_cov_diff"],
            r["trace_cov_diff_se"],
            r["noise_to_signal"],
            r["sq_bias"],
            r["sq_bias_noise"],
        )
