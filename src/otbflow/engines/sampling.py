"""Sampling groups of responses from a policy and scoring them: the rollout stage and the
variance study's pool both call ``sample_groups``.

Prompts are rendered by ``otbflow.engines.prompts.render_table`` (the chat template with ``task.chat``)
and generated from by the ``rollout.backend`` engine (``otbflow.engines``: which log-probs each
backend returns). The table keeps the raw prompt and the rendered token ids; the metadata
records the backend, the sampling arguments, the chat template's use, the system prompt and the
stop tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import torch
from omegaconf import DictConfig

from otbflow import schemas
from otbflow.algorithms.shaping import Scorer
from otbflow.engines import Sample, Sampling, open_backend
from otbflow.engines.prompts import check_prompt_lengths, prompt_metadata, render_table
from otbflow.models.policy import load_tokenizer
from otbflow.seeds import derive_seed


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
    behaviour_iteration: int,
    scorer: Scorer,
) -> pl.DataFrame:
    """The rollouts table (schemas.ROLLOUTS) of any backend's samples of ``batch``'s prompts;
    ``behaviour_iteration`` names the iteration whose starting policy sampled them; ``scorer``
    gives each response's verifiable and training reward."""
    rows = batch.to_dicts()
    scores = [scorer(s.text, rows[s.prompt_index]["answer"], len(s.response_ids)) for s in samples]
    versions = {"token_versions": [s.versions for s in samples]} if any(s.versions is not None for s in samples) else {}
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
            "reward": [training for _, training in scores],
            "verifiable_reward": [verifiable for verifiable, _ in scores],
            **versions,
        },
        schema={c: schemas.ROLLOUTS.columns[c] for c in schemas.ROLLOUTS.present(list(versions))},
    )


def check_logprobs(samples: list[Sample], prompt_ids: list, policy: str | Path) -> None:
    """Raise ValueError naming ``policy`` where a sampled token's log-prob is not finite (NaN or
    infinite: a token drawn from a distribution gets a finite one, so the policy's weights or its
    logits are broken, e.g. NaN weights), with the first such token (its prompt's id from
    ``prompt_ids``) and how many there are: the advantages stage refused the table only after the
    rollout had written it and exited 0."""
    finite = [np.isfinite(np.asarray(s.logprobs, dtype=np.float64)) for s in samples]
    bad = [k for k, f in enumerate(finite) if not f.all()]
    if bad:
        s, i = samples[bad[0]], int(np.argmin(finite[bad[0]]))
        tokens = sum(int((~finite[k]).sum()) for k in bad)
        raise ValueError(
            f"policy {policy}: a sampled token's log-prob is {s.logprobs[i]} (prompt {prompt_ids[s.prompt_index]}, "
            f"sample {s.sample_idx}, token {i}); {tokens} of {sum(map(len, finite))} tokens in {len(bad)} of "
            f"{len(samples)} responses are not finite: the policy's weights or logits are broken (NaN or infinite)"
        )


class GroupSampler:
    """The ``rollout.backend`` engine over one policy, opened once (at the first batch, after that
    batch's prompts have rendered) for every batch the job samples, and the task's scorer.
    ``weights``: where the engine takes newer policies from while it decodes (the hf backend's
    ``weights``, rollout.take_newer); None: the one policy."""

    def __init__(self, cfg: DictConfig, policy: str, behaviour_iteration: int, weights=None) -> None:
        self.cfg, self.policy, self.behaviour, self.weights = cfg, policy, behaviour_iteration, weights
        self.tok = load_tokenizer(policy)
        self.scorer = Scorer(cfg)
        self.backend = None
        self.meta: dict[str, Any] = {}

    def sample(self, batch: pl.DataFrame, group_size: int, iteration: int, shard: int, seed: int) -> pl.DataFrame:
        """``group_size`` responses to each prompt of ``batch`` (table 'prompts') with the rollout
        section's sampling options and ``seed``, scored: the rollouts table. The metadata of the
        first call is kept in ``meta``, with ``reward_timeouts``: the reward calls of every call so
        far that ran past their deadline (each scored 0)."""
        ids, chat = self.render(batch)
        sampling = self.sampling(group_size, seed)
        samples = self.engine().generate(ids, sampling)
        check_logprobs(samples, batch["prompt_id"].to_list(), self.policy)
        if not self.meta:
            self.meta = self.describe(sampling, chat, iteration, seed)
        table = rollout_table(samples, batch, iteration, shard, seed, self.behaviour, self.scorer)
        self.meta["reward_timeouts"] = self.scorer.timeouts
        return table

    def render(self, batch: pl.DataFrame) -> tuple[list[list[int]], bool]:
        """``batch``'s prompts rendered (``render_table``), each checked to fit the policy's positions
        with rollout.max_new_tokens: a prompt that cannot be rendered, or is too long, fails before
        the engine starts."""
        ids, chat = render_table(self.cfg, self.tok, batch, self.policy)
        mnt = self.cfg.rollout.max_new_tokens
        check_prompt_lengths(ids, batch["prompt_id"].to_list(), mnt, "rollout.max_new_tokens", self.policy)
        return ids, chat

    def sampling(self, group_size: int, seed: int) -> Sampling:
        r = self.cfg.rollout
        return Sampling(group_size, r.temperature, r.top_p, r.max_new_tokens, greedy=False, seed=seed, min_p=r.min_p)

    def engine(self):
        """The backend, opened at the first call (with ``weights``, where newer policies may be taken)."""
        if self.backend is None:
            self.backend = open_backend(self.cfg, self.policy)
            if self.weights is not None:
                self.backend.weights = self.weights
        return self.backend

    def describe(self, sampling: Sampling, chat: bool, iteration: int, seed: int) -> dict[str, Any]:
        """The rollouts' metadata: the backend, the policy, the sampling arguments and the prompts' rendering."""
        return {
            "backend": self.cfg.rollout.backend,
            "policy": str(Path(self.policy)),
            "iteration": iteration,
            "behaviour_iteration": self.behaviour,
            "seed": seed,
            "torch_version": torch.__version__,
            **self.backend.metadata(sampling),
            **prompt_metadata(self.cfg, self.tok, chat, self.backend.stops),
        }


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
    sampler = GroupSampler(cfg, policy, behaviour_iteration)
    df = sampler.sample(batch, group_size, iteration, shard, seed)
    return df, sampler.meta


