"""Experiment: the report that compares the runs x seeds of an experiment (config/experiments/*.yaml),
all trained from one shared initial policy and prompt set: per-seed, summary and paired tables and
the accuracy and training plots. The experiment workflow and its outputs: docs/experiments.md, "Experiments";
the file's schema and loader: ``otbflow.studies.experiment_config``."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
from omegaconf import DictConfig

from otbflow import schemas
from otbflow.io import atomic_file, pyplot, read_table, save_figure, write_parquet
from otbflow.studies.experiment_config import load_experiment
from otbflow.studies.stats import late_trend, t_interval

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


def tokens_to_target(tokens: np.ndarray, accuracy: np.ndarray, target: float) -> float | None:
    """Rollout tokens at which an accuracy curve (one point per evaluated policy, in order) first
    reaches ``target``, linear between evaluations; 0 if the first (initial) policy is already
    there; None if it never does (censored: the run ended before)."""
    for i, acc in enumerate(accuracy):
        if acc >= target:
            if i == 0:
                return float(tokens[0])
            frac = (target - accuracy[i - 1]) / (acc - accuracy[i - 1])
            return float(tokens[i - 1] + frac * (tokens[i] - tokens[i - 1]))
    return None


def censored_median(reached: np.ndarray, n: int) -> float:
    """Median over ``n`` seeds of the tokens to the target, the ``n - len(reached)`` seeds that
    never reached it counted as +inf (they needed more than their run's tokens): finite only when
    more than half of the seeds reached the target, else NaN. Never a mean over the seeds that
    reached it (which would drop the slow seeds)."""
    if n == 0:
        return float("nan")
    median = float(np.median(np.concatenate([np.asarray(reached, dtype=float), np.full(n - len(reached), np.inf)])))
    return median if math.isfinite(median) else float("nan")


def per_seed_table(exp: dict, curves: pl.DataFrame, metrics: pl.DataFrame) -> pl.DataFrame:
    """One row per (run, seed): initial and final avg@k and greedy accuracy, tokens generated and
    trained, whether and at how many tokens avg@k reached the fixed ``analysis.target`` (NaN when
    it did not: censored at the member's tokens_generated), the avg@k gain over the last
    ``plateau_window`` iterations (from the last evaluation at least that many iterations before
    the final one, see evaluate.every; nan if there is none), the longest mean response length
    relative to the initial one, the largest finite grad norm and, beside it, the steps whose loss
    or gradient was not finite (skipped: no update; the instability signal a max over the
    finite norms would hide), and the lowest avg@k on the way."""
    a = exp["analysis"]
    target = float(a["target"])
    finite = pl.col("grad_norm").is_finite()
    trained = metrics.group_by("run", "seed").agg(
        pl.col("tokens").sum().cast(pl.Float64).alias("tokens_trained"),
        pl.col("grad_norm").filter(finite).max().fill_null(float("nan")).alias("max_grad_norm"),
        (~finite).sum().cast(pl.Int64).alias("nonfinite_steps"),  # a skipped step's norm is NaN
    )
    window = int(a["plateau_window"])
    rows = []
    for (run, seed), part in curves.sort("iteration").group_by(["run", "seed"], maintain_order=True):
        acc = part["sampled_accuracy"].to_numpy()
        length = part["mean_response_length"].to_numpy()
        its = part["iteration"].to_numpy()
        before = np.flatnonzero(its <= its[-1] - window)  # evaluations >= window iterations before the last
        late_gain = float(acc[-1] - acc[before[-1]]) if len(before) else float("nan")
        ttt = tokens_to_target(part["tokens_generated"].to_numpy(), acc, target)
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
                "responses_generated": float(part["responses_generated"][-1]),
                "target_accuracy": target,
                "reached_target": ttt is not None,
                "tokens_to_target": float("nan") if ttt is None else ttt,
                "final_response_length": float(length[-1]),
                "max_length_ratio": float(length.max() / max(length[0], 1e-9)),
            }
        )
    out = pl.DataFrame(rows).join(trained, on=["run", "seed"], how="left")
    order = {r: i for i, r in enumerate(exp["runs"])}
    return out.sort(pl.col("run").replace_strict(order), "seed").select(list(schemas.EXPERIMENT_SEEDS.columns))


def summary_table(exp: dict, per_seed: pl.DataFrame) -> pl.DataFrame:
    """One row per run: means over seeds with t-intervals (``otbflow.studies.stats.t_interval``: the seeds'
    values assumed normal), the late gain read as plateau / rising / falling / unresolved against
    ``analysis.plateau_margin``, and the tokens to the target as how many seeds reached it, their
    median with the others censored, and the fastest and slowest seed that reached it."""
    a = exp["analysis"]
    rows = []
    for run in exp["runs"]:
        part = per_seed.filter(pl.col("run") == run)
        final = part["final_accuracy"].to_numpy()
        reached = part.filter(pl.col("reached_target"))["tokens_to_target"].to_numpy()
        ci = t_interval(final, a["confidence"])
        late = part["late_gain"].to_numpy()
        late = late[np.isfinite(late)]  # members with fewer evaluations than the window have none
        lci = t_interval(late, a["confidence"])
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
                "late_trend": late_trend(lci[0], lci[1], float(a["plateau_margin"])),
                "target_accuracy": float(a["target"]),
                "reached_seeds": int(len(reached)),
                "tokens_to_target": censored_median(reached, part.height),
                "tokens_to_target_min": float(reached.min()) if len(reached) else float("nan"),
                "tokens_to_target_max": float(reached.max()) if len(reached) else float("nan"),
                "tokens_generated": float(part["tokens_generated"].mean()),
                "responses_generated": float(part["responses_generated"].mean()),
                "tokens_trained": float(part["tokens_trained"].mean()),
                "final_response_length": float(part["final_response_length"].mean()),
                "max_length_ratio": float(part["max_length_ratio"].max()),
                "min_accuracy": float(part["min_accuracy"].min()),
                "max_grad_norm": float(part["max_grad_norm"].max()),
                "nonfinite_steps": int(part["nonfinite_steps"].sum()),
            }
        )
    return pl.DataFrame(rows, schema=schemas.EXPERIMENT_SUMMARY.columns)


def first_to_target(ta: float | None, tb: float | None, end_a: float, end_b: float) -> str:
    """Which of two members of one seed reached the target first: 'a', 'b', 'neither' (both
    censored), or 'undecided' (the same tokens, e.g. both already there at 0, or one censored
    before the tokens at which the other reached it: it might have reached it sooner). A crossing
    at 0 tokens (the initial policy already at the target) counts like any other."""
    if ta is None and tb is None:
        return "neither"
    if ta is not None and tb is not None:
        return "a" if ta < tb else "b" if tb < ta else "undecided"
    if ta is not None:  # b censored at end_b
        return "a" if ta <= end_b else "undecided"
    return "b" if tb <= end_a else "undecided"


def matched_budget(curves: pl.DataFrame, a: str, b: str) -> int:
    """The largest number of rollout responses generated (dropped groups' included: the members'
    reports count them from the rollouts' metadata) after which both runs were evaluated on every
    seed (the initial policy aside): the point where they compare at an equal rollout budget
    without interpolating either curve. 0 if there is none: make evaluate.every put evaluations
    there (e.g. N = 4 every 4th iteration against N = 16 every iteration); a run with dynamic
    sampling generates a budget of its own per seed and iteration, so it rarely has one."""
    common = None
    for run in (a, b):
        for _, part in curves.filter(pl.col("run") == run).group_by("seed"):
            points = set(part.filter(pl.col("responses_generated") > 0)["responses_generated"].to_list())
            common = points if common is None else common & points
    return max(common) if common else 0


def paired_table(exp: dict, per_seed: pl.DataFrame, curves: pl.DataFrame) -> pl.DataFrame:
    """For each analysis pair [a, b], seed by seed: the final avg@k difference a - b with the
    t-interval of the per-seed differences (assumed normal); which run reached the target first
    (counts of seeds); and the avg@k difference at the largest equal budget of rollout responses
    where both were evaluated (``matched_budget``; the ``matched_responses*`` columns), with its
    t-interval and both runs' tokens there."""
    an = exp["analysis"]
    rows = []
    for a, b in an["pairs"]:
        joined = per_seed.filter(pl.col("run") == a).join(per_seed.filter(pl.col("run") == b), on="seed", suffix="_b")
        diff = (joined["final_accuracy"] - joined["final_accuracy_b"]).to_numpy()
        dci = t_interval(diff, an["confidence"])
        first = [
            first_to_target(
                r["tokens_to_target"] if r["reached_target"] else None,
                r["tokens_to_target_b"] if r["reached_target_b"] else None,
                r["tokens_generated"],
                r["tokens_generated_b"],
            )
            for r in joined.iter_rows(named=True)
        ]
        budget = matched_budget(curves, a, b)
        row = {
            "a": a,
            "b": b,
            "seeds": joined.height,
            "accuracy_diff": float(diff.mean()) if len(diff) else float("nan"),
            "accuracy_diff_lo": dci[0],
            "accuracy_diff_hi": dci[1],
            "a_better_seeds": int((diff > 0).sum()),
            "a_first_seeds": first.count("a"),
            "b_first_seeds": first.count("b"),
            "neither_seeds": first.count("neither"),
            "undecided_seeds": first.count("undecided"),
            "matched_responses": budget,
            "matched_responses_tokens_a": float("nan"),
            "matched_responses_tokens_b": float("nan"),
            "matched_responses_diff": float("nan"),
            "matched_responses_diff_lo": float("nan"),
            "matched_responses_diff_hi": float("nan"),
            "matched_responses_a_better_seeds": 0,
        }
        if budget:
            at = curves.filter(pl.col("responses_generated") == budget)
            m = at.filter(pl.col("run") == a).join(at.filter(pl.col("run") == b), on="seed", suffix="_b")
            mdiff = (m["sampled_accuracy"] - m["sampled_accuracy_b"]).to_numpy()
            mci = t_interval(mdiff, an["confidence"])
            row |= {
                "matched_responses_tokens_a": float(m["tokens_generated"].mean()),
                "matched_responses_tokens_b": float(m["tokens_generated_b"].mean()),
                "matched_responses_diff": float(mdiff.mean()),
                "matched_responses_diff_lo": mci[0],
                "matched_responses_diff_hi": mci[1],
                "matched_responses_a_better_seeds": int((mdiff > 0).sum()),
            }
        rows.append(row)
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
