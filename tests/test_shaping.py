"""Reward shaping (otbflow.algorithms.shaping): DAPO's overlong punishment and the cosine length reward at the
points where their definitions (algorithms.md §6.1, §8) give values by hand, the configurations
they refuse, and evaluation scoring with the verifiable reward whatever shapes training."""

from __future__ import annotations

import math
from types import SimpleNamespace

import polars as pl
import pytest
from conftest import tiny_config

from otbflow import schemas
from otbflow.algorithms.shaping import (
    Scorer,
    cosine_reward,
    overlong_penalty,
    repetition_penalty,
    training_reward,
    verifier,
)
from otbflow.config import ConfigError
from otbflow.io import read_table

# the run script's values (eddycmu/demystify-long-cot scripts/run_local.sh) and the code's margin
SEED = SimpleNamespace(
    correct_min=1.0,
    correct_max=2.0,
    wrong_min=-10.0,
    wrong_max=0.0,
    exceed=-10.0,
    exceed_margin=16,
    repetition_ngram=40,
    repetition_max=0.0,
)


@pytest.mark.parametrize(
    "length, want",
    [
        (0, 0.0),
        (12, 0.0),  # L_max - L_cache: no punishment yet
        (13, -0.125),  # one token into the buffer: 1/8 of the factor
        (16, -0.5),  # half-way through the buffer
        (20, -1.0),  # L_max: the whole factor
        (21, -1.0),  # beyond L_max (a response is capped there; the spec's value)
        (64, -1.0),
    ],
)
def test_overlong_punishment_by_hand(length, want):
    """L_max 20, L_cache 8, factor 1: 0 up to 12 tokens, then linear down to -1 at 20."""
    assert overlong_penalty(length, 20, 8, 1.0) == pytest.approx(want, abs=1e-12)
    assert overlong_penalty(length, 20, 8, 0.5) == pytest.approx(want / 2, abs=1e-12)
    assert overlong_penalty(length, 20, 0, 1.0) == 0.0  # buffer 0: off


def test_the_cosine_reward_at_its_anchor_points():
    """L_max = 100, margin 16: at L = 0 a correct answer gets r_c,max (2) and a wrong one r_w,min
    (-10); at L_max/2 (cos = 0) the midpoints 1.5 and -5; from L = 84 on (L + 16 >= 100) r_exceed,
    right or wrong; just before it the curve."""
    assert cosine_reward(True, 0, 100, SEED) == pytest.approx(2.0)
    assert cosine_reward(False, 0, 100, SEED) == pytest.approx(-10.0)
    assert cosine_reward(True, 50, 100, SEED) == pytest.approx(1.5)
    assert cosine_reward(False, 50, 100, SEED) == pytest.approx(-5.0)
    assert cosine_reward(True, 84, 100, SEED) == cosine_reward(False, 84, 100, SEED) == -10.0
    assert cosine_reward(True, 100, 100, SEED) == -10.0  # cut at the limit: exceeding
    # L = 83: cos(0.83 pi) = -0.8607...; correct 1 + 0.5 (1 - 0.8607), wrong 0 - 5 (1 - 0.8607)
    c = math.cos(0.83 * math.pi)
    assert cosine_reward(True, 83, 100, SEED) == pytest.approx(1 + 0.5 * (1 + c))
    assert cosine_reward(False, 83, 100, SEED) == pytest.approx(-5 * (1 + c))
    # shorter correct answers earn more, longer wrong ones lose less
    correct = [cosine_reward(True, n, 100, SEED) for n in range(0, 84)]
    wrong = [cosine_reward(False, n, 100, SEED) for n in range(0, 84)]
    assert all(a > b for a, b in zip(correct, correct[1:])) and all(a < b for a, b in zip(wrong, wrong[1:]))
    assert min(correct) > max(wrong)


def test_the_repetition_penalty_counts_repeated_word_ngrams():
    """'a b a b a b' has 5 word bigrams, 2 of them distinct: 1 - 2/5 = 0.6 of p_max; only wrong
    answers pay it; fewer words than n: nothing."""
    assert repetition_penalty("a b A b a b", 2, -1.0) == pytest.approx(-0.6)
    assert repetition_penalty("a b c d", 2, -1.0) == 0.0
    assert repetition_penalty("a b", 3, -1.0) == 0.0
    rep = SimpleNamespace(**{**vars(SEED), "repetition_ngram": 2, "repetition_max": -1.0})
    assert cosine_reward(False, 50, 100, rep, "a b a b a b") == pytest.approx(-5.6)
    assert cosine_reward(True, 50, 100, rep, "a b a b a b") == pytest.approx(1.5)


