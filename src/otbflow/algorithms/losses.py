"""Policy losses and loss aggregations, their registries (algorithms.md §6.3-6.5).

The functions take and return torch tensors but call only tensor methods, so that importing this
module (the config reads its registries) imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from otbflow.algorithms.rollout_is import rollout_is_weights
from otbflow.registry import Entry, Registry

if TYPE_CHECKING:
    import torch

# What the rollout IS ratio rho is taken against (algorithms.md §6.5): the proximal policy
# pi_old (decoupled: the loss's own ratio handles pi_theta / pi_old) or pi_theta itself (bypass).
IS_MODES = ("decoupled", "bypass")


@dataclass(frozen=True)
class PolicyLoss(Entry):
    """A registered policy loss: ``obj`` is ``fn(logp, old_logp, adv, is_w, tc) -> (token_loss,
    clipped)``, all [B, T] (``tc`` the config's train section, ``is_w`` the stop-gradient rollout
    IS weights, which the loss applies itself; ``clipped`` the tokens where a clip is active); its
    options are the train.* keys it reads (its keys in the train stage's rerun trigger), and
    ``is_mode`` which log-prob its IS weights are taken against (one of IS_MODES)."""

    is_mode: str = "decoupled"

    @property
    def fn(self) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
        return self.obj

    def is_logp(self, logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
        """log pi_x of rho = pi_x / pi_rollout: pi_old (decoupled) or pi_theta (bypass)."""
        return old_logp if self.is_mode == "decoupled" else logp


POLICY_LOSSES = Registry("policy loss", "train", entry=PolicyLoss)
"""The policy losses by name (train.loss_type): the config's choices are this registry."""


def register_policy_loss(name: str, is_mode: str, options: tuple[str, ...] = ()) -> Callable[[Callable], Callable]:
    """Decorator: register ``fn`` as the policy loss ``name`` (a value of train.loss_type) whose
    rollout IS weights are taken in ``is_mode`` (see IS_MODES) and which reads the train.*
    ``options``. Returns ``fn`` unchanged."""
    if is_mode not in IS_MODES:
        raise ValueError(f"unknown is_mode {is_mode!r} for policy loss {name!r}; one of {', '.join(IS_MODES)}")
    return POLICY_LOSSES.register(name, options=options, is_mode=is_mode)


@register_policy_loss("ppo_clip", is_mode="decoupled", options=("clip_ratio_low", "clip_ratio_high", "clip_ratio_c"))
def ppo_clip_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, is_w: torch.Tensor, tc: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss max(-A r, -A clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high)),
    r = exp(clamp(log pi_theta - log pi_old, +-20)), with the dual clip min(L, -A clip_ratio_c) for
    A < 0 when ``tc.clip_ratio_c`` is not None; times the IS weight w. And the mask of tokens where a
    clip is active (the loss is flat in r there: no gradient)."""
    ratio = (logp - old_logp).clamp(-20.0, 20.0).exp()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - tc.clip_ratio_low, 1.0 + tc.clip_ratio_high)
    loss, active = unclipped.maximum(clipped), clipped > unclipped
    if tc.clip_ratio_c is not None:
        dual = -adv * tc.clip_ratio_c
        lower = (adv < 0) & (dual < loss)
        loss, active = dual.where(lower, loss), active | lower
    return loss * is_w, active


@register_policy_loss("reinforce", is_mode="bypass")
def reinforce_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, is_w: torch.Tensor, tc: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """L_t = -A_t log pi_theta(y_t) sg(w_t), REINFORCE in bypass mode (algorithms.md §6.4); no clip."""
    return -adv * logp * is_w.detach(), logp.new_zeros(logp.shape).bool()


def policy_token_loss(
    tc: Any,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-token loss of ``tc.loss_type`` with its truncated rollout IS weights, all [B, T]:
    ``logp`` pi_theta, ``old_logp`` the proximal pi_old (the features stage's pass of the policy the
    update starts from), ``rollout_logp`` the behaviour policy's (the rollout engine's; with
    rollout.staleness s it is s iterations old). ppo_clip is decoupled PPO (algorithms.md §10):
    clip(pi_theta / pi_old) times w = min(pi_old / pi_behav, C); reinforce is bypass (§6.4): w =
    min(pi_theta / pi_behav, C). Returns (token_loss, clipped, is_w)."""
    policy_loss = POLICY_LOSSES[tc.loss_type]
    threshold = tc.rollout_is_threshold if tc.rollout_is != "none" else None  # read only where it is used
    is_w = rollout_is_weights(policy_loss.is_logp(logp, old_logp) - rollout_logp, mask, tc.rollout_is, threshold)
    token_loss, clipped = policy_loss.fn(logp, old_logp, adv, is_w, tc)
    return token_loss, clipped, is_w


