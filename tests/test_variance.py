"""The offline variance study: its pieces against plain loops and autograd, and the stage."""

from __future__ import annotations

import itertools

import numpy as np
import polars as pl
import pytest
import torch
from conftest import tiny_config

from otbflow import schemas
from otbflow.io import read_table, write_parquet
from otbflow.stages import variance, variance_pool
from otbflow.studies.variance_study import (
    CountSketch,
    center_scores,
    group_gradients,
    resample_groups,
    study,
    token_gradients,
)


def every_pair_group(prompt: list[int]) -> pl.DataFrame:
    """Every ordered pair of a prompt's pool rows as one group of N = 2 (the exact enumeration
    of the resampling with replacement), for each prompt id in ``prompt``."""
    groups = {"pool_row": [], "prompt_id": [], "group_id": []}
    for p in sorted(set(prompt)):
        for combo in itertools.product([j for j in range(len(prompt)) if prompt[j] == p], repeat=2):
            gid = len(groups["group_id"]) // 2
            groups["pool_row"] += combo
            groups["prompt_id"] += [p, p]
            groups["group_id"] += [gid, gid]
    return pl.DataFrame(groups, schema={"pool_row": pl.Int64, "prompt_id": pl.Int64, "group_id": pl.Int64})


def test_token_gradients_are_the_per_token_scores(tiny_policy):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_policy, local_files_only=True)
    prompt, response = [5, 6, 7], [8, 9, 10, 4]
    s = token_gradients(model, prompt, response, temperature=0.7, pad_id=0)
    params = list(model.parameters())
    assert s.shape == (4, sum(p.numel() for p in params))
    ids = torch.tensor([prompt + response])
    logp = torch.log_softmax(model(ids).logits[0, 2:6].float() / 0.7, -1)[torch.arange(4), torch.tensor(response)]
    for t in (0, 3):
        g = torch.cat([x.reshape(-1) for x in torch.autograd.grad(logp[t], params, retain_graph=True)])
        torch.testing.assert_close(s[t], g, atol=1e-5, rtol=1e-4)