def test_the_training_reward_composes_and_is_the_verifiable_one_unshaped():
    cfg = tiny_config()  # max_new_tokens 24
    assert [training_reward(cfg.task, 24, v, n, "") for v, n in [(1.0, 24), (0.0, 3)]] == [1.0, 0.0]
    both = tiny_config("task.reward=cosine", "task.cosine.exceed_margin=4", "task.overlong_buffer=8")
    # 12 tokens: cos(pi/2) = 0, correct 1.5; 4 of 8 buffer tokens past 16? no: 12 <= 16, no punishment
    assert training_reward(both.task, 24, 1.0, 12, "") == pytest.approx(1.5)
    # 18 tokens: cos(0.75 pi); punishment (16 - 18)/8 = -0.25
    c = math.cos(0.75 * math.pi)
    assert training_reward(both.task, 24, 0.0, 18, "") == pytest.approx(-5 * (1 + c) - 0.25)
    assert training_reward(both.task, 24, 1.0, 20, "") == pytest.approx(-10 - 0.5)  # exceeding (20 + 4 >= 24)
    assert Scorer(both)("... #3", "3", 12) == (1.0, pytest.approx(1.5))


@pytest.mark.parametrize(
    "override, key",
    [
        ("task.cosine.wrong_min=1", "task.cosine.wrong_min"),
        ("task.cosine.wrong_max=0.5", "task.cosine.wrong_max"),
        ("task.cosine.repetition_max=0.1", "task.cosine.repetition_max"),
        ("task.cosine.exceed_margin=24", "task.cosine.exceed_margin"),  # every response would exceed
        ("task.overlong_buffer=25", "task.overlong_buffer"),  # more than max_new_tokens (24)
        ("task.overlong_penalty=-1", "task.overlong_penalty"),
        ("task.cosine.verifier=cosine", "task.cosine.verifier"),
    ],
)
def test_refused_shaping_names_the_key(override, key):
    with pytest.raises(ConfigError, match=f"config key '{key}'"):
        tiny_config("task.reward=cosine", override)


def test_the_verifier_is_what_evaluation_and_filtering_score_with():
    assert verifier(tiny_config().task) == "arithmetic"
    assert verifier(tiny_config("task.reward=cosine").task) == "arithmetic"
    assert verifier(tiny_config("task.reward=cosine", "task.cosine.verifier=math").task) == "math"


def test_evaluation_scores_with_the_verifiable_reward_whatever_shapes_training(tiny_policy, data_dir, tmp_path):
    """The evaluate stage under the cosine reward with the overlong punishment writes the same
    tables as under the plain verifiable reward: rewards 0 or 1, greedy and avg@k unchanged."""
    from otbflow.stages import evaluate

    tables = []
    for name, cfg in [
        ("plain", tiny_config()),
        ("shaped", tiny_config("task.reward=cosine", "task.cosine.exceed_margin=4", "task.overlong_buffer=8")),
    ]:
        out = tmp_path / name
        args = evaluate.Args(
            prompts=str(data_dir / "eval.parquet"),
            policy=str(tiny_policy),
            name="initial",
            samples=str(out / "samples.parquet"),
            summary=str(out / "summary.parquet"),
        )
        evaluate.run(cfg, args)
        tables.append((read_table(args.samples, schemas.EVAL_SAMPLES), read_table(args.summary, schemas.EVAL_SUMMARY)))
    (plain, plain_summary), (shaped, shaped_summary) = tables
    assert shaped.equals(plain) and shaped_summary.equals(plain_summary)
    assert set(shaped["reward"].unique().to_list()) <= {0.0, 1.0}


def test_the_rollout_stores_both_rewards_and_shaping_leaves_the_samples_alone(tiny_policy, data_dir, tmp_path):
    """The same rollout under the plain and the shaped reward: the same responses, the same
    verifiable rewards; the shaped reward follows the cosine curve of each row's length and
    verdict, with the overlong punishment past 16 of 24 tokens (hand-written formula)."""
    from otbflow.stages import rollout

    out = {}
    for name, overrides in [
        ("plain", []),
        ("shaped", ["task.reward=cosine", "task.cosine.exceed_margin=4", "task.overlong_buffer=8"]),
    ]:
        path = tmp_path / f"{name}.parquet"
        args = rollout.Args(prompts=str(data_dir / "train" / "shard_0.parquet"), policy=str(tiny_policy), out=str(path))
        rollout.run(tiny_config(*overrides), args)
        out[name] = read_table(path, schemas.ROLLOUTS)
    plain, shaped = out["plain"], out["shaped"]
    assert plain["reward"].equals(plain["verifiable_reward"])
    same = ["response_ids", "rollout_logprobs", "verifiable_reward"]
    assert shaped.select(same).equals(plain.select(same))
    for row in shaped.iter_rows(named=True):
        n, right = row["response_length"], row["verifiable_reward"] == 1.0
        c = math.cos(math.pi * n / 24)
        want = -10.0 if n + 4 >= 24 else (1 + 0.5 * (1 + c) if right else -5 * (1 + c))
        want -= max(0, n - 16) / 8
        assert row["reward"] == pytest.approx(want), row
    assert shaped.filter(pl.col("response_length") >= 20).height > 0  # the tiny policy runs long: exceeding is tested


