"""Estimators against slow, obviously correct loop references, on random ragged batches."""

import math

import numpy as np
import polars as pl
import pytest

from otbflow import advantages, schemas
from otbflow.advantages import ESTIMATORS, compute_advantages, diagnostics
from otbflow.io import SchemaError, read_table


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
            row = {"group_id": 100 + g, "reward": 1.0 if equal else float(rng.integers(0, 2)),
                   "logprobs": logp.tolist(), "sum_pi_sq": spp.tolist()}
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
    shift = opt.get("baseline_shift", 0.0)
    adv = [[(R[i] - base[i] - shift) / scale[i]] * T[i] for i in range(len(R))]
    if kind == "reinforce_pp_baseline":  # whiten over every valid token of the batch
        flat = [a for row in adv for a in row]
        mu = sum(flat) / len(flat)
        var = sum((a - mu) ** 2 for a in flat) / (len(flat) - 1)
        adv = [[(a - mu) / math.sqrt(var + 1e-8) for a in row] for row in adv]
    return [[base[i] + shift] * T[i] for i in range(len(R))], adv


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
        np.testing.assert_allclose(np.asarray(a, dtype=np.float64), np.asarray(e, dtype=np.float64), atol=tol, rtol=1e-5)


CASES = [
    ("grpo", {}), ("grpo", {"std_normalize": False}), ("grpo", {"baseline_shift": -0.1}),
    ("rloo", {}), ("opo", {}), ("none", {}), ("reinforce_pp_baseline", {}),
    ("length_power", {"exponent": 0.0}), ("length_power", {"exponent": 1.58}),
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
    assert_lists_close(compute_advantages(table, "eob")["advantages"].to_list(),
                       compute_advantages(table, "opo")["advantages"].to_list())


def test_identities():
    table = random_table(7)
    lp0 = compute_advantages(table, "length_power", exponent=0.0)["advantages"].to_list()
    assert_lists_close(lp0, compute_advantages(table, "grpo", std_normalize=False)["advantages"].to_list())
    lp1 = compute_advantages(table, "length_power", exponent=1.0)["advantages"].to_list()
    assert_lists_close(lp1, compute_advantages(table, "opo")["advantages"].to_list())


def test_otb_with_constant_energy_is_mean_over_alive():
    # pi = 0.5 and sum_pi_sq = 0.5 give w = 1 - 1 + 0.5 = 0.5 on every token: W_t = 0.5 (t+1)
    # for every alive sequence, so B_t is the plain mean reward of the sequences alive at t.
    rows = [{"group_id": 1, "reward": r, "logprobs": [math.log(0.5)] * T, "sum_pi_sq": [0.5] * T}
            for r, T in [(1.0, 3), (0.0, 5), (1.0, 5), (0.0, 2)]]
    out = compute_advantages(pl.DataFrame(rows), "otb", handle_zero_tail=False)
    b = out["baselines"].to_list()
    np.testing.assert_allclose(b[1], [0.5, 0.5, 2 / 3, 0.5, 0.5], atol=1e-6)


def test_group_of_one_and_all_equal():
    rows = [{"group_id": 1, "reward": 1.0, "logprobs": [-0.5] * 4, "sum_pi_sq": [0.6] * 4},
            {"group_id": 2, "reward": 1.0, "logprobs": [-0.5] * 3, "sum_pi_sq": [0.6] * 3},
            {"group_id": 2, "reward": 1.0, "logprobs": [-0.5] * 3, "sum_pi_sq": [0.6] * 3}]
    t = pl.DataFrame(rows)
    otb = compute_advantages(t, "otb")["advantages"].to_list()
    assert otb[0] == [1.0] * 4  # singleton: REINFORCE, A = G
    # all equal and tied for longest (no zero-tail): A = 0 up to the eps = 1e-8 of the denominator
    np.testing.assert_allclose(otb[1] + otb[2], [0.0] * 6, atol=1e-7)
    grpo = compute_advantages(t, "grpo")["advantages"].to_list()
    assert grpo[0][0] == pytest.approx(1 / (1 + 1e-6)) and grpo[1] == [0.0] * 3


def test_bad_input_errors():
    t = random_table(0)
    with pytest.raises(ValueError, match="unknown estimator 'foo'; registered: .*otb"):
        compute_advantages(t, "foo")
    with pytest.raises(SchemaError, match="estimator 'otb' needs column 'sum_pi_sq'"):
        compute_advantages(t.drop("sum_pi_sq"), "otb")
    with pytest.raises(SchemaError, match="estimator 'eob' needs column 'grad_sq_norm'"):
        compute_advantages(t, "eob")
    bad = t.with_columns(pl.when(pl.int_range(pl.len()) == 4).then(float("nan")).otherwise(pl.col("reward")).alias("reward"))
    with pytest.raises(SchemaError, match=r"row 4 \(group_id 101\)"):
        compute_advantages(bad, "grpo")
    ragged = t.with_columns(pl.when(pl.int_range(pl.len()) == 3).then(pl.col("sum_pi_sq").list.slice(1))
                            .otherwise(pl.col("sum_pi_sq")).alias("sum_pi_sq"))
    with pytest.raises(SchemaError, match="row 3: 'sum_pi_sq'"):
        compute_advantages(ragged, "otb")


def test_registry_is_one_decorated_function():
    @advantages.register("half_mean_test")
    def half_mean(b, baseline_shift=0.0):
        """Half the group mean (test only)."""
        return advantages._with_seq_baseline(b, 0.5 * advantages._group_mean(b, b.reward), baseline_shift)

    try:
        out = compute_advantages(random_table(1), "half_mean_test")
        assert "advantages" in out.columns
    finally:
        del ESTIMATORS["half_mean_test"]


def test_diagnostics_and_stage(features_path, cfg, tmp_path):
    table = read_table(features_path, schemas.FEATURES)
    d = diagnostics(compute_advantages(table, "otb"))
    assert d["total_power"] >= 0 and 0 <= d["zero_adv_fraction"] <= 1
    assert d["pessimism"] == pytest.approx(d["reward_mean"] - d["baseline_mean"])
    advantages.run(cfg, advantages.Args(features=[str(features_path)], out=str(tmp_path / "a.parquet"),
                                        comparison=str(tmp_path / "c.parquet"), iteration=3))
    adv = read_table(tmp_path / "a.parquet", schemas.ADVANTAGES)
    assert set(adv["estimator"]) == {cfg.advantages.estimator}
    cmp = read_table(tmp_path / "c.parquet", schemas.COMPARISON)
    assert set(cmp["estimator"]) == set(cfg.advantages.compare) | {cfg.advantages.estimator}
    assert (cmp["iteration"] == 3).all()


def ref_otb_general(table, handle_zero_tail=True, tir=False):
    """OTB with token rewards (reward-to-go), IS weights and, for TIR, compacted positions."""
    R = table["reward"].to_list()
    lp = table["logprobs"].to_list()
    sp = table["sum_pi_sq"].to_list()
    n = len(R)
    masks = table["loss_mask"].to_list() if "loss_mask" in table.columns else [[True] * len(x) for x in lp]
    isw = table["is_weights"].to_list() if "is_weights" in table.columns else [[1.0] * len(x) for x in lp]
    if "token_rewards" in table.columns:
        tr = table["token_rewards"].to_list()
        G = [[sum(tr[i][k] * masks[i][k] for k in range(t, len(lp[i]))) for t in range(len(lp[i]))] for i in range(n)]
    else:
        G = [[R[i]] * len(lp[i]) for i in range(n)]
    # per sequence: positions used (absolute, or the model tokens only) and W along them
    idx = [[t for t in range(len(lp[i])) if masks[i][t] or not tir] for i in range(n)]
    W = []
    for i in range(n):
        acc, cum = 0.0, []
        for t in idx[i]:
            w = max(0.0, 1 - 2 * math.exp(lp[i][t]) + sp[i][t]) * isw[i][t] ** 2
            acc += w * masks[i][t]
            cum.append(acc)
        W.append(cum)
    L = [len(x) for x in idx]
    adv = [[0.0] * len(lp[i]) for i in range(n)]
    for _, members in groups_of(table).items():
        members = [j for j in members if L[j] > 0] if tir else members
        alive_n = len([j for j in members if L[j] > 0]) if not tir else len(members)
        tail_from = {}
        if handle_zero_tail and len(members) >= 2:
            lens = sorted((L[j] for j in members), reverse=True)
            if lens[0] > lens[1]:
                tail_from[next(j for j in members if L[j] == lens[0])] = lens[1]
        for i in members:
            for k, t in enumerate(idx[i]):
                alive = [j for j in members if L[j] > k]
                num = sum(W[j][k] * G[j][idx[j][k]] * masks[j][idx[j][k]] for j in alive)
                den = sum(W[j][k] * masks[j][idx[j][k]] for j in alive)
                b = num / (den + 1e-8) if alive_n > 1 else 0.0
                if i in tail_from and k >= tail_from[i]:
                    b = 0.0
                adv[i][t] = (G[i][t] - b) * masks[i][t]
    return adv


def with_extras(table, seed, mask=False, token_rewards=False, isw=False):
    rng = np.random.default_rng(seed)
    lens = table["logprobs"].list.len().to_list()
    cols = {}
    if mask:
        cols["loss_mask"] = pl.Series([(rng.uniform(size=T) > 0.3).tolist() for T in lens], dtype=pl.List(pl.Boolean))
    if token_rewards:
        cols["token_rewards"] = pl.Series([(rng.uniform(size=T) * (rng.uniform(size=T) > 0.8)).tolist() for T in lens],
                                          dtype=pl.List(pl.Float32))
    if isw:
        cols["is_weights"] = pl.Series([rng.uniform(0.5, 2.0, T).tolist() for T in lens], dtype=pl.List(pl.Float32))
    return table.with_columns(**cols)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_otb_tir_matches_loop(seed):
    table = with_extras(random_table(seed), seed, mask=True)
    out = compute_advantages(table, "otb_tir")
    assert_lists_close(out["advantages"].to_list(), ref_otb_general(table, tir=True))


@pytest.mark.parametrize("seed", [0, 1])
def test_otb_with_token_rewards_and_is_weights_matches_loop(seed):
    table = with_extras(random_table(seed), seed, token_rewards=True, isw=True)
    out = compute_advantages(table, "otb")
    assert_lists_close(out["advantages"].to_list(), ref_otb_general(table))


def test_token_rewards_give_reward_to_go():
    t = pl.DataFrame({"group_id": [1], "reward": [0.0], "logprobs": [[-0.1] * 4],
                      "sum_pi_sq": [[0.9] * 4], "token_rewards": [[0.5, 0.0, 1.0, 0.25]]})
    assert compute_advantages(t, "none")["advantages"].to_list()[0] == pytest.approx([1.75, 1.25, 1.25, 0.25])


def test_loss_mask_zeroes_tool_tokens():
    table = with_extras(random_table(3), 3, mask=True)
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
    rows = [{"group_id": g, "reward": r[y], "logprobs": [float(np.log(pi[y]))] * T[y], "sum_pi_sq": [0.5] * T[y]}
            for g, ys in enumerate(outcomes) for y in ys]
    table = pl.DataFrame(rows)

    def expected_gradient(name, **opt):
        adv = [a[0] for a in compute_advantages(table, name, **opt)["advantages"].to_list()]
        total = np.zeros(4)
        for g, ys in enumerate(outcomes):
            p = np.prod([pi[y] for y in ys])
            total += p * sum(adv[g * N + i] * (np.eye(4)[y] - pi) for i, y in enumerate(ys)) / N
        return total

    np.testing.assert_allclose(expected_gradient("rloo"), true_grad, atol=1e-6)
    np.testing.assert_allclose(expected_gradient("length_power", exponent=1.5, leave_one_out=True), true_grad, atol=1e-6)
    np.testing.assert_allclose(expected_gradient("none"), true_grad, atol=1e-6)
    # the enumeration is sensitive: a self-inclusive group mean is biased by (N-1)/N
    np.testing.assert_allclose(expected_gradient("grpo", std_normalize=False), true_grad * (N - 1) / N, atol=1e-6)


def test_estimator_options_come_from_the_config():
    from conftest import tiny_config

    cfg = tiny_config("advantages.estimator=length_power", "advantages.exponent=1.5", "advantages.baseline_shift=-0.1")
    assert advantages.estimator_options(cfg, "length_power") == {"exponent": 1.5, "leave_one_out": False,
                                                                 "baseline_shift": -0.1}
    assert advantages.estimator_options(cfg, "otb") == {"handle_zero_tail": True, "baseline_shift": -0.1}