def test_sketched_token_gradients_sketch_the_exact_ones(tiny_policy):
    """The block-by-block sketch of the variance stage is the sketch of the exact [T, D] matrix:
    a loop over coordinates, bucket by bucket, on the exact gradients."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_policy, local_files_only=True)
    exact = token_gradients(model, [5, 6, 7], [8, 9, 10], temperature=0.7, pad_id=0).double()
    sk = CountSketch(exact.shape[1], 64, seed=3)
    fast = token_gradients(model, [5, 6, 7], [8, 9, 10], temperature=0.7, pad_id=0, sketch=sk)
    slow = torch.zeros(3, 64, dtype=torch.float64)
    for j in range(exact.shape[1]):
        slow[:, int(sk.bucket[j])] += float(sk.sign[j]) * exact[:, j]
    torch.testing.assert_close(fast.double(), slow, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(fast, sk(exact.float()), atol=0, rtol=0)  # the same sums in the same order
    with pytest.raises(ValueError, match="blocks hold 10 coordinates"):
        sk.of_blocks([exact[:, :10].float()])


def test_count_sketch_preserves_inner_products():
    x, y = torch.randn(2, 50_000, dtype=torch.float64)
    y = 0.5 * x + y
    sk = CountSketch(50_000, 16_384, seed=0)
    sx, sy = sk(torch.stack([x, y]))
    assert float(sx @ sx) == pytest.approx(float(x @ x), rel=0.05)
    assert float(sx @ sy) == pytest.approx(float(x @ y), rel=0.05)


def test_group_gradients_match_a_loop():
    rng = np.random.default_rng(0)
    lengths = np.array([3, 1, 4, 2])
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    grads = torch.from_numpy(rng.normal(size=(lengths.sum(), 5)))
    pool_row = np.array([0, 2, 2, 3, 1, 0])  # 3 groups of 2, a row drawn twice in group 1
    group = np.array([0, 0, 1, 1, 2, 2])
    adv = pl.Series([rng.normal(size=lengths[r]).tolist() for r in pool_row], dtype=pl.List(pl.Float64))
    g = group_gradients(adv, pool_row, offsets, group, 3, 2, grads)
    for r in range(3):
        expected = (
            sum(
                torch.tensor(a, dtype=torch.float64) @ grads[offsets[p] : offsets[p] + lengths[p]]
                for p, a, gr in zip(pool_row, adv.to_list(), group)
                if gr == r
            )
            / 2
        )
        torch.testing.assert_close(g[r], expected)


def center_by_loop(grads, prompt, lengths):
    """Each token's score minus the mean score at its position over the responses of its prompt
    that have a token there: a loop over prompts, positions and responses."""
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(int)
    out = grads.clone().double()
    for p in set(prompt):
        rows = [j for j in range(len(lengths)) if prompt[j] == p]
        for t in range(max(lengths[j] for j in rows)):
            alive = [j for j in rows if lengths[j] > t]
            mean = sum(grads[starts[j] + t].double() for j in alive) / len(alive)
            for j in alive:
                out[starts[j] + t] = grads[starts[j] + t].double() - mean
    return out


def test_centering_makes_each_position_and_sequence_mean_zero():
    pool = pl.DataFrame({"prompt_id": [0, 0, 1, 1, 1], "response_length": [2, 3, 1, 0, 2]})
    grads = torch.randn(8, 4, dtype=torch.float64)
    c = center_scores(grads, pool)
    torch.testing.assert_close(c, center_by_loop(grads, [0, 0, 1, 1, 1], [2, 3, 1, 0, 2]))
    zero = torch.zeros(4, dtype=torch.float64)
    torch.testing.assert_close(c[0] + c[2], zero)  # prompt 0, position 0
    torch.testing.assert_close(c[4], zero)  # position 2 of prompt 0: one response, its score is 0
    seq = [c[0:2].sum(0), c[2:5].sum(0), c[5:6].sum(0), c[6:8].sum(0)]
    torch.testing.assert_close(seq[0] + seq[1], zero)  # so the sequence scores sum to zero too
    torch.testing.assert_close(seq[2] + seq[3], zero)


def test_resampling_is_seeded_and_per_prompt():
    pool = pl.DataFrame({"prompt_id": [3, 3, 3, 7, 7]})
    a, b = resample_groups(pool, 4, 10, seed=1), resample_groups(pool, 4, 10, seed=1)
    assert a.equals(b) and a.height == 2 * 10 * 4 and a["group_id"].n_unique() == 20
    rows = a.with_columns(pl.col("pool_row").cast(pl.Int64)).group_by("prompt_id").agg(pl.col("pool_row").unique())
    assert {k: sorted(v) for k, v in rows.iter_rows()} == {3: [0, 1, 2], 7: [3, 4]}


@pytest.fixture(scope="module")
def pool_path(tmp_path_factory, tiny_policy, data_dir):
    """8 responses to each of 4 prompts from the tiny policy, with seeded random 0/1 rewards (the
    untrained policy solves nothing)."""
    out = tmp_path_factory.mktemp("pool")
    variance_pool.run(
        tiny_config("variance.pool_size=8", "variance.pool_prompts=4"),
        variance_pool.Args(
            prompts=str(data_dir / "train" / "shard_0.parquet"), policy=str(tiny_policy), out=str(out / "raw.parquet")
        ),
    )
    df = read_table(out / "raw.parquet", schemas.ROLLOUTS)
    assert df.height == 32 and df["prompt_id"].n_unique() == 4
    rewards = np.random.default_rng(0).integers(0, 2, df.height).astype(float)
    return write_parquet(df.with_columns(pl.Series("reward", rewards)), out / "pool.parquet")


def test_variance_stage(pool_path, tiny_policy, tmp_path):
    cfg = tiny_config("variance.resamples=300")
    variance.run(cfg, variance.Args(rollouts=[str(pool_path)], policy=str(tiny_policy), out_dir=str(tmp_path)))
    s = read_table(tmp_path / "summary.parquet", schemas.VARIANCE)
    assert s["estimator"].to_list() == ["none", "rloo", "grpo", "opo", "length_power", "otb", "eob"]
    row = {r["estimator"]: r for r in s.iter_rows(named=True)}
    assert row["rloo"]["trace_cov"] < row["none"]["trace_cov"]  # a baseline removes variance
    # leave-one-out is unbiased: its bias is within the Monte-Carlo noise; the group mean is
    # (N-1)/N x RLOO exactly, so the same noise-to-signal ratio, a shrunk variance and a bias
    assert abs(row["rloo"]["sq_bias"]) < 3 * row["rloo"]["sq_bias_noise"]
    assert row["grpo"]["noise_to_signal"] == pytest.approx(row["rloo"]["noise_to_signal"], rel=1e-6)
    assert row["grpo"]["trace_cov"] == pytest.approx(row["rloo"]["trace_cov"] * (3 / 4) ** 2, rel=1e-6)
    assert row["grpo"]["sq_bias"] > 3 * row["grpo"]["sq_bias_noise"]
    assert (tmp_path / "variance.png").read_bytes()[:4] == b"\x89PNG" and (tmp_path / "summary.json").is_file()


def test_sketched_and_exact_studies_agree(pool_path, tiny_policy, tmp_path):
    out = {}
    for k in (0, 16384):
        cfg = tiny_config(f"variance.sketch_dim={k}", "variance.resamples=50", "variance.estimators=[otb]")
        variance.run(
            cfg, variance.Args(rollouts=[str(pool_path)], policy=str(tiny_policy), out_dir=str(tmp_path / str(k)))
        )
        out[k] = read_table(tmp_path / str(k) / "summary.parquet", schemas.VARIANCE)
    np.testing.assert_allclose(out[16384]["trace_cov"].to_numpy(), out[0]["trace_cov"].to_numpy(), rtol=0.05)


def test_study_equals_an_exact_enumeration_of_all_groups():
    """A pool of 3 responses to each of 2 prompts with known per-token score vectors. Evaluated on
    all 3^2 ordered groups of N = 2 (each equally likely under i.i.d. draws), every estimator's
    trace_cov must be the sample covariance of g_hat = (1/N) sum_i A_i S~_i over those 9 groups,
    with S~_i the sum of the response's centred token scores (``center_by_loop``), computed here by
    loops; EOB's weights are ||S~_i||^2 (not ||S_i||^2)."""
    rng = np.random.default_rng(4)
    lengths = [2, 1, 3, 1, 2, 2]
    prompt = [0, 0, 0, 1, 1, 1]
    reward = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    dim = 5
    grads = torch.from_numpy(rng.normal(size=(sum(lengths), dim)))
    grads[:6] += 3.0  # prompt 0's scores have a large common mean: centring matters for EOB
    pool = pl.DataFrame({"prompt_id": prompt, "group_id": prompt, "response_length": lengths, "reward": reward})
    stats = [{"logprobs": [-0.5] * n, "sum_pi_sq": [0.5] * n} for n in lengths]
    groups = every_pair_group(prompt)
    cfg = tiny_config("variance.estimators=[rloo,grpo,opo]", "variance.sketch_dim=0")
    got = {r["estimator"]: r for r in study(cfg, pool, grads, stats, groups).iter_rows(named=True)}
    assert list(got) == ["none", "rloo", "grpo", "opo", "eob"]

    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    S = np.stack([grads[starts[j] : starts[j] + lengths[j]].sum(0).numpy() for j in range(6)])
    c = center_by_loop(grads, prompt, lengths).numpy()
    S_c = np.stack([c[starts[j] : starts[j] + lengths[j]].sum(0) for j in range(6)])
    n_c, n_raw = (S_c**2).sum(1), (S**2).sum(1)

    def baseline(name, i, others, members, norms):
        R = [reward[j] for j in members]
        if name == "none":
            return 0.0
        if name == "rloo":
            return sum(reward[j] for j in others) / len(others)
        if name == "grpo":
            return sum(R) / len(R)
        if name == "opo":
            return sum(lengths[j] * reward[j] for j in members) / sum(lengths[j] for j in members)
        return sum(norms[j] * reward[j] for j in members) / (sum(norms[j] for j in members) + 1e-8)  # eob

    def trace_covs(name, norms=n_c):
        out = []
        for p in (0, 1):
            rows = [j for j in range(6) if prompt[j] == p]
            g = []
            for combo in itertools.product(rows, repeat=2):
                g.append(
                    sum(
                        (reward[i] - baseline(name, i, [combo[1 - k]], combo, norms)) * S_c[i]
                        for k, i in enumerate(combo)
                    )
                    / 2
                )
            out.append(np.trace(np.cov(np.array(g), rowvar=False)))
        return np.array(out)

    ref_none = trace_covs("none")  # (advantages are stored as float32: agreement to 1e-6)
    for name in got:
        expected = trace_covs(name)
        assert got[name]["trace_cov"] == pytest.approx(expected.mean(), rel=1e-6), name
        diff = expected - ref_none
        assert got[name]["trace_cov_diff"] == pytest.approx(diff.mean(), rel=1e-6, abs=1e-6), name
        assert got[name]["trace_cov_diff_se"] == pytest.approx(diff.std(ddof=1) / np.sqrt(2), rel=1e-6, abs=1e-6)
    # the oracle's weights are the centred norms; the uncentred ones give a different variance
    assert abs(trace_covs("eob", n_raw).mean() - got["eob"]["trace_cov"]) > 0.01 * got["eob"]["trace_cov"]
    # REINFORCE analytically: the mean of N i.i.d. draws has covariance Cov(R S~) / N (the
    # population covariance over the 3 equally likely responses), times 9/8 for the unbiased
    # sample covariance over the 9 groups
    analytic = []
    for p in (0, 1):
        x = np.array([reward[j] * S_c[j] for j in range(6) if prompt[j] == p])
        analytic.append(((x - x.mean(0)) ** 2).sum(1).mean() / 2 * 9 / 8)
    assert got["none"]["trace_cov"] == pytest.approx(np.mean(analytic), rel=1e-6)