def low_var_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 estimate of KL(pi_theta || pi_ref) per token: exp(d) - d - 1, d = log pi_ref - log pi_theta,
    clamped to [-10, 10] (verl's low_var_kl); >= 0, gradient through pi_theta."""
    d = (ref_logp - logp).clamp(-20.0, 20.0)
    return (d.exp() - d - 1.0).clamp(-10.0, 10.0)


LOSS_AGGREGATIONS = Registry("loss aggregation", "train")
"""The loss aggregations by name (train.loss_agg_mode): each ``fn(per_seq, m, global_tokens,
global_seqs, scale, seq_tokens)`` (``aggregate_loss``); the config's choices are this registry."""


@LOSS_AGGREGATIONS.register("token-mean")
def token_mean(per_seq, m, global_tokens, global_seqs, scale, seq_tokens):
    """sum_{i,t} m L / global_tokens."""
    return per_seq.sum() / max(global_tokens, 1)


@LOSS_AGGREGATIONS.register("seq-mean-token-sum")
def seq_mean_token_sum(per_seq, m, global_tokens, global_seqs, scale, seq_tokens):
    """sum_i sum_t m L / global_seqs."""
    return per_seq.sum() / max(global_seqs, 1)


@LOSS_AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(per_seq, m, global_tokens, global_seqs, scale, seq_tokens):
    """sum_i (sum_t m L / (T_i + 1e-8)) / global_seqs."""
    t = m.sum(-1) if seq_tokens is None else seq_tokens
    return (per_seq / (t + 1e-8)).sum() / max(global_seqs, 1)


@LOSS_AGGREGATIONS.register("seq-mean-token-sum-norm", options=("loss_scale_factor",))
def seq_mean_token_sum_norm(per_seq, m, global_tokens, global_seqs, scale, seq_tokens):
    """sum_i sum_t m L / global_seqs / scale (Dr.GRPO's constant C; the Aug-2026 verl form, which keeps the 1/N_seq)."""
    return per_seq.sum() / max(global_seqs, 1) / scale


def loss_scale(cfg: Any) -> float:
    """The ``scale`` of ``aggregate_loss``: an aggregation that reads train.loss_scale_factor gets
    it (0: rollout.max_new_tokens, Dr.GRPO's constant C), the others 1. Both keys are read only
    where they are used (the train stage's keys follow: otbflow.pipeline)."""
    tc = cfg.train
    if "loss_scale_factor" not in LOSS_AGGREGATIONS[tc.loss_agg_mode].options:
        return 1.0
    return tc.loss_scale_factor or cfg.rollout.max_new_tokens


def aggregate_loss(
    token_loss: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    global_tokens: int,
    global_seqs: int,
    scale: float = 1.0,
    seq_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """This micro-batch's share of the optimizer step's loss under the aggregation ``mode``
    (a name in LOSS_AGGREGATIONS; algorithms.md §6.3).

    ``token_loss`` and ``mask`` are [B, T]. ``global_tokens`` (valid tokens) and ``global_seqs``
    (sequences with at least one valid token) count the whole step's batch over all micro-batches
    and ranks, so the shares of all micro-batches add up to the full-batch value. T_i is
    ``seq_tokens`` (default: sum_t m). Masking a sequence out of the loss (TRM) while keeping it in
    the counts is done by zeroing its ``token_loss`` rows.
    """
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; one of {', '.join(LOSS_AGGREGATIONS)}")
    m = mask.to(token_loss.dtype)
    per_seq = (token_loss * m).sum(-1)
    return LOSS_AGGREGATIONS[mode].obj(per_seq, m, global_tokens, global_seqs, scale, seq_tokens)


def trm_keep(seq_max_k2: np.ndarray, seq_mean_k3: np.ndarray, max_k2: float, mean_k3: float) -> np.ndarray:
    """TRM-Max and TRM-Avg together: 1.0 for accepted sequences, 0.0 for masked ones."""
    return ((seq_max_k2 <= max_k2) & (seq_mean_k3 <= mean_k3)).astype(np.float64)
