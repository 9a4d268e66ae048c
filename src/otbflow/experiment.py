"""Experiment: several runs x seeds of the whole workflow on one initial policy and prompt set,
and the report that compares them.

An experiment file (``config/experiments/*.yaml``) has ``experiment`` (its name), ``seeds``,
``base`` (a config layered over config/config.yaml for every member) and ``runs`` (name ->
config overrides). ``advantages.exponent: scaling`` takes the length-power exponent that the
shared ``otbflow scaling`` stage measured. ``workflow/experiment.smk`` runs:

- ``shared``: the default workflow with ``base`` (seed = the first seed) up to the bootstrap,
  the length-scaling fit and the offline variance study, in ``results/<experiment>/shared``;
- one member per (run, seed): the default workflow in ``results/<experiment>/<run>/seed_<s>``
  with ``model.path`` = the shared initial policy and ``task.seed`` = the first seed (the same
  prompts for every member), so only the sampling and training seeds differ;
- ``otbflow experiment`` (this module's stage): per run, accuracy against tokens generated
  (mean and min-max band over seeds), grad norm and response length against step, the variance
  study and the scaling fit, and ``summary.parquet``.

Every member config is validated when the experiment workflow loads, before any job runs.
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
import yaml
from omegaconf import DictConfig

from otbflow import schemas
from otbflow.config import DEFAULT_CONFIG, ConfigError, load_config, nest, to_yaml
from otbflow.io import pyplot, read_table, save_figure, write_parquet

log = logging.getLogger("otbflow.experiment")
SECTIONS = ()
KEYS = {"experiment", "seeds", "base", "runs"}


@dataclass
class Args:
    experiment: str
    """Experiment YAML (config/experiments/*.yaml)."""
    root: str
    """Folder of the experiment's members (results/<experiment>)."""
    out_dir: str
    """Output folder: summary.parquet (and .tsv), variance.tsv (the shared variance study), curves.parquet,
    metrics.parquet, accuracy_vs_tokens.png, training.png."""


def _merge(a: dict, b: dict) -> dict:
    out = copy.deepcopy(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def load_experiment(path: str | Path) -> dict:
    """The experiment file, checked: keys, seeds, runs, and every member's config (validated by
    the same loader as any config; errors name the run and the key)."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    unknown = set(data) - KEYS
    if unknown or not KEYS <= set(data):
        raise ConfigError(f"{path}: an experiment needs exactly the keys {sorted(KEYS)} (unknown: {sorted(unknown)}, "
                          f"missing: {sorted(KEYS - set(data))})")
    if not (isinstance(data["seeds"], list) and data["seeds"] and all(isinstance(s, int) for s in data["seeds"])):
        raise ConfigError(f"{path}: 'seeds' must be a non-empty list of integers (got {data['seeds']!r})")
    if not (isinstance(data["runs"], dict) and data["runs"]):
        raise ConfigError(f"{path}: 'runs' must map run names to config overrides")
    for name in data["runs"]:
        for seed in data["seeds"]:
            try:
                load_config(DEFAULT_CONFIG, extra=member_config(data, name, seed, "/shared/policy", 1.0))
            except ConfigError as e:
                raise ConfigError(f"{path}: run '{name}': {e}") from None
    return data


def shared_config(exp: dict) -> dict:
    """The shared part: base config, first seed (bootstrap, prompts, scaling, variance)."""
    return _merge(nest(exp.get("base") or {}), {"seed": exp["seeds"][0]})


def member_config(exp: dict, run: str, seed: int, policy: str, exponent: float) -> dict:
    """One member's config: base, then the run's overrides, then its seed, the shared policy
    and prompt seed; ``advantages.exponent: scaling`` becomes the measured ``exponent``."""
    cfg = _merge(_merge(nest(exp.get("base") or {}), nest(exp["runs"][run] or {})),
                 {"seed": seed, "model": {"path": policy}, "task": {"seed": exp["seeds"][0]}})
    if cfg.get("advantages", {}).get("exponent") == "scaling":
        cfg["advantages"]["exponent"] = float(exponent)
    return cfg


def write_member_config(experiment: str, run: str, seed: int, policy: str, scaling: str, out: str) -> None:
    """The member's resolved config YAML (the exponent read from the shared scaling summary)."""
    exp = load_experiment(experiment)
    slope = json.loads(Path(scaling).read_text())["grad_sq_norm_slope"]
    cfg = load_config(DEFAULT_CONFIG, extra=member_config(exp, run, seed, str(Path(policy).resolve()), slope))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(to_yaml(cfg))
    tmp.replace(out)


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


def summary_table(exp: dict, curves: pl.DataFrame, metrics: pl.DataFrame) -> pl.DataFrame:
    last = curves.filter(pl.col("iteration") == pl.col("iteration").max().over("run", "seed"))
    first = curves.filter(pl.col("iteration") == -1)
    trained = metrics.group_by("run", "seed").agg(pl.col("tokens").sum().alias("tokens_trained"),
                                                  pl.col("grad_norm").max().alias("max_grad_norm"))
    per_seed = (last.join(first.select("run", "seed", pl.col("sampled_accuracy").alias("initial")), on=["run", "seed"])
                .join(trained, on=["run", "seed"]))
    out = per_seed.group_by("run", maintain_order=True).agg(
        pl.len().alias("seeds"),
        pl.col("initial").mean().alias("initial_accuracy"),
        pl.col("sampled_accuracy").mean().alias("final_accuracy"),
        pl.col("sampled_accuracy").std().fill_null(0.0).alias("final_accuracy_std"),
        pl.col("greedy_accuracy").mean().alias("final_greedy_accuracy"),
        pl.col("tokens_generated").mean().alias("tokens_generated"),
        pl.col("tokens_trained").mean().cast(pl.Float64).alias("tokens_trained"),
        pl.col("mean_response_length").mean().alias("final_response_length"),
        pl.col("max_grad_norm").max().alias("max_grad_norm"))
    order = {r: i for i, r in enumerate(exp["runs"])}
    out = out.with_columns((pl.col("final_accuracy") - pl.col("initial_accuracy")).alias("accuracy_gain"))
    return out.sort(pl.col("run").replace_strict(order)).select(list(schemas.EXPERIMENT_SUMMARY.columns))


def _band(ax, x, ys, label):
    ys = np.asarray(ys)
    line = ax.plot(x, ys.mean(0), marker="o", markersize=3, label=label)[0]
    if len(ys) > 1:
        ax.fill_between(x, ys.min(0), ys.max(0), alpha=0.15, color=line.get_color())


def plot_accuracy(path: Path, exp: dict, curves: pl.DataFrame) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for name in exp["runs"]:
        part = curves.filter(pl.col("run") == name).sort("seed", "iteration")
        seeds = part.partition_by("seed", maintain_order=True)
        tokens = np.mean([s["tokens_generated"].to_numpy() for s in seeds], axis=0)
        _band(axes[0], tokens, [s["sampled_accuracy"].to_numpy() for s in seeds], name)
        _band(axes[1], tokens, [s["greedy_accuracy"].to_numpy() for s in seeds], name)
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
    tmp = path.with_name(f".{path.name}.tmp")
    df.write_csv(tmp, separator="\t", float_precision=4)
    tmp.replace(path)


def run(cfg: DictConfig, args: Args) -> None:
    exp = load_experiment(args.experiment)
    curves, metrics = collect(exp, Path(args.root))
    out = Path(args.out_dir)
    summary = summary_table(exp, curves, metrics)
    write_parquet(summary, out / "summary.parquet", metadata={"experiment": exp["experiment"], "seeds": exp["seeds"]})
    write_parquet(curves, out / "curves.parquet")
    write_tsv(summary, out / "summary.tsv")  # the same table, rendered in the HTML report
    variance = read_table(Path(args.root) / "shared" / "results" / "variance" / "summary.parquet", schemas.VARIANCE)
    write_tsv(variance, out / "variance.tsv")
    write_parquet(metrics, out / "metrics.parquet")
    plot_accuracy(out / "accuracy_vs_tokens.png", exp, curves)
    plot_training(out / "training.png", exp, metrics)
    with pl.Config(tbl_cols=20, tbl_width_chars=200):
        log.info("%s\n%s", exp["experiment"], summary)
