"""Estimators against slow, obviously correct loop references, on random ragged batches, against
loop transcriptions of verl's OTB code, and against hand-computed small groups."""

import math
from collections import defaultdict

import numpy as np
import polars as pl
import pytest
import torch

from otbflow import schemas
from otbflow.algorithms.estimators import ESTIMATORS, compare, compute_advantages, diagnostics, register
from otbflow.io import SchemaError, read_table
from otbflow.stages import advantages


def random_table(seed=0, n_groups=12, max_len=40, with_grad=False):
    """Ragged groups including singletons, all-equal rewards, zero-length and long tails."""
    rng = np.random.default_rng(seed)
    rows = []
    for g in range(n_groups):
        size = 1 if g % 5 == 0 else int(rng.integers(2, 6))
        equal = g % 4 == 1
        for i in range(size):
            T = 0 if (g % 6 == 2 and i == 0) else int(rng.integers(1, max_len))
            if g % 7 == 3 and i == size - 1:
                T = max_len * 3  # a very long unique tail
            logp = np.log(rng.uniform(0.05, 1.0, T))
            p = np.exp(logp)
            spp = p**2 + rng.uniform(0, 1, T) * (1 - p) ** 2  # a valid sum_pi_sq >= pi^2
            row = {
                "group_id": 100 + g,
                "reward": 1.0 if equal else float(rng.integers(0, 2)),
                "logprobs": logp.tolist(),
                "sum_pi_sq": spp.tolist(),
            }
            if with_grad:
                row["grad_sq_norm"] = float(rng.uniform(0.1, 5.0))
            rows.append(row)
    return pl.DataFrame(rows, schema_overrides={"logprobs": pl.List(pl.Float32), "sum_pi_sq": pl.List(pl.Float32)})


def groups_of(table):
    out = {}
    for i, g in enumerate(table["group_id"]):
        out.setdefault(g, []).append(i)
    return out


def ref_seq_baseline(table, kind, **opt):
    """Per-sequence baselines, one group at a time."""
    R = table["reward"].to_list()
    T = [len(x) for x in table["logprobs"]]
    base = [0.0] * len(R)
    scale = [1.0] * len(R)
    for _, idx in groups_of(table).items():
        n = len(idx)
        rs = [R[i] for i in idx]
        mean = sum(rs) / n
        for i in idx:
            if kind == "grpo":
                if n == 1:
                    base[i], scale[i] = 0.0, 1.0 + 1e-6
                else:
                    std = math.sqrt(sum((r - mean) ** 2 for r in rs) / (n - 1))
                    base[i] = mean
                    scale[i] = std + 1e-6 if opt.get("std_normalize", True) else 1.0
            elif kind == "rloo":
                base[i] = 0.0 if n == 1 else (sum(rs) - R[i]) / (n - 1)
            elif kind in ("opo", "length_power"):
                s = 1.0 if kind == "opo" else opt["exponent"]
                w = {j: (T[j] ** s if (T[j] > 0 or s == 0) else 0.0) for j in idx}
                others = [j for j in idx if j != i] if opt.get("leave_one_out") else idx
                den = sum(w[j] for j in others)
                if n == 1:
                    base[i] = 0.0
                elif den > 0:
                    base[i] = sum(w[j] * R[j] for j in others) / den
                else:
                    base[i] = sum(R[j] for j in others) / len(others)
            elif kind == "eob":
                nn = table["grad_sq_norm"].to_list()
                den = sum(nn[j] for j in idx)
                base[i] = 0.0 if n == 1 else (sum(nn[j] * R[j] for j in idx) / (den + 1e-8) if den >= 1e-10 else mean)
            elif kind in ("none", "reinforce_pp_baseline"):
                base[i] = 0.0 if kind == "none" else (mean if n > 1 else 0.0)
    # the shift acts on the scale of the advantage: (R - b) / s - shift, i.e. a baseline b + shift * s
    shift = opt.get("baseline_shift", 0.0)
    adv = [[(R[i] - base[i]) / scale[i] - shift] * T[i] for i in range(len(R))]
    if kind == "reinforce_pp_baseline":  # whiten over every valid token of the batch
        flat = [a for row in adv for a in row]
        mu = sum(flat) / len(flat)
        var = sum((a - mu) ** 2 for a in flat) / (len(flat) - 1)
        adv = [[(a - mu) / math.sqrt(var + 1e-8) for a in row] for row in adv]
        base = [b + mu for b in base]  # on the raw scale the whitening subtracts mean + mu
    return [[base[i] + shift * scale[i]] * T[i] for i in range(len(R))], adv


def ref_otb(table, handle_zero_tail=True, baseline_shift=0.0):
    R = table["reward"].to_list()
    lp = table["logprobs"].to_list()
    sp = table["sum_pi_sq"].to_list()
    T = [len(x) for x in lp]
    W = []
    for i in range(len(R)):
        acc, cum = 0.0, []
        for t in range(T[i]):
            pi = math.exp(lp[i][t])
            acc += max(0.0, 1 - 2 * pi + sp[i][t])
            cum.append(acc)
        W.append(cum)
    base = [[0.0] * T[i] for i in range(len(R))]
    for _, idx in groups_of(table).items():
        for i in idx:
            for t in range(T[i]):
                alive = [j for j in idx if T[j] > t]
                num = sum(W[j][t] * R[j] for j in alive)
                den = sum(W[j][t] for j in alive)
                base[i][t] = num / (den + 1e-8) if len(idx) > 1 else 0.0
        if handle_zero_tail and len(idx) >= 2:
            lens = sorted((T[j] for j in idx), reverse=True)
            if lens[0] > lens[1]:
                j = next(j for j in idx if T[j] == lens[0])
                for t in range(lens[1], T[j]):
                    base[j][t] = 0.0
    base = [[b + baseline_shift for b in row] for row in base]
    return base, [[R[i] - b for b in base[i]] for i in range(len(R))]


def assert_lists_close(actual, expected, tol=1e-5):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert len(a) == len(e)
        np.testing.assert_allclose(
            np.asarray(a, dtype=np.float64), np.asarray(e, dtype=np.float64), atol=tol, rtol=1e-5
        )


CASES = [
    ("grpo", {}),
    ("grpo", {"std_normalize": False}),
    ("grpo", {"baseline_shift": -0.1}),
    ("grpo", {"std_normalize": False, "baseline_shift": -0.1}),
    ("rloo", {"baseline_shift": 0.2}),
    ("rloo", {}),
    ("opo", {}),
    ("none", {}),
    ("reinforce_pp_baseline", {}),
    ("length_power", {"exponent": 0.0}),
    ("length_power", {"exponent": 1.58}),
    ("length_power", {"exponent": 2.0, "leave_one_out": True}),
]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name, opt", CASES)
def test_sequence_estimators_match_loops(name, opt, seed):
    table = random_table(seed)
    out = compute_advantages(table, name, **opt)
    base, adv = ref_seq_baseline(table, name, **opt)
    assert_lists_close(out["advantages"].to_list(), adv)
    assert_lists_close(out["baselines"].to_list(), base)
    assert out.schema["advantages"] == pl.List(pl.Float32)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("zero_tail", [True, False])
