"""Dynamic vocabulary pruning (rollout.min_p; algorithms.md §5, docs/training.md): the safe set and
the pruned policy pi_S computed by hand on a five-token vocabulary against every path that
computes them (the features stage's full and vocabulary-streamed statistics, the train stage's
differentiable log-probs, the transformers engine's sampling distribution), the force-included
sampled token, the gradient, the config's refusals, and the rollout and features stages run with
pruning on the tiny policy. The first PPO ratio with pruning: tests/test_train.py; vLLM:
tests/test_vllm.py."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest
import torch
from conftest import tiny_config

from otbflow import schemas
from otbflow.config import ConfigError
from otbflow.engines import vllm as vllm_engine
from otbflow.engines.hf import processed_logits
from otbflow.io import read_metadata, read_table
from otbflow.models.logits import sequence_token_stats, streamed_token_stats, token_stats
from otbflow.models.policy import load_policy
from otbflow.training.logprobs import logit_stats

# Five logits at temperature 2: z = [2, 1, 0, -3, -5]. rho = e^-2.5 keeps z >= 2 - 2.5 = -0.5,
# the safe set {0, 1, 2}. On the logits before the temperature the rule would keep {0, 1}
# (4 - 2.5 = 1.5), so the cases below also pin that the mask is built after the temperature.
LOGITS = [4.0, 2.0, 0.0, -6.0, -10.0]
T = 2.0
RHO = math.exp(-2.5)


def by_hand(target: int, rho: float = RHO) -> dict[str, float]:
    """The definition, in float64: pi = softmax(logits / T); V_S = {v : pi_v >= rho max pi}, with
    the sampled token added; pi_S = pi on V_S, renormalised; its log-prob of the target, entropy,
    sum of squares and proxy ||e_y - pi_S||^2; the pruned share of the vocabulary and pi's mass on it."""
    z = np.array(LOGITS) / T
    pi = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    keep = pi >= rho * pi.max()
    forced = not keep[target]
    keep[target] = True
    pi_s = np.where(keep, pi, 0.0) / pi[keep].sum()
    onehot = np.eye(len(z))[target]
    return {
        "logprobs": math.log(pi_s[target]),
        "entropy": float(-(pi_s[keep] * np.log(pi_s[keep])).sum()),
        "sum_pi_sq": float((pi_s**2).sum()),
        "proxy": float(((onehot - pi_s) ** 2).sum()),
        "pruned_fraction": float((~keep).mean()),
        "pruned_mass": float(pi[~keep].sum()),
        "forced": float(forced),
        "safe_set": [int(v) for v in np.flatnonzero(keep)],
    }


def test_the_hand_computed_safe_set():
    """The numbers the other tests compare with, checked once against the definition."""
    assert by_hand(0)["safe_set"] == [0, 1, 2] and by_hand(0)["forced"] == 0.0
    assert by_hand(3)["safe_set"] == [0, 1, 2, 3] and by_hand(3)["forced"] == 1.0  # force-included
    # pi_S on {0, 1, 2} is softmax([2, 1, 0]): log pi_S(0) = 2 - log(e^2 + e + 1)
    assert by_hand(0)["logprobs"] == pytest.approx(2 - math.log(math.e**2 + math.e + 1), abs=1e-12)
    assert by_hand(1)["pruned_fraction"] == pytest.approx(2 / 5)
    total = sum(math.exp(v / T) for v in LOGITS)
    assert by_hand(1)["pruned_mass"] == pytest.approx((math.exp(-3) + math.exp(-5)) / total)


def identity_head() -> torch.nn.Linear:
    head = torch.nn.Linear(5, 5, bias=False)
    head.weight.data = torch.eye(5)
    return head


TARGETS = [0, 1, 2, 3, 4]  # 3 and 4 are outside the safe set: force-included


