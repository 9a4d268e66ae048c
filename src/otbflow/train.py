"""Train: one PPO-clip policy update with DeepSpeed, from an iteration's advantages.

Input is the advantages table: per response token the sampled id, pi_old's log-prob (the
``logprobs`` column of the features stage) and the advantage A_t. For ``train.ppo_epochs`` passes
over the rows, in a seeded shuffled order, each mini-batch of ``train.mini_batch_size`` sequences
(the last, partial one included) is one optimizer step, accumulated over micro-batches of
``train.micro_batch_size`` sequences per rank:

- log pi_theta(y_t) is computed exactly as the features stage does: the prompt and response are
  right-padded together, and the temperature-scaled logits (``rollout.temperature``) are taken
  at the positions that predict response tokens (len(prompt) - 1 + t).
- per-token loss L_t = max(-A_t r_t, -A_t clip(r_t, 1 - clip_ratio_low, 1 + clip_ratio_high)),
  r_t = exp(clamp(log pi_theta - log pi_old, -20, 20))  (no dual clip, no entropy or KL term).
- ``train.loss_agg_mode`` aggregates L over the whole mini-batch: every micro-batch is divided
  by the mini-batch's token / sequence count, so accumulating micro-batches (and ranks) gives
  the gradient of one big batch. An optional ``loss_mask`` list column (1 = train on the token)
  removes tokens from the loss and from those counts.

Metrics per optimizer step (table 'train metrics'): the aggregated loss, the fraction of
clipped tokens, the gradient norm before clipping, the learning rate, the mean entropy and the
mean k3 estimate of KL(pi_old || pi_theta), both measured during the step's forward passes,
i.e. before its update. The next policy is written as an HF folder of fp32 weights (with bf16,
ZeRO's fp32 master weights; bf16 therefore needs zero_stage >= 1) with the input policy's tokenizer.

Launch: ``otbflow train ...`` as one process, or one process per device under ``torchrun``,
the ``deepspeed`` launcher (``--no_local_rank``) or Slurm's ``srun`` (the Slurm variables are
mapped to RANK / LOCAL_RANK / WORLD_SIZE here; DeepSpeed does not do it itself).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import subprocess
import time
from dataclasses import dataclass

import polars as pl
import torch
from omegaconf import DictConfig

from otbflow import schemas
from otbflow.config import derive_seed
from otbflow.features import ResponseLogits, pack
from otbflow.io import SchemaError, atomic_dir, read_table, write_parquet
from otbflow.model import set_threads

log = logging.getLogger("otbflow.train")
SECTIONS = ("train", "rollout", "model")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


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


# ------------------------------------------------------------------------------------------
# Loss
# ------------------------------------------------------------------------------------------


def ppo_clip_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, clip_low: float,
                  clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)) and the mask of
    tokens where the clipped term is the larger one (the clip is active: no gradient)."""
    ratio = torch.exp(torch.clamp(logp - old_logp, -20.0, 20.0))
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def aggregate_loss(token_loss: torch.Tensor, mask: torch.Tensor, mode: str, global_tokens: int,
                   global_seqs: int) -> torch.Tensor:
    """This micro-batch's share of the mini-batch loss (algorithms.md §6.3).

    ``token_loss`` and ``mask`` are [B, T]. ``global_tokens`` (valid tokens) and ``global_seqs``
    (sequences with at least one valid token) count the whole mini-batch over all micro-batches
    and ranks, so the shares of all micro-batches add up to the full-batch value:

    - token-mean:          sum_{i,t} m L / global_tokens
    - seq-mean-token-sum:  sum_i sum_t m L / global_seqs
    - seq-mean-token-mean: sum_i (sum_t m L / (sum_t m + 1e-8)) / global_seqs
    """
    m = mask.to(token_loss.dtype)
    per_seq = (token_loss * m).sum(-1)
    if mode == "token-mean":
        return per_seq.sum() / max(global_tokens, 1)
    if mode == "seq-mean-token-sum":
        return per_seq.sum() / max(global_seqs, 1)
    if mode == "seq-mean-token-mean":
        return (per_seq / (m.sum(-1) + 1e-8)).sum() / max(global_seqs, 1)
    raise ValueError(f"unknown loss_agg_mode {mode!r}; one of {', '.join(LOSS_AGG_MODES)}")