def test_otb_matches_loop(seed, zero_tail):
    table = random_table(seed)
    out = compute_advantages(table, "otb", handle_zero_tail=zero_tail, baseline_shift=0.05)
    base, adv = ref_otb(table, zero_tail, baseline_shift=0.05)
    assert_lists_close(out["baselines"].to_list(), base)
    assert_lists_close(out["advantages"].to_list(), adv)


def test_eob_matches_loop_and_equals_opo_when_norm_is_length():
    table = random_table(5, with_grad=True)
    out = compute_advantages(table, "eob")
    assert_lists_close(out["advantages"].to_list(), ref_seq_baseline(table, "eob")[1])
    table = table.with_columns(pl.col("logprobs").list.len().cast(pl.Float64).mul(0.37).alias("grad_sq_norm"))
    table = table.filter(pl.col("logprobs").list.len() > 0)  # EOB's 1e-10 guard vs OPO on empty groups
    assert_lists_close(
        compute_advantages(table, "eob")["advantages"].to_list(),
        compute_advantages(table, "opo")["advantages"].to_list(),
    )


def test_identities():
    table = random_table(7)
    lp0 = compute_advantages(table, "length_power", exponent=0.0)["advantages"].to_list()
    assert_lists_close(lp0, compute_advantages(table, "grpo", std_normalize=False)["advantages"].to_list())
    lp1 = compute_advantages(table, "length_power", exponent=1.0)["advantages"].to_list()
    assert_lists_close(lp1, compute_advantages(table, "opo")["advantages"].to_list())


def test_otb_with_constant_energy_is_mean_over_alive():
    # pi = 0.5 and sum_pi_sq = 0.5 give w = 1 - 1 + 0.5 = 0.5 on every token: W_t = 0.5 (t+1)
    # for every alive sequence, so B_t is the plain mean reward of the sequences alive at t.
    rows = [
        {"group_id": 1, "reward": r, "logprobs": [math.log(0.5)] * T, "sum_pi_sq": [0.5] * T}
        for r, T in [(1.0, 3), (0.0, 5), (1.0, 5), (0.0, 2)]
    ]
    out = compute_advantages(pl.DataFrame(rows), "otb", handle_zero_tail=False)
    b = out["baselines"].to_list()
    np.testing.assert_allclose(b[1], [0.5, 0.5, 2 / 3, 0.5, 0.5], atol=1e-6)


def test_group_of_one_and_all_equal():
    rows = [
        {"group_id": 1, "reward": 1.0, "logprobs": [-0.5] * 4, "sum_pi_sq": [0.6] * 4},
        {"group_id": 2, "reward": 0.7, "logprobs": [-0.5, -0.1, -2.0], "sum_pi_sq": [0.6, 0.9, 0.3]},
        {"group_id": 2, "reward": 0.7, "logprobs": [-1.5, -0.2, -0.3], "sum_pi_sq": [0.4, 0.8, 0.7]},
        {"group_id": 2, "reward": 0.7, "logprobs": [-0.01], "sum_pi_sq": [0.98]},
    ]
    t = pl.DataFrame(rows)
    otb = compute_advantages(t, "otb")["advantages"].to_list()
    assert otb[0] == [1.0] * 4  # singleton: REINFORCE, A = G
    # all equal (0.7, not a binary fraction) and tied for longest (no zero-tail): exactly 0, no eps residue
    assert otb[1] + otb[2] + otb[3] == [0.0] * 7
    grpo = compute_advantages(t, "grpo")["advantages"].to_list()
    assert grpo[0][0] == pytest.approx(1 / (1 + 1e-6)) and grpo[1] == [0.0] * 3
    # so OTB and GRPO agree on which tokens carry no signal
    assert diagnostics(compute_advantages(t, "otb"))["zero_adv_fraction"] == pytest.approx(7 / 11)
    assert diagnostics(compute_advantages(t, "grpo"))["zero_adv_fraction"] == pytest.approx(7 / 11)


def test_zero_tail_pushes_up_the_longest_correct_answer_of_an_all_correct_group():
    """Issue 22 point 9 (docs/estimators.md, results.md): {0,1} rewards, every response correct,
    lengths 2, 3, 5. With handle_zero_tail (the default) OTB's baseline is 0 on the longest
    response's positions 3 and 4 (from L2 = 3 on), so A = R - 0 = 1 there and 0 everywhere else;
    GRPO (with or without the std) gives 0 on every token; without the zero-tail OTB does too."""
    rows = [{"group_id": 1, "reward": 1.0, "logprobs": [-0.5] * n, "sum_pi_sq": [0.5] * n} for n in (2, 3, 5)]
    t = pl.DataFrame(rows)
    assert compute_advantages(t, "otb")["advantages"].to_list() == [[0.0] * 2, [0.0] * 3, [0.0] * 3 + [1.0] * 2]
    zeros = [[0.0] * 2, [0.0] * 3, [0.0] * 5]
    assert compute_advantages(t, "otb", handle_zero_tail=False)["advantages"].to_list() == zeros
    assert compute_advantages(t, "grpo")["advantages"].to_list() == zeros
    assert compute_advantages(t, "grpo", std_normalize=False)["advantages"].to_list() == zeros
    # all wrong with {0,1} rewards: R = 0, so the tail's A = R is 0 as well
    assert compute_advantages(t.with_columns(pl.lit(0.0).alias("reward")), "otb")["advantages"].to_list() == zeros


def test_otb_all_equal_group_with_a_zero_energy_prefix():
    # pi = 1 and sum_pi_sq = 1 on the first token of every member: w = 0 there, so the group's
    # cumulative energy is 0 at t = 0. The baseline is then the plain mean of the alive returns
    # (verl's 0/(0 + eps) gives B = 0, A = R, on a token whose logit gradient is 0).
    rows = [
        {"group_id": 1, "reward": 1.0, "logprobs": [0.0, -0.5, -1.0], "sum_pi_sq": [1.0, 0.6, 0.5]},
        {"group_id": 1, "reward": 1.0, "logprobs": [0.0, -0.3, -2.0], "sum_pi_sq": [1.0, 0.7, 0.2]},
        {"group_id": 2, "reward": 1.0, "logprobs": [0.0, -0.5], "sum_pi_sq": [1.0, 0.6]},
        {"group_id": 2, "reward": 0.0, "logprobs": [0.0, -0.5], "sum_pi_sq": [1.0, 0.6]},
    ]
    out = compute_advantages(pl.DataFrame(rows), "otb")
    assert out["advantages"].to_list()[:2] == [[0.0] * 3, [0.0] * 3]
    # group 2: mean 0.5 at t = 0; equal energies at t = 1 give the mean too
    np.testing.assert_allclose(out["advantages"].to_list()[2], [0.5, 0.5], atol=1e-12)
    np.testing.assert_allclose(out["advantages"].to_list()[3], [-0.5, -0.5], atol=1e-12)


