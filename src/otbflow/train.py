"""Train: one policy update with DeepSpeed, from an iteration's advantages.

Input is the advantages table: per response token the sampled id, pi_old's log-prob (the
``logprobs`` column of the features stage), the rollout engine's log-prob, the proxy energy and
the advantage A_t. For ``train.ppo_epochs`` passes over the rows, in a seeded shuffled order,
each mini-batch of ``train.mini_batch_size`` sequences (the last, partial one included) is one
optimizer step, accumulated over micro-batches of ``train.micro_batch_size`` sequences per rank.

- log pi_theta(y_t) is computed as the features stage computes pi_old: the prompt and response
  are right-padded together, the temperature-scaled logits (``rollout.temperature``) are taken at
  the positions that predict response tokens (len(prompt) - 1 + t), with the same module mode
  (eval: dropout off, as in the features stage) and precision (fp32, or bf16 with ``train.bf16``,
  which the features stage then uses too), and the same fp32 arithmetic, so the first ratio of an
  iteration is 1 (``max_abs_log_ratio`` in the metrics).
- Memory: the output head and the log-softmax run over chunks of ``train.logprob_chunk_size``
  response positions, each under activation checkpointing: the graph keeps only the chunk's
  hidden states and per-token results, and the backward recomputes one chunk's logits at a time;
  no [tokens x V] tensor exists (``benchmarks/bench_train_memory.py``). The entropy is computed
  in the same pass, with a gradient only for an entropy bonus.
- Policy loss (``train.loss_type``, algorithms.md §6.3-6.4), r_t = exp(clamp(log pi_theta -
  log pi_old, +-20)):
  - ``ppo_clip``: L_t = max(-A r, -A clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high)), and for
    A < 0 the dual clip L_t = min(L_t, -A clip_ratio_c); times the rollout IS weight w_t.
  - ``reinforce``: L_t = -A_t log pi_theta(y_t) sg(w_t) (REINFORCE in bypass mode).
- Rollout correction (``train.rollout_is``): truncated IS weights w = min(rho, C), token- or
  sequence-level, stop-gradient, rho = pi_old / pi_rollout from the stored log-probs for
  ppo_clip (decoupled) and pi_theta / pi_rollout for reinforce (bypass); none: w = 1.
  ``train.trm`` (Trust Region Masking) removes every sequence whose max k2 or mean k3 against
  the rollout engine exceeds ``mismatch.max_k2`` / ``mismatch.mean_k3`` from the loss while the
  normalisers keep the pre-mask counts, as the paper's 1/N does (algorithms.md §3.3).
- Optional terms: ``kl_coef`` x k3 estimate of KL(pi_theta || pi_ref) (verl's low_var_kl, pi_ref
  the initial policy) and ``- entropy_coef`` x entropy.
- ``aggregate_loss`` (the one shared aggregation) divides every micro-batch by counts of the
  whole optimizer step's batch, so accumulating micro-batches and ranks gives the gradient of
  one big batch. An optional ``loss_mask`` list column (1 = train on the token) removes tokens
  from the loss and from those counts.

Learning rate: ``otbflow.lr_schedule`` (constant, cosine, response-length-triggered decay), its
state read from the previous iteration (``--prev-state``) and written for the next (``--state``).
Optimizer: the AdamW state (moments and step counts, with bf16 also ZeRO's fp32 master weights)
is written as a DeepSpeed checkpoint (``--optimizer``, ZeRO-sharded as DeepSpeed saves it) and
loaded by the next iteration (``--prev-optimizer``), so the iterations form one optimizer run;
``train.reset_optimizer`` starts every iteration from a fresh AdamW instead. The stored state
must come from the same world size, ZeRO stage and bf16 setting, and from the job that wrote
``--policy``: anything else is refused before training starts.

Robustness (checkpoints, optimizer state and the written policy: ``otbflow.train_state``):
gradients are clipped at ``max_grad_norm``. A step whose loss or gradient is not
finite is skipped (no update, logged, ``skipped`` in the metrics; under ZeRO >= 1 DeepSpeed's own
overflow check skips it); ``max_consecutive_skips`` in a row fail the job. Every
``checkpoint_every`` steps a DeepSpeed checkpoint (weights, optimizer, data position, schedule,
RNG, metrics so far) goes to ``--checkpoint-dir``, outside the Snakemake outputs; a rerun with
the same inputs and config resumes from the latest one and ends with the same weights as an
uninterrupted run. It is deleted when the stage finishes.

Metrics per optimizer step (table 'train metrics'): loss, clip fraction, grad norm, lr, entropy,
k3 KL to pi_old (and to pi_ref), IS weight mean/max, TRM acceptance and |log-PPL gap|, tokens and
sequences, mean response length, verl's variance proxies S, P, V, and skip/LR events.

The next policy is written as an HF folder of fp32 weights (with bf16, ZeRO's fp32 master
weights; bf16 therefore needs zero_stage >= 1) with the input policy's tokenizer.

Launch: ``otbflow train ...`` as one process, or one process per device under ``torchrun``,
the ``deepspeed`` launcher (``--no_local_rank``) or Slurm's ``srun`` (the Slurm variables are
mapped to RANK / LOCAL_RANK / WORLD_SIZE here; DeepSpeed does not do it itself).
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
import torch
from omegaconf import DictConfig

from otbflow import schemas
from otbflow.advantages import total_power, variance_proxies
from otbflow.config import derive_seed
from otbflow.io import SchemaError, read_table, write_json, write_parquet
from otbflow.logits import ResponseLogits, pack
from otbflow.lr_schedule import LRSchedule
from otbflow.model import set_threads
from otbflow.rollout_is import rollout_is_weights
from otbflow.train_state import (
    Checkpoints,
    OptimizerStateError,
    check_optimizer_state,
    fingerprint,
    full_fp32_state_dict,
    load_optimizer_state,
    optimizer_layout,
    policy_digest,
    save_optimizer_state,
    save_policy,
)

log = logging.getLogger("otbflow.train")
SECTIONS = ("train", "rollout", "mismatch", "model")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass
class Args:
    advantages: str
    """Advantages Parquet (table 'advantages') of one iteration."""
    policy: str
    """HF folder of the policy that sampled the rollouts (pi_old); training starts from it."""
    out: str
    """Output HF folder of the next policy (model and tokenizer)."""
    metrics: str
    """Output Parquet with one row per optimizer step (table 'train metrics')."""
    iteration: int = 0
    """RL iteration k (seeds the data order, labels the metrics)."""
    state: str = ""
    """Output JSON of the LR schedule's state after this iteration (for the next one's --prev-state)."""
    prev_state: str = ""
    """The previous iteration's --state JSON: the LR schedule resumes from it. Empty: a fresh schedule."""
    reference: str = ""
    """HF folder of the reference policy of the KL term (train.kl_coef > 0), e.g. the initial policy."""
    checkpoint_dir: str = ""
    """Folder of the resumable checkpoints (not an output). Empty: a 'checkpoint' folder beside --out."""
    optimizer: str = ""
    """Output folder of the optimizer state after this iteration (a DeepSpeed checkpoint, for the next
    one's --prev-optimizer). Empty: not written."""
    prev_optimizer: str = ""
    """The previous iteration's --optimizer folder: AdamW resumes from it (same world size, ZeRO stage
    and bf16). Empty: a fresh optimizer."""