def _grpo(groups: list[list[float]]) -> list[list[float]]:
    """Std-normalised GRPO's per-sequence advantage of each group of rewards (one token each)."""
    from otbflow.algorithms.estimators import compute_advantages

    rows = [{"group_id": g, "reward": r, "logprobs": [-1.0]} for g, rs in enumerate(groups) for r in rs]
    adv = [a[0] for a in compute_advantages(pl.DataFrame(rows), "grpo")["advantages"].to_list()]
    return [adv[4 * g : 4 * g + 4] for g in range(len(groups))]


def test_std_normalised_grpo_is_scale_invariant_and_the_cosine_reward_fills_every_group():
    """docs/results.md (the probe's cosine grad norms): every right/wrong pattern of a group of 4 with
    lengths 10, 20, 30, 40 under a 48-token limit (the probe's cosine, margin 1), enumerated. An
    identity, whatever the rewards' scale: a group whose rewards are not all equal gets
    std-normalised advantages with sum A^2 = N - 1 = 3 (unbiased std), a uniform one 0. {0, 1}
    rewards: 14 of 16 patterns mixed, mean A^2 per sequence 0.75 x 14/16 = 0.65625, 87.5% of
    sequences non-zero; the same rewards on {-10, 2}: the same advantages; the cosine reward: all
    16 groups non-uniform, mean A^2 0.75 (the maximum), 100% non-zero."""
    import itertools

    lengths = (10, 20, 30, 40)
    probe = SimpleNamespace(**{**vars(SEED), "exceed_margin": 1})
    patterns = list(itertools.product((0.0, 1.0), repeat=4))
    binary = _grpo([list(p) for p in patterns])
    rescaled = _grpo([[12 * r - 10 for r in p] for p in patterns])  # {0, 1} -> {-10, 2}
    cosine = _grpo([[cosine_reward(r == 1.0, n, 48, probe) for r, n in zip(p, lengths)] for p in patterns])
    for adv, signal in ((binary, "mixed"), (rescaled, "mixed"), (cosine, "every")):  # sum A^2 per group
        for p, a in zip(patterns, adv):
            want = 3.0 if signal == "every" or len(set(p)) == 2 else 0.0  # N - 1, to the std's 1e-6 eps
            assert sum(x * x for x in a) == pytest.approx(want, abs=1e-4)
    assert all(a == pytest.approx(b, abs=1e-5) for g, h in zip(binary, rescaled) for a, b in zip(g, h))
    flat = {name: [x for g in adv for x in g] for name, adv in (("binary", binary), ("cosine", cosine))}
    assert sum(x * x for x in flat["binary"]) / 64 == pytest.approx(0.65625, abs=1e-5)
    assert sum(x != 0 for x in flat["binary"]) / 64 == 0.875
    assert sum(x * x for x in flat["cosine"]) / 64 == pytest.approx(0.75, abs=1e-5)
    assert all(x != 0 for x in flat["cosine"])


def test_an_all_correct_group_is_not_zero_advantage_under_shaping():
    """docs/rewards.md (why dynamic sampling filters on the verifiable reward): the overlong
    punishment with L_max 48, buffer 10, factor 1 gives an all-correct group of lengths 20, 30,
    40, 45 the rewards 1, 1, 1 - 2/10 = 0.8, 1 - 7/10 = 0.3; mean 0.775, deviations 0.225, 0.225,
    0.025, -0.475, unbiased std sqrt(0.3275 / 3) = 0.33040: GRPO advantages +0.681, +0.681,
    +0.076, -1.438. The same group unshaped: all 0."""
    lengths = (20, 30, 40, 45)
    rewards = [1.0 + overlong_penalty(n, 48, 10, 1.0) for n in lengths]
    assert rewards == pytest.approx([1.0, 1.0, 0.8, 0.3])
    (adv,) = _grpo([rewards])
    assert adv == pytest.approx([0.681, 0.681, 0.076, -1.438], abs=1e-3)
    assert _grpo([[1.0] * 4]) == [[0.0] * 4]
