"""Advantages stage: the features shards of one iteration merged, ``advantages.estimator`` for
training and the diagnostics of every estimator in ``advantages.compare`` (``otbflow.estimators``;
docs/estimators.md). Every estimator runs with the ``advantages.*`` options it takes
(``baseline_shift`` included), and each comparison row records the shift it used. Every row's
diagnostics are on the raw-reward scale (``otbflow.estimators.compare``); an estimator that
normalises its advantages also has P and E[A^2] of them as trained, marked ``normalised``."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import polars as pl
from omegaconf import DictConfig

from otbflow import schemas
from otbflow.estimators import compare, estimator_options
from otbflow.io import check_finite, read_table, write_parquet

log = logging.getLogger("otbflow.advantages")


@dataclass
class Args:
    features: list[str]
    """Features Parquet files of one iteration (all shards)."""
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


def run(cfg: DictConfig, args: Args) -> None:
    table = pl.concat([read_features(p) for p in args.features], how="vertical")
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
