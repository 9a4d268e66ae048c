"""Sampling groups of responses from a policy and scoring them: the rollout stage and the
variance study's pool both call ``sample_groups``.

Prompts are rendered by ``otbflow.engines.render_table`` (the chat template with ``task.chat``)
and generated from by the ``rollout.backend`` engine (``otbflow.engines``: which log-probs each
backend returns). The table keeps the raw prompt and the rendered token ids; the metadata
records the backend, the sampling arguments, the chat template's use, the system prompt and the
stop tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import polars as pl
import torch
from omegaconf import DictConfig

from otbflow import schemas
from otbflow.engines import Sample, Sampling, open_backend, prompt_metadata, render_table
from otbflow.model import load_tokenizer
from otbflow.rewards import get_reward, resolve_reward_name


def select_prompts(df: pl.DataFrame, iteration: int, per_shard: int) -> pl.DataFrame:
    """The iteration's window of a shard: consecutive rows, cycling through the shard."""
    n = df.height
    rows = [(iteration * per_shard + i) % n for i in range(min(per_shard, n))]
    return df[rows]


def rollout_table(
    samples: list[Sample],
    batch: pl.DataFrame,
    iteration: int,
    shard: int,
    seed: int,
    reward_fn,
    behaviour_iteration: int,
) -> pl.DataFrame:
    """The rollouts table (schemas.ROLLOUTS) of any backend's samples of ``batch``'s prompts;
    ``behaviour_iteration`` names the iteration whose starting policy sampled them."""
    rows = batch.to_dicts()
    return pl.DataFrame(
        {
            "iteration": [iteration] * len(samples),
            "behaviour_iteration": [behaviour_iteration] * len(samples),
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


def sample_groups(
    cfg: DictConfig,
    batch: pl.DataFrame,
    policy: str,
    group_size: int,
    iteration: int,
    shard: int,
    seed: int,
    behaviour_iteration: int,
) -> tuple[pl.DataFrame, dict[str, Any]]:
    """``group_size`` responses to each prompt of ``batch`` (table 'prompts'), sampled from
    ``policy`` (the starting policy of iteration ``behaviour_iteration``)
    with the rollout section's sampling options and scored with the task's reward: the rollouts
    table and its metadata."""
    r = cfg.rollout
    tok = load_tokenizer(policy)
    ids, chat = render_table(cfg, tok, batch)  # a prompt that cannot be rendered fails before the engine starts
    backend = open_backend(cfg, policy)
    sampling = Sampling(group_size, r.temperature, r.top_p, r.max_new_tokens, greedy=False, seed=seed)
    samples = backend.generate(ids, sampling)
    reward_fn = get_reward(resolve_reward_name(cfg.task.name, cfg.task.reward))
    df = rollout_table(samples, batch, iteration, shard, seed, reward_fn, behaviour_iteration)
    meta = {
        "backend": r.backend,
        "policy": str(Path(policy)),
        "iteration": iteration,
        "behaviour_iteration": behaviour_iteration,
        "seed": seed,
        "torch_version": torch.__version__,
        **backend.metadata(sampling),
        **prompt_metadata(cfg, tok, chat, backend.stops),
    }
    return df, meta
