"""Rollout: sample G responses per prompt with the current policy and score them.

Backends (``rollout.backend``), both writing the same table:

- 'hf': transformers ``generate`` (CPU or GPU). The rollout log-prob of each sampled token is
  log_softmax(logits / temperature) of the engine's raw logits, i.e. before top-p, so that it
  is directly comparable with the trainer's log-probs in the features stage.
- 'vllm': ``vllm.LLM.generate`` with n samples per prompt on GPUs, in its own environment
  (envs/vllm.yaml); see otbflow.vllm_engine for which log-probs it returns.
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
from otbflow.config import derive_seed
from otbflow.io import read_table, write_parquet
from otbflow.model import encode, load_policy, set_threads
from otbflow.rewards import get_reward, resolve_reward_name

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


@dataclass
class Sample:
    prompt_index: int
    sample_idx: int
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str


@torch.no_grad()
def hf_generate(model, tok, prompts: list[str], n: int, temperature: float = 1.0, top_p: float = 1.0,
                max_new_tokens: int = 48, greedy: bool = False, batch_size: int = 64,
                seed: int = 0) -> list[Sample]:
    """Sample ``n`` responses for each prompt (greedy: one). Deterministic on CPU for a seed."""
    torch.manual_seed(seed)
    eos = tok.eos_token_id
    ids = encode(tok, prompts)
    out: list[Sample] = []
    n = 1 if greedy else n
    for start in range(0, len(prompts), batch_size):
        batch = ids[start:start + batch_size]
        width = max(len(x) for x in batch)
        pad = tok.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in batch], device=model.device)
        attention = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in batch], device=model.device)
        gen_kwargs = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=temperature,
                                                             top_p=top_p, top_k=0)
        res = model.generate(input_ids=input_ids, attention_mask=attention, max_new_tokens=max_new_tokens,
                             num_return_sequences=n, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=pad, eos_token_id=eos, **gen_kwargs)
        new = res.sequences[:, width:]
        # log-prob of each sampled token under the raw, temperature-scaled distribution
        t = 1.0 if greedy else temperature
        lp = torch.stack([torch.log_softmax(step.float() / t, dim=-1).gather(-1, new[:, i:i + 1]).squeeze(-1)
                          for i, step in enumerate(res.logits)], dim=1)
        for row in range(new.shape[0]):
            toks = new[row].tolist()
            if eos in toks:
                length, reason = toks.index(eos) + 1, "stop"
            else:
                length, reason = len(toks), "length"
            pi = start + row // n
            out.append(Sample(pi, row % n, ids[pi], toks[:length], lp[row, :length].tolist(), reason,
                              tok.decode(toks[:length], skip_special_tokens=True)))
    return out


def generate_samples(cfg: DictConfig, policy: str, prompts: list[str], n: int, temperature: float, top_p: float,
                     max_new_tokens: int, greedy: bool, seed: int) -> tuple[list[Sample], dict]:
    """Samples from the configured backend, and metadata describing how they were made."""
    r = cfg.rollout
    if r.backend == "vllm":
        from transformers import AutoTokenizer

        from otbflow import vllm_engine

        tok = AutoTokenizer.from_pretrained(policy, local_files_only=True)
        return vllm_engine.generate(policy, encode(tok, prompts), tok.eos_token_id, n, temperature, top_p,
                                    max_new_tokens, greedy, seed, cfg.model.dtype, r.tensor_parallel_size,
                                    r.gpu_memory_utilization)
    import transformers

    model, tok = load_policy(policy, cfg.model.dtype)
    samples = hf_generate(model, tok, prompts, n, temperature, top_p, max_new_tokens, greedy, r.batch_size, seed)
    return samples, {"transformers_version": transformers.__version__,
                     "sampling": {"n": n, "temperature": temperature, "top_p": top_p, "top_k": 0,
                                  "max_new_tokens": max_new_tokens, "greedy": greedy}}


def select_prompts(df: pl.DataFrame, iteration: int, per_shard: int) -> pl.DataFrame:
    """The iteration's window of a shard: consecutive rows, cycling through the shard."""
    n = df.height
    rows = [(iteration * per_shard + i) % n for i in range(min(per_shard, n))]
    return df[rows]


def rollout_table(samples: list[Sample], batch: pl.DataFrame, iteration: int, shard: int, seed: int,
                  reward_fn) -> pl.DataFrame:
    """The rollouts table (schemas.ROLLOUTS) of any backend's samples of ``batch``'s prompts."""
    rows = batch.to_dicts()
    return pl.DataFrame({
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
    }, schema=schemas.ROLLOUTS.columns)


def run(cfg: DictConfig, args: Args) -> None:
    set_threads()
    prompts = read_table(args.prompts, schemas.PROMPTS)
    shard = int(prompts["shard"][0]) if prompts.height else 0
    per_shard = args.n_prompts or math.ceil(cfg.rollout.prompts_per_iteration / cfg.shard.n_shards)
    batch = select_prompts(prompts, args.iteration, per_shard)
    r = cfg.rollout
    seed = derive_seed(cfg.seed, "rollout", args.iteration, shard)
    samples, engine_meta = generate_samples(cfg, args.policy, batch["prompt"].to_list(), r.group_size, r.temperature,
                                            r.top_p, r.max_new_tokens, greedy=False, seed=seed)
    reward_fn = get_reward(resolve_reward_name(cfg.task.name, cfg.task.reward))
    df = rollout_table(samples, batch, args.iteration, shard, seed, reward_fn)
    meta = {"backend": r.backend, "policy": str(Path(args.policy)), "iteration": args.iteration, "seed": seed,
            "torch_version": torch.__version__, **engine_meta}
    write_parquet(df, args.out, metadata=meta)
    log.info("iteration %d shard %d: %d responses, mean reward %.3f, mean length %.1f", args.iteration, shard,
             df.height, df["reward"].mean(), df["response_length"].mean())
