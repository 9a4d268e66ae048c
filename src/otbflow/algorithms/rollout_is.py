"""Truncated rollout importance weights (algorithms.md §6.5), one definition for every stage.

The features stage stores them per token (``is_weights``, rho = pi_old / pi_rollout) for the OTB
baseline and its diagnostics; the train stage weights its loss with them. A core module, imported
by stages, importing none of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from otbflow.registry import Registry

if TYPE_CHECKING:  # tensor methods only: importing this module (the config does) imports no torch
    import torch

ROLLOUT_IS_LEVELS = Registry("rollout IS level", "train")
"""The levels of the truncated IS weights by name (train.rollout_is): each ``fn(log_rho, m,
threshold)`` (``rollout_is_weights``); the config's choices are this registry. A level that weights
reads the truncation C (option rollout_is_threshold); one without options weights nothing."""


@ROLLOUT_IS_LEVELS.register("none")
def no_weights(log_rho: torch.Tensor, m: torch.Tensor, threshold: float | None) -> torch.Tensor:
    """All 1 (no IS weight)."""
    return m.clone()


@ROLLOUT_IS_LEVELS.register("token", options=("rollout_is_threshold",))
def token_weights(log_rho: torch.Tensor, m: torch.Tensor, threshold: float | None) -> torch.Tensor:
    """min(exp(clamp(log rho, +-20)), C) per token."""
    return log_rho.clamp(-20.0, 20.0).exp().clamp(max=threshold) * m


@ROLLOUT_IS_LEVELS.register("sequence", options=("rollout_is_threshold",))
def sequence_weights(log_rho: torch.Tensor, m: torch.Tensor, threshold: float | None) -> torch.Tensor:
    """min(exp(clamp(sum_t log rho, +-20)), C), broadcast to the sequence."""
    w = (log_rho * m).sum(-1, keepdim=True).clamp(-20.0, 20.0).exp().expand_as(log_rho)
    return w.clamp(max=threshold) * m


def weighting_levels() -> list[str]:
    """The levels that weight (those that read the truncation C): what stale rollouts need."""
    return [name for name, level in ROLLOUT_IS_LEVELS.items() if "rollout_is_threshold" in level.options]


def rollout_is_weights(log_rho: torch.Tensor, mask: torch.Tensor, level: str, threshold: float | None) -> torch.Tensor:
    """Truncated IS weights (algorithms.md §6.5), detached, 0 on padding. ``log_rho`` [B, T] is
    log pi_x - log pi_rollout per token; ``level`` a name in ROLLOUT_IS_LEVELS: none (all 1) |
    token: min(exp(clamp(log rho, +-20)), C) | sequence: min(exp(clamp(sum_t log rho, +-20)), C)
    broadcast to the sequence. ``threshold`` is C (None only with a level that does not read it)."""
    if level not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"unknown rollout_is level {level!r}; one of {', '.join(ROLLOUT_IS_LEVELS)}")
    return ROLLOUT_IS_LEVELS[level].obj(log_rho.detach(), mask.to(log_rho.dtype), threshold)
