"""The policy losses and their aggregation (otbflow.algorithms.losses) and the truncated IS weights
(otbflow.algorithms.rollout_is), by hand on small tensors: PPO-clip and its dual clip, REINFORCE,
decoupled PPO against a stale behaviour policy, the k3 KL, TRM's sequence mask, and the loss
aggregations under gradient accumulation."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from train_helpers import MODES

from otbflow.algorithms.losses import (
    aggregate_loss,
    low_var_kl,
    policy_token_loss,
    ppo_clip_loss,
    reinforce_loss,
    trm_keep,
)
from otbflow.algorithms.rollout_is import rollout_is_weights


def clip(low: float, high: float, c: float | None = None) -> SimpleNamespace:
    """The train-section keys ppo_clip_loss reads (c None: no dual clip)."""
    return SimpleNamespace(clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c)


@pytest.mark.parametrize("mode", MODES)
def test_aggregate_loss_accumulation_equals_full_batch(mode):
    torch.manual_seed(0)
    lengths = torch.tensor([3, 7, 1, 0, 5, 8, 2, 6])  # one empty response
    mask = torch.arange(8)[None, :] < lengths[:, None]
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(8, 8)
    tokens, seqs = int(mask.sum()), int((lengths > 0).sum())

    (full_grad,) = torch.autograd.grad(aggregate_loss(w * x, mask, mode, tokens, seqs, 48.0), w)
    w.grad = None
    total = 0.0
    for rows in ([0, 1, 2], [3, 4], [5, 6, 7]):  # uneven micro-batches, trimmed to their longest response
        width = int(lengths[rows].max())
        part = aggregate_loss((w * x)[rows, :width], mask[rows, :width], mode, tokens, seqs, 48.0)
        part.backward()
        total += float(part.detach())
    torch.testing.assert_close(w.grad, full_grad, atol=1e-5, rtol=0)
    assert abs(total - float(aggregate_loss(w * x, mask, mode, tokens, seqs, 48.0).detach())) < 1e-5


def test_aggregate_loss_values():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert float(aggregate_loss(loss, mask, "token-mean", 4, 2)) == pytest.approx(10 / 4)
    assert float(aggregate_loss(loss, mask, "seq-mean-token-sum", 4, 2)) == pytest.approx((6 + 4) / 2)
    assert float(aggregate_loss(loss, mask, "seq-mean-token-mean", 4, 2)) == pytest.approx((2 + 4) / 2, rel=1e-6)
    assert float(aggregate_loss(loss, mask, "seq-mean-token-sum-norm", 4, 2, 5.0)) == pytest.approx((6 + 4) / 2 / 5)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        aggregate_loss(loss, mask, "token-sum", 4, 2)


def test_ppo_clip_loss_by_hand():
    # ratios 1.5, 0.5, 1.1, 0.5, 1.5 with clip range [0.8, 1.28]
    ratio = torch.tensor([1.5, 0.5, 1.1, 0.5, 1.5])
    adv = torch.tensor([2.0, 2.0, 2.0, -1.0, -1.0])
    old = torch.full((5,), -2.0)
    loss, clipped = ppo_clip_loss(old + ratio.log(), old, adv, torch.ones(5), clip(0.2, 0.28))
    # A > 0, r = 1.5 > 1.28: max(-3, -2.56) = -2.56, clipped (no gradient to push r further up)
    # A > 0, r = 0.5 < 0.8: max(-1, -1.6) = -1, not clipped (the loss still pulls r back up)
    # A > 0, r = 1.1 inside the range: -2.2, not clipped
    # A < 0, r = 0.5 < 0.8: max(0.5, 0.8) = 0.8, clipped
    # A < 0, r = 1.5 > 1.28: max(1.5, 1.28) = 1.5, not clipped
    torch.testing.assert_close(loss, torch.tensor([-2.56, -1.0, -2.2, 0.8, 1.5]))
    assert clipped.tolist() == [True, False, False, True, False]


def test_ppo_clip_loss_gradient_vanishes_when_clipped():
    logp = torch.tensor([0.5, 0.0], requires_grad=True)  # r = e^0.5 (clipped), r = 1
    loss, clipped = ppo_clip_loss(logp, torch.zeros(2), torch.ones(2), torch.ones(2), clip(0.2, 0.2))
    loss.sum().backward()
    assert clipped.tolist() == [True, False]
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, -1.0]))


def test_dual_clip_caps_the_loss_of_negative_advantages():
    ratio = torch.tensor([5.0, 2.0, 5.0])
    adv = torch.tensor([-1.0, -1.0, 1.0])
    loss, active = ppo_clip_loss(ratio.log(), torch.zeros(3), adv, torch.ones(3), clip(0.2, 0.2, 3.0))
    # A < 0, r = 5: max(5, 1.2) = 5 > 3 -> capped at 3 (no gradient); r = 2: 2 < 3, unchanged;
    # A > 0: the dual clip does not apply (max(-5, -1.2) = -1.2, the ordinary clip)
    torch.testing.assert_close(loss, torch.tensor([3.0, 2.0, -1.2]))
    assert active.tolist() == [True, False, True]


def test_reinforce_loss_weights_are_stop_gradient():
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    w = torch.tensor([2.0, 0.5], requires_grad=True)
    loss, clipped = reinforce_loss(logp, logp.detach(), torch.tensor([1.0, -1.0]), w, None)
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([-2.0, 0.5]))  # -A w
    assert w.grad is None or torch.all(w.grad == 0)
    assert clipped.tolist() == [False, False]


def test_ppo_clip_loss_is_times_the_is_weight():
    logp, adv, w = torch.tensor([0.3, -0.1, 0.0]), torch.tensor([1.0, -1.0, 2.0]), torch.tensor([0.5, 2.0, 1.5])
    plain, active = ppo_clip_loss(logp, torch.zeros(3), adv, torch.ones(3), clip(0.2, 0.2, 3.0))
    weighted, active_w = ppo_clip_loss(logp, torch.zeros(3), adv, w, clip(0.2, 0.2, 3.0))
    torch.testing.assert_close(weighted, plain * w)
    assert active_w.tolist() == active.tolist()


def test_decoupled_ppo_with_a_stale_behaviour_policy_by_hand():
    """algorithms.md §10 on three tokens (a fourth is padding): behaviour pi_b (the rollout, one
    iteration old), proximal pi_p (the features stage's pass), current pi_t; C = 2, clip 0.2."""
    pi_b = torch.tensor([[0.2, 0.5], [0.4, 0.9]])
    pi_p = torch.tensor([[0.5, 0.4], [0.2, 0.9]])
    pi_t = torch.tensor([[0.7, 0.3], [0.3, 0.9]])
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    tc = SimpleNamespace(
        loss_type="ppo_clip", rollout_is="token", rollout_is_threshold=2.0, **vars(clip(0.2, 0.2, 3.0))
    )
    logp = pi_t.log().requires_grad_(True)
    token_loss, clipped, w = policy_token_loss(tc, logp, pi_p.log(), pi_b.log(), adv, mask)
    # w = pi_p / pi_b: 2.5 -> truncated to 2, 0.8, 0.5; r = pi_t / pi_p: 1.4, 0.75, 1.5
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.8], [0.5, 0.0]]))
    # A = +1, r = 1.4: max(-1.4, -1.2) = -1.2 (clipped) x 2 = -2.4; A = +1, r = 0.75: -0.75 x 0.8 = -0.6;
    # A = -1, r = 1.5: max(1.5, 1.2) = 1.5 (under the dual clip's 3) x 0.5 = 0.75
    torch.testing.assert_close((token_loss * mask), torch.tensor([[-2.4, -0.6], [0.75, 0.0]]))
    assert (clipped & (mask > 0)).tolist() == [[True, False], [False, False]]
    loss = aggregate_loss(token_loss, mask, "token-mean", 3, 2)
    assert float(loss) == pytest.approx((-2.4 - 0.6 + 0.75) / 3)
    loss.backward()  # d/d log pi_t of -w A r: 0 where clipped, -0.8 * 0.75 and 0.5 * 1.5, over 3 tokens
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.6 / 3], [0.75 / 3, 0.0]]))
    # REINFORCE is bypass (§6.4): w = min(pi_t / pi_b, C) = 2 (3.5 truncated), 0.6, 0.75; -A w log pi_t
    tc.loss_type = "reinforce"
    token_loss, _, w = policy_token_loss(tc, pi_t.log(), pi_p.log(), pi_b.log(), adv, mask)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.6], [0.75, 0.0]]))
    expected = torch.tensor([[-2.0 * np.log(0.7), -0.6 * np.log(0.3)], [0.75 * np.log(0.3), 0.0]], dtype=torch.float32)
    torch.testing.assert_close(token_loss * mask, expected)