@pytest.mark.parametrize(
    "path",
    ["token_stats", "streamed, slices of 2", "streamed, slices of 3", "train"],
)
def test_every_path_computes_the_hand_computed_pruned_policy(path):
    """The features stage's statistics (full vocabulary, and streamed over vocabulary slices,
    where the safe set needs the maximum over all slices first) and the train stage's log-probs
    and entropy equal the definition to 1e-6 for each target, the force-included ones too; and
    the pruning statistics: the pruned share, pi's mass on it, the forced flag."""
    logits = torch.tensor([LOGITS] * len(TARGETS))
    y = torch.tensor(TARGETS)
    if path == "token_stats":
        got = token_stats(logits, y, T, min_p=RHO)
    elif path.startswith("streamed"):
        with torch.no_grad():
            got = streamed_token_stats(logits, identity_head(), y, T, int(path[-1]), min_p=RHO)
    else:
        logp, entropy, pruning = logit_stats(logits, y, T, min_p=RHO)
        got = {
            "logprobs": logp,
            "entropy": entropy,
            **dict(zip(("pruned_fraction", "pruned_mass", "forced"), pruning.T)),
        }
    for i, target in enumerate(TARGETS):
        want = by_hand(target)
        for key, value in got.items():
            assert float(value[i]) == pytest.approx(want[key], abs=1e-6), (path, target, key)


def test_the_engine_samples_from_the_hand_computed_safe_set():
    """The transformers engine's processed logits: -inf outside the safe set (min-p after the
    temperature), and log_softmax of them is log pi_S, the rollout log-prob contract."""
    z = processed_logits(torch.tensor([LOGITS]), T, 1.0, RHO)[0]
    assert torch.isfinite(z).nonzero().flatten().tolist() == by_hand(0)["safe_set"]
    logp = torch.log_softmax(z, -1)
    for target in by_hand(0)["safe_set"]:
        assert float(logp[target]) == pytest.approx(by_hand(target)["logprobs"], abs=1e-6)
    assert torch.equal(processed_logits(torch.tensor([LOGITS]), T, 1.0, 0.0), torch.tensor([LOGITS]) / T)


def test_the_gradient_flows_through_the_safe_set_only():
    """d log pi_S(y) / d logit_v = (1[v = y] - pi_S(v)) / T on the safe set (the sampled token
    force-included) and 0 on the pruned logits: the mask is a constant for autograd."""
    for target in (1, 3):
        logits = torch.tensor([LOGITS], requires_grad=True)
        logp, _, _ = logit_stats(logits, torch.tensor([target]), T, min_p=RHO)
        (grad,) = torch.autograd.grad(logp.sum(), logits)
        want = by_hand(target)
        keep = want["safe_set"]
        z = np.array(LOGITS)[keep] / T
        pi_s = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
        expected = np.zeros(5)
        expected[keep] = (np.eye(5)[target][keep] - pi_s) / T
        np.testing.assert_allclose(grad[0].numpy(), expected, atol=1e-6)


def test_rho_zero_is_the_unpruned_policy():
    """min_p = 0: no pruning statistics, and the same numbers, bitwise, as before pruning existed
    (token_stats without the argument)."""
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(0))
    y = torch.arange(6)
    a, b = token_stats(logits, y, 0.7), token_stats(logits, y, 0.7, min_p=0.0)
    assert set(b) == {"logprobs", "entropy", "sum_pi_sq", "proxy"}
    assert all(torch.equal(a[k], b[k]) for k in a)
    _, _, pruning = logit_stats(logits, y, 0.7)
    assert not pruning.any()


# ------------------------------------------------------------------------------------------
# Config and engine arguments
# ------------------------------------------------------------------------------------------


def test_min_p_is_bounded_and_goes_with_any_top_p():
    """Both engines apply min-p before top-p (tests/test_vllm.py checks vLLM's log-probs against
    engines.hf.processed_logits with both on), so top_p < 1 is no longer refused with min_p."""
    assert tiny_config("rollout.min_p=6.1e-6").rollout.min_p == pytest.approx(6.1e-6)
    assert tiny_config("rollout.min_p=0.01", "rollout.top_p=0.9").rollout.top_p == 0.9
    for bad in ("1.0", "-0.1"):
        with pytest.raises(ConfigError, match=r"config key 'rollout.min_p': must be in \[0, 1\)"):
            tiny_config(f"rollout.min_p={bad}")
    assert tiny_config("rollout.top_p=0.9").rollout.min_p == 0.0  # off: any top_p


