"""Features: one teacher-forced forward pass of the training model over stored rollouts.

Per response token it stores, from the temperature-scaled logits z (the rollout's temperature):

- ``logprobs``  log pi(y_t)                      (pi_old for the policy update)
- ``entropy``   -sum_v p_v log p_v
- ``sum_pi_sq`` sum_v p_v^2 = exp(logsumexp(2z) - 2 logsumexp(z))
- ``proxy``     max(0, 1 - 2 pi + sum_pi_sq) = ||e_y - p||^2, the Logit-Gradient Proxy energy
- ``log_ratio`` logprobs - rollout_logprobs, k1, k2, k3; per sequence mean k1, max k2, mean k3
  and the |log-PPL gap| (the mismatch between trainer and rollout engine)
- with ``features.exact_grad_norm``: ``grad_sq_norm`` = ||grad_theta sum_t log pi(y_t)||^2, one
  backward pass per sequence (the EOB oracle; small models only)
- with ``train.rollout_is`` token or sequence: ``is_weights``, the truncated rollout IS weights of
  rho = pi_old / pi_rollout (``otbflow.rollout_is``, the train stage's definition), which the OTB
  baseline and the variance-proxy diagnostics weight by (algorithms.md §1.3, §1.8)

Precision: the policy runs at the train stage's precision (fp32, or bf16 with ``train.bf16``, cast
as DeepSpeed casts it), not ``model.dtype``, and in eval mode as the train stage does, so that
``logprobs`` is the log pi_old the first optimizer step reproduces.

Memory: the transformer body runs once per batch; the output projection and the statistics run
over chunks of ``features.chunk_size`` response positions. Per chunk only two chunk x V fp32
tensors are alive (the logits, scaled in place, and their exponentials in a buffer reused across
chunks), as in a log-prob-only pass; never a vocabulary-sized tensor for every token.
``benchmarks/bench_features.py`` measures time and peak memory against a log-prob-only pass.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import polars as pl
import torch
from omegaconf import DictConfig

from otbflow import schemas
from otbflow.io import read_table, write_parquet
from otbflow.model import cast_parameters, load_policy, set_threads, trainer_dtype
from otbflow.progress import Progress
from otbflow.rollout_is import rollout_is_weights

log = logging.getLogger("otbflow.features")
SECTIONS = ("features", "rollout", "train")
STAT_COLUMNS = ("logprobs", "entropy", "sum_pi_sq", "proxy")


@dataclass
class Args:
    rollouts: str
    """Rollouts Parquet (table 'rollouts')."""
    policy: str
    """HF folder of the training model (the policy that sampled these rollouts)."""
    out: str
    """Output features Parquet."""


def token_stats(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float = 1.0, *,
                inplace: bool = False, buffer: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Per-token statistics of softmax(logits / temperature) at the sampled ``token_ids``.

    ``logits`` [..., V], ``token_ids`` [...]. Returns fp32 tensors of shape [...]: ``logprobs``,
    ``entropy``, ``sum_pi_sq`` and ``proxy`` = max(0, 1 - 2 pi + sum_pi_sq).

    With z = logits / temperature, m = max z, e = exp(z - m) and S = sum e:
    logp = z_y - m - log S, sum_pi_sq = sum e^2 / S^2 (= exp(lse(2z) - 2 lse(z))),
    entropy = m + log S - sum e z / S. The two sums of products are a vector norm and batched dot
    products, which allocate nothing of size V.

    Memory: only z and e are vocabulary-sized, as in a log-softmax. ``inplace=True`` lets the
    function scale an fp32 ``logits`` in place (the features stage owns each chunk's logits);
    ``buffer`` is a reusable [n, V] fp32 tensor for e (allocation dominates the cost of exp).
    """
    shape = token_ids.shape
    z = logits.reshape(-1, logits.shape[-1])
    if inplace and z.dtype == torch.float32:
        if temperature != 1.0:
            z.div_(temperature)
    else:
        z = z.float() / temperature
    y = token_ids.reshape(-1, 1)
    m = torch.amax(z, dim=-1, keepdim=True)
    e = torch.empty_like(z) if buffer is None else buffer[: z.shape[0]]
    torch.sub(z, m, out=e)
    e.exp_()
    s = e.sum(-1)
    log_s = torch.log(s)
    m = m.squeeze(-1)
    logp = z.gather(-1, y).squeeze(-1) - m - log_s
    ez = torch.bmm(e.unsqueeze(1), z.unsqueeze(2)).reshape(-1)
    sum_pi_sq = torch.linalg.vector_norm(e, dim=-1) ** 2 / (s * s)
    entropy = m + log_s - ez / s
    pi = logp.exp()
    proxy = ((1.0 - pi) ** 2 + (sum_pi_sq - pi**2)).clamp_min(0.0)
    return {k: v.reshape(shape) for k, v in
            (("logprobs", logp), ("entropy", entropy), ("sum_pi_sq", sum_pi_sq), ("proxy", proxy))}


