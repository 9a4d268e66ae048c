"""Dynamic vocabulary pruning (DVP, ``rollout.min_p``; algorithms.md §5, arXiv 2512.23087): the one
place of the safe-set rule, read by the transformers engine's sampling (``engines.hf``) and by the
trainer's statistics (``otbflow.models.logits``: features; ``otbflow.training.logprobs``: train).

With z = logits / temperature and m = max z, the safe set of a context is
V_S = {v : pi_v >= rho * max_u pi_u} = {v : z_v >= m + log rho}. Sampling draws from pi restricted
to V_S and renormalised (pi_S); the trainer computes pi_S the same way, with the pruned logits
replaced by m + MASK_VALUE (relative probability e^-50, about 2e-22) instead of -inf, so that a
bf16 backward through log_softmax stays finite. A sampled token outside the trainer's safe set
(the engines computed V_S from slightly different logits: §5.2's hazard) is force-included: its
own logit is kept, and it is counted. docs/training.md, "Dynamic vocabulary pruning"."""

from __future__ import annotations

import math

import torch

MASK_VALUE = -50.0
"""A pruned token's logit in the trainer, relative to the largest logit of its context."""

PRUNING_STATS = ("pruned_fraction", "pruned_mass", "forced")
"""Per token: the fraction of the vocabulary outside the safe set (the sampled token excluded
when force-included), the probability mass pi gives it, 1 - sum over V_S of pi, and 1.0 where the
sampled token was outside the safe set and was force-included."""


def threshold(m: torch.Tensor, min_p: float) -> torch.Tensor:
    """The smallest temperature-scaled logit inside the safe set, m + log rho (``m``: the row
    maxima, any shape). A token is pruned where its logit is strictly below it."""
    return m + math.log(min_p)


@torch.no_grad()
def outside(z: torch.Tensor, m: torch.Tensor, min_p: float) -> torch.Tensor:
    """Boolean, shaped like ``z`` (temperature-scaled logits [..., V] or a vocabulary slice of
    them): True where the token is outside the safe set of its row, whose maximum over the whole
    vocabulary is ``m`` [..., 1]."""
    return z < threshold(m, min_p)


@torch.no_grad()
def force_include(cut: torch.Tensor, targets: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """Take the sampled tokens ``targets`` [n] out of the pruned set ``cut`` [n, V'] (in place;
    ``offset``: the first vocabulary id of a slice ``cut`` covers). Returns [n] bool: the rows
    whose sampled token was pruned (always False for a token outside the slice)."""
    y = targets.reshape(-1) - offset
    inside = (y >= 0) & (y < cut.shape[-1])
    idx = y.clamp(0, cut.shape[-1] - 1)[:, None]
    forced = cut.gather(-1, idx).squeeze(-1) & inside
    cut.scatter_(-1, idx, cut.gather(-1, idx) & ~inside[:, None])
    return forced
