"""Features: one teacher-forced forward pass of the training model over stored rollouts.

Per response token it stores, from the temperature-scaled logits z (the rollout's temperature):

- ``logprobs``  log pi(y_t)                      (pi_old for the policy update)
- ``entropy``   -sum_v p_v log p_v
- ``sum_pi_sq`` sum_v p_v^2 = exp(logsumexp(2z) - 2 logsumexp(z))
- ``proxy``     max(0, 1 - 2 pi + sum_pi_sq) = ||e_y - p||^2, the Logit-Gradient Proxy energy
- ``log_ratio`` logprobs - rollout_logprobs, and per sequence max k2, mean k3 and the log-PPL gap.

Memory: the transformer body runs once per batch; the output projection and the statistics run
over chunks of ``features.chunk_size`` response positions, so at most chunk_size x V logits (and
their temporaries) are alive at a time, never a vocabulary-sized tensor for every token.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import polars as pl
import torch
from omegaconf import DictConfig

from otbflow import schemas
from otbflow.io import read_table, write_parquet
from otbflow.model import load_policy, set_threads

log = logging.getLogger("otbflow.features")
SECTIONS = ("features", "rollout", "model")


@dataclass
class Args:
    rollouts: str
    """Rollouts Parquet (table 'rollouts')."""
    policy: str
    """HF folder of the training model (the policy that sampled these rollouts)."""
    out: str
    """Output features Parquet."""


def token_stats(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float = 1.0) -> dict[str, torch.Tensor]:
    """Per-token statistics of softmax(logits / temperature) at the sampled ``token_ids``.

    ``logits`` [..., V], ``token_ids`` [...]. Returns fp32 tensors of shape [...]: ``logprobs``,
    ``entropy``, ``sum_pi_sq`` (via logsumexp) and ``proxy`` = max(0, 1 - 2 pi + sum_pi_sq).
    """
    z = logits.float() / temperature
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1) - lse
    sum_pi_sq = torch.exp(torch.logsumexp(2.0 * z, dim=-1) - 2.0 * lse)
    entropy = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
    pi = logp.exp()
    proxy = ((1.0 - pi) ** 2 + (sum_pi_sq - pi**2)).clamp_min(0.0)
    return {"logprobs": logp, "entropy": entropy, "sum_pi_sq": sum_pi_sq, "proxy": proxy}


def has_logit_postprocessing(model) -> bool:
    """Models whose logits are not just lm_head(hidden) (soft-capping, scaling)."""
    c = model.config
    return bool(getattr(c, "final_logit_softcapping", None) or getattr(c, "logit_scale", None))


@torch.no_grad()
def sequence_token_stats(model, prompt_ids: list[list[int]], response_ids: list[list[int]],
                         temperature: float, chunk_size: int, pad_id: int) -> list[dict[str, list[float]]]:
    """token_stats for every response token of a batch of (prompt, response) pairs."""
    seqs = [p + r for p, r in zip(prompt_ids, response_ids)]
    width = max(len(s) for s in seqs)
    dev = model.device
    ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in seqs], device=dev)
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs], device=dev)
    # (row, position predicting the token) for every response token, flattened
    rows = torch.tensor([i for i, r in enumerate(response_ids) for _ in r], dtype=torch.long, device=dev)
    pos = torch.tensor([len(p) - 1 + t for p, r in zip(prompt_ids, response_ids) for t in range(len(r))],
                       dtype=torch.long, device=dev)
    targets = torch.tensor([t for r in response_ids for t in r], dtype=torch.long, device=dev)
    if has_logit_postprocessing(model):
        logits_all = model(input_ids=ids, attention_mask=mask).logits
        project = lambda sl: logits_all[rows[sl], pos[sl]]  # noqa: E731
    else:
        hidden = model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
        head = model.get_output_embeddings()
        project = lambda sl: head(hidden[rows[sl], pos[sl]])  # noqa: E731
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("logprobs", "entropy", "sum_pi_sq", "proxy")}
    for start in range(0, len(targets), chunk_size):
        sl = slice(start, start + chunk_size)
        stats = token_stats(project(sl), targets[sl], temperature)
        for k, v in stats.items():
            parts[k].append(v.cpu())
    flat = {k: (torch.cat(v) if v else torch.empty(0)) for k, v in parts.items()}
    out, offset = [], 0
    for r in response_ids:
        out.append({k: v[offset:offset + len(r)].tolist() for k, v in flat.items()})
        offset += len(r)
    return out


def mismatch_columns(df: pl.DataFrame) -> pl.DataFrame:
    """log_ratio per token; max k2, mean k3 and |log-PPL gap| per sequence."""
    lr = pl.col("logprobs") - pl.col("rollout_logprobs")  # list arithmetic, element-wise
    df = df.with_columns(lr.cast(schemas.F32L).alias("log_ratio"))
    k2 = pl.col("log_ratio").list.eval(0.5 * pl.element().cast(pl.Float64) ** 2)
    k3 = pl.col("log_ratio").list.eval(pl.element().cast(pl.Float64).exp() - 1.0 - pl.element().cast(pl.Float64))
    return df.with_columns(
        k2.list.max().fill_null(0.0).alias("seq_max_k2"),
        k3.list.mean().fill_null(0.0).alias("seq_mean_k3"),
        (pl.col("logprobs").list.mean() - pl.col("rollout_logprobs").list.mean()).abs().cast(pl.Float64)
        .fill_null(0.0).alias("log_ppl_abs_diff"),
    )


def run(cfg: DictConfig, args: Args) -> None:
    set_threads()
    df = read_table(args.rollouts, schemas.ROLLOUTS)
    model, tok = load_policy(args.policy, cfg.model.dtype)
    f = cfg.features
    stats: list[dict[str, list[float]]] = []
    for start in range(0, df.height, f.batch_size):
        part = df[start:start + f.batch_size]
        stats += sequence_token_stats(model, part["prompt_ids"].to_list(), part["response_ids"].to_list(),
                                      cfg.rollout.temperature, f.chunk_size, tok.pad_token_id)
    df = df.with_columns(*(pl.Series(k, [s[k] for s in stats], dtype=schemas.F32L)
                           for k in ("logprobs", "entropy", "sum_pi_sq", "proxy")))
    df = mismatch_columns(df).select(list(schemas.FEATURES.columns))
    write_parquet(df, args.out, metadata={"temperature": cfg.rollout.temperature, "policy": args.policy})
    log.info("%d sequences, %d tokens; mean proxy %.4f, mean k3 %.2e, max k2 %.2e", df.height,
             df["response_length"].sum(), df["proxy"].explode().mean(), df["seq_mean_k3"].mean(),
             df["seq_max_k2"].max())
