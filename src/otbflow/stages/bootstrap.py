"""Bootstrap: build a small policy (``otbflow.models.policy``) and warm-start it on the synthetic task by
supervised training until its sampled held-out accuracy reaches ``bootstrap.target_accuracy``;
writes the HF folder and the warm-start curve. Skipped when ``model.path`` is set. Details:
docs/data.md, "A real model and dataset" (built policies)."""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass

import polars as pl
import torch
from omegaconf import DictConfig

from otbflow.algorithms.rewards import arithmetic_reward
from otbflow.algorithms.tensors import padded
from otbflow.engines import stops_of
from otbflow.engines.hf import hf_generate
from otbflow.engines.prompts import render_prompts, use_chat
from otbflow.io import atomic_dir, write_parquet
from otbflow.models.policy import build_tiny_model, build_tokenizer, encode, set_threads
from otbflow.models.tasks import TASKS, arithmetic_problem, arithmetic_prompts, arithmetic_solution, synthetic_splits
from otbflow.seeds import derive_seed

log = logging.getLogger("otbflow.bootstrap")


@dataclass
class Args:
    out: str
    """Output HF folder of the initial policy."""
    metrics: str
    """Output Parquet of the warm-start curve (step, loss, held-out sampled accuracy)."""


def sft_batch(tok, rng: random.Random, cfg: DictConfig, exclude: set[str], chat: bool) -> tuple[torch.Tensor, ...]:
    """Right-padded (input_ids, attention_mask, labels) with the loss on response tokens only."""
    t = cfg.task
    seqs, labels = [], []
    while len(seqs) < cfg.bootstrap.sft_batch_size:
        p = arithmetic_problem(rng, t.min_terms, t.max_terms, t.max_operand, t.terms_tail)
        if p in exclude:
            continue
        target, _ = arithmetic_solution(p, rng, cfg.bootstrap.slip_rate)
        (pi,) = render_prompts(tok, [p], None, chat, t.system_prompt)
        ri = encode(tok, [target])[0] + [tok.eos_token_id]
        seqs.append(pi + ri)
        labels.append([-100] * len(pi) + ri)
    mask = padded([[1] * len(s) for s in seqs], 0)
    return padded(seqs, tok.pad_token_id), mask, padded(labels, -100)


def sampled_accuracy(
    model,
    tok,
    problems: list[dict],
    seed: int,
    max_new_tokens: int,
    chat: bool,
    system_prompt: str | None,
    stops: list[int],
) -> float:
    model.eval()
    ids = render_prompts(tok, [p["prompt"] for p in problems], None, chat, system_prompt)
    samples = hf_generate(
        model, tok, ids, n=1, temperature=1.0, max_new_tokens=max_new_tokens, seed=seed, stop_ids=stops
    )
    model.train()
    return sum(arithmetic_reward(s.text, problems[s.prompt_index]["answer"]) for s in samples) / len(samples)


def generation_stops(tok, model) -> list[int]:
    """What the rollout will stop on: the tokenizer's eos, then the generation config's eos ids."""
    return stops_of(tok, model.generation_config.eos_token_id)


def tokenizer_corpus(cfg: DictConfig) -> list[str]:
    """Text the bpe tokenizer is trained on: problems with their scratchpads (own seed), and the
    chat roles and system prompt as the template writes them."""
    t = cfg.task
    rng = random.Random(derive_seed(cfg.seed, "bootstrap-tokenizer"))
    problems = [
        arithmetic_problem(rng, t.min_terms, t.max_terms, t.max_operand, t.terms_tail) for _ in range(2048)
    ]  # repeats allowed
    chat = [f"{role}\n" for role in ("system", "user", "assistant")] + ([t.system_prompt] if t.system_prompt else [])
    return [p + arithmetic_solution(p)[0] for p in problems] + chat * 16


def run(cfg: DictConfig, args: Args) -> None:
    if not TASKS[cfg.task.name].bootstrap:
        raise ValueError(
            "the bootstrap builds a policy for the synthetic task only; set model.path "
            f"to a local HF causal-LM folder for task.name={cfg.task.name}"
        )
    set_threads()
    b, t = cfg.bootstrap, cfg.task
    tok = build_tokenizer(cfg.model, tokenizer_corpus(cfg))
    model = build_tiny_model(cfg.model, tok, derive_seed(cfg.seed, "bootstrap-init"))
    chat = use_chat(cfg, tok)
    stops = generation_stops(tok, model)
    # Held-out checks use their own problems; training problems avoid them and the eval split's.
    _, eval_split = synthetic_splits(cfg)
    heldout = arithmetic_prompts(
        b.n_eval_prompts,
        derive_seed(cfg.seed, "bootstrap-heldout"),
        t.min_terms,
        t.max_terms,
        t.max_operand,
        exclude=set(eval_split["prompt"]),
        tail=t.terms_tail,
    )
    exclude = set(eval_split["prompt"]) | {p["prompt"] for p in heldout}
    rng = random.Random(derive_seed(cfg.seed, "bootstrap-sft"))
    torch.manual_seed(derive_seed(cfg.seed, "bootstrap-torch"))
    opt = torch.optim.AdamW(model.parameters(), lr=b.sft_lr, weight_decay=0.0)
    max_new = cfg.rollout.max_new_tokens
    curve = []
    acc = sampled_accuracy(
        model, tok, heldout, derive_seed(cfg.seed, "bootstrap-acc", 0), max_new, chat, t.system_prompt, stops
    )
    curve.append({"step": 0, "loss": float("nan"), "heldout_accuracy": acc, "time_s": 0.0})
    start = time.perf_counter()
    model.train()
    step = 0
    while acc < b.target_accuracy and step < b.sft_max_steps:
        step += 1
        lr = b.sft_lr * min(1.0, step / 20)  # short linear warm-up
        for g in opt.param_groups:
            g["lr"] = lr
        ids, mask, lab = sft_batch(tok, rng, cfg, exclude, chat)
        loss = model(input_ids=ids, attention_mask=mask, labels=lab).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % b.eval_every == 0:
            acc = sampled_accuracy(
                model, tok, heldout, derive_seed(cfg.seed, "bootstrap-acc", step), max_new, chat, t.system_prompt, stops
            )
            curve.append(
                {"step": step, "loss": loss.item(), "heldout_accuracy": acc, "time_s": time.perf_counter() - start}
            )
            log.info("sft step %d loss %.4f held-out sampled accuracy %.3f", step, loss.item(), acc)
    if acc < b.target_accuracy:
        log.warning(
            "warm-start stopped at sft_max_steps=%d with held-out accuracy %.3f < target %.3f",
            b.sft_max_steps,
            acc,
            b.target_accuracy,
        )
    model.eval()
    with atomic_dir(args.out) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    write_parquet(
        pl.DataFrame(curve),
        args.metrics,
        metadata={
            "target_accuracy": b.target_accuracy,
            "final_accuracy": acc,
            "steps": step,
            "arch": cfg.model.arch,
            "tokenizer": cfg.model.tokenizer,
            "vocab_size": len(tok),
            "parameters": sum(p.numel() for p in model.parameters()),
            "chat": chat,
        },
    )