# ------------------------------------------------------------------------------------------
# Losses
# ------------------------------------------------------------------------------------------


def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    clip_low: float,
    clip_high: float,
    clip_ratio_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)), with the dual
    clip min(L, -A clip_ratio_c) for A < 0 when ``clip_ratio_c`` is given; and the mask of tokens
    where a clip is active (the loss is flat in r there: no gradient)."""
    ratio = torch.exp(torch.clamp(logp - old_logp, -20.0, 20.0))
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss, active = torch.maximum(unclipped, clipped), clipped > unclipped
    if clip_ratio_c is not None:
        dual = -adv * clip_ratio_c
        lower = (adv < 0) & (dual < loss)
        loss, active = torch.where(lower, dual, loss), active | lower
    return loss, active


def reinforce_loss(logp: torch.Tensor, adv: torch.Tensor, is_weights: torch.Tensor) -> torch.Tensor:
    """L_t = -A_t log pi_theta(y_t) sg(w_t) (algorithms.md §6.4)."""
    return -adv * logp * is_weights.detach()


def low_var_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 estimate of KL(pi_theta || pi_ref) per token: exp(d) - d - 1, d = log pi_ref - log pi_theta,
    clamped to [-10, 10] (verl's low_var_kl); >= 0, gradient through pi_theta."""
    d = torch.clamp(ref_logp - logp, -20.0, 20.0)
    return torch.clamp(torch.exp(d) - d - 1.0, -10.0, 10.0)


