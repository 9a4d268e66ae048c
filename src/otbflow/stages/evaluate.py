"""Evaluate: greedy accuracy and sampled avg@k of one policy on the held-out prompts.

Generates with ``rollout.backend`` (transformers or vLLM; one engine for both modes) from the
prompts rendered as the rollout renders them (``task.chat``). Writes every response (samples
Parquet) and a one-row summary: greedy accuracy, avg@k (mean reward over k samples per prompt at
``evaluate.temperature``) and mean sampled response length. The seed is fixed per policy name,
so the same policy always gets the same samples. Each response is scored with the verifiable
reward under the reward's deadline, as the rollout scores it (a call past it scores 0; the samples'
metadata counts them: ``reward_timeouts``). The summary is also a point of the live curves
(``otbflow.runtime.tracking``), at the optimizer steps and tokens that made the policy (``--train-state``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import polars as pl
from omegaconf import DictConfig

from otbflow import schemas
from otbflow.algorithms.lr_schedule import ScheduleState
from otbflow.algorithms.rewards import get_reward, reward_timeouts
from otbflow.algorithms.shaping import verifier
from otbflow.engines import Sampling, open_backend
from otbflow.engines.prompts import check_prompt_lengths, prompt_metadata, render_table
from otbflow.io import read_table, write_parquet
from otbflow.models.policy import load_tokenizer, set_threads
from otbflow.runtime.tracking import open_curves
from otbflow.seeds import derive_seed

log = logging.getLogger("otbflow.evaluate")


@dataclass
class Args:
    prompts: str
    """Eval prompts Parquet (table 'prompts', split 'eval')."""
    policy: str
    """HF folder of the policy to evaluate."""
    name: str
    """Name of the policy in the outputs: 'initial' or 'iter_{k}'."""
    samples: str
    """Output Parquet of every eval response."""
    summary: str
    """Output one-row summary Parquet."""
    iteration: int = -1
    """Iteration that trained this policy (-1: the initial policy)."""
    train_state: str = ""
    """The --state JSON of the train job that wrote the policy (iter_k/train/schedule.json): the
    optimizer steps and tokens that made it, the live curves' axes. Empty: 0 and 0 (the initial policy)."""
    tracking_name: str = ""
    """This job's name in the live curves (tracking.*), e.g. evaluate/iter_3: its TensorBoard folder
    results_dir/tensorboard/<name>/ (made anew) and its W&B run. Empty: no live curves."""


def run(cfg: DictConfig, args: Args) -> None:
    set_threads()
    curves = open_curves(cfg, args.tracking_name)
    prompts = read_table(args.prompts, schemas.PROMPTS)
    e = cfg.evaluate
    reward_fn = get_reward(verifier(cfg.task))  # never the shaped training reward
    answers, ids = prompts["answer"].to_list(), prompts["prompt_id"].to_list()
    tok = load_tokenizer(args.policy)
    prompt_ids, chat = render_table(cfg, tok, prompts, args.policy)
    check_prompt_lengths(prompt_ids, ids, e.max_new_tokens, "evaluate.max_new_tokens", args.policy)
    backend = open_backend(cfg, args.policy)
    rows, meta = [], {"backend": cfg.rollout.backend, "policy": args.policy}
    timeouts_before = reward_timeouts()
    for mode in ("greedy", "sampled"):
        sampling = Sampling(
            e.n_samples,
            e.temperature,
            1.0,
            e.max_new_tokens,
            greedy=mode == "greedy",
            seed=derive_seed(cfg.seed, "evaluate", args.name),
        )
        samples = backend.generate(prompt_ids, sampling)
        meta[mode] = backend.metadata(sampling)
        rows += [
            {
                "policy": args.name,
                "prompt_id": ids[s.prompt_index],
                "mode": mode,
                "sample_idx": s.sample_idx,
                "response_text": s.text,
                "response_length": len(s.response_ids),
                "reward": reward_fn(s.text, answers[s.prompt_index]),
            }
            for s in samples
        ]
    df = pl.DataFrame(rows, schema=schemas.EVAL_SAMPLES.columns)
    meta["reward_timeouts"] = reward_timeouts() - timeouts_before
    if meta["reward_timeouts"]:
        log.warning(
            "%s: %d of %d reward calls ran past the reward's deadline and scored 0 (the samples' metadata: "
            "reward_timeouts)",
            args.name,
            meta["reward_timeouts"],
            df.height,
        )
    write_parquet(df, args.samples, metadata={**meta, **prompt_metadata(cfg, tok, chat, backend.stops)})
    greedy = df.filter(pl.col("mode") == "greedy")
    sampled = df.filter(pl.col("mode") == "sampled")
    summary = pl.DataFrame(
        [
            {
                "policy": args.name,
                "iteration": args.iteration,
                "greedy_accuracy": greedy["reward"].mean(),
                "sampled_accuracy": sampled["reward"].mean(),
                "k": e.n_samples,
                "mean_response_length": float(sampled["response_length"].mean()),
                "n_prompts": prompts.height,
            }
        ],
        schema=schemas.EVAL_SUMMARY.columns,
    )
    write_parquet(summary, args.summary)
    made = ScheduleState(**json.loads(Path(args.train_state).read_text())) if args.train_state else ScheduleState()
    point = summary.drop("policy", "iteration").row(0, named=True)
    curves.log("evaluate", point, made.step, args.iteration, made.tokens)
    curves.close()
    log.info(
        "%s: greedy accuracy %.3f, avg@%d %.3f, mean length %.1f",
        args.name,
        summary["greedy_accuracy"][0],
        e.n_samples,
        summary["sampled_accuracy"][0],
        summary["mean_response_length"][0],
    )
