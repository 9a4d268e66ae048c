import json

import numpy as np
import polars as pl
import pytest

from otbflow import schemas
from otbflow.io import read_table
from otbflow.stages import scaling
from otbflow.studies import scaling_fit


def test_fit_recovers_a_known_power_law():
    rng = np.random.default_rng(0)
    T = rng.integers(5, 500, 300).astype(float)
    g = 3.0 * T**1.5 * np.exp(rng.normal(0, 0.3, T.size))
    w = 0.2 * T * np.exp(rng.normal(0, 0.1, T.size))
    s = scaling_fit.fit_summary(T, g, w, n_boot=400, seed=1)
    assert s["grad_sq_norm_slope_ci_low"] < 1.5 < s["grad_sq_norm_slope_ci_high"]
    assert s["grad_sq_norm_slope_ci_high"] - s["grad_sq_norm_slope_ci_low"] < 0.2
    assert s["w_hat_slope"] == pytest.approx(1.0, abs=0.05)
    assert s["alpha_blog"] == pytest.approx(s["grad_sq_norm_slope"] / 2)
    assert s["spearman_w_hat_grad_sq_norm"] > 0.8


def test_spearman_and_spread():
    assert scaling_fit.spearman(np.array([1.0, 2, 3, 4]), np.array([10.0, 20, 25, 100])) == pytest.approx(1.0)
    assert scaling_fit.spearman(np.array([1.0, 2, 3]), np.array([3.0, 2, 1])) == pytest.approx(-1.0)
    df = pl.DataFrame({"response_length": list(range(100))})
    picked = scaling_fit.spread_by_length(df, 10)["response_length"].to_list()
    assert len(picked) == 10 and picked[0] == 0 and picked[-1] == 99


def test_scaling_stage(tmp_path, cfg, tiny_policy, rollouts_path):
    scaling.run(cfg, scaling.Args(rollouts=[str(rollouts_path)], policy=str(tiny_policy), out_dir=str(tmp_path)))
    seqs = read_table(tmp_path / "sequences.parquet", schemas.SCALING_SEQUENCES)
    assert seqs.height == pl.read_parquet(rollouts_path).filter(pl.col("response_length") > 0).height
    assert (seqs["grad_sq_norm"] > 0).all()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary == pytest.approx(pl.read_parquet(tmp_path / "summary.parquet").row(0, named=True))
    assert (
        summary["grad_sq_norm_slope_ci_low"] <= summary["grad_sq_norm_slope"] <= summary["grad_sq_norm_slope_ci_high"]
    )
    assert (tmp_path / "scaling.png").read_bytes()[:4] == b"\x89PNG"


def test_responses_of_one_length_give_no_fit_not_a_failed_workflow(tmp_path, cfg, tiny_policy, rollouts_path):
    """Every response cut at max_new_tokens (one length): the stage still writes its outputs, with
    NaN slopes, instead of stopping the whole workflow for a diagnostic."""
    df = pl.read_parquet(rollouts_path).filter(pl.col("response_length") > 0)
    n = int(df["response_length"].min())
    one = df.with_columns(
        pl.col("response_ids").list.head(n),
        pl.col("rollout_logprobs").list.head(n),
        pl.lit(n, dtype=df.schema["response_length"]).alias("response_length"),
    )
    one.write_parquet(tmp_path / "one.parquet")
    scaling.run(
        cfg,
        scaling.Args(rollouts=[str(tmp_path / "one.parquet")], policy=str(tiny_policy), out_dir=str(tmp_path / "out")),
    )
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["min_length"] == summary["max_length"] == n
    assert np.isnan(summary["grad_sq_norm_slope"]) and np.isnan(summary["alpha_blog"])
    assert (
        read_table(tmp_path / "out" / "sequences.parquet", schemas.SCALING_SEQUENCES).height == summary["n_sequences"]
    )
