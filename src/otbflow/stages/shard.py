"""Shard: split the prompts into a held-out eval set and N training shards.

The synthetic task is generated from the seed; a dataset (``task.name: dataset``) is read from
``task.path`` (JSONL or Parquet in a layout of ``task.format``: prompt/answer, verl, GSM8K, MATH;
see ``otbflow.models.tasks.load_dataset_file``), shuffled with the seed, and ``task.n_eval`` rows are
split off unless ``task.eval_path`` gives a separate eval file. Training prompt i goes to shard
i mod N. Every prompt keeps its raw text and its chat messages (table 'prompts'); the rollout
renders them for the policy's tokenizer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import polars as pl
from omegaconf import DictConfig

from otbflow import schemas
from otbflow.io import write_parquet
from otbflow.models.tasks import prompt_splits

log = logging.getLogger("otbflow.shard")


@dataclass
class Args:
    out_dir: str
    """Output folder: train/shard_{s}.parquet for each shard, and eval.parquet."""


def run(cfg: DictConfig, args: Args) -> None:
    train, ev = prompt_splits(cfg)
    n = cfg.shard.n_shards
    if train.height < n:
        raise ValueError(f"{train.height} training prompts cannot fill shard.n_shards={n} shards")
    train = train.with_row_index("prompt_id").with_columns(
        pl.col("prompt_id").cast(pl.Int64),
        pl.lit("train").alias("split"),
        (pl.col("prompt_id").cast(pl.Int64) % n).alias("shard"),
    )
    ev = ev.with_row_index("prompt_id").with_columns(
        pl.col("prompt_id").cast(pl.Int64), pl.lit("eval").alias("split"), pl.lit(0, pl.Int64).alias("shard")
    )
    cols = list(schemas.PROMPTS.columns)
    for s in range(n):
        write_parquet(train.filter(pl.col("shard") == s).select(cols), f"{args.out_dir}/train/shard_{s}.parquet")
    write_parquet(ev.select(cols), f"{args.out_dir}/eval.parquet")
    log.info("%d train prompts in %d shards, %d eval prompts", train.height, n, ev.height)