def has_logit_postprocessing(model) -> bool:
    """Models whose logits are not just lm_head(hidden) (soft-capping, scaling)."""
    c = model.config
    return bool(getattr(c, "final_logit_softcapping", None) or getattr(c, "logit_scale", None))


def pack(prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int,
         device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Right-padded prompt + response ids and, for each response token t of row i, flattened:
    ``rows`` = i, ``pos`` = len(prompt_i) - 1 + t (the position predicting it), ``cols`` = t and
    ``targets`` = the token id. Shared by the features and train stages, so both compute the
    same log-probs."""
    seqs = [p + r for p, r in zip(prompt_ids, response_ids)]
    width = max(len(s) for s in seqs)

    def tensor(values):
        return torch.tensor(values, dtype=torch.long, device=device)

    return {
        "input_ids": tensor([s + [pad_id] * (width - len(s)) for s in seqs]),
        "attention_mask": tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs]),
        "rows": tensor([i for i, r in enumerate(response_ids) for _ in r]),
        "pos": tensor([len(p) - 1 + t for p, r in zip(prompt_ids, response_ids) for t in range(len(r))]),
        "cols": tensor([t for r in response_ids for t in range(len(r))]),
        "targets": tensor([t for r in response_ids for t in r]),
    }


class ResponseLogits:
    """Logits of the response tokens of a packed batch, chunk by chunk: ``self(sl)`` for a slice
    ``sl`` of the flattened tokens. The transformer body runs once, at construction; the output
    head runs per call. ``head`` is the output projection (None where the model post-processes
    its logits, e.g. soft-capping: then the full logits are computed once instead)."""

    def __init__(self, model, batch: dict[str, torch.Tensor]):
        self.rows, self.pos = batch["rows"], batch["pos"]
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "use_cache": False}
        if has_logit_postprocessing(model):
            self.head, self._hidden = None, None
            self._logits = model(**inputs).logits
        else:
            self.head = model.get_output_embeddings()
            self._hidden = model.base_model(**inputs).last_hidden_state

    def hidden(self, sl: slice) -> torch.Tensor:
        return self._hidden[self.rows[sl], self.pos[sl]]

    def __call__(self, sl: slice) -> torch.Tensor:
        if self.head is None:
            return self._logits[self.rows[sl], self.pos[sl]]
        return self.head(self.hidden(sl))


def streamed_token_stats(hidden: torch.Tensor, head: torch.nn.Linear, token_ids: torch.Tensor, temperature: float,
                         vocab_chunk: int) -> dict[str, torch.Tensor]:
    """token_stats with the output head applied over vocabulary slices (an online softmax), so
    that only n x vocab_chunk logits exist at a time. Same results as token_stats(head(hidden))."""
    n = hidden.shape[0]
    dev = hidden.device
    m = torch.full((n,), float("-inf"), device=dev)
    s, ez, ee, z_y = (torch.zeros(n, device=dev) for _ in range(4))
    y = token_ids.reshape(-1)
    weight, bias = head.weight, head.bias
    for v0 in range(0, weight.shape[0], vocab_chunk):
        v1 = min(v0 + vocab_chunk, weight.shape[0])
        z = torch.nn.functional.linear(hidden, weight[v0:v1], None if bias is None else bias[v0:v1]).float()
        z /= temperature
        new_m = torch.maximum(m, torch.amax(z, dim=-1))
        scale = torch.exp(m - new_m)
        e = torch.exp(z - new_m[:, None])
        s = s * scale + e.sum(-1)
        ez = ez * scale + torch.bmm(e.unsqueeze(1), z.unsqueeze(2)).reshape(-1)
        ee = ee * scale**2 + torch.linalg.vector_norm(e, dim=-1) ** 2
        inside = (y >= v0) & (y < v1)
        z_y[inside] = z[inside.nonzero().squeeze(-1), y[inside] - v0]
        m = new_m
    log_s = torch.log(s)
    logp = z_y - m - log_s
    sum_pi_sq = ee / (s * s)
    pi = logp.exp()
    return {"logprobs": logp, "entropy": m + log_s - ez / s, "sum_pi_sq": sum_pi_sq,
            "proxy": ((1.0 - pi) ** 2 + (sum_pi_sq - pi**2)).clamp_min(0.0)}


@torch.no_grad()
def chunked_token_stats(project: ResponseLogits, targets: torch.Tensor, temperature: float, chunk_size: int,
                        vocab_chunk: int = 0) -> dict[str, torch.Tensor]:
    """token_stats of the flattened response tokens ``targets`` over chunks of ``chunk_size``
    positions (and, with ``vocab_chunk`` > 0, of the vocabulary). Flat fp32 CPU tensors."""
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in STAT_COLUMNS}
    buffer = None
    for start in range(0, len(targets), chunk_size):
        sl = slice(start, start + chunk_size)
        if vocab_chunk > 0 and project.head is not None:
            stats = streamed_token_stats(project.hidden(sl), project.head, targets[sl], temperature, vocab_chunk)
        else:
            logits = project(sl)
            if buffer is None and logits.dtype == torch.float32:
                buffer = torch.empty((min(chunk_size, len(targets)), logits.shape[-1]), device=logits.device)
            stats = token_stats(logits, targets[sl], temperature, inplace=True, buffer=buffer)
            del logits
        for k, v in stats.items():
            parts[k].append(v.cpu())
    return {k: (torch.cat(v) if v else torch.empty(0)) for k, v in parts.items()}


@torch.no_grad()
def sequence_token_stats(model, prompt_ids: list[list[int]], response_ids: list[list[int]],
                         temperature: float, chunk_size: int, pad_id: int,
                         vocab_chunk: int = 0) -> list[dict[str, list[float]]]:
    """token_stats for every response token of a batch of (prompt, response) pairs, computed
    over chunks of ``chunk_size`` response tokens; one dict of lists per sequence."""
    batch = pack(prompt_ids, response_ids, pad_id, model.device)
    flat = chunked_token_stats(ResponseLogits(model, batch), batch["targets"], temperature, chunk_size, vocab_chunk)
    out, offset = [], 0
    for r in response_ids:
        out.append({k: v[offset:offset + len(r)].tolist() for k, v in flat.items()})
        offset += len(r)
    return out


def exact_grad_sq_norms(model, prompt_ids: list[list[int]], response_ids: list[list[int]],
                        temperature: float, pad_id: int, progress: Progress | None = None) -> list[float]:
    """||grad_theta sum_t log pi(y_t)||^2 over all parameters, one backward pass per sequence
    (the EOB oracle and the length-scaling fit; meant for small models). ``progress`` counts the
    sequences done."""
    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for p_ids, r_ids in zip(prompt_ids, response_ids):
        if not r_ids:
            out.append(0.0)
        else:
            batch = pack([p_ids], [r_ids], pad_id, model.device)
            with torch.enable_grad():
                logits = ResponseLogits(model, batch)(slice(None)).float() / temperature
                logp = torch.log_softmax(logits, -1).gather(-1, batch["targets"][:, None]).sum()
                grads = torch.autograd.grad(logp, params, allow_unused=True)
            out.append(float(sum((g.double() ** 2).sum() for g in grads if g is not None)))
        if progress is not None:
            progress.update()
    return out


def mismatch_columns(df: pl.DataFrame) -> pl.DataFrame:
    """Trainer vs rollout engine, per token: log_ratio = log pi_trainer - log pi_rollout and
    k1 = -log_ratio, k2 = log_ratio^2 / 2, k3 = exp(log_ratio) - 1 - log_ratio (log_ratio clamped
    to +-20 for k3); per sequence: mean k1, max k2, mean k3 and the |log-PPL gap|."""
    lr = pl.element().cast(pl.Float64)
    df = df.with_columns((pl.col("logprobs") - pl.col("rollout_logprobs")).cast(schemas.F32L).alias("log_ratio"))
    df = df.with_columns(
        pl.col("log_ratio").list.eval(-lr).cast(schemas.F32L).alias("k1"),
        pl.col("log_ratio").list.eval(0.5 * lr**2).cast(schemas.F32L).alias("k2"),
        pl.col("log_ratio").list.eval(lr.clip(-20, 20).exp() - 1.0 - lr.clip(-20, 20)).cast(schemas.F32L).alias("k3"),
    )
    return df.with_columns(
        pl.col("k1").list.mean().cast(pl.Float64).fill_null(0.0).alias("seq_mean_k1"),
        pl.col("k2").list.max().cast(pl.Float64).fill_null(0.0).alias("seq_max_k2"),
        pl.col("k3").list.mean().cast(pl.Float64).fill_null(0.0).alias("seq_mean_k3"),
        (pl.col("logprobs").list.mean() - pl.col("rollout_logprobs").list.mean()).abs().cast(pl.Float64)
        .fill_null(0.0).alias("log_ppl_abs_diff"),
    )


def is_weights_column(logprobs: pl.Series, rollout_logprobs: pl.Series, level: str, threshold: float,
                      rows_per_batch: int = 256) -> pl.Series:
    """Per-token ``is_weights``: rollout_is_weights(log pi_old - log pi_rollout) of every row, from
    the stored fp32 log-probs, padded ``rows_per_batch`` rows at a time (the train stage computes
    the same weights from the same columns for its decoupled PPO loss)."""
    out: list[list[float]] = []
    lp_all, rp_all = logprobs.to_list(), rollout_logprobs.to_list()
    for start in range(0, len(lp_all), rows_per_batch):
        lp, rp = lp_all[start:start + rows_per_batch], rp_all[start:start + rows_per_batch]
        width = max((len(x) for x in lp), default=0)
        log_rho = torch.zeros(len(lp), width)
        mask = torch.zeros(len(lp), width)
        for i, (a, b) in enumerate(zip(lp, rp)):
            log_rho[i, :len(a)] = torch.tensor(a, dtype=torch.float32) - torch.tensor(b, dtype=torch.float32)
            mask[i, :len(a)] = 1.0
        w = rollout_is_weights(log_rho, mask, level, threshold)
        out += [w[i, :len(a)].tolist() for i, a in enumerate(lp)]
    return pl.Series("is_weights", out, dtype=schemas.F32L)


def run(cfg: DictConfig, args: Args) -> None:
    set_threads()
    df = read_table(args.rollouts, schemas.ROLLOUTS)
    # pi_old at the trainer's precision (fp32, or DeepSpeed's bf16 cast with train.bf16), so that
    # the first PPO ratio of the train stage is 1; model.dtype is the rollout/evaluate dtype
    model, tok = load_policy(args.policy, "float32")
    cast_parameters(model, trainer_dtype(cfg.train))
    f = cfg.features
    stats: list[dict[str, list[float]]] = []
    progress = Progress(log, "features", df.height, "sequences")
    for start in range(0, df.height, f.batch_size):
        part = df[start:start + f.batch_size]
        stats += sequence_token_stats(model, part["prompt_ids"].to_list(), part["response_ids"].to_list(),
                                      cfg.rollout.temperature, f.chunk_size, tok.pad_token_id, f.vocab_chunk_size)
        progress.update(part.height)
    df = df.with_columns(*(pl.Series(k, [s[k] for s in stats], dtype=schemas.F32L) for k in STAT_COLUMNS))
    if f.exact_grad_norm:
        df = df.with_columns(pl.Series("grad_sq_norm", exact_grad_sq_norms(
            model, df["prompt_ids"].to_list(), df["response_ids"].to_list(), cfg.rollout.temperature,
            tok.pad_token_id, Progress(log, "exact gradient norms", df.height, "sequences")), dtype=pl.Float64))
    tc = cfg.train
    if tc.rollout_is != "none":
        df = df.with_columns(is_weights_column(df["logprobs"], df["rollout_logprobs"], tc.rollout_is,
                                               tc.rollout_is_threshold))
    df = mismatch_columns(df).select(schemas.FEATURES.present(df.columns))
    meta = {"temperature": cfg.rollout.temperature, "policy": args.policy}
    if tc.rollout_is != "none":
        meta |= {"rollout_is": tc.rollout_is, "rollout_is_threshold": tc.rollout_is_threshold}
    write_parquet(df, args.out, metadata=meta)
    log.info("%d sequences, %d tokens; mean proxy %.4f, mean k3 %.2e, max k2 %.2e", df.height,
             df["response_length"].sum(), df["proxy"].explode().mean(), df["seq_mean_k3"].mean(),
             df["seq_max_k2"].max())