def aggregate_loss(
    token_loss: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    global_tokens: int,
    global_seqs: int,
    scale: float = 1.0,
    seq_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """This micro-batch's share of the optimizer step's loss (algorithms.md §6.3).

    ``token_loss`` and ``mask`` are [B, T]. ``global_tokens`` (valid tokens) and ``global_seqs``
    (sequences with at least one valid token) count the whole step's batch over all micro-batches
    and ranks, so the shares of all micro-batches add up to the full-batch value:

    - token-mean:              sum_{i,t} m L / global_tokens
    - seq-mean-token-sum:      sum_i sum_t m L / global_seqs
    - seq-mean-token-mean:     sum_i (sum_t m L / (T_i + 1e-8)) / global_seqs
    - seq-mean-token-sum-norm: sum_i sum_t m L / global_seqs / scale   (Dr.GRPO's constant C;
      the Aug-2026 verl form, which keeps the 1/N_seq)

    T_i is ``seq_tokens`` (default: sum_t m). Masking a sequence out of the loss (TRM) while
    keeping it in the counts is done by zeroing its ``token_loss`` rows.
    """
    m = mask.to(token_loss.dtype)
    per_seq = (token_loss * m).sum(-1)
    if mode == "token-mean":
        return per_seq.sum() / max(global_tokens, 1)
    if mode == "seq-mean-token-sum":
        return per_seq.sum() / max(global_seqs, 1)
    if mode == "seq-mean-token-mean":
        t = m.sum(-1) if seq_tokens is None else seq_tokens
        return (per_seq / (t + 1e-8)).sum() / max(global_seqs, 1)
    if mode == "seq-mean-token-sum-norm":
        return per_seq.sum() / max(global_seqs, 1) / scale
    raise ValueError(f"unknown loss_agg_mode {mode!r}; one of {', '.join(LOSS_AGG_MODES)}")


def trm_keep(seq_max_k2: np.ndarray, seq_mean_k3: np.ndarray, max_k2: float, mean_k3: float) -> np.ndarray:
    """TRM-Max and TRM-Avg together: 1.0 for accepted sequences, 0.0 for masked ones."""
    return ((seq_max_k2 <= max_k2) & (seq_mean_k3 <= mean_k3)).astype(np.float64)


# ------------------------------------------------------------------------------------------
# Log-probs of the current policy (the features stage's arithmetic, with grad, in chunks)
# ------------------------------------------------------------------------------------------


def logit_stats(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, entropy_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log pi(y_t), entropy) of rows of logits [n, V] at ``targets`` [n], with the features
    stage's fp32 arithmetic (``logits.token_stats``): z = logits / temperature, m = max z,
    e = exp(z - m), s = sum e; log pi = z_y - m - log s and entropy = m + log s - sum e z / s.
    m is a constant for autograd (it cancels). The entropy carries a gradient only with
    ``entropy_grad`` (an entropy bonus)."""
    z = logits.float() / temperature
    m = torch.amax(z, dim=-1, keepdim=True).detach()
    e = torch.exp(z - m)
    s = e.sum(-1)
    log_s = torch.log(s)
    m = m.squeeze(-1)
    logp = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - m - log_s
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        ez = torch.bmm(e.unsqueeze(1), z.unsqueeze(2)).reshape(-1)
        entropy = m + log_s - ez / s
    return logp, entropy


def _head_stats(head, hidden, targets, temperature: float, entropy_grad: bool):
    return logit_stats(head(hidden), targets, temperature, entropy_grad)


def response_token_stats(
    model,
    input_ids,
    attention_mask,
    rows,
    pos,
    targets,
    temperature: float,
    chunk_size: int = 256,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log pi(y_t), entropy) of every response token, flattened, computed over chunks of
    ``chunk_size`` tokens. The transformer body runs once; the output head and ``logit_stats``
    run per chunk, under activation checkpointing when gradients are on: the graph keeps each
    chunk's hidden states [chunk, H] and its per-token results, never its logits, and the
    backward recomputes one chunk's logits at a time. Peak: a few chunk x V fp32 tensors instead
    of several [tokens x V] ones. The head is called as a module inside the caller's forward, so
    ZeRO-3 gathers its weight for every chunk (and again for the recomputation).

    Models whose logits are post-processed (soft-capping) return full logits from their own
    forward: then only the statistics are chunked."""
    from torch.utils.checkpoint import checkpoint

    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "rows": rows, "pos": pos}
    project = ResponseLogits(model, batch)
    logps, entropies = [], []
    for start in range(0, len(targets), chunk_size):
        sl = slice(start, start + chunk_size)
        if project.head is None:
            out = logit_stats(project(sl), targets[sl], temperature, entropy_grad)
        elif torch.is_grad_enabled():
            out = checkpoint(
                _head_stats,
                project.head,
                project.hidden(sl),
                targets[sl],
                temperature,
                entropy_grad,
                use_reentrant=False,
                preserve_rng_state=False,
            )
        else:
            out = _head_stats(project.head, project.hidden(sl), targets[sl], temperature, entropy_grad)
        logps.append(out[0])
        entropies.append(out[1])
    if not logps:
        empty = torch.zeros(0, device=input_ids.device)
        return empty, empty
    return torch.cat(logps), torch.cat(entropies)


