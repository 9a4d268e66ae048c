"""Variance pool: ``variance.pool_size`` responses to each of the first ``variance.pool_prompts``
prompts of a shard, sampled by the initial policy with the rollout's sampling options
(``otbflow.engines.sampling``): the population the variance study (``otbflow variance``) draws groups from."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from omegaconf import DictConfig

from otbflow import schemas
from otbflow.engines.sampling import sample_groups, select_prompts
from otbflow.io import read_table, write_parquet
from otbflow.models.policy import set_threads
from otbflow.seeds import derive_seed

log = logging.getLogger("otbflow.variance_pool")


@dataclass
class Args:
    prompts: str
    """Prompt shard Parquet (table 'prompts'); the pool takes its first variance.pool_prompts rows."""
    policy: str
    """HF folder of the policy to sample from (the initial policy)."""
    out: str
    """Output pool Parquet (the rollouts table)."""


def run(cfg: DictConfig, args: Args) -> None:
    set_threads()
    prompts = read_table(args.prompts, schemas.PROMPTS)
    shard = int(prompts["shard"][0]) if prompts.height else 0
    batch = select_prompts(prompts, 0, cfg.variance.pool_prompts)
    # the seed of iteration 0's rollout of the shard: the pool drawn before this stage existed
    seed = derive_seed(cfg.seed, "rollout", 0, shard)
    df, meta = sample_groups(cfg, batch, args.policy, cfg.variance.pool_size, 0, shard, seed, 0)
    write_parquet(df, args.out, metadata=meta)
    log.info(
        "pool: %d prompts x %d responses, mean reward %.3f", batch.height, cfg.variance.pool_size, df["reward"].mean()
    )
