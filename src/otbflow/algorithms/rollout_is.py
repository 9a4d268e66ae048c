"""Truncated rollout importance weights (algorithms.md §6.5), one definition for every stage.

The features stage stores them per token (``is_weights``, rho = pi_old / pi_rollout) for the OTB
baseline and its diagnostics; the train stage weights its loss with them. A core module, imported
by stages, importing none of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # tensor methods only: importing this module (the config does) imports no torch
    import torch

LEVELS = ("none", "token", "sequence")


def rollout_is_weights(log_rho: torch.Tensor, mask: torch.Tensor, level: str, threshold: float | None) -> torch.Tensor:
    """Truncated IS weights (algorithms.md §6.5), detached, 0 on padding. ``log_rho`` [B, T] is
    log pi_x - log pi_rollout per token; ``level``: none (all 1) | token: min(exp(clamp(log rho,
    +-20)), C) | sequence: min(exp(clamp(sum_t log rho, +-20)), C) broadcast to the sequence.
    ``threshold`` is C (None only with level none)."""
    log_rho = log_rho.detach()
    m = mask.to(log_rho.dtype)
    if level == "none":
        return m.clone()
    if level == "token":
        w = log_rho.clamp(-20.0, 20.0).exp()
    elif level == "sequence":
        w = (log_rho * m).sum(-1, keepdim=True).clamp(-20.0, 20.0).exp().expand_as(log_rho)
    else:
        raise ValueError(f"unknown rollout_is level {level!r}; one of {', '.join(LEVELS)}")
    return w.clamp(max=threshold) * m
