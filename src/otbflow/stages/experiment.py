"""Experiment: the report that compares the runs x seeds of an experiment (config/experiments/*.yaml),
all trained from one shared initial policy and prompt set: per-seed, summary and paired tables and
the accuracy and training plots. The experiment workflow and its outputs: docs/experiments.md, "Experiments";
the file's schema and loader: ``otbflow.studies.experiment_config``; the tables' statistics:
``otbflow.studies.experiment_stats``."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
from omegaconf import DictConfig

from otbflow import schemas
from otbflow.io import atomic_file, pyplot, read_table, save_figure, write_parquet
from otbflow.studies.experiment_config import load_experiment
from otbflow.studies.experiment_stats import paired_table, per_seed_table, summary_table

log = logging.getLogger("otbflow.experiment")


@dataclass
class Args:
    experiment: str
    """Experiment YAML (config/experiments/*.yaml)."""
    root: str
    """Folder of the experiment's members (results/<experiment>)."""
    out_dir: str
    """Output folder: summary.parquet (and .tsv), variance.tsv (the shared variance study), curves.parquet,
    metrics.parquet, accuracy_vs_tokens.png, training.png."""


# ------------------------------------------------------------------------------------------
# The experiment report
# ------------------------------------------------------------------------------------------


def collect(exp: dict, root: Path) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(curves: every member's eval progress, with the rollout responses and tokens generated up
    to each evaluated policy as its report counted them -- from the rollouts' metadata, groups
    that dynamic sampling dropped included --, metrics: every member's train steps), with run and
    seed."""
    curves, metrics = [], []
    for name in exp["runs"]:
        for seed in exp["seeds"]:
            r = root / name / f"seed_{seed}" / "results" / "report"
            tag = [pl.lit(name).alias("run"), pl.lit(seed, pl.Int64).alias("seed")]
            curves.append(read_table(r / "progress.parquet", schemas.PROGRESS).with_columns(tag))
            metrics.append(read_table(r / "metrics.parquet", schemas.METRICS).with_columns(tag))
    return pl.concat(curves), pl.concat(metrics, how="diagonal_relaxed")


def _band(ax, x, ys, label):
    ys = np.asarray(ys)
    line = ax.plot(x, ys.mean(0), marker="o", markersize=3, label=label)[0]
    if len(ys) > 1:
        ax.fill_between(x, ys.min(0), ys.max(0), alpha=0.15, color=line.get_color())


def plot_accuracy(path: Path, exp: dict, curves: pl.DataFrame, target: float | None = None) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for name in exp["runs"]:
        part = curves.filter(pl.col("run") == name).sort("seed", "iteration")
        seeds = part.partition_by("seed", maintain_order=True)
        tokens = np.mean([s["tokens_generated"].to_numpy() for s in seeds], axis=0)
        _band(axes[0], tokens, [s["sampled_accuracy"].to_numpy() for s in seeds], name)
        _band(axes[1], tokens, [s["greedy_accuracy"].to_numpy() for s in seeds], name)
    if target is not None:
        axes[0].axhline(target, color="grey", linestyle=":", label=f"target {target:.3f}")
    for ax, name in zip(axes, ("avg@k (sampled)", "greedy")):
        ax.set_xlabel("rollout tokens generated (mean over seeds)")
        ax.set_ylabel(f"held-out accuracy, {name}")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    save_figure(fig, path)


def plot_training(path: Path, exp: dict, metrics: pl.DataFrame) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for name in exp["runs"]:
        m = metrics.filter(pl.col("run") == name).sort("seed", "global_step").partition_by("seed", maintain_order=True)
        steps = min(len(s) for s in m)
        _band(axes[0], np.arange(steps), [s["grad_norm"].to_numpy()[:steps] for s in m], name)
        _band(axes[1], np.arange(steps), [s["mean_response_length"].to_numpy()[:steps] for s in m], name)
    for ax in axes:
        ax.set_xlabel("optimizer step")
    axes[0].set_ylabel("grad norm (before clipping)")
    axes[1].set_ylabel("mean response length of the step's rollouts")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    save_figure(fig, path)


def write_tsv(df: pl.DataFrame, path: Path) -> None:
    with atomic_file(path) as tmp:
        df.write_csv(tmp, separator="\t", float_precision=4)


def run(cfg: DictConfig, args: Args) -> None:
    exp = load_experiment(args.experiment)
    curves, metrics = collect(exp, Path(args.root))
    out = Path(args.out_dir)
    per_seed = per_seed_table(exp, curves, metrics)
    summary = summary_table(exp, per_seed)
    pairs = paired_table(exp, per_seed, curves)
    meta = {"experiment": exp["experiment"], "seeds": exp["seeds"], "analysis": exp["analysis"]}
    write_parquet(summary, out / "summary.parquet", metadata=meta)
    write_parquet(per_seed, out / "seeds.parquet", metadata=meta)
    write_parquet(pairs, out / "pairs.parquet", metadata=meta)
    write_parquet(curves, out / "curves.parquet")
    write_tsv(summary, out / "summary.tsv")  # the same tables, rendered in the HTML report
    write_tsv(pairs, out / "pairs.tsv")
    variance = read_table(Path(args.root) / "shared" / "results" / "variance" / "summary.parquet", schemas.VARIANCE)
    write_tsv(variance, out / "variance.tsv")
    write_parquet(metrics, out / "metrics.parquet")
    plot_accuracy(out / "accuracy_vs_tokens.png", exp, curves, float(exp["analysis"]["target"]))
    plot_training(out / "training.png", exp, metrics)
    with pl.Config(tbl_cols=30, tbl_width_chars=250):
        log.info("%s\n%s\n%s", exp["experiment"], summary, pairs)