# ------------------------------------------------------------------------------------------
# Log-probs of the current policy (mirrors otbflow.features.sequence_token_stats, with grad)
# ------------------------------------------------------------------------------------------


def response_token_stats(model, input_ids, attention_mask, rows, pos, targets,
                         temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(log pi(y_t) with gradient, entropy without) of every response token, flattened.

    Same arithmetic as the features stage (``features.ResponseLogits``): the head is applied
    only at the positions predicting response tokens, then log-softmax of logits / temperature in
    fp32."""
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "rows": rows, "pos": pos}
    z = ResponseLogits(model, batch)(slice(None)).float() / temperature
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    with torch.no_grad():
        entropy = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
    return logp, entropy


class ResponseLogprobs(torch.nn.Module):
    """The policy with a forward that returns ``response_token_stats``. DeepSpeed wraps this
    module, so that the whole computation runs inside ``engine(...)`` (ZeRO's hooks)."""

    def __init__(self, policy):
        super().__init__()
        self.policy = policy

    def forward(self, input_ids, attention_mask, rows, pos, targets, temperature: float):
        return response_token_stats(self.policy, input_ids, attention_mask, rows, pos, targets, temperature)


def to_padded(flat: torch.Tensor, batch: dict[str, torch.Tensor], n_rows: int) -> torch.Tensor:
    """Scatter flat per-token values into [n_rows, longest response], zeros elsewhere
    (differentiable)."""
    width = int(batch["cols"].max()) + 1 if len(batch["cols"]) else 0
    return flat.new_zeros(n_rows, width).index_put((batch["rows"], batch["cols"]), flat)


def policy_logprobs(model, prompt_ids: list[list[int]], response_ids: list[list[int]], temperature: float,
                    pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log pi(y_t) [B, T] zero-padded, mask [B, T]) of an HF causal LM, differentiable."""
    batch = pack(prompt_ids, response_ids, pad_id, model.device)
    logp, _ = response_token_stats(model, batch["input_ids"], batch["attention_mask"], batch["rows"],
                                   batch["pos"], batch["targets"], temperature)
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
        out = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                             capture_output=True, text=True, check=True, timeout=30).stdout.split()
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


def deepspeed_config(tc: DictConfig, world_size: int) -> dict:
    """DeepSpeed config from the train section. The accumulation boundary is set explicitly
    per mini-batch (the last one may be partial), so gradient_accumulation_steps is nominal."""
    return {
        "train_micro_batch_size_per_gpu": tc.micro_batch_size,
        "gradient_accumulation_steps": max(1, tc.mini_batch_size // (tc.micro_batch_size * world_size)),
        "optimizer": {"type": "AdamW",
                      "params": {"lr": tc.lr, "weight_decay": tc.weight_decay, "torch_adam": True}},
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
    policy.train()
    module = ResponseLogprobs(policy)
    engine, *_ = deepspeed.initialize(model=module, model_parameters=module.parameters(),
                                      config=deepspeed_config(tc, world_size))
    return engine


def full_fp32_state_dict(engine, keep: bool) -> dict[str, torch.Tensor]:
    """The policy's full fp32 weights, on CPU (ZeRO's fp32 master weights where it keeps them).
    Collective under ZeRO: every rank must call it; only ranks with ``keep`` hold the result."""
    from deepspeed.utils import safe_get_full_fp32_param

    policy = engine.module.policy
    state = policy.state_dict()  # buffers, and every name of tied parameters
    full: dict[int, torch.Tensor | None] = {}
    for name, p in policy.named_parameters(remove_duplicate=False):
        if id(p) not in full:
            hp = safe_get_full_fp32_param(p)  # None where the module's parameter is the fp32 weight
            if hp is None:
                hp = p.detach()
            full[id(p)] = hp.float().cpu() if keep else None
        state[name] = full[id(p)]
    return state if keep else {}


def save_policy(engine, state: dict[str, torch.Tensor], policy_dir: str, out: str) -> None:
    from transformers import AutoTokenizer

    policy = engine.module.policy
    with atomic_dir(out) as tmp:
        policy.save_pretrained(tmp, state_dict=state)
        if policy.dtype != torch.float32:  # bf16 module: config.json names the saved fp32 weights
            policy.config.dtype = "float32"
            policy.config.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(policy_dir, local_files_only=True).save_pretrained(tmp)


def param_grad_norm(module) -> float | None:
    """L2 norm of the .grad of all parameters (None when no parameter holds one, as under ZeRO)."""
    grads = [p.grad.detach().float() for p in module.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))) if grads else None


# ------------------------------------------------------------------------------------------
# Training loop
# ------------------------------------------------------------------------------------------


def micro_step(engine, data: dict[str, list], rows: list[int], weight: float, cfg: DictConfig, pad_id: int,
               global_tokens: int, global_seqs: int, world_size: int) -> dict[str, float]:
    """Forward and backward of one micro-batch; returns its sums for the step's metrics.
    ``weight`` 0 turns it into a no-op that still runs the collectives (empty rank slice)."""
    tc = cfg.train
    responses = [data["response_ids"][i] for i in rows]
    batch = pack([data["prompt_ids"][i] for i in rows], responses, pad_id, engine.device)
    flat_logp, flat_entropy = engine(batch["input_ids"], batch["attention_mask"], batch["rows"], batch["pos"],
                                     batch["targets"], cfg.rollout.temperature)
    logp = to_padded(flat_logp, batch, len(rows))
    width = logp.shape[1]
    old_logp = pad_right([data["logprobs"][i] for i in rows], width, logp.device)
    adv = pad_right([data["advantages"][i] for i in rows], width, logp.device)
    mask = pad_right([data["loss_mask"][i] for i in rows], width, logp.device) * weight

    token_loss, clipped = ppo_clip_loss(logp, old_logp, adv, tc.clip_ratio_low, tc.clip_ratio_high)
    loss = aggregate_loss(token_loss, mask, tc.loss_agg_mode, global_tokens, global_seqs)
    # DeepSpeed averages gradients over ranks, and scale_wrt_gas=False stops it from also
    # dividing by the accumulation steps: the mini-batch normalisers already did both.
    engine.backward(loss * world_size, scale_wrt_gas=False)

    with torch.no_grad():
        log_ratio = torch.clamp(logp - old_logp, -20.0, 20.0)
        k3 = torch.exp(log_ratio) - 1.0 - log_ratio  # r - 1 - log r, r = pi_theta / pi_old
        entropy = to_padded(flat_entropy, batch, len(rows))
        return {"loss": float(loss.detach()), "clipped": float((clipped * mask).sum()),
                "entropy": float((entropy * mask).sum()), "k3": float((k3 * mask).sum())}


def reduce_sum(values: dict[str, float], world_size: int, device) -> dict[str, float]:
    if world_size == 1:
        return values
    t = torch.tensor(list(values.values()), dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t)
    return dict(zip(values, t.tolist()))


def train_step(engine, data: dict[str, list], mini: list[int], cfg: DictConfig, pad_id: int, rank: int,
               world_size: int) -> dict[str, float]:
    """One optimizer step on the mini-batch ``mini`` (row indices; every rank gets the same list
    and takes every world_size-th row)."""
    tc = cfg.train
    mask_sums = [sum(data["loss_mask"][i]) for i in mini]
    global_tokens = int(sum(mask_sums))
    global_seqs = sum(1 for s in mask_sums if s > 0)
    local = mini[rank::world_size]
    n_micro = math.ceil(math.ceil(len(mini) / world_size) / tc.micro_batch_size)  # the same on every rank
    sums = {"loss": 0.0, "clipped": 0.0, "entropy": 0.0, "k3": 0.0}
    norm_before_step = None
    for j in range(n_micro):
        rows = local[j * tc.micro_batch_size:(j + 1) * tc.micro_batch_size]
        weight = 1.0 if rows else 0.0
        last = j == n_micro - 1
        engine.set_gradient_accumulation_boundary(last)
        out = micro_step(engine, data, rows or mini[:1], weight, cfg, pad_id, global_tokens, global_seqs,
                         world_size)
        sums = {k: sums[k] + out[k] for k in sums}
        if last:
            norm_before_step = param_grad_norm(engine.module)  # fp32 without ZeRO reports no norm
    engine.step()
    norm = engine.get_global_grad_norm()
    norm = float(norm) if norm is not None else norm_before_step
    sums = reduce_sum(sums, world_size, engine.device)
    tokens = max(global_tokens, 1)
    return {"loss": sums["loss"], "clip_fraction": sums["clipped"] / tokens,
            "grad_norm": float("nan") if norm is None else norm, "lr": float(engine.get_lr()[0]),
            "entropy": sums["entropy"] / tokens, "approx_kl": sums["k3"] / tokens,
            "tokens": global_tokens, "sequences": len(mini)}


def load_rows(path: str) -> dict[str, list]:
    """The columns training uses, as Python lists; loss_mask is all ones when absent."""
    df = read_table(path, schemas.ADVANTAGES)
    data = {c: df[c].to_list() for c in ("prompt_ids", "response_ids", "logprobs", "advantages")}
    if "loss_mask" in df.columns:
        data["loss_mask"] = df["loss_mask"].to_list()
    else:
        data["loss_mask"] = [[1.0] * len(r) for r in data["response_ids"]]
    return data


def run(cfg: DictConfig, args: Args) -> None:
    set_threads()
    tc = cfg.train
    data = load_rows(args.advantages)
    n = len(data["response_ids"])
    if n == 0:
        raise SchemaError(f"{args.advantages}: no rows to train on")
    rank, world_size = init_distributed_env()
    seed = derive_seed(cfg.seed, "train", args.iteration)
    torch.manual_seed(seed)
    engine = build_engine(args.policy, tc, world_size)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.policy, local_files_only=True)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    order_rng = torch.Generator().manual_seed(seed)
    steps_per_epoch = math.ceil(n / tc.mini_batch_size)
    metrics = []
    step = 0
    for epoch in range(tc.ppo_epochs):
        order = torch.randperm(n, generator=order_rng).tolist()
        for start in range(0, n, tc.mini_batch_size):
            t0 = time.perf_counter()
            m = train_step(engine, data, order[start:start + tc.mini_batch_size], cfg, pad_id, rank, world_size)
            m = {"iteration": args.iteration, "step": step, **m,
                 "step_time_s": time.perf_counter() - t0}
            metrics.append(m)
            if rank == 0:
                log.info("epoch %d step %d/%d: loss %.5f grad_norm %.4f lr %.2e clip %.3f kl %.2e entropy %.3f",
                         epoch, step + 1, tc.ppo_epochs * steps_per_epoch, m["loss"], m["grad_norm"], m["lr"],
                         m["clip_fraction"], m["approx_kl"], m["entropy"])
            step += 1

    state = full_fp32_state_dict(engine, keep=rank == 0)  # collective: all ranks
    if rank == 0:
        save_policy(engine, state, args.policy, args.out)
        df = pl.DataFrame(metrics, schema=schemas.TRAIN_METRICS.columns)
        import deepspeed

        write_parquet(df, args.metrics, metadata={
            "policy": args.policy, "iteration": args.iteration, "world_size": world_size, "seed": seed,
            "deepspeed": dict(deepspeed_config(tc, world_size), version=deepspeed.__version__),
            "loss_agg_mode": tc.loss_agg_mode, "temperature": cfg.rollout.temperature})
        log.info("%d steps on %d sequences; next policy in %s", step, n, args.out)
    if world_size > 1:
        torch.distributed.barrier()
