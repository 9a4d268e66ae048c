"""Scaling: how the squared gradient norm of a response grows with its length, and how well the
forward-only Logit-Gradient Proxy tracks it (exact norms, proxy energies, log-log fits in
``otbflow.studies.scaling_fit``). The experiment and its reading: docs/features.md, "Length scaling of
the gradient"."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
from omegaconf import DictConfig

from otbflow import schemas
from otbflow.io import pyplot, read_table, save_figure, write_json, write_parquet
from otbflow.models.logits import check_head_logits, exact_grad_sq_norms, sequence_token_stats
from otbflow.models.policy import load_policy, set_threads
from otbflow.progress import Progress
from otbflow.seeds import derive_seed
from otbflow.studies.scaling_fit import can_fit, fit_summary, spread_by_length

log = logging.getLogger("otbflow.scaling")


@dataclass
class Args:
    rollouts: list[str]
    """Rollout Parquets sampled by ``policy`` (e.g. every shard of iteration 0)."""
    policy: str
    """HF folder of the policy whose gradients are measured."""
    out_dir: str
    """Output folder: sequences.parquet, summary.parquet, summary.json, scaling.png."""


def plot(path: Path, lengths: np.ndarray, grad_sq: np.ndarray, w_hat: np.ndarray, s: dict) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    if np.isnan(s["grad_sq_norm_slope"]):
        fig.suptitle(f"no fit: {s['n_sequences']} responses of length(s) {sorted(set(lengths.astype(int).tolist()))}")
        save_figure(fig, path)
        return
    t = np.linspace(lengths.min(), lengths.max(), 50)
    for ax, y, name, label in (
        (axes[0], grad_sq, "grad_sq_norm", "exact ||grad log pi(y)||^2"),
        (axes[1], w_hat, "w_hat", "proxy energy W = sum_t w_t"),
    ):
        ax.loglog(lengths, y, ".", alpha=0.5)
        ax.loglog(
            t,
            np.exp(s[f"{name}_intercept"]) * t ** s[f"{name}_slope"],
            "-",
            label=f"slope {s[f'{name}_slope']:.2f} [{s[f'{name}_slope_ci_low']:.2f}, {s[f'{name}_slope_ci_high']:.2f}]",
        )
        ax.set_xlabel("response length T (tokens)")
        ax.set_ylabel(label)
        ax.legend()
    axes[2].loglog(w_hat, grad_sq, ".", alpha=0.5)
    axes[2].set_xlabel("proxy energy W")
    axes[2].set_ylabel("exact squared gradient norm")
    axes[2].set_title(f"Pearson {s['pearson_w_hat_grad_sq_norm']:.2f}, Spearman {s['spearman_w_hat_grad_sq_norm']:.2f}")
    save_figure(fig, path)


def run(cfg: DictConfig, args: Args) -> None:
    set_threads()
    sc = cfg.scaling
    df = pl.concat([read_table(p, schemas.ROLLOUTS) for p in args.rollouts]).filter(pl.col("response_length") > 0)
    df = spread_by_length(df, sc.max_sequences)
    if df.height == 0:
        raise ValueError("scaling: no non-empty response in the rollouts")
    if not can_fit(df["response_length"].to_numpy()):
        log.warning(
            "%d responses, all of length(s) %s: no length scaling can be fitted (slopes are NaN); "
            "raise rollout.max_new_tokens if every response is cut there",
            df.height,
            sorted(df["response_length"].unique().to_list()),
        )
    model, tok = load_policy(args.policy, "float32")
    check_head_logits(model)
    prompts, responses = df["prompt_ids"].to_list(), df["response_ids"].to_list()
    t = cfg.rollout.temperature
    grad_sq = np.asarray(
        exact_grad_sq_norms(
            model,
            prompts,
            responses,
            t,
            tok.pad_token_id,
            Progress(log, "exact gradient norms", len(prompts), "sequences"),
        )
    )
    w_hat = np.asarray(
        [
            sum(s["proxy"])
            for s in sequence_token_stats(model, prompts, responses, t, cfg.features.chunk_size, tok.pad_token_id)
        ]
    )
    lengths = df["response_length"].to_numpy().astype(np.float64)
    summary = fit_summary(lengths, grad_sq, w_hat, sc.ci_resamples, derive_seed(cfg.seed, "scaling"))
    out = Path(args.out_dir)
    table = df.select("iteration", "group_id", "sample_idx", "response_length", "reward").with_columns(
        pl.Series("grad_sq_norm", grad_sq), pl.Series("w_hat", w_hat)
    )
    write_parquet(table, out / "sequences.parquet", metadata={"policy": args.policy})
    write_parquet(pl.DataFrame([summary]), out / "summary.parquet", metadata={"policy": args.policy})
    write_json(summary, out / "summary.json")
    plot(out / "scaling.png", lengths, grad_sq, w_hat, summary)
    log.info(
        "%d responses, T in [%d, %d]: slope of log ||g||^2 vs log T = %.3f [%.3f, %.3f] (alpha %.3f); "
        "proxy slope %.3f; Pearson(W, ||g||^2) %.3f, Spearman %.3f",
        summary["n_sequences"],
        summary["min_length"],
        summary["max_length"],
        summary["grad_sq_norm_slope"],
        summary["grad_sq_norm_slope_ci_low"],
        summary["grad_sq_norm_slope_ci_high"],
        summary["alpha_blog"],
        summary["w_hat_slope"],
        summary["pearson_w_hat_grad_sq_norm"],
        summary["spearman_w_hat_grad_sq_norm"],
    )
