"""Score: a learned reward model (``task.reward_model``; ``otbflow.models.reward_model``) scores each
(prompt, response) of one rollout shard in a job of its own, so that on a cluster its GPU is this
job's resource. The output is the rollouts table with ``rm_score`` added and the reward that
trains raised by ``task.reward_model.weight`` times it (or, with ``alone``, replaced by that);
``verifiable_reward`` stays as it was.
Contract (rendering, truncation, padding, the last-token score): docs/rewards.md."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import polars as pl
from omegaconf import DictConfig

from otbflow import schemas
from otbflow.io import read_metadata, read_table, write_parquet
from otbflow.models.policy import device, set_threads
from otbflow.models.reward_model import RewardModel

log = logging.getLogger("otbflow.score")


@dataclass
class Args:
    rollouts: str
    """Rollouts Parquet of one shard (the rollout stage's output)."""
    out: str
    """Output: the same table with rm_score, and reward + weight * rm_score as the reward."""


def run(cfg: DictConfig, args: Args) -> None:
    set_threads()
    rm = cfg.task.reward_model
    if rm.path is None:
        raise ValueError("task.reward_model.path is null: there is no reward model to score with")
    df = read_table(args.rollouts, schemas.ROLLOUTS)
    scores = []  # a shard that dynamic sampling left empty (rollout.filter_groups): no model to load
    if df.height:
        model = RewardModel(rm.path, device=device(), dtype=rm.dtype)
        scores = model.score(df["prompt"].to_list(), df["response_text"].to_list(), batch_size=rm.batch_size)
    score = pl.Series("rm_score", scores, dtype=pl.Float64)
    base = pl.lit(0.0) if rm.alone else pl.col("reward")
    df = df.with_columns(score, reward=base + rm.weight * score)
    info = {"path": rm.path, "weight": rm.weight, "alone": rm.alone, "dtype": rm.dtype}
    meta = {**read_metadata(args.rollouts), "reward_model": info}
    write_parquet(df.select(schemas.ROLLOUTS.present(df.columns)), args.out, metadata=meta)
    if not df.height:
        log.info("no responses to score (a shard that dynamic sampling left empty): an empty table written")
        return
    log.info(
        "%d responses scored by %s: mean score %.4f (sd %.4f), mean reward %.4f (weight %g)",
        df.height,
        rm.path,
        score.mean(),
        score.std() or 0.0,
        df["reward"].mean(),
        rm.weight,
    )