class ResponseLogprobs(torch.nn.Module):
    """The policy with a forward that returns ``response_token_stats``. DeepSpeed wraps this
    module, so that the whole computation runs inside ``engine(...)`` (ZeRO's hooks)."""

    def __init__(self, policy, chunk_size: int):
        super().__init__()
        self.policy = policy
        self.chunk_size = chunk_size

    def forward(self, input_ids, attention_mask, rows, pos, targets, temperature: float, entropy_grad: bool = False):
        return response_token_stats(
            self.policy, input_ids, attention_mask, rows, pos, targets, temperature, self.chunk_size, entropy_grad
        )


def to_padded(flat: torch.Tensor, batch: dict[str, torch.Tensor], n_rows: int) -> torch.Tensor:
    """Scatter flat per-token values into [n_rows, longest response], zeros elsewhere
    (differentiable)."""
    width = int(batch["cols"].max()) + 1 if len(batch["cols"]) else 0
    return flat.new_zeros(n_rows, width).index_put((batch["rows"], batch["cols"]), flat)


def policy_logprobs(
    model,
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    temperature: float,
    pad_id: int,
    chunk_size: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log pi(y_t) [B, T] zero-padded, mask [B, T]) of an HF causal LM, differentiable."""
    batch = pack(prompt_ids, response_ids, pad_id, model.device)
    logp, _ = response_token_stats(
        model,
        batch["input_ids"],
        batch["attention_mask"],
        batch["rows"],
        batch["pos"],
        batch["targets"],
        temperature,
        chunk_size,
    )
    mask = to_padded(torch.ones_like(logp), batch, len(response_ids)).bool()
    return to_padded(logp, batch, len(response_ids)), mask


def pad_right(lists: list[list[float]], width: int, device) -> torch.Tensor:
    return torch.tensor([list(x) + [0.0] * (width - len(x)) for x in lists], dtype=torch.float32, device=device)


# ------------------------------------------------------------------------------------------
# DeepSpeed
# ------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _slurm_master_addr() -> str:
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout.split()
        return out[0] if out else "127.0.0.1"
    except (KeyError, OSError, subprocess.SubprocessError):
        return "127.0.0.1"


def init_distributed_env() -> tuple[int, int]:
    """Set the torch.distributed variables DeepSpeed needs; returns (rank, world_size).

    - A launcher (torchrun, deepspeed) already set RANK: keep everything.
    - Under srun (SLURM_PROCID set): RANK / LOCAL_RANK / WORLD_SIZE from SLURM_PROCID /
      SLURM_LOCALID / SLURM_NTASKS, MASTER_ADDR the first node of the job, MASTER_PORT derived
      from the job id (the same on every rank).
    - Otherwise one process: rank 0 of 1 on 127.0.0.1 and a free port.

    DS_ACCELERATOR=cpu is set when there is no CUDA (before deepspeed is imported).
    """
    env = os.environ
    if "RANK" not in env and "SLURM_PROCID" in env:
        env["RANK"] = env["SLURM_PROCID"]
        env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
        env["WORLD_SIZE"] = env.get("SLURM_NTASKS", "1")
        env.setdefault("MASTER_ADDR", _slurm_master_addr())
        env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
    elif "RANK" not in env:
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    env.setdefault("LOCAL_RANK", "0")
    if not torch.cuda.is_available():
        env.setdefault("DS_ACCELERATOR", "cpu")
    return int(env["RANK"]), int(env["WORLD_SIZE"])


def skip_cpu_shm_op() -> None:
    """On CPU, DeepSpeed's communication backend JIT-compiles a shared-memory all-reduce op when
    it starts (about a minute of C++ on 2 cores, in the first train job) and takes a ``lock``
    file in torch's extension cache on every load, which a killed job (preempted, ``kill -9``)
    leaves behind for every later job to wait on forever. That op serves only
    ``inference_all_reduce`` (tensor-parallel inference); training's all-reduce goes through
    torch.distributed (gloo) either way. Marked unavailable, it is neither built nor loaded."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def deepspeed_config(tc: DictConfig, world_size: int) -> dict:
    """DeepSpeed config from the train section. The accumulation boundary is set explicitly
    per mini-batch (the last one may be partial), so gradient_accumulation_steps is nominal."""
    return {
        "train_micro_batch_size_per_gpu": tc.micro_batch_size,
        "gradient_accumulation_steps": max(1, tc.mini_batch_size // (tc.micro_batch_size * world_size)),
        "optimizer": {"type": "AdamW", "params": {"lr": tc.lr, "weight_decay": tc.weight_decay, "torch_adam": True}},
        "gradient_clipping": tc.max_grad_norm,
        "zero_optimization": {"stage": tc.zero_stage},
        "bf16": {"enabled": bool(tc.bf16)},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def build_engine(policy_dir: str, tc: DictConfig, world_size: int):
    import deepspeed
    from transformers import AutoModelForCausalLM

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    policy = AutoModelForCausalLM.from_pretrained(policy_dir, local_files_only=True, dtype=torch.float32)
    # Eval mode, as in the features stage: no dropout (nor any other train-only randomness), so that
    # log pi_theta at the first step is the stored log pi_old. verl keeps dropout out of RL too
    # (its supported models have zero dropout, `override_config` exists "mainly [for] dropout",
    # its Megatron attention hard-codes dropout_rate = 0.0); eval() also covers models whose
    # checkpoints do set dropout, such as GPT-2's 0.1. Gradients are unaffected by the mode.
    module = ResponseLogprobs(policy, tc.logprob_chunk_size).eval()
    skip_cpu_shm_op()  # the op is CPU-only: nothing changes on GPUs
    engine, *_ = deepspeed.initialize(
        model=module, model_parameters=module.parameters(), config=deepspeed_config(tc, world_size)
    )
    return engine


def param_grad_norm(module) -> float | None:
    """L2 norm of the .grad of all parameters (None when no parameter holds one, as under ZeRO)."""
    grads = [p.grad.detach().float() for p in module.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))) if grads else None


