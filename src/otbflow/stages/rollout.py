"""Rollout: ``rollout.group_size`` responses to each of the iteration's prompts of one shard,
sampled by the current policy and scored (``otbflow.engines.sampling``; backends in ``otbflow.engines``).
With ``rollout.stream`` the job continues the shard's stream that the rollout of the iteration
before left and takes the first complete groups (``otbflow.engines.laminar``).
With ``rollout.filter_groups`` (DAPO's dynamic sampling) the job samples further rounds of prompts
until it holds its share of informative groups (``otbflow.engines.sampling.sample_informative_groups``).
The metadata's ``reward_timeouts`` counts the reward calls (of every round) that ran past their
deadline and scored 0; the job's log warns where there are any."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Optional

from omegaconf import DictConfig

from otbflow import schemas
from otbflow.engines.hf_backend import PublishedPolicies
from otbflow.engines.laminar import stream_rollout
from otbflow.engines.sampling import GroupSampler, sample_informative_groups, select_prompts
from otbflow.io import fault_point, read_table, write_parquet
from otbflow.models.policy import set_threads
from otbflow.runtime import resident
from otbflow.seeds import derive_seed

log = logging.getLogger("otbflow.rollout")


@dataclass
class Args:
    prompts: str
    """Prompt shard Parquet (table 'prompts')."""
    policy: str
    """HF folder of the policy to sample from."""
    out: str
    """Output rollouts Parquet."""
    iteration: int = 0
    """RL iteration k (selects which prompts of the shard are used)."""
    behaviour_iteration: Optional[int] = None
    """The iteration whose starting policy --policy is: max(0, k - rollout.staleness) in the
    workflow (a column of every row). Default: --iteration (on-policy)."""
    newer_policies: list[str] = field(default_factory=list)
    """rollout.take_newer: the policies of iterations --behaviour-iteration + 1 .. --iteration, in
    order, taken while the job decodes as each is published (none need exist when it starts)."""
    carry_in: Optional[str] = None
    """rollout.stream: the stream the rollout of iteration k - 1 left (its --carry); none at the stream's start."""
    carry: Optional[str] = None
    """rollout.stream: where this rollout writes what it leaves of the stream (schemas.STREAM)."""


def run(cfg: DictConfig, args: Args) -> None:
    set_threads()
    prompts = read_table(args.prompts, schemas.PROMPTS)
    shard = int(prompts["shard"][0]) if prompts.height else 0
    per_shard = math.ceil(cfg.rollout.prompts_per_iteration / cfg.shard.n_shards)
    batch = select_prompts(prompts, args.iteration, per_shard)
    seed = derive_seed(cfg.seed, "rollout", args.iteration, shard)
    behaviour = args.iteration if args.behaviour_iteration is None else args.behaviour_iteration
    if not 0 <= behaviour <= args.iteration:
        raise ValueError(f"--behaviour-iteration {behaviour} must be in [0, --iteration {args.iteration}]")
    if len(args.newer_policies) > args.iteration - behaviour or (
        args.newer_policies and cfg.rollout.take_newer == "none"
    ):
        raise ValueError(
            f"--newer-policies: at most the {args.iteration - behaviour} policies of iterations "
            f"{behaviour + 1} .. {args.iteration}, and only with rollout.take_newer (is {cfg.rollout.take_newer!r})"
        )
    if cfg.rollout.stream != (args.carry is not None) or (args.carry_in and not cfg.rollout.stream):
        raise ValueError(
            f"--carry (and --carry-in after the first iteration) go with rollout.stream (is {cfg.rollout.stream})"
        )
    resident.LAST_LOAD.clear()
    trajectory = cfg.rollout.take_newer == "trajectory"
    newer = (args.newer_policies, behaviour, args.policy, cfg.model.dtype, trajectory)
    weights = PublishedPolicies(*newer) if args.newer_policies or cfg.rollout.stream else None
    sampler = GroupSampler(cfg, args.policy, behaviour, weights)
    if cfg.rollout.stream:
        df, carry, carry_meta, meta = stream_rollout(sampler, prompts, shard, args.iteration, args.carry_in)
        st = meta["stream"]
        log.info(
            "stream, iteration %d shard %d: %d groups taken (%d started in an earlier rollout), %d carried groups "
            "dropped and %d regenerated (older than rollout.staleness %d), %d responses carried to the next "
            "(%d decoding)",
            args.iteration,
            shard,
            st["groups_taken"],
            st["groups_from_carry"],
            st["groups_dropped_stale"],
            st["groups_regenerated"],
            cfg.rollout.staleness,
            st["carried_responses"],
            st["carried_in_flight"],
        )
    elif cfg.rollout.filter_groups:
        df, stats = sample_informative_groups(sampler, prompts, batch, per_shard, args.iteration, shard)
        meta = {**sampler.meta, "dynamic_sampling": stats}
        log.log(
            logging.INFO if stats["reached"] else logging.WARNING,
            "dynamic sampling, iteration %d shard %d: %d rounds, %d groups generated, %d dropped (all-equal "
            "verifiable rewards), %d kept of %d%s",
            args.iteration,
            shard,
            stats["rounds"],
            stats["groups_generated"],
            stats["groups_dropped"],
            stats["groups_kept"],
            per_shard,
            "" if stats["reached"] else ": rollout.max_gen_batches spent (or the shard's prompts), training on these",
        )
    else:
        df = sampler.sample(batch, cfg.rollout.group_size, args.iteration, shard, seed)
        meta = sampler.meta
    if timeouts := meta.get("reward_timeouts", 0):
        log.warning(
            "iteration %d shard %d: %d reward calls ran past the reward's deadline and scored 0 (the "
            "metadata's reward_timeouts; the report's rollouts table sums them per iteration)",
            args.iteration,
            shard,
            timeouts,
        )
    if resident.LAST_LOAD:  # the HF backend's load (the vLLM engine reloads its own)
        meta = {**meta, "policy_load": dict(resident.LAST_LOAD)}
    if weights is not None:  # which policies sampled it, and what taking them cost
        meta = {
            "stream": vars(sampler.backend.stats) if sampler.backend is not None else {},
            **meta,
            "take_newer": cfg.rollout.take_newer,
            "policies": {str(v): d for v, d in weights.digests.items()},
        }
    write_parquet(df, args.out, metadata=meta)
    if args.carry is not None:  # last: a stream continues only from a rollout that was written whole
        fault_point("rollout:before-carry")
        write_parquet(carry, args.carry, metadata=carry_meta)
    log.info(
        "iteration %d shard %d (policy of iteration %d): %d responses, mean reward %.3f, mean length %.1f",
        args.iteration,
        shard,
        behaviour,
        df.height,
        df["reward"].mean(),
        df["response_length"].mean(),
    )