def test_vllm_gets_min_p_only_when_on():
    off = vllm_engine.sampling_kwargs(4, 1.0, 1.0, 8, greedy=False, seed=0)
    on = vllm_engine.sampling_kwargs(4, 1.0, 1.0, 8, greedy=False, seed=0, min_p=0.05)
    assert "min_p" not in off and on == {**off, "min_p": 0.05}
    assert "min_p" not in vllm_engine.sampling_kwargs(1, 1.0, 1.0, 8, greedy=True, seed=0, min_p=0.05)


# ------------------------------------------------------------------------------------------
# The tiny policy: its untrained distribution is nearly flat, so rho is large here
# ------------------------------------------------------------------------------------------

TINY_RHO = 0.55


def test_the_vocabulary_chunked_path_equals_the_full_one(tiny_policy, rollouts_path):
    """features.vocab_chunk_size > 0 with pruning on (the maximum over all slices first, then the
    mask per slice): every statistic equals the full-vocabulary path's to 1e-6, with tokens pruned
    and force-included in the batch."""
    model, tok = load_policy(tiny_policy)
    df = pl.read_parquet(rollouts_path).head(6)
    args = (model, df["prompt_ids"].to_list(), df["response_ids"].to_list(), 1.0, 5, tok.pad_token_id)
    full = sequence_token_stats(*args, 0, TINY_RHO)
    for vocab_chunk in (7, 32):
        streamed = sequence_token_stats(*args, vocab_chunk, TINY_RHO)
        for x, y in zip(full, streamed):
            for k in x:
                assert x[k] == pytest.approx(y[k], abs=1e-6), (vocab_chunk, k)
    fractions = [f for s in full for f in s["pruned_fraction"]]
    assert 0.05 < np.mean(fractions) < 0.95


@pytest.fixture(scope="module")
def pruned_run(tmp_path_factory, tiny_policy, data_dir):
    """The rollout and features stages with rollout.min_p on (transformers backend, fp32)."""
    from otbflow.stages import features, rollout

    cfg = tiny_config(f"rollout.min_p={TINY_RHO}")
    out = tmp_path_factory.mktemp("pruned")
    rollout.run(
        cfg,
        rollout.Args(
            prompts=str(data_dir / "train" / "shard_0.parquet"),
            policy=str(tiny_policy),
            out=str(out / "rollout.parquet"),
            iteration=0,
        ),
    )
    features.run(
        cfg,
        features.Args(
            rollouts=str(out / "rollout.parquet"), policy=str(tiny_policy), out=str(out / "features.parquet")
        ),
    )
    return out


def test_rollout_and_features_agree_under_pruning(pruned_run, features_path):
    """The transformers rollout samples from pi_S and records log pi_S; the features stage computes
    pi_S from its own forward pass: the two agree to 1e-5 on every token, no sampled token falls
    outside the trainer's safe set, and the pruning statistics are live (a share of the
    vocabulary pruned, with mass)."""
    df = read_table(pruned_run / "features.parquet", schemas.FEATURES)
    ours = df["logprobs"].explode().to_numpy()
    rollout = df["rollout_logprobs"].explode().to_numpy()
    assert len(ours) > 100 and abs(ours - rollout).max() <= 1e-5
    assert df["forced_tokens"].sum() == 0
    assert 0.05 < df["pruned_fraction"].mean() < 0.95 and df["pruned_mass"].min() > 0
    assert read_metadata(pruned_run / "rollout.parquet")["sampling"]["min_p"] == TINY_RHO
    assert read_metadata(pruned_run / "features.parquet")["min_p"] == TINY_RHO
    # the default run (rho = 0) has none of the optional columns
    assert not {"pruned_fraction", "pruned_mass", "forced_tokens"} & set(pl.read_parquet(features_path).columns)