# ------------------------------------------------------------------------------------------
# Training loop
# ------------------------------------------------------------------------------------------


SUMS = ("loss", "clipped", "entropy", "k3", "kl_ref", "is_w", "power", "bad")
MAXES = ("is_w", "log_ratio")


def micro_step(
    engine,
    ref_model,
    data: dict,
    rows: list[int],
    weight: float,
    cfg: DictConfig,
    pad_id: int,
    global_tokens: int,
    global_seqs: int,
    world_size: int,
) -> tuple[dict[str, float], dict[str, float]]:
    """Forward and backward of one micro-batch; returns its sums and its maxima (largest IS
    weight, largest |log pi_theta - log pi_old|) for the step's metrics. ``weight`` 0 turns it
    into a no-op that still runs the collectives (empty rank slice)."""
    tc = cfg.train
    dev = engine.device
    batch = pack([data["prompt_ids"][i] for i in rows], [data["response_ids"][i] for i in rows], pad_id, dev)
    flat_logp, flat_entropy = engine(
        batch["input_ids"],
        batch["attention_mask"],
        batch["rows"],
        batch["pos"],
        batch["targets"],
        cfg.rollout.temperature,
        tc.entropy_coef > 0,
    )
    logp = to_padded(flat_logp, batch, len(rows))
    width = logp.shape[1]

    def column(name: str) -> torch.Tensor:
        return pad_right([data[name][i] for i in rows], width, dev)

    old_logp, adv = column("logprobs"), column("advantages")
    mask = column("loss_mask") * weight
    keep = torch.tensor([[data["keep"][i]] for i in rows], dtype=torch.float32, device=dev)
    is_base = old_logp if tc.loss_type == "ppo_clip" else logp  # decoupled vs bypass (algorithms.md §6.5)
    is_w = rollout_is_weights(is_base - column("rollout_logprobs"), mask, tc.rollout_is, tc.rollout_is_threshold)
    if tc.loss_type == "ppo_clip":
        token_loss, clipped = ppo_clip_loss(logp, old_logp, adv, tc.clip_ratio_low, tc.clip_ratio_high, tc.clip_ratio_c)
        token_loss = token_loss * is_w
    else:
        token_loss, clipped = reinforce_loss(logp, adv, is_w), torch.zeros_like(mask, dtype=torch.bool)
    entropy = to_padded(flat_entropy, batch, len(rows))
    if tc.entropy_coef > 0:
        token_loss = token_loss - tc.entropy_coef * entropy
    kl_ref = torch.zeros_like(mask)
    if ref_model is not None:
        with torch.no_grad():
            ref_flat, _ = response_token_stats(
                ref_model,
                batch["input_ids"],
                batch["attention_mask"],
                batch["rows"],
                batch["pos"],
                batch["targets"],
                cfg.rollout.temperature,
                tc.logprob_chunk_size,
            )
        kl_ref = low_var_kl(logp, to_padded(ref_flat, batch, len(rows)))
        token_loss = token_loss + tc.kl_coef * kl_ref
    scale = tc.loss_scale_factor or cfg.rollout.max_new_tokens
    loss = aggregate_loss(token_loss * keep, mask, tc.loss_agg_mode, global_tokens, global_seqs, scale)
    # DeepSpeed averages gradients over ranks, and scale_wrt_gas=False stops it from also
    # dividing by the accumulation steps: the step-wide normalisers already did both.
    engine.backward(loss * world_size, scale_wrt_gas=False)

    with torch.no_grad():
        log_ratio = torch.clamp(logp - old_logp, -20.0, 20.0)
        k3 = torch.exp(log_ratio) - 1.0 - log_ratio  # r - 1 - log r, r = pi_theta / pi_old
        n_tok = mask.sum(-1)
        t = n_tok.clamp_min(1e-12)
        w_hat = (column("proxy") * mask).sum(-1)
        abar = (adv * mask).sum(-1) / t
        rho = (is_w * mask).sum(-1) / t if tc.rollout_is != "none" else None
        to_np = lambda x: x.double().cpu().numpy()  # noqa: E731
        power = total_power(to_np(w_hat), to_np(abar), None if rho is None else to_np(rho)) * len(rows) * weight
        sums = {
            "loss": float(loss.detach()),
            "clipped": float((clipped * mask).sum()),
            "entropy": float((entropy * mask).sum()),
            "k3": float((k3 * mask).sum()),
            "kl_ref": float((kl_ref * mask).sum()),
            "is_w": float((is_w * mask).sum()),
            "power": power,
            "bad": 0.0 if math.isfinite(float(loss.detach())) else 1.0,
        }
        valid = mask > 0
        maxes = {
            "is_w": float(is_w[valid].max()) if valid.any() else 0.0,
            "log_ratio": float((logp - old_logp).abs()[valid].max()) if valid.any() else 0.0,
        }
    return sums, maxes