def test_otb_hand_computed_mask_with_trailing_zeros():
    # a: 5 tokens, the last two masked (3 valid), R = 0; b: 4 valid tokens, R = 1. Constant energy
    # w = 0.5 (pi = 0.5, sum_pi_sq = 0.5) on every token. By the mask, b is the unique longest
    # (4 > 3): with handle_zero_tail its baseline is 0 from position L2 = 3 on, A_b[3] = 1. By the
    # list lengths a would be the longest (5 > 4) and b's last token would get A = 0.
    rows = [
        {
            "group_id": 1,
            "reward": 0.0,
            "logprobs": [math.log(0.5)] * 5,
            "sum_pi_sq": [0.5] * 5,
            "loss_mask": [True, True, True, False, False],
        },
        {
            "group_id": 1,
            "reward": 1.0,
            "logprobs": [math.log(0.5)] * 4,
            "sum_pi_sq": [0.5] * 4,
            "loss_mask": [True] * 4,
        },
    ]
    t = pl.DataFrame(rows)
    adv = compute_advantages(t, "otb")["advantages"].to_list()
    np.testing.assert_allclose(adv[0], [-0.5, -0.5, -0.5, 0.0, 0.0], atol=1e-12)
    np.testing.assert_allclose(adv[1], [0.5, 0.5, 0.5, 1.0], atol=1e-12)
    # without the zero tail, b is alone at position 3: B = 1, A = 0
    adv = compute_advantages(t, "otb", handle_zero_tail=False)["advantages"].to_list()
    np.testing.assert_allclose(adv[1], [0.5, 0.5, 0.5, 0.0], atol=1e-12)


@pytest.mark.parametrize("empty", ["no tokens", "all masked"])
def test_otb_empty_member_counts_in_the_group(empty):
    # {empty, length-4 reward 1}: a group of two (verl counts every row). Without the zero tail the
    # non-empty member is alone at every position: B = R, A = 0. With it, it is the unique longest
    # (4 > 0) and its whole response is the tail: A = R = 1.
    lp = [] if empty == "no tokens" else [-0.5, -0.5]
    rows = [
        {"group_id": 7, "reward": 0.0, "logprobs": lp, "sum_pi_sq": [0.6] * len(lp), "loss_mask": [False] * len(lp)},
        {"group_id": 7, "reward": 1.0, "logprobs": [-0.5] * 4, "sum_pi_sq": [0.6] * 4, "loss_mask": [True] * 4},
    ]
    t = pl.DataFrame(
        rows,
        schema_overrides={
            "logprobs": pl.List(pl.Float64),
            "sum_pi_sq": pl.List(pl.Float64),
            "loss_mask": pl.List(pl.Boolean),
        },
    )
    assert compute_advantages(t, "otb", handle_zero_tail=False)["advantages"].to_list()[1] == [0.0] * 4
    assert compute_advantages(t, "otb", handle_zero_tail=True)["advantages"].to_list()[1] == [1.0] * 4
    if empty == "no tokens":
        no_mask = t.drop("loss_mask")
        assert compute_advantages(no_mask, "otb", handle_zero_tail=False)["advantages"].to_list()[1] == [0.0] * 4
    # otb_tir drops a member without model tokens: a group of one, A = G either way
    assert compute_advantages(t, "otb_tir", handle_zero_tail=False)["advantages"].to_list()[1] == [1.0] * 4


@pytest.mark.parametrize(
    "name, opt",
    [
        ("none", {}),
        ("grpo", {}),
        ("grpo", {"std_normalize": False}),
        ("rloo", {}),
        ("opo", {}),
        ("length_power", {"exponent": 1.58}),
        ("eob", {}),
        ("otb", {}),
        ("otb_tir", {}),
    ],
)
def test_baseline_shift_on_an_all_equal_group_is_bounded(name, opt):
    # {0, 0, 0, 0}, delta = -0.1, tied lengths (no zero tail): every estimator gives A = -delta = 0.1
    # on every token (std-normalised GRPO used to give -delta / 1e-6 = 100000)
    rows = [
        {
            "group_id": 3,
            "reward": 0.0,
            "logprobs": [-0.4 - 0.1 * i] * 5,
            "sum_pi_sq": [0.5] * 5,
            "grad_sq_norm": 1.0 + i,
            "loss_mask": [True] * 5,
        }
        for i in range(4)
    ]
    out = compute_advantages(pl.DataFrame(rows), name, baseline_shift=-0.1, **opt)
    adv = np.concatenate(out["advantages"].to_list())
    np.testing.assert_allclose(adv, 0.1, atol=1e-6)


def test_grpo_shift_is_on_the_normalised_scale():
    # R = (1, 0, 0, 0): mean 0.25, unbiased std 0.5; A = (R - 0.25) / (0.5 + 1e-6) - delta
    rows = [{"group_id": 1, "reward": r, "logprobs": [-0.5] * 2} for r in (1.0, 0.0, 0.0, 0.0)]
    out = compute_advantages(pl.DataFrame(rows), "grpo", baseline_shift=-0.1)
    adv = [a[0] for a in out["advantages"].to_list()]
    np.testing.assert_allclose(adv, [0.75 / 0.500001 + 0.1] + [-0.25 / 0.500001 + 0.1] * 3, rtol=1e-6)
    # the baseline column is the reward-scale baseline: returns - advantages x scale
    np.testing.assert_allclose(out["baselines"].to_list()[0], [0.25 - 0.1 * 0.500001] * 2, rtol=1e-6)