def uniform_groups(df: pl.DataFrame) -> pl.Series:
    """The group ids of ``df`` (a rollouts table) whose verifiable rewards are all equal (all right
    or all wrong): groups that carry no signal about correctness (DAPO's dynamic sampling drops
    them; verl's metric 'acc'). Their advantage is zero under the group-mean baselines with the
    verifiable reward alone, but not under a shaped reward (overlong, cosine: it varies with the
    length) or OTB's zero-tail; there what they teach is length (docs/rewards.md)."""
    spread = df.group_by("group_id").agg(pl.col("verifiable_reward").n_unique().alias("values"))
    return spread.filter(pl.col("values") == 1)["group_id"]


def round_prompts(prompts: pl.DataFrame, used: set[int], n: int, seed: int) -> pl.DataFrame:
    """A further round's ``n`` prompts of a shard: drawn without replacement, with ``seed``, from
    the rows whose prompt ids are not in ``used`` (the rounds before it), so that group ids stay
    unique within an iteration; fewer where the shard has fewer left."""
    left = prompts.filter(~pl.col("prompt_id").is_in(sorted(used)))
    rows = np.random.default_rng(seed).permutation(left.height)[: min(n, left.height)]
    return left[sorted(rows.tolist())]


def sample_informative_groups(
    sampler: GroupSampler,
    prompts: pl.DataFrame,
    first: pl.DataFrame,
    target: int,
    iteration: int,
    shard: int,
) -> tuple[pl.DataFrame, dict[str, Any]]:
    """DAPO's dynamic sampling within one rollout job (algorithms.md §6.1): round 0 samples the
    prompts ``first`` (the iteration's window of the shard), each later round ``target`` prompts
    the rounds before it did not use (``round_prompts``); groups whose verifiable rewards are all
    equal are dropped, until ``target`` informative groups are held -- trimmed to exactly that,
    in the order generated, as verl does -- or ``rollout.max_gen_batches`` rounds are spent (0:
    until the shard's prompts run out). Every round's sampling seed and prompt draw derive from
    (iteration, shard, round). Returns the kept groups and what happened (the Parquet metadata's
    ``dynamic_sampling``: rounds, groups generated, dropped and kept, responses and tokens
    generated in all).
    A shard left with no informative group writes an empty table (the other shards train); the
    advantages stage stops the iteration only when every shard is empty (verl raises on the whole
    batch)."""
    r, seed0 = sampler.cfg.rollout, sampler.cfg.seed
    parts, used, seeds = [], set(), []
    kept = generated = responses = tokens = 0
    batch = first
    while batch.height:
        seeds.append(derive_seed(seed0, "rollout", iteration, shard, "round", len(seeds)))
        df = sampler.sample(batch, r.group_size, iteration, shard, seeds[-1])
        informative = df.filter(~pl.col("group_id").is_in(uniform_groups(df).implode()))
        used |= set(batch["prompt_id"].to_list())
        generated += batch.height
        kept += informative["group_id"].n_unique()
        responses += df.height
        tokens += int(df["response_length"].sum())
        parts.append(informative)
        if kept >= target or (r.max_gen_batches and len(seeds) >= r.max_gen_batches):
            break
        batch = round_prompts(prompts, used, target, derive_seed(seed0, "filter_groups", iteration, shard, len(seeds)))
    df = pl.concat(parts)
    keep = df["group_id"].unique(maintain_order=True).head(target)
    df = df.filter(pl.col("group_id").is_in(keep.implode()))
    stats = {
        "target_groups": target,
        "rounds": len(seeds),
        "round_seeds": seeds,
        "groups_generated": generated,
        "groups_dropped": generated - kept,
        "groups_informative": kept,
        "groups_kept": int(keep.len()),
        "responses_generated": responses,
        "tokens_generated": tokens,
        "reached": kept >= target,
    }
    return df, stats