def all_reduce(values: list[float], world_size: int, device, op: str = "sum") -> list[float]:
    if world_size == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    torch.distributed.all_reduce(
        t, op=torch.distributed.ReduceOp.SUM if op == "sum" else torch.distributed.ReduceOp.MAX
    )
    return t.tolist()


def grads_finite(module) -> bool:
    return all(bool(torch.isfinite(p.grad).all()) for p in module.parameters() if p.grad is not None)


def train_step(
    engine, ref_model, data: dict, mini: list[int], cfg: DictConfig, pad_id: int, rank: int, world_size: int, lr: float
) -> dict:
    """One optimizer step on the mini-batch ``mini`` (row indices; every rank gets the same list
    and takes every world_size-th row) at learning rate ``lr``."""
    tc = cfg.train
    for group in engine.optimizer.param_groups:
        group["lr"] = lr
    mask_sums = [sum(data["loss_mask"][i]) for i in mini]
    global_tokens = int(sum(mask_sums))  # pre-TRM counts: masked sequences count, as the paper's 1/N
    global_seqs = sum(1 for s in mask_sums if s > 0)
    local = mini[rank::world_size]
    n_micro = math.ceil(math.ceil(len(mini) / world_size) / tc.micro_batch_size)  # the same on every rank
    sums = dict.fromkeys(SUMS, 0.0)
    maxes = dict.fromkeys(MAXES, 0.0)
    norm_before_step = None
    for j in range(n_micro):
        rows = local[j * tc.micro_batch_size : (j + 1) * tc.micro_batch_size]
        last = j == n_micro - 1
        engine.set_gradient_accumulation_boundary(last)
        out, mx = micro_step(
            engine,
            ref_model,
            data,
            rows or mini[:1],
            1.0 if rows else 0.0,
            cfg,
            pad_id,
            global_tokens,
            global_seqs,
            world_size,
        )
        sums = {k: sums[k] + out[k] for k in SUMS}
        maxes = {k: max(maxes[k], mx[k]) for k in MAXES}
        if last:
            if tc.zero_stage == 0 and not grads_finite(engine.module):
                sums["bad"] += 1.0
            norm_before_step = param_grad_norm(engine.module)  # fp32 without ZeRO reports no norm
    sums = dict(zip(SUMS, all_reduce([sums[k] for k in SUMS], world_size, engine.device)))
    maxes = dict(zip(MAXES, all_reduce([maxes[k] for k in MAXES], world_size, engine.device, op="max")))
    if sums["bad"] and tc.zero_stage == 0:
        engine.zero_grad()  # discard the step; ZeRO >= 1 runs its own overflow check in step()
        skipped, norm = True, float("nan")
    else:
        before = engine.skipped_steps
        engine.step()
        skipped = engine.skipped_steps > before
        norm = engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else norm_before_step
        norm = float("nan") if norm is None or skipped else norm
    tokens = max(global_tokens, 1)
    accept = np.asarray([data["accept"][i] for i in mini])
    return {
        "loss": sums["loss"],
        "clip_fraction": sums["clipped"] / tokens,
        "grad_norm": norm,
        "lr": float(engine.get_lr()[0]),  # what the optimizer used
        "entropy": sums["entropy"] / tokens,
        "approx_kl": sums["k3"] / tokens,
        "max_abs_log_ratio": maxes["log_ratio"],
        "kl_ref": sums["kl_ref"] / tokens,
        "is_weight_mean": sums["is_w"] / tokens,
        "is_weight_max": maxes["is_w"],
        "trm_acceptance": float(accept.mean()),
        "log_ppl_abs_diff": float(np.mean([data["log_ppl_abs_diff"][i] for i in mini])),
        "tokens": global_tokens,
        "sequences": len(mini),
        "mean_response_length": float(np.mean([len(data["response_ids"][i]) for i in mini])),
        **variance_proxies(sums["power"] / len(mini), norm, len(mini)),
        "skipped": skipped,
    }