def test_bad_input_errors():
    t = random_table(0)
    with pytest.raises(ValueError, match="unknown estimator 'foo'; registered: .*otb"):
        compute_advantages(t, "foo")
    with pytest.raises(SchemaError, match="estimator 'otb' needs column 'sum_pi_sq'"):
        compute_advantages(t.drop("sum_pi_sq"), "otb")
    with pytest.raises(SchemaError, match="estimator 'eob' needs column 'grad_sq_norm'"):
        compute_advantages(t, "eob")
    with pytest.raises(SchemaError, match="estimator 'otb_tir' needs column 'loss_mask'.*compacted index"):
        compute_advantages(t, "otb_tir")
    with pytest.raises(ValueError, match="'reinforce_pp_baseline' takes no option 'baseline_shift'"):
        compute_advantages(t, "reinforce_pp_baseline", baseline_shift=-0.1)
    bad = t.with_columns(
        pl.when(pl.int_range(pl.len()) == 4).then(float("nan")).otherwise(pl.col("reward")).alias("reward")
    )
    with pytest.raises(SchemaError, match=r"row 4 \(group_id 101\)"):
        compute_advantages(bad, "grpo")
    ragged = t.with_columns(
        pl.when(pl.int_range(pl.len()) == 3)
        .then(pl.col("sum_pi_sq").list.slice(1))
        .otherwise(pl.col("sum_pi_sq"))
        .alias("sum_pi_sq")
    )
    with pytest.raises(SchemaError, match="'sum_pi_sq' is ragged against 'logprobs': row 3 has"):
        compute_advantages(ragged, "otb")


def test_registry_is_one_decorated_function():
    from otbflow.algorithms import estimators

    @estimators.register("half_mean_test")
    def half_mean(b, baseline_shift=0.0):
        """Half the group mean (test only)."""
        return estimators.with_seq_baseline(b, 0.5 * estimators.group_mean(b, b.reward), baseline_shift)

    try:
        t = pl.DataFrame({"group_id": [1, 1, 2], "reward": [1.0, 0.0, 3.0], "logprobs": [[-0.1, -0.2], [-0.3], [-1.0]]})
        out = compute_advantages(t, "half_mean_test", baseline_shift=0.25)
        # group 1: b = 0.25 + 0.25; group 2: b = 1.5 + 0.25
        assert out["advantages"].to_list() == [[0.5, 0.5], [-0.5], [1.25]]
    finally:
        del ESTIMATORS["half_mean_test"]


def test_diagnostics_hand_computed():
    # two sequences of one group, energies w = 1 - 2 pi + sum_pi_sq per token:
    # a: pi = (0.5, 0.5), spp = (0.5, 0.3) -> w = (0.5, 0.3), W_a = 0.8; A = (0.2, 0.4) -> Abar 0.3
    # b: pi = (1.0,), spp = (1.0,) -> w = 0, W_b = 0; A = (0.0,) -> Abar 0
    t = pl.DataFrame(
        {
            "group_id": [1, 1],
            "reward": [1.0, 0.0],
            "logprobs": [[math.log(0.5)] * 2, [0.0]],
            "sum_pi_sq": [[0.5, 0.3], [1.0]],
            "advantages": [[0.2, 0.4], [0.0]],
            "baselines": [[0.8, 0.6], [0.0]],
        }
    )
    d = diagnostics(t)
    assert d["total_power"] == pytest.approx((0.8 * 0.3**2 + 0.0) / 2)
    assert d["expected_a_squared"] == pytest.approx(0.3**2 / 2)
    assert d["expected_w"] == pytest.approx(0.4)
    assert d["zero_adv_fraction"] == pytest.approx(1 / 3)
    assert d["adv_mean"] == pytest.approx(0.2)
    assert d["baseline_mean"] == pytest.approx((0.7 + 0.0) / 2)
    assert d["pessimism"] == pytest.approx(0.5 - 0.35)
    # with IS weights (token-mean 1.5 for a): P = mean_i rho_i^2 Abar_i^2 W_i (algorithms.md §1.8)
    d = diagnostics(t.with_columns(pl.Series("is_weights", [[1.0, 2.0], [0.5]])))
    assert d["total_power"] == pytest.approx((1.5**2 * 0.8 * 0.3**2) / 2)


def test_comparison_is_on_the_raw_reward_scale():
    """Issue 22 point 6: std-normalised GRPO and GRPO without the std share the baseline (the group
    mean), so on the raw-reward scale their P and E[A^2] are the same; the normalised ones (P
    divided by the group variance) are shown beside them, marked. One group of N = 8 with 3
    correct, references by a slow loop over sequences and tokens."""
    R = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    T = [3, 5, 2, 4, 6, 1, 3, 5]
    rng = np.random.default_rng(7)
    rows = []
    for r, n in zip(R, T):
        pi = rng.uniform(0.2, 0.95, n)
        rows.append({"group_id": 0, "reward": r, "logprobs": np.log(pi).tolist(), "sum_pi_sq": (pi**2 + 0.1).tolist()})
    t = pl.DataFrame(rows, schema_overrides={"logprobs": pl.List(pl.Float32), "sum_pi_sq": pl.List(pl.Float32)})
    W = []
    for lp, sp in zip(t["logprobs"].to_list(), t["sum_pi_sq"].to_list()):
        W.append(sum(max(0.0, 1 - 2 * math.exp(a) + b) for a, b in zip(lp, sp)))
    mean = sum(R) / 8
    std = math.sqrt(sum((r - mean) ** 2 for r in R) / 7)

    def power(abar):
        return sum(w * a * a for w, a in zip(W, abar)) / 8, sum(a * a for a in abar) / 8

    p_raw, a2_raw = power([r - mean for r in R])
    p_std, a2_std = power([(r - mean) / (std + 1e-6) for r in R])
    _, with_std = compare(t, "grpo", std_normalize=True)
    _, without = compare(t, "grpo", std_normalize=False)
    for row in (with_std, without):
        assert row["total_power"] == pytest.approx(p_raw, rel=1e-6)
        assert row["expected_a_squared"] == pytest.approx(a2_raw, rel=1e-6)
    assert with_std["normalised"] and not without["normalised"]
    assert with_std["total_power_normalised"] == pytest.approx(p_std, rel=1e-6)
    assert with_std["expected_a_squared_normalised"] == pytest.approx(a2_std, rel=1e-6)
    assert math.isnan(without["total_power_normalised"]) and math.isnan(without["expected_a_squared_normalised"])
    assert p_std / p_raw == pytest.approx(7 / 1.875, rel=1e-5)  # 1 / the group's variance: 3.73x

    # REINFORCE++: (R - mean) whitened over the batch's tokens, (x - mu) / sigma: on the raw scale
    # x - mu, the baseline mean + mu (its baselines column), sigma the scale
    x = [r - mean for r, n in zip(R, T) for _ in range(n)]
    mu = sum(x) / len(x)
    sigma = math.sqrt(sum((a - mu) ** 2 for a in x) / (len(x) - 1) + 1e-8)
    p_pp, a2_pp = power([r - mean - mu for r in R])
    out, pp = compare(t, "reinforce_pp_baseline")
    assert pp["normalised"] and pp["total_power"] == pytest.approx(p_pp, rel=1e-6)
    assert pp["expected_a_squared"] == pytest.approx(a2_pp, rel=1e-6)
    assert pp["total_power_normalised"] == pytest.approx(p_pp / sigma**2, rel=1e-5)
    assert out["baselines"].to_list()[0][0] == pytest.approx(mean + mu, rel=1e-6)

    # an estimator that does not normalise: the row is its diagnostics as they are
    out, otb = compare(t, "otb")
    assert not otb["normalised"] and otb["total_power"] == diagnostics(out)["total_power"]