def test_rollout_is_weights_token_and_sequence():
    log_rho = torch.tensor([[0.1, 2.0, 0.0], [0.3, 0.2, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    token = rollout_is_weights(log_rho, mask, "token", 2.0)
    torch.testing.assert_close(
        token, torch.tensor([[np.exp(0.1), 2.0, 0.0], [np.exp(0.3), np.exp(0.2), 2.0]], dtype=torch.float32)
    )
    seq = rollout_is_weights(torch.tensor([[0.1, 0.2, 5.0], [-0.3, -0.2, 0.0]]), mask, "sequence", 2.0)
    torch.testing.assert_close(
        seq, torch.tensor([[np.exp(0.3), np.exp(0.3), 0.0], [np.exp(-0.5)] * 3], dtype=torch.float32)
    )
    torch.testing.assert_close(rollout_is_weights(log_rho, mask, "none", 2.0), mask)


def test_low_var_kl_is_k3_and_zero_at_the_reference():
    logp = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-1.0, -1.0, -3.0])
    d = ref - logp
    torch.testing.assert_close(low_var_kl(logp, ref), torch.exp(d) - d - 1)
    assert float(low_var_kl(logp, ref)[0]) == 0.0 and (low_var_kl(logp, ref) >= 0).all()


def test_trm_keep_needs_both_criteria():
    keep = trm_keep(np.array([0.01, 0.2, 0.01, 0.01]), np.array([1e-4, 1e-4, 0.01, 1e-3]), 0.05, 0.001)
    assert keep.tolist() == [1.0, 0.0, 0.0, 1.0]
