"""Experiment: the report that compares the runs x seeds of an experiment (config/experiments/*.yaml),
all trained from one shared initial policy and prompt set: per-seed, summary and paired tables and
the accuracy and training plots. The experiment workflow and its outputs: README.md, "Experiments";
the file's schema and loader: ``otbflow.experiment_config``."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
from omegaconf import DictConfig

from otbflow import schemas
from otbflow.experiment_config import load_experiment
from otbflow.io import atomic_file, pyplot, read_table, save_figure, write_parquet

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
    """(curves: every member's eval progress, metrics: every member's train steps), with run and seed."""
    curves, metrics = [], []
    for name in exp["runs"]:
        for seed in exp["seeds"]:
            r = root / name / f"seed_{seed}" / "results" / "report"
            tag = [pl.lit(name).alias("run"), pl.lit(seed, pl.Int64).alias("seed")]
            curves.append(read_table(r / "progress.parquet", schemas.PROGRESS).with_columns(tag))
            metrics.append(read_table(r / "metrics.parquet", schemas.METRICS).with_columns(tag))
    return pl.concat(curves), pl.concat(metrics, how="diagonal_relaxed")


def tokens_to_target(tokens: np.ndarray, accuracy: np.ndarray, target: float) -> float:
    """Rollout tokens at which an accuracy curve (one point per evaluated policy, in order) first
    reaches ``target``, linear between evaluations; nan if it never does."""
    for i, acc in enumerate(accuracy):
        if acc >= target:
            if i == 0:
                return float(tokens[0])
            frac = (target - accuracy[i - 1]) / (acc - accuracy[i - 1])
            return float(tokens[i - 1] + frac * (tokens[i] - tokens[i - 1]))
    return float("nan")


def bootstrap_ci(values: np.ndarray, resamples: int, confidence: float, seed: int, stat=np.mean) -> tuple[float, float]:
    """Percentile interval of ``stat`` over ``values`` resampled with replacement (nan for fewer
    than 2 values). With few seeds the interval is rough: it shows the spread, not a guarantee."""
    values = np.asarray(values, dtype=float)
    if len(values) < 2:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    stats = np.array([stat(values[rng.integers(0, len(values), len(values))]) for _ in range(resamples)])
    tail = (1 - confidence) / 2
    return float(np.quantile(stats, tail)), float(np.quantile(stats, 1 - tail))


def per_seed_table(exp: dict, curves: pl.DataFrame, metrics: pl.DataFrame) -> pl.DataFrame:
    """One row per (run, seed): initial and final avg@k and greedy accuracy, tokens generated and
    trained, tokens to the target, the avg@k gain over the last ``plateau_window`` iterations (from
    the last evaluation at least that many iterations before the final one, see evaluate.every; nan
    if there is none), the longest mean response length relative to the initial one, the
    largest grad norm and the lowest avg@k on the way."""
    a = exp["analysis"]
    last = curves.filter(pl.col("iteration") == pl.col("iteration").max().over("run", "seed"))
    reference = last.filter(pl.col("run") == a["reference"])["sampled_accuracy"].mean()
    target = float(a["target_fraction"]) * float(reference)
    trained = metrics.group_by("run", "seed").agg(
        pl.col("tokens").sum().cast(pl.Float64).alias("tokens_trained"),
        pl.col("grad_norm").max().alias("max_grad_norm"),
    )
    window = int(a["plateau_window"])
    rows = []
    for (run, seed), part in curves.sort("iteration").group_by(["run", "seed"], maintain_order=True):
        acc = part["sampled_accuracy"].to_numpy()
        length = part["mean_response_length"].to_numpy()
        its = part["iteration"].to_numpy()
        before = np.flatnonzero(its <= its[-1] - window)  # evaluations >= window iterations before the last
        late_gain = float(acc[-1] - acc[before[-1]]) if len(before) else float("nan")
        rows.append(
            {
                "run": run,
                "seed": seed,
                "initial_accuracy": acc[0],
                "final_accuracy": acc[-1],
                "late_gain": late_gain,
                "final_greedy_accuracy": part["greedy_accuracy"][-1],
                "min_accuracy": float(acc.min()),
                "tokens_generated": float(part["tokens_generated"][-1]),
                "target_accuracy": target,
                "tokens_to_target": tokens_to_target(part["tokens_generated"].to_numpy(), acc, target),
                "final_response_length": float(length[-1]),
                "max_length_ratio": float(length.max() / max(length[0], 1e-9)),
            }
        )
    out = pl.DataFrame(rows).join(trained, on=["run", "seed"], how="left")
    order = {r: i for i, r in enumerate(exp["runs"])}
    return out.sort(pl.col("run").replace_strict(order), "seed").select(list(schemas.EXPERIMENT_SEEDS.columns))


def summary_table(exp: dict, per_seed: pl.DataFrame) -> pl.DataFrame:
    """One row per run: means over seeds with bootstrap intervals (resampling the seeds)."""
    a = exp["analysis"]
    rows = []
    for i, run in enumerate(exp["runs"]):
        part = per_seed.filter(pl.col("run") == run)
        final = part["final_accuracy"].to_numpy()
        ttt = part["tokens_to_target"].to_numpy()
        reached = ttt[np.isfinite(ttt)]
        ci = bootstrap_ci(final, a["ci_resamples"], a["confidence"], seed=i)
        tci = bootstrap_ci(reached, a["ci_resamples"], a["confidence"], seed=1000 + i)
        late = part["late_gain"].to_numpy()
        late = late[np.isfinite(late)]  # members with fewer evaluations than the window have none
        lci = bootstrap_ci(late, a["ci_resamples"], a["confidence"], seed=4000 + i)
        rows.append(
            {
                "run": run,
                "seeds": part.height,
                "initial_accuracy": float(part["initial_accuracy"].mean()),
                "final_accuracy": float(final.mean()),
                "final_accuracy_lo": ci[0],
                "final_accuracy_hi": ci[1],
                "final_accuracy_std": float(final.std(ddof=1)) if len(final) > 1 else 0.0,
                "final_greedy_accuracy": float(part["final_greedy_accuracy"].mean()),
                "accuracy_gain": float(final.mean() - part["initial_accuracy"].mean()),
                "late_gain": float(late.mean()) if len(late) else float("nan"),
                "late_gain_lo": lci[0],
                "late_gain_hi": lci[1],
                "target_accuracy": float(part["target_accuracy"][0]),
                "reached_target": int(len(reached)),
                "tokens_to_target": float(reached.mean()) if len(reached) else float("nan"),
                "tokens_to_target_lo": tci[0],
                "tokens_to_target_hi": tci[1],
                "tokens_generated": float(part["tokens_generated"].mean()),
                "tokens_trained": float(part["tokens_trained"].mean()),
                "final_response_length": float(part["final_response_length"].mean()),
                "max_length_ratio": float(part["max_length_ratio"].max()),
                "min_accuracy": float(part["min_accuracy"].min()),
                "max_grad_norm": float(part["max_grad_norm"].max()),
            }
        )
    return pl.DataFrame(rows, schema=schemas.EXPERIMENT_SUMMARY.columns)


def paired_table(exp: dict, per_seed: pl.DataFrame) -> pl.DataFrame:
    """For each analysis pair [a, b], seed by seed: the final avg@k difference a - b, and the ratio
    of tokens to the target a / b over the seeds where both reached it after some training, as a
    geometric mean, with bootstrap intervals that resample the seeds (the same seeds for a and b)."""
    an = exp["analysis"]
    rows = []
    for i, (a, b) in enumerate(an["pairs"]):
        joined = per_seed.filter(pl.col("run") == a).join(per_seed.filter(pl.col("run") == b), on="seed", suffix="_b")
        diff = (joined["final_accuracy"] - joined["final_accuracy_b"]).to_numpy()
        # seeds where both reached the target after some training (0 tokens: the initial policy was already
        # there, and a ratio of it means nothing)
        reached = [pl.col(c).is_not_nan() & (pl.col(c) > 0) for c in ("tokens_to_target", "tokens_to_target_b")]
        both = joined.filter(reached[0] & reached[1])  # (polars orders NaN above every number)
        log_ratio = np.log(
            both["tokens_to_target"].to_numpy() / np.maximum(both["tokens_to_target_b"].to_numpy(), 1e-9)
        )
        dci = bootstrap_ci(diff, an["ci_resamples"], an["confidence"], seed=2000 + i)
        rci = bootstrap_ci(log_ratio, an["ci_resamples"], an["confidence"], seed=3000 + i)
        rows.append(
            {
                "a": a,
                "b": b,
                "seeds": joined.height,
                "accuracy_diff": float(diff.mean()) if len(diff) else float("nan"),
                "accuracy_diff_lo": dci[0],
                "accuracy_diff_hi": dci[1],
                "a_better_seeds": int((diff > 0).sum()),
                "both_reached": both.height,
                "tokens_ratio": float(np.exp(log_ratio.mean())) if len(log_ratio) else float("nan"),
                "tokens_ratio_lo": float(np.exp(rci[0])),
                "tokens_ratio_hi": float(np.exp(rci[1])),
            }
        )
    return pl.DataFrame(rows, schema=schemas.EXPERIMENT_PAIRS.columns)


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
    pairs = paired_table(exp, per_seed)
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
    plot_accuracy(out / "accuracy_vs_tokens.png", exp, curves, float(per_seed["target_accuracy"][0]))
    plot_training(out / "training.png", exp, metrics)
    with pl.Config(tbl_cols=30, tbl_width_chars=250):
        log.info("%s\n%s\n%s", exp["experiment"], summary, pairs)