def load_rows(path: str, cfg: DictConfig) -> dict:
    """The columns training uses, as Python lists and arrays; loss_mask is all ones when
    absent. ``accept`` is the TRM verdict of each sequence, ``keep`` what the loss uses (all
    ones unless train.trm)."""
    df = read_table(path, schemas.ADVANTAGES)
    data = {
        c: df[c].to_list()
        for c in ("prompt_ids", "response_ids", "logprobs", "rollout_logprobs", "advantages", "proxy")
    }
    if "loss_mask" in df.columns:
        data["loss_mask"] = df["loss_mask"].cast(pl.List(pl.Float64)).to_list()
    else:
        data["loss_mask"] = [[1.0] * len(r) for r in data["response_ids"]]
    data["log_ppl_abs_diff"] = df["log_ppl_abs_diff"].to_list()
    data["accept"] = trm_keep(
        df["seq_max_k2"].to_numpy(), df["seq_mean_k3"].to_numpy(), cfg.mismatch.max_k2, cfg.mismatch.mean_k3
    )
    data["keep"] = data["accept"] if cfg.train.trm else np.ones(df.height)
    return data


def mini_batches(n: int, tc: DictConfig, seed: int) -> list[list[int]]:
    """Every optimizer step's row indices: ppo_epochs passes, each in a seeded shuffled order."""
    order_rng = torch.Generator().manual_seed(seed)
    plan = []
    for _ in range(tc.ppo_epochs):
        order = torch.randperm(n, generator=order_rng).tolist()
        plan += [order[s : s + tc.mini_batch_size] for s in range(0, n, tc.mini_batch_size)]
    return plan


