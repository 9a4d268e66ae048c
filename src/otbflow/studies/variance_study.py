"""The offline variance study: per-token score gradients of a pool of responses (sketched with a
CountSketch), centred per position (``center_scores``: the score identity E[s_t 1{token t}] = 0
holds in the pool at every position, not per prefix), groups resampled from the pool, and per
estimator the within-prompt variance of the group-mean policy gradient (paired against
REINFORCE), its squared bias and noise-to-signal. Formulas and choices: docs/estimators.md,
"Offline variance study"."""

from __future__ import annotations

import logging

import numpy as np
import polars as pl
import torch
from omegaconf import DictConfig

from otbflow import schemas
from otbflow.algorithms.estimators import compute_advantages, studied, study_options
from otbflow.models.logits import ResponseLogits, pack
from otbflow.progress import Progress
from otbflow.seeds import derive_seed

log = logging.getLogger("otbflow.variance")


class CountSketch:
    """x in R^D -> S x in R^k: coordinate j goes to bucket h(j) with sign s(j)."""

    def __init__(self, dim: int, k: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.k = k
        self.bucket = torch.randint(0, k, (dim,), generator=g)
        self.sign = torch.randint(0, 2, (dim,), generator=g).float() * 2 - 1

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Rows of ``x`` [n, D] sketched to [n, k]."""
        return self.of_blocks([x])

    def of_blocks(self, blocks: list[torch.Tensor]) -> torch.Tensor:
        """The sketch of the rows of ``torch.cat(blocks, 1)`` (blocks [n, D_b] in coordinate order),
        one block at a time: the [n, D] concatenation is never built, and the buckets receive the
        same products in the same order as from the concatenation."""
        out = torch.zeros(blocks[0].shape[0], self.k, dtype=blocks[0].dtype)
        start = 0
        for b in blocks:
            end = start + b.shape[1]
            out.index_add_(1, self.bucket[start:end], b * self.sign[start:end])
            start = end
        if start != len(self.bucket):
            raise ValueError(f"the blocks hold {start} coordinates; the sketch was drawn for {len(self.bucket)}")
        return out


def token_gradients(
    model,
    prompt_ids: list[int],
    response_ids: list[int],
    temperature: float,
    pad_id: int,
    sketch: CountSketch | None = None,
) -> torch.Tensor:
    """[T, D]: the gradient of each log pi(y_t) w.r.t. every parameter (one batched backward);
    [T, k] with ``sketch``, sketched parameter by parameter (1.7x faster than sketching the
    concatenation, and no [T, D] copy)."""
    params = [p for p in model.parameters() if p.requires_grad]
    n = len(response_ids)
    batch = pack([prompt_ids], [response_ids], pad_id, model.device)
    with torch.enable_grad():
        z = ResponseLogits(model, batch)(slice(None)).float() / temperature
        logp = torch.log_softmax(z, -1).gather(-1, batch["targets"][:, None]).squeeze(-1)
        eye = torch.eye(n, device=logp.device)
        grads = torch.autograd.grad(logp, params, grad_outputs=eye, is_grads_batched=True, allow_unused=True)
    blocks = [
        (g.detach().cpu() if g is not None else torch.zeros(n, *p.shape)).reshape(n, -1) for g, p in zip(grads, params)
    ]
    return sketch.of_blocks(blocks) if sketch is not None else torch.cat(blocks, dim=1)


def pool_gradients(
    model, df: pl.DataFrame, temperature: float, pad_id: int, sketch: CountSketch | None
) -> torch.Tensor:
    """Per-token gradients of every pool response, sketched or exact, stacked [n_tokens, k]."""
    rows = []
    progress = Progress(log, "per-token gradients", df.height, "responses")
    for p_ids, r_ids in zip(df["prompt_ids"].to_list(), df["response_ids"].to_list()):
        if r_ids:
            rows.append(token_gradients(model, p_ids, r_ids, temperature, pad_id, sketch))
        progress.update()
    return torch.cat(rows) if rows else torch.zeros(0, 1)


def center_scores(token_grads: torch.Tensor, pool: pl.DataFrame) -> torch.Tensor:
    """Per-token centring: from the score of token t of every response, subtract the mean score at
    position t over the responses of the same prompt that have a token t (float64 means).

    The policy's scores satisfy E[s_t | prefix] = 0 for every prefix, hence E[s_t 1{token t
    exists}] = 0 at every position (the prefix decides whether there is a token t). A finite pool,
    used as the population the groups are drawn from, does not. After this centring it does, per
    position, exactly; so does the sum over positions (each prompt's sequence scores sum to zero).
    Any baseline that is a function of the position and of the other members of the group (a
    constant, RLOO's, the other-members part of a token baseline) then gets exactly zero bias from
    the pool, as from the policy. Centring per prefix is not possible without changing what is
    measured: past the pool's branch points a prefix belongs to one response, whose score would be
    set to 0 (docs/estimators.md, "Offline variance study"). A token alone at its position (the
    tail of a prompt's single longest response) gets score 0."""
    lengths = pool["response_length"].to_numpy().astype(np.int64)
    if not len(lengths) or not lengths.sum():
        return token_grads.clone()
    _, prompt = np.unique(pool["prompt_id"].to_numpy(), return_inverse=True)
    width = int(lengths.max())
    pos = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    key = torch.from_numpy(np.repeat(prompt.astype(np.int64), lengths) * width + pos)
    cells = (int(prompt.max()) + 1) * width
    sums = torch.zeros(cells, token_grads.shape[1], dtype=torch.float64).index_add_(0, key, token_grads.double())
    counts = torch.bincount(key, minlength=cells).clamp_min(1).to(torch.float64)
    return token_grads - (sums / counts[:, None]).to(token_grads.dtype)[key]


def resample_groups(df: pl.DataFrame, n: int, resamples: int, seed: int) -> pl.DataFrame:
    """``resamples`` groups of ``n`` pool rows per prompt, drawn with replacement: columns
    pool_row, prompt_id and group_id (one per resample, numbered prompt by prompt)."""
    rng = np.random.default_rng(seed)
    out = {"pool_row": [], "prompt_id": [], "group_id": []}
    gid = 0
    for pid, rows in sorted(df.with_row_index("pool_row").group_by("prompt_id").agg("pool_row").iter_rows()):
        for _ in range(resamples):
            out["pool_row"] += rng.choice(rows, size=n, replace=True).tolist()
            out["prompt_id"] += [pid] * n
            out["group_id"] += [gid] * n
            gid += 1
    return pl.DataFrame(out, schema={"pool_row": pl.Int64, "prompt_id": pl.Int64, "group_id": pl.Int64})


def group_gradients(
    advantages: pl.Series,
    pool_row: np.ndarray,
    offsets: np.ndarray,
    group: np.ndarray,
    n_groups: int,
    n: int,
    token_grads: torch.Tensor,
) -> torch.Tensor:
    """[n_groups, k]: g_hat of every resampled group, (1/N) sum_i sum_t A_{i,t} s_{i,t}, as one
    sparse [groups x pool tokens] product with the pool's token gradients."""
    lengths = advantages.list.len().to_numpy()
    adv = np.concatenate([np.asarray(a, dtype=np.float64) for a in advantages.to_list()]) if len(lengths) else []
    starts = np.repeat(offsets[pool_row], lengths)
    within = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    cols = torch.from_numpy(starts + within)
    rows = torch.from_numpy(np.repeat(group, lengths))
    weights = torch.sparse_coo_tensor(
        torch.stack([rows, cols]),
        torch.as_tensor(adv, dtype=torch.float64) / n,
        (n_groups, token_grads.shape[0]),
        check_invariants=True,
    )
    return torch.sparse.mm(weights, token_grads.double())


def per_prompt_stats(g: torch.Tensor, prompt_of_group: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per prompt: the unbiased trace of the covariance of g_hat over its resamples, and the
    squared norm of their mean."""
    traces, sq_means = [], []
    for pid in np.unique(prompt_of_group):
        rows = g[torch.from_numpy(np.flatnonzero(prompt_of_group == pid))]
        mean = rows.mean(0)
        traces.append(float(((rows - mean) ** 2).sum(1).sum() / max(len(rows) - 1, 1)))
        sq_means.append(float((mean**2).sum()))
    return np.asarray(traces), np.asarray(sq_means)


def sequence_sq_norms(token_grads: torch.Tensor, lengths: np.ndarray) -> np.ndarray:
    """||sum_t s_{i,t}||^2 of every response (0 for an empty one), in float64."""
    seq = torch.zeros(len(lengths), token_grads.shape[1], dtype=torch.float64)
    seq.index_add_(0, torch.from_numpy(np.repeat(np.arange(len(lengths)), lengths)), token_grads.double())
    return (seq**2).sum(1).numpy()


def study(
    cfg: DictConfig,
    pool: pl.DataFrame,
    token_grads: torch.Tensor,
    stats: list[dict[str, list[float]]],
    groups: pl.DataFrame | None = None,
) -> pl.DataFrame:
    """The summary table (one row per estimator) from the pool and its per-token score gradients
    (uncentred, as measured). The scores are centred per prompt and position first
    (``center_scores``); every g_hat and EOB's weights n_i = ||sum_t s_it||^2 use those centred
    scores. ``groups``
    (pool_row, prompt_id, group_id): the groups to evaluate on; None draws
    ``variance.resamples`` per prompt (``resample_groups``)."""
    v = cfg.variance
    token_grads = center_scores(token_grads, pool)
    lengths = pool["response_length"].to_numpy()
    pool = pool.with_columns(
        pl.Series("logprobs", [s["logprobs"] for s in stats], dtype=schemas.F32L),
        pl.Series("sum_pi_sq", [s["sum_pi_sq"] for s in stats], dtype=schemas.F32L),
        pl.Series("grad_sq_norm", sequence_sq_norms(token_grads, lengths), dtype=pl.Float64),
    )
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    if groups is None:
        groups = resample_groups(pool, v.group_size, v.resamples, derive_seed(cfg.seed, "variance"))
    group_size = int(groups.group_by("group_id").len()["len"].max())
    table = groups.join(
        pool.drop("group_id", "prompt_id").with_row_index("pool_row").with_columns(pl.col("pool_row").cast(pl.Int64)),
        on="pool_row",
        how="left",
        maintain_order="left",
    )
    n_groups = int(groups["group_id"].max()) + 1
    prompt_of_group = groups.unique("group_id", maintain_order=True).sort("group_id")["prompt_id"].to_numpy()
    resamples = np.unique(prompt_of_group, return_counts=True)[1]  # groups per prompt, in per_prompt_stats' order
    rows, reference, ref_traces = [], None, None
    for name in studied(cfg):
        out = compute_advantages(table, name, **study_options(cfg, name))
        g = group_gradients(
            out["advantages"],
            table["pool_row"].to_numpy(),
            offsets,
            table["group_id"].to_numpy(),
            n_groups,
            group_size,
            token_grads,
        )
        traces, sq_means = per_prompt_stats(g, prompt_of_group)
        if reference is None:
            reference, ref_traces = g, traces
        # E||mean(d)||^2 = ||E d||^2 + tr Cov(d) / R for d = g_hat - g_hat_none on the same groups
        d_traces, d_sq_means = per_prompt_stats(g - reference, prompt_of_group)
        noise = d_traces / resamples
        signal = float((sq_means - traces / resamples).mean())  # ||E g_hat||^2, noise removed likewise
        paired = traces - ref_traces  # per prompt, on the same resampled groups
        rows.append(
            {
                "estimator": name,
                "trace_cov": float(traces.mean()),
                "trace_cov_se": _se(traces),
                "trace_cov_diff": float(paired.mean()),
                "trace_cov_diff_se": _se(paired),
                "signal": signal,
                "noise_to_signal": float(traces.mean()) / signal if signal > 0 else float("nan"),
                "sq_bias": float((d_sq_means - noise).mean()),
                "sq_bias_noise": float(noise.mean()),
            }
        )
    v_none = rows[0]["trace_cov"]
    for r in rows:
        r["ratio_to_none"] = r["trace_cov"] / v_none if v_none > 0 else float("nan")
    return pl.DataFrame(rows, schema=schemas.VARIANCE.columns)


def _se(x: np.ndarray) -> float:
    """Standard error of the mean of per-prompt values (0 for a single prompt)."""
    return float(x.std(ddof=1) / np.sqrt(len(x))) if len(x) > 1 else 0.0