def test_a_baseline_of_position_and_other_members_is_unbiased_in_the_pool():
    """Issue 22 point 7. B_{i,t} = the mean reward of the group's other members that have a token t
    depends on the position and on the other members only, so under the policy E[B s_t] = 0 and
    the estimator is unbiased. Over all 3^2 ordered groups of N = 2 of each prompt (an exact
    enumeration of the pool's i.i.d. draws) the mean of g_hat - g_hat(REINFORCE) must then be 0:
    the study's sq_bias + sq_bias_noise (the squared norm of that mean) is 0. With the scores
    centred per sequence only (each prompt's sequence scores summing to zero, the study before
    issue 22) the same enumeration, by a loop, gives a clearly non-zero mean."""
    from otbflow.algorithms.estimators import ESTIMATORS, register

    @register("others_alive_mean_test")
    def others_alive_mean_test(b):
        """Mean reward of the other members alive at t (0 if none)."""
        base = np.zeros(len(b.returns))
        for i in range(len(b.lengths)):
            for t in range(b.lengths[i]):
                others = [j for j in range(len(b.lengths)) if j != i and b.group[j] == b.group[i] and b.lengths[j] > t]
                base[b.offsets[i] + t] = np.mean(b.reward[others]) if others else 0.0
        return base, b.returns - base

    try:
        rng = np.random.default_rng(5)
        lengths = [2, 1, 3, 1, 2, 3]
        prompt = [0, 0, 0, 1, 1, 1]
        reward = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0]
        grads = torch.from_numpy(rng.normal(size=(sum(lengths), 4)))
        pool = pl.DataFrame({"prompt_id": prompt, "group_id": prompt, "response_length": lengths, "reward": reward})
        stats = [{"logprobs": [-0.5] * n, "sum_pi_sq": [0.5] * n} for n in lengths]
        groups = every_pair_group(prompt)
        cfg = tiny_config("variance.estimators=[others_alive_mean_test]", "variance.sketch_dim=0")
        got = {r["estimator"]: r for r in study(cfg, pool, grads, stats, groups).iter_rows(named=True)}
        row = got["others_alive_mean_test"]
        assert abs(row["sq_bias"] + row["sq_bias_noise"]) < 1e-10

        def mean_bias_sq(centred):  # ||E[g_hat - g_hat_none]||^2 per prompt, averaged: -(1/N) sum_i sum_t B s
            starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
            out = []
            for p in (0, 1):
                rows = [j for j in range(6) if prompt[j] == p]
                d = []
                for combo in itertools.product(rows, repeat=2):
                    total = np.zeros(4)
                    for k, i in enumerate(combo):
                        other = combo[1 - k]
                        for t in range(lengths[i]):
                            b = reward[other] if lengths[other] > t else 0.0
                            total -= b * centred[starts[i] + t] / 2
                    d.append(total)
                out.append((np.mean(d, 0) ** 2).sum())
            return np.mean(out)

        seq_centred = grads.numpy().copy()
        for p in (0, 1):
            rows = [j for j in range(6) if prompt[j] == p]
            starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
            mean = np.mean([grads[starts[j] : starts[j] + lengths[j]].sum(0).numpy() for j in rows], 0)
            for j in rows:
                seq_centred[starts[j] : starts[j] + lengths[j]] -= mean / lengths[j]
        assert mean_bias_sq(center_by_loop(grads, prompt, lengths).numpy()) < 1e-20
        assert mean_bias_sq(seq_centred) > 0.01
    finally:
        del ESTIMATORS["others_alive_mean_test"]