def _destroy_process_group() -> None:
    """At exit: NCCL warns about (and may leak) a process group that was never destroyed."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def load_reference(path: str, device):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32).to(device)
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def run(cfg: DictConfig, args: Args) -> None:
    set_threads()
    tc = cfg.train
    data = load_rows(args.advantages, cfg)
    n = len(data["response_ids"])
    if n == 0:
        raise SchemaError(f"{args.advantages}: no rows to train on")
    if tc.kl_coef > 0 and not args.reference:
        raise SchemaError("train.kl_coef > 0 needs --reference, the reference policy (e.g. the initial one)")
    if tc.reset_optimizer and args.prev_optimizer:
        raise OptimizerStateError(
            f"train.reset_optimizer is true but --prev-optimizer {args.prev_optimizer} was given: drop one of them"
        )
    rank, world_size = init_distributed_env()
    if args.prev_optimizer:
        prev_meta = check_optimizer_state(args.prev_optimizer, tc, world_size, args.policy)  # before any work
    seed = derive_seed(cfg.seed, "train", args.iteration)
    torch.manual_seed(seed)
    engine = build_engine(args.policy, tc, world_size)
    if args.prev_optimizer:
        load_optimizer_state(engine, args.prev_optimizer)
        if rank == 0:
            log.info(
                "AdamW resumes from %s (%s optimizer steps before this iteration)",
                args.prev_optimizer,
                prev_meta.get("optimizer_steps"),
            )
    atexit.register(_destroy_process_group)
    ref_model = load_reference(args.reference, engine.device) if tc.kl_coef > 0 else None
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.policy, local_files_only=True)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    plan = mini_batches(n, tc, seed)
    schedule = LRSchedule.from_dict(tc, json.loads(Path(args.prev_state).read_text()) if args.prev_state else None)
    schedule.set_horizon(len(plan), cfg.iterations)
    fp = fingerprint(cfg, args, world_size)
    ckpt = Checkpoints(
        args.checkpoint_dir or str(Path(args.out).with_name("checkpoint")), fp, tc.checkpoint_every, rank, world_size
    )
    metrics: list[dict] = []
    start, skips = 0, 0
    client = ckpt.load(engine)
    if client is not None:
        metrics, start, skips = client["metrics"], client["next_step"], client["consecutive_skips"]
        schedule = LRSchedule.from_dict(tc, client["schedule"])
        torch.set_rng_state(client["torch_rng"])
        if rank == 0:
            log.warning("resuming from the checkpoint in %s after step %d of %d", ckpt.folder, start, len(plan))

    for i in range(start, len(plan)):
        t0 = time.perf_counter()
        m = train_step(engine, ref_model, data, plan[i], cfg, pad_id, rank, world_size, schedule.lr())
        events = ["skipped: non-finite loss or gradient"] if m["skipped"] else []
        events += [e for e in [schedule.observe(m["mean_response_length"])] if e]
        skips = skips + 1 if m["skipped"] else 0
        metrics.append(
            {
                "iteration": args.iteration,
                "step": i,
                **m,
                "event": "; ".join(events),
                "step_time_s": time.perf_counter() - t0,
            }
        )
        if rank == 0:
            for e in events:
                log.warning("step %d: %s", i, e)
            log.info(
                "step %d/%d: loss %.5f grad_norm %.4f lr %.2e clip %.3f kl %.2e entropy %.3f trm %.2f",
                i + 1,
                len(plan),
                m["loss"],
                m["grad_norm"],
                m["lr"],
                m["clip_fraction"],
                m["approx_kl"],
                m["entropy"],
                m["trm_acceptance"],
            )
        if skips >= tc.max_consecutive_skips:
            raise RuntimeError(
                f"{skips} consecutive optimizer steps had a non-finite loss or gradient (last: step "
                f"{i}); stopping (train.max_consecutive_skips={tc.max_consecutive_skips}). The "
                f"checkpoint in {ckpt.folder} holds the last good state."
            )
        if ckpt.due(i + 1, len(plan)):
            ckpt.save(
                engine,
                i + 1,
                {
                    "next_step": i + 1,
                    "metrics": metrics,
                    "consecutive_skips": skips,
                    "schedule": schedule.to_dict(),
                    "torch_rng": torch.get_rng_state(),
                },
            )

    state = full_fp32_state_dict(engine, keep=rank == 0)  # collective: all ranks
    if rank == 0:
        save_policy(engine, state, args.policy, args.out)
    del state
    if args.optimizer:
        import deepspeed

        digest = policy_digest(args.out) if rank == 0 else ""
        meta = {
            **optimizer_layout(tc, world_size),
            "deepspeed": deepspeed.__version__,
            "iteration": args.iteration,
            "optimizer_steps": schedule.to_dict().get("step"),
            "policy_sha256": digest,
            "job_fingerprint": fp,
        }
        save_optimizer_state(engine, args.optimizer, meta, rank, world_size)  # collective
    if rank == 0:
        df = pl.DataFrame(metrics, schema=schemas.TRAIN_METRICS.columns)
        import deepspeed

        write_parquet(
            df,
            args.metrics,
            metadata={
                "policy": args.policy,
                "iteration": args.iteration,
                "world_size": world_size,
                "seed": seed,
                "deepspeed": dict(deepspeed_config(tc, world_size), version=deepspeed.__version__),
                "loss_agg_mode": tc.loss_agg_mode,
                "temperature": cfg.rollout.temperature,
                "resumed_at_step": start,
                "schedule": schedule.to_dict(),
            },
        )
        if args.state:
            write_json(schedule.to_dict(), args.state)
        log.info("%d steps on %d sequences; next policy in %s", len(plan), n, args.out)
    ckpt.finish()
