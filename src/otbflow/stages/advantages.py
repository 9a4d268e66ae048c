"""Advantages stage: the features shards of one iteration merged, ``advantages.estimator`` for
training and the diagnostics of every estimator in ``advantages.compare`` (``otbflow.algorithms.estimators``;
docs/estimators.md). Every estimator runs with the ``advantages.*`` options it takes
(``baseline_shift`` included), and each comparison row records the shift it used. Every row's
diagnostics are on the raw-reward scale (``otbflow.algorithms.estimators.compare``); an estimator that
normalises its advantages also has P and E[A^2] of them as trained, marked ``normalised``. The
inputs must be one iteration's shards, each given once, every float finite (``check_shards``,
``read_features``): otherwise the job stops before any output, naming the files."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import polars as pl
from omegaconf import DictConfig

from otbflow import schemas
from otbflow.algorithms.estimators import compare, estimator_options
from otbflow.io import SchemaError, check_finite, read_table, write_parquet

log = logging.getLogger("otbflow.advantages")


@dataclass
class Args:
    features: list[str]
    """Features Parquet files of one iteration (all shards, each once: a file given twice, files of
    different iterations or of one shard, and a group_id in two files are refused)."""
    out: str
    """Output advantages Parquet (table 'advantages'), used by the train stage."""
    comparison: str
    """Output Parquet of the diagnostics of every estimator in advantages.compare."""
    iteration: int = 0
    """RL iteration k (recorded in the comparison table)."""


def read_features(path: str) -> pl.DataFrame:
    """One features shard, refused (naming the file, the row, its group and the token) where a float
    column holds a NaN or an infinity: the estimators and the train stage read them all."""
    table = read_table(path, schemas.FEATURES)
    check_finite(table, schemas.FEATURES.floats, path)
    return table


def check_shards(paths: list[str], tables: list[pl.DataFrame]) -> None:
    """Refuse (SchemaError, naming the files) inputs that are not one iteration's shards, each once:
    a file given twice, files of different iterations, two files of one shard, and a group_id in
    two files (a group's responses are one shard's: merged, it would count twice as many)."""
    seen: dict[Path, str] = {}
    for p in paths:
        if (real := Path(p).resolve()) in seen:
            raise SchemaError(f"--features: {p} is given twice (as {seen[real]} too)")
        seen[real] = p
    full = [(p, t) for p, t in zip(paths, tables) if t.height]  # an empty shard has nothing to tell
    iterations = {p: sorted(t["iteration"].unique().to_list()) for p, t in full}
    if len({k for ks in iterations.values() for k in ks}) > 1:
        raise SchemaError(
            "--features: shards of different iterations: "
            + ", ".join(f"{p} (iteration {', '.join(map(str, ks))})" for p, ks in iterations.items())
        )
    owner: dict[int, str] = {}
    for p, t in full:
        for shard in t["shard"].unique().to_list():
            if shard in owner:
                raise SchemaError(f"--features: shard {shard} is in {owner[shard]} and in {p}")
            owner[shard] = p
    groups: dict[int, str] = {}
    for p, t in full:
        for group in t["group_id"].unique(maintain_order=True).to_list():
            if group in groups:
                raise SchemaError(f"--features: group_id {group} is in {groups[group]} and in {p}")
            groups[group] = p


def run(cfg: DictConfig, args: Args) -> None:
    tables = [read_features(p) for p in args.features]
    check_shards(args.features, tables)
    table = pl.concat(tables, how="vertical")
    if table.height == 0:
        raise ValueError(
            f"iteration {args.iteration}: no sequences in any shard ({len(args.features)}): dynamic sampling "
            "(rollout.filter_groups) found no group with unequal verifiable rewards in any shard. Raise "
            "rollout.max_gen_batches (0: until the shards' prompts run out), or turn filter_groups off"
        )
    a = cfg.advantages
    rows = []
    for name in dict.fromkeys(list(a.compare) + [a.estimator]):
        options = estimator_options(cfg, name)  # the one rule: the advantages.* options it takes
        out, row = compare(table, name, **options)
        rows.append(
            {
                "iteration": args.iteration,
                "estimator": name,
                "baseline_shift": float(options.get("baseline_shift", 0.0)),
                **row,
            }
        )
        if name == a.estimator:
            train = out.with_columns(pl.lit(name).alias("estimator"))
            train = train.select(schemas.ADVANTAGES.present(train.columns))
    write_parquet(train, args.out, metadata={"estimator": a.estimator, "options": estimator_options(cfg, a.estimator)})
    comparison = pl.DataFrame(rows, schema=schemas.COMPARISON.columns)
    write_parquet(comparison, args.comparison)
    for r in rows:
        log.info(
            "%-22s delta=%+.3g  P=%.4g  E[A^2]=%.4g (raw-reward scale%s)  zero-adv=%.3f  pessimism=%+.4f",
            r["estimator"],
            r["baseline_shift"],
            r["total_power"],
            r["expected_a_squared"],
            f"; as trained, normalised: P={r['total_power_normalised']:.4g}" if r["normalised"] else "",
            r["zero_adv_fraction"],
            r["pessimism"],
        )