def test_a_normalising_estimator_must_declare_it():
    @register("scaled_test")
    def scaled_test(b):
        """Half the return, declared as not normalising but returning a scale."""
        return np.zeros_like(b.returns), b.returns / 2, np.full(len(b.returns), 2.0)

    try:
        t = pl.DataFrame({"group_id": [1], "reward": [1.0], "logprobs": [[-0.1]]})
        with pytest.raises(RuntimeError, match="registered with normalises=False but returned a scale"):
            compute_advantages(t, "scaled_test")
    finally:
        del ESTIMATORS["scaled_test"]


def test_stage_and_comparison_rule(features_path, tmp_path):
    from conftest import tiny_config

    # training estimator rloo with delta = -0.1; compared: std-normalised grpo (takes delta on its
    # scale), reinforce_pp_baseline (takes none), otb
    cfg = tiny_config(
        "advantages.estimator=rloo",
        "advantages.baseline_shift=-0.1",
        "advantages.compare=[grpo,reinforce_pp_baseline,otb]",
    )
    advantages.run(
        cfg,
        advantages.Args(
            features=[str(features_path)],
            out=str(tmp_path / "a.parquet"),
            comparison=str(tmp_path / "c.parquet"),
            iteration=3,
        ),
    )
    adv = read_table(tmp_path / "a.parquet", schemas.ADVANTAGES)
    assert set(adv["estimator"]) == {"rloo"}
    table = read_table(features_path, schemas.FEATURES)
    expected = compute_advantages(table, "rloo", baseline_shift=-0.1)["advantages"]
    assert adv["advantages"].to_list() == expected.to_list()
    cmp = read_table(tmp_path / "c.parquet", schemas.COMPARISON)
    row = {r["estimator"]: r for r in cmp.iter_rows(named=True)}
    assert list(row) == ["grpo", "reinforce_pp_baseline", "otb", "rloo"] and (cmp["iteration"] == 3).all()
    assert {k: r["baseline_shift"] for k, r in row.items()} == pytest.approx(
        {"grpo": -0.1, "reinforce_pp_baseline": 0.0, "otb": -0.1, "rloo": -0.1}
    )
    for name in ("grpo", "otb"):  # each row is the estimator as it would train under this config
        out = compute_advantages(table, name, baseline_shift=-0.1)
        # on the raw-reward scale: G - baseline on every token (grpo's baseline is mean + delta (std + 1e-6))
        raw = [r - b for r, bs in zip(out["reward"], out["baselines"].to_list()) for b in bs]
        assert row[name]["adv_mean"] == pytest.approx(np.mean(raw), abs=1e-6)
    assert {k: r["normalised"] for k, r in row.items()} == {
        "grpo": True,
        "reinforce_pp_baseline": True,
        "otb": False,
        "rloo": False,
    }
    assert math.isnan(row["otb"]["total_power_normalised"]) and math.isnan(row["rloo"]["expected_a_squared_normalised"])
    assert row["reinforce_pp_baseline"]["adv_mean"] == pytest.approx(0.0, abs=1e-6)  # whitened


# ------------------------------------------------------------------------------------------
# verl's OTB, transcribed as a slow loop. Source: verl/trainer/ppo/core_algos.py,
# compute_optimal_token_baseline_advantage and compute_multi_turn_optimal_token_baseline_advantage
# in volcengine/verl@b178a3cd56f58b2d502255daba591e92833930a7 (2026-01-29; the bodies are the same
# in verl-project/verl@1dda039b9c6311889a9c9a26040677e1254814f9, where handle_zero_tail defaults to
# True), and the truncated IS weights of verl/trainer/ppo/rollout_corr_helper.py,
# compute_rollout_correction_weights (TIS: a single upper threshold), in verl-project/verl@1dda039.
# ------------------------------------------------------------------------------------------


def verl_batch(table):
    """[B, T] float64 tensors as verl holds them: right-padded; response_mask = loss_mask (or 1 on
    the response); token_level_rewards = token_rewards, else the outcome reward on the last valid token."""
    lp = table["logprobs"].to_list()
    B, T = len(lp), max(max((len(x) for x in lp), default=0), 1)

    def pad(rows):
        out = torch.zeros(B, T, dtype=torch.float64)
        for i, r in enumerate(rows):
            out[i, : len(r)] = torch.tensor([float(x) for x in r], dtype=torch.float64)
        return out

    mask = pad(table["loss_mask"].to_list() if "loss_mask" in table.columns else [[1.0] * len(x) for x in lp])
    if "token_rewards" in table.columns:
        rewards = pad(table["token_rewards"].to_list())
    else:
        rewards = torch.zeros(B, T, dtype=torch.float64)
        for i, r in enumerate(table["reward"].to_list()):
            valid = torch.nonzero(mask[i]).flatten()
            if len(valid):
                rewards[i, valid[-1]] = r
    isw = pad(table["is_weights"].to_list()) if "is_weights" in table.columns else None
    return {
        "token_level_rewards": rewards,
        "response_mask": mask,
        "index": np.asarray(table["group_id"].to_list()),
        "old_log_probs": pad(lp),
        "sum_pi_squared": pad(table["sum_pi_sq"].to_list()),
        "rollout_is_weights": isw,
    }


def verl_otb(
    token_level_rewards,
    response_mask,
    index,
    old_log_probs,
    sum_pi_squared,
    rollout_is_weights=None,
    handle_zero_tail=False,
    epsilon=1e-8,
):
    batch_size, seq_len = token_level_rewards.shape
    returns = (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    pi_t = torch.exp(old_log_probs)
    w_per_timestep = 1 - 2 * pi_t + sum_pi_squared
    if rollout_is_weights is not None:
        w_per_timestep = w_per_timestep * (rollout_is_weights**2)
    w_cumulative = (w_per_timestep * response_mask).cumsum(dim=-1)
    prompt_groups = defaultdict(list)
    for i in range(batch_size):
        prompt_groups[index[i]].append(i)
    baselines = torch.zeros_like(returns)
    for _, trajectory_indices in prompt_groups.items():
        N = len(trajectory_indices)
        if N == 1:
            continue
        traj_idx = torch.tensor(trajectory_indices)
        returns_group = returns[traj_idx]
        w_cumulative_group = w_cumulative[traj_idx]
        mask_group = response_mask[traj_idx]
        numerator = (returns_group * w_cumulative_group * mask_group).sum(dim=0)
        denominator = (w_cumulative_group * mask_group).sum(dim=0) + epsilon
        baselines[traj_idx] = (numerator / denominator).unsqueeze(0).expand(N, -1)
        if handle_zero_tail:
            response_lengths = mask_group.sum(dim=-1)
            sorted_lengths, _ = torch.sort(response_lengths)
            max_length = int(sorted_lengths[-1].item())
            second_max_length = int(sorted_lengths[-2].item())
            max_length_idx = (response_lengths == max_length).nonzero(as_tuple=True)[0]
            if max_length_idx.numel() == 1 and max_length > second_max_length:
                baselines[trajectory_indices[int(max_length_idx[0])], second_max_length:] = 0.0
    return (returns - baselines) * response_mask


def verl_tir_otb(
    token_level_rewards,
    response_mask,
    index,
    old_log_probs,
    sum_pi_squared,
    rollout_is_weights=None,
    handle_zero_tail=True,
    epsilon=1e-8,
):
    token_returns = (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    pi_t = torch.exp(old_log_probs)
    w_per_timestep = 1 - 2 * pi_t + sum_pi_squared
    if rollout_is_weights is not None:
        w_per_timestep = w_per_timestep * (rollout_is_weights**2)
    w_cumulative = (w_per_timestep * response_mask).cumsum(dim=-1)
    response_lengths = response_mask.sum(dim=-1).to(dtype=torch.long)
    max_response_length = int(response_lengths.max().item()) if response_lengths.numel() > 0 else 0
    all_w_values = w_cumulative.new_zeros((len(response_lengths), max_response_length))
    all_returns = torch.zeros_like(all_w_values)
    for i in range(len(response_lengths)):
        length = int(response_lengths[i].item())
        if length == 0:
            continue
        mask = response_mask[i].bool()
        all_w_values[i, :length] = w_cumulative[i, mask]
        all_returns[i, :length] = token_returns[i, mask]
    prompt_groups = defaultdict(list)
    for i in range(len(response_lengths)):
        if response_lengths[i] == 0:
            continue
        prompt_groups[index[i]].append(i)
    baselines = torch.zeros_like(all_returns)
    for _, trajectory_indices in prompt_groups.items():
        N = len(trajectory_indices)
        traj_idx = torch.tensor(trajectory_indices)
        if N == 1:
            baselines[traj_idx[0]] = 0.0
            continue
        w_group = all_w_values[traj_idx]
        R_group = all_returns[traj_idx]
        b_star = (R_group * w_group).sum(dim=0) / (w_group.sum(dim=0) + epsilon)
        baselines[traj_idx] = b_star.to(baselines.dtype)
        if handle_zero_tail:
            response_lengths_group = response_lengths[traj_idx]
            sorted_lengths, _ = torch.sort(response_lengths_group)
            max_length = int(sorted_lengths[-1].item())
            second_max_length = int(sorted_lengths[-2].item())
            max_length_idx = (response_lengths_group == max_length).nonzero(as_tuple=True)[0]
            if max_length_idx.numel() == 1 and max_length > second_max_length:
                baselines[trajectory_indices[int(max_length_idx[0])], second_max_length:] = 0.0
    all_advantages = all_returns - baselines
    advantages = torch.zeros_like(token_returns)
    for i in range(len(response_lengths)):
        if response_lengths[i] == 0:
            continue
        advantages[i, response_mask[i].bool()] = all_advantages[i, : response_lengths[i]]
    return advantages * response_mask


def verl_rollout_is_weights(log_ratio, response_mask, rollout_is, threshold):
    if rollout_is == "token":
        raw = torch.exp(torch.clamp(log_ratio, min=-20.0, max=20.0))
    else:
        log_ratio_sum = (log_ratio * response_mask).sum(-1).unsqueeze(-1)
        raw = torch.exp(torch.clamp(log_ratio_sum, min=-20.0, max=20.0)).expand_as(log_ratio)
    return (raw * response_mask).clamp(max=threshold)


def unpad(padded, table):
    return [padded[i, :n].tolist() for i, n in enumerate(table["logprobs"].list.len().to_list())]


def with_extras(table, seed, mask=None, token_rewards=False, isw=False):
    """mask: None | 'trailing' (some responses end in masked tokens, some are fully masked, as
    padding inside the lists) | 'interleaved' (tool-output spans, some responses without a model token)."""
    rng = np.random.default_rng(seed)
    lens = table["logprobs"].list.len().to_list()
    cols = {}
    if mask == "trailing":
        masks = []
        for i, T in enumerate(lens):
            keep = 0 if i % 7 == 3 else int(rng.integers(0, T + 1)) if rng.uniform() < 0.5 else T
            masks.append([t < keep for t in range(T)])
        cols["loss_mask"] = pl.Series(masks, dtype=pl.List(pl.Boolean))
    elif mask == "interleaved":
        cols["loss_mask"] = pl.Series(
            [((rng.uniform(size=T) > 0.3) & (rng.uniform() > 0.1)).tolist() for T in lens], dtype=pl.List(pl.Boolean)
        )
    if token_rewards:
        cols["token_rewards"] = pl.Series(
            [(rng.uniform(size=T) * (rng.uniform(size=T) > 0.8)).tolist() for T in lens], dtype=pl.List(pl.Float32)
        )
    if isw:
        cols["is_weights"] = pl.Series([rng.uniform(0.5, 2.0, T).tolist() for T in lens], dtype=pl.List(pl.Float32))
    return table.with_columns(**cols)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("zero_tail", [True, False])
@pytest.mark.parametrize("mask", [None, "trailing", "interleaved"])
def test_otb_matches_verl(seed, zero_tail, mask):
    table = with_extras(random_table(seed), seed, mask=mask, token_rewards=seed == 1, isw=seed == 2)
    if mask == "trailing":
        assert any(m and not any(m) for m in table["loss_mask"].to_list())  # a fully masked member
    out = compute_advantages(table, "otb", handle_zero_tail=zero_tail)
    assert_lists_close(
        out["advantages"].to_list(), unpad(verl_otb(**verl_batch(table), handle_zero_tail=zero_tail), table)
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("zero_tail", [True, False])
@pytest.mark.parametrize("mask", ["trailing", "interleaved"])
def test_otb_tir_matches_verl(seed, zero_tail, mask):
    table = with_extras(random_table(seed), seed, mask=mask, token_rewards=seed == 1, isw=seed == 2)
    out = compute_advantages(table, "otb_tir", handle_zero_tail=zero_tail)
    expected = verl_tir_otb(**verl_batch(table), handle_zero_tail=zero_tail)
    assert_lists_close(out["advantages"].to_list(), unpad(expected, table))


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_is_weighted_otb_through_the_stages_matches_verl(level, tiny_policy, rollouts_path, tmp_path):
    """The features stage stores truncated IS weights; the advantages stage's OTB and diagnostics
    use them: the advantages equal verl's OTB given verl's own rollout_is_weights, and total_power
    equals verl's proxy 2 with IS (metric_utils.compute_variance_proxy_metrics)."""
    from conftest import tiny_config

    from otbflow.stages import features

    # the rollout engine is the same fp32 model here (rho = 1): shift its stored log-probs so that
    # rho = pi_old / pi_rollout moves on both sides of 1 and beyond the threshold C = 1.3; seeded
    # random 0/1 rewards (the untrained policy solves nothing)
    raw = pl.read_parquet(rollouts_path)
    rng = np.random.default_rng(0)
    shifted = raw.with_columns(
        pl.Series(
            "rollout_logprobs",
            [(np.asarray(x) + rng.normal(0, 0.3, len(x))).tolist() for x in raw["rollout_logprobs"]],
            dtype=schemas.F32L,
        ),
        pl.Series("reward", rng.integers(0, 2, raw.height).astype(float)),
    )
    shifted.write_parquet(tmp_path / "r.parquet")
    cfg = tiny_config(f"train.rollout_is={level}", "train.rollout_is_threshold=1.3")
    features.run(
        cfg,
        features.Args(rollouts=str(tmp_path / "r.parquet"), policy=str(tiny_policy), out=str(tmp_path / "f.parquet")),
    )
    table = read_table(tmp_path / "f.parquet", schemas.FEATURES)
    batch = verl_batch(table.drop("is_weights"))
    log_ratio = (
        batch["old_log_probs"]
        - verl_batch(table.with_columns(pl.col("rollout_logprobs").alias("logprobs")))["old_log_probs"]
    )
    rho = verl_rollout_is_weights(log_ratio, batch["response_mask"], level, 1.3)
    assert_lists_close(table["is_weights"].to_list(), unpad(rho, table), tol=1e-5)
    flat = rho[batch["response_mask"] > 0]
    assert (flat == 1.3).any() and (flat < 1.0).any()  # truncated, and weights below 1
    advantages.run(
        cfg,
        advantages.Args(
            features=[str(tmp_path / "f.parquet")],
            out=str(tmp_path / "a.parquet"),
            comparison=str(tmp_path / "c.parquet"),
        ),
    )
    adv = read_table(tmp_path / "a.parquet", schemas.ADVANTAGES)
    assert adv["estimator"][0] == "otb" and "is_weights" in adv.columns
    batch["rollout_is_weights"] = rho
    expected = verl_otb(**batch, handle_zero_tail=True)
    assert_lists_close(adv["advantages"].to_list(), unpad(expected, table))
    unweighted = verl_otb(**(batch | {"rollout_is_weights": None}), handle_zero_tail=True)
    assert (expected - unweighted).abs().max() > 1e-3  # the weights change the baseline
    # verl's proxy 2 with IS: mean_i (masked mean rho)^2 Abar_i^2 W_i (W before the IS scaling)
    m = batch["response_mask"]
    w = (1 - 2 * batch["old_log_probs"].exp() + batch["sum_pi_squared"]) * m
    abar = (expected * m).sum(-1) / (m.sum(-1) + 1e-8)
    rho_bar = (rho * m).sum(-1) / (m.sum(-1) + 1e-8)
    p2 = float((rho_bar**2 * abar**2 * w.sum(-1).clamp_min(0)).mean())
    cmp = read_table(tmp_path / "c.parquet", schemas.COMPARISON).filter(pl.col("estimator") == "otb")
    assert cmp["total_power"][0] == pytest.approx(p2, rel=1e-4)


def test_token_rewards_give_reward_to_go():
    t = pl.DataFrame(
        {
            "group_id": [1],
            "reward": [0.0],
            "logprobs": [[-0.1] * 4],
            "sum_pi_sq": [[0.9] * 4],
            "token_rewards": [[0.5, 0.0, 1.0, 0.25]],
        }
    )
    assert compute_advantages(t, "none")["advantages"].to_list()[0] == pytest.approx([1.75, 1.25, 1.25, 0.25])


def test_loss_mask_zeroes_tool_tokens():
    table = with_extras(random_table(3), 3, mask="interleaved")
    for name in ("grpo", "otb", "otb_tir", "opo"):
        out = compute_advantages(table, name)
        for adv, m in zip(out["advantages"].to_list(), table["loss_mask"].to_list()):
            assert all(a == 0.0 for a, keep in zip(adv, m) if not keep)


def test_leave_one_out_estimators_are_unbiased():
    """Exact expectation over every group of N = 3 i.i.d. draws from a 4-way softmax policy.

    Response y has length T_y; the score of a response is d log pi(y) / d theta = e_y - pi.
    E[(1/N) sum_i A_i (e_{y_i} - pi)] must equal the true gradient sum_y pi(y) r(y) (e_y - pi)
    for leave-one-out baselines; a self-inclusive mean baseline shrinks it by (N-1)/N."""
    import itertools

    theta = np.array([0.3, -0.5, 1.0, 0.1])
    pi = np.exp(theta) / np.exp(theta).sum()
    r = np.array([1.0, 0.0, 0.5, 2.0])
    T = [3, 7, 1, 12]
    N = 3
    true_grad = sum(pi[y] * r[y] * (np.eye(4)[y] - pi) for y in range(4))
    outcomes = list(itertools.product(range(4), repeat=N))
    rows = [
        {"group_id": g, "reward": r[y], "logprobs": [float(np.log(pi[y]))] * T[y], "sum_pi_sq": [0.5] * T[y]}
        for g, ys in enumerate(outcomes)
        for y in ys
    ]
    table = pl.DataFrame(rows)

    def expected_gradient(name, **opt):
        adv = [a[0] for a in compute_advantages(table, name, **opt)["advantages"].to_list()]
        total = np.zeros(4)
        for g, ys in enumerate(outcomes):
            p = np.prod([pi[y] for y in ys])
            total += p * sum(adv[g * N + i] * (np.eye(4)[y] - pi) for i, y in enumerate(ys)) / N
        return total

    np.testing.assert_allclose(expected_gradient("rloo"), true_grad, atol=1e-6)
    np.testing.assert_allclose(
        expected_gradient("length_power", exponent=1.5, leave_one_out=True), true_grad, atol=1e-6
    )
    np.testing.assert_allclose(expected_gradient("none"), true_grad, atol=1e-6)
    # the enumeration is sensitive: a self-inclusive group mean is biased by (N-1)/N
    np.testing.assert_allclose(expected_gradient("grpo", std_normalize=False), true_grad * (N - 1) / N, atol=1e-6)


def test_estimator_options_come_from_the_config():
    from conftest import tiny_config

    cfg = tiny_config("advantages.estimator=length_power", "advantages.exponent=1.5", "advantages.baseline_shift=-0.1")
    assert advantages.estimator_options(cfg, "length_power") == {
        "exponent": 1.5,
        "leave_one_out": False,
        "baseline_shift": -0.1,
    }
    assert advantages.estimator_options(cfg, "otb") == {"handle_zero_tail": True, "baseline_shift": -0.1}


# ------------------------------------------------------------------------------------------
# Non-finite inputs are refused where they are read, naming the row, its group and the token
# (issue 35, item 5: one NaN log-prob made every advantage of 1,024 rows NaN, exit 0)
# ------------------------------------------------------------------------------------------


def poisoned(table, column, *cells):
    """``table`` with ``column``'s entries at the (row, token) ``cells`` replaced by the values
    given with them (token None: a per-row column's value)."""
    values = table[column].to_list()
    for row, token, value in cells:
        if token is None:
            values[row] = value
        else:
            values[row][token] = value
    return table.with_columns(pl.Series(column, values, dtype=table.schema[column]))


def first_non_finite(table, column):
    """(row, token) of the first non-finite entry, one row and one token at a time."""
    for i, value in enumerate(table[column].to_list()):
        for t, v in enumerate(value if isinstance(value, list) else [value]):
            if not math.isfinite(v):
                return i, (t if isinstance(value, list) else None)
    return None


@pytest.mark.parametrize(
    "estimator, column", [("grpo", "logprobs"), ("otb", "logprobs"), ("otb", "sum_pi_sq"), ("rloo", "reward")]
)
def test_an_estimator_refuses_a_non_finite_input_naming_the_row_and_token(estimator, column):
    t = random_table(0)
    first, later = [i for i, x in enumerate(t["logprobs"]) if len(x) >= 3][2:4]
    if column == "reward":
        bad = poisoned(t, column, (later, None, float("inf")), (first, None, float("nan")))
    else:
        bad = poisoned(t, column, (later, 0, float("-inf")), (first, 2, float("nan")))
    row, token = first_non_finite(bad, column)
    where = rf"row {row} \(group_id {bad['group_id'][row]}\)" + (f" token {token}" if token is not None else "")
    with pytest.raises(SchemaError, match=rf"estimator '{estimator}' input: column '{column}' {where}: .* \(2 rows"):
        compute_advantages(bad, estimator)


def test_an_estimator_reads_only_its_own_columns():
    """GRPO reads no sum_pi_sq: a NaN there is not its concern (the stage refuses it; see below)."""
    t = random_table(0)
    bad = poisoned(t, "sum_pi_sq", ([i for i, x in enumerate(t["logprobs"]) if len(x) >= 3][0], 2, float("nan")))
    assert compute_advantages(bad, "grpo")["advantages"].equals(compute_advantages(t, "grpo")["advantages"])


@pytest.mark.parametrize(
    "column, token",
    [
        ("logprobs", 2),
        ("rollout_logprobs", 0),
        ("entropy", 1),
        ("sum_pi_sq", 3),
        ("proxy", 2),
        ("k3", 0),
        ("reward", None),
    ],
)
def test_the_stage_refuses_a_non_finite_feature_before_any_output(features_path, tmp_path, column, token):
    from conftest import tiny_config

    table = read_table(features_path, schemas.FEATURES)
    row = 5
    assert table["response_length"][row] > (token or 0)
    bad = poisoned(table, column, (row, token, float("nan")))
    path = tmp_path / "shard_0.parquet"
    bad.write_parquet(path)
    assert first_non_finite(bad, column) == (row, token)
    args = advantages.Args(
        features=[str(path)], out=str(tmp_path / "a.parquet"), comparison=str(tmp_path / "c.parquet")
    )
    where = rf"row {row} \(group_id {table['group_id'][row]}\)" + (f" token {token}" if token is not None else "")
    with pytest.raises(SchemaError, match=rf"shard_0.parquet: column '{column}' {where}: nan is not a finite number"):
        advantages.run(tiny_config(), args)
    assert not (tmp_path / "a.parquet").exists() and not (tmp_path / "c.parquet").exists()


def test_the_stage_takes_one_iterations_shards_each_once(features_path, tmp_path):
    """Issue 35: the stage merged a shard given twice (groups of 2G responses) and shards of
    different iterations. It refuses them, and a group_id in two files, naming the files."""
    from conftest import tiny_config

    table = read_table(features_path, schemas.FEATURES)
    assert table["shard"].unique().to_list() == [0] and table["iteration"].unique().to_list() == [0]

    def run(*tables_or_paths):
        paths = []
        for i, t in enumerate(tables_or_paths):
            if isinstance(t, pl.DataFrame):
                t.write_parquet(tmp_path / f"f{i}.parquet")
                t = tmp_path / f"f{i}.parquet"
            paths.append(str(t))
        args = advantages.Args(features=paths, out=str(tmp_path / "a.parquet"), comparison=str(tmp_path / "c.parquet"))
        advantages.run(tiny_config(), args)

    shard1 = table.with_columns(pl.lit(1, pl.Int64).alias("shard"), pl.col("group_id") + 1000)
    with pytest.raises(SchemaError, match=r"--features: .*shard_0.parquet is given twice"):
        run(features_path, features_path)
    with pytest.raises(
        SchemaError, match=r"shards of different iterations: .*f0.parquet \(iteration 0\), .*f1.parquet \(iteration 1\)"
    ):
        run(table, shard1.with_columns(pl.lit(1, pl.Int64).alias("iteration")))
    with pytest.raises(SchemaError, match=r"--features: shard 0 is in .*f0.parquet and in .*f1.parquet"):
        run(table, table)  # a copy of one shard under another name
    group = table["group_id"][0]
    with pytest.raises(SchemaError, match=rf"--features: group_id {group} is in .*f0.parquet and in .*f1.parquet"):
        run(table, table.with_columns(pl.lit(1, pl.Int64).alias("shard")))
    assert not (tmp_path / "a.parquet").exists() and not (tmp_path / "c.parquet").exists()
    run(table, shard1)  # two shards of one iteration
    assert read_table(tmp_path / "a.parquet", schemas.ADVANTAGES).height == 2 * table.height
