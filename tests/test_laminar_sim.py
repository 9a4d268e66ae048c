"""benchmarks/laminar_sim.py, the discrete-event model of lockstep, one-step-off and streamed
rollouts: the facts it must hold whatever its costs (issue 58), and its length fit against the
parameters a sample was drawn with."""

from __future__ import annotations

import importlib.util
import math
import sys

import numpy as np
import pytest
from conftest import REPO

spec = importlib.util.spec_from_file_location("laminar_sim", REPO / "benchmarks" / "laminar_sim.py")
sim = importlib.util.module_from_spec(spec)
sys.modules["laminar_sim"] = sim  # its dataclasses look their module up
spec.loader.exec_module(sim)

COSTS = sim.Costs(
    decode_fixed=0.01, decode_row=0.0001, prefill_token=1e-5, train_fixed=0.5, train_token=1e-4, handover=0.3
)
TAIL = sim.Lengths(mu=math.log(60), sigma=0.8, budget=192, prompt=20)


def setup(mode: str, **over) -> sim.Setup:
    base = dict(
        mode=mode,
        engines=6,
        rows=32,
        groups=24,
        group_size=8,
        iterations=6,
        warmup=2,
        staleness=2,
        repack_below=0.25,
        trainer_devices=2,
        costs=COSTS,
        lengths=TAIL,
        seed=0,
    )
    return sim.Setup(**{**base, **over})


def test_with_every_length_equal_and_nothing_else_to_overlap_the_modes_agree():
    """No tail, no training or handover to hide: every mode decodes the same full batches."""
    equal = sim.Lengths(mu=math.log(50), sigma=0.0, budget=192, prompt=20)
    free = sim.Costs(decode_fixed=0.01, decode_row=0.0001, prefill_token=0, train_fixed=0, train_token=0, handover=0)
    rates = {m: sim.simulate(setup(m, lengths=equal, costs=free))["tokens_per_s"] for m in sim.MODES}
    one_batch = 6 * 32 / free.decode(32)  # every engine decoding full batches
    for mode, rate in rates.items():
        assert rate == pytest.approx(one_batch, rel=1e-9), mode


def test_with_every_length_equal_streaming_gains_nothing_over_one_step_off():
    equal = sim.Lengths(mu=math.log(50), sigma=0.0, budget=192, prompt=20)
    cheap = sim.Costs(
        decode_fixed=0.01, decode_row=0.0001, prefill_token=1e-5, train_fixed=0.1, train_token=1e-5, handover=0
    )
    stream = sim.simulate(setup("stream", lengths=equal, costs=cheap))["tokens_per_s"]
    off = sim.simulate(setup("one_step_off", lengths=equal, costs=cheap))["tokens_per_s"]
    assert stream == pytest.approx(off, rel=0.02)


def test_with_a_tail_streaming_beats_lockstep():
    """The premise, as a sanity check of the bookkeeping: refilled slots decode more per step."""
    lock = sim.simulate(setup("lockstep"))
    stream = sim.simulate(setup("stream"))
    assert stream["tokens_per_s"] > 1.1 * lock["tokens_per_s"]
    assert stream["occupancy_mean"] > lock["occupancy_mean"]
    for out in (lock, stream):
        assert 0 <= out["occupancy_mean"] <= 1
        assert all(0 <= x <= 1 for x in out["idle_share"])


def test_one_engine_decoding_one_trajectory_at_a_time_streams_as_lockstep():
    """One engine, one row at a time, nothing to hide: the same trajectories one after another."""
    free = sim.Costs(decode_fixed=0.01, decode_row=0.0, prefill_token=0, train_fixed=0, train_token=0, handover=0)
    rates = [
        sim.simulate(setup(m, engines=1, rows=1, groups=2, costs=free))["tokens_per_s"] for m in ("lockstep", "stream")
    ]
    assert rates[0] == pytest.approx(rates[1], rel=1e-9)
    assert rates[0] == pytest.approx(1 / 0.01, rel=1e-9)  # a token a step


def test_the_simulation_is_a_function_of_its_seed():
    for mode in sim.MODES:
        a, b = sim.simulate(setup(mode)), sim.simulate(setup(mode))
        assert a == b
    assert sim.simulate(setup("stream", seed=1))["tokens_per_s"] != sim.simulate(setup("stream"))["tokens_per_s"]


@pytest.mark.parametrize("staleness", [1, 2])
def test_no_trained_token_is_older_than_the_bound(staleness):
    out = sim.simulate(setup("stream", staleness=staleness))
    assert max(int(k) for k in out["lag_tokens"]) <= staleness
    assert sim.simulate(setup("one_step_off"))["lag_tokens"].keys() <= {"0", "1"}
    assert sim.simulate(setup("lockstep"))["lag_tokens"].keys() == {"0"}


@pytest.mark.parametrize("mode", sim.MODES)
def test_every_trained_token_is_counted_once_under_its_version(mode):
    """The version spans of a row add up to its length, through cuts, moves and drops."""
    out = sim.simulate(setup(mode, staleness=1, groups=12))
    assert sum(out["lag_tokens"].values()) == sum(out["trained_tokens"])
    assert len(out["trained_tokens"]) == 6


def test_a_stream_at_staleness_0_trains_only_current_tokens():
    """The bound at 0 (each group admitted under the version that trains it): the run does not
    stall, and every trained token is the iteration's own version."""
    slow = sim.Costs(
        decode_fixed=0.01, decode_row=1e-4, prefill_token=1e-5, train_fixed=50, train_token=1e-4, handover=0.3
    )
    out = sim.simulate(setup("stream", staleness=0, costs=slow, engines=2, groups=4))
    assert out["lag_tokens"].keys() == {"0"}


def test_one_step_off_starts_an_iteration_once_the_engines_share_of_the_last_is_done():
    """Iterations 0 and 1 both sample version 0, yet iteration 1's rows wait for 0's on their
    engine: with one engine of room for both, iteration 1 ends one batch after iteration 0."""
    equal = sim.Lengths(mu=math.log(50), sigma=0.0, budget=192, prompt=20)
    free = sim.Costs(decode_fixed=0.01, decode_row=0.0, prefill_token=0, train_fixed=0, train_token=0, handover=0)
    s = sim.Sim(setup("one_step_off", engines=1, rows=64, groups=2, lengths=equal, costs=free))
    s.run()
    assert s.train_ends[:2] == [pytest.approx(0.5), pytest.approx(1.0)]  # 50 steps of 0.01 s a batch


def test_repack_moves_thinned_engines_rows():
    out = sim.simulate(setup("stream_repack", staleness=1, groups=12))
    assert out["moved_rows"] > 0
    assert sim.simulate(setup("stream", staleness=1, groups=12))["moved_rows"] == 0


def test_the_length_fit_recovers_a_censored_lognormal():
    """Drawn with mu = log 60, sigma = 0.8 and cut at 192 (about 7% cut): the fit, counting the cut
    as censored, finds the parameters; the plain mean and spread of the logs would not."""
    rng = np.random.default_rng(0)
    x = np.clip(np.rint(np.exp(math.log(60) + 0.8 * rng.standard_normal(200_000))), 1, 192).astype(int)
    hist = {int(k): int(v) for k, v in zip(*np.unique(x, return_counts=True))}
    fit = sim.fit_lengths(hist, 192, 20)
    assert fit.mu == pytest.approx(math.log(60), abs=0.01)
    assert fit.sigma == pytest.approx(0.8, abs=0.01)
    assert np.log(x).std() < 0.78  # what ignoring the censoring gives


def test_lengths_fit_to_stored_rollouts_count_the_cut_ones_as_censored(tmp_path):
    """`--rollouts`: a run's rollouts.parquet files, the responses cut at max_new_tokens censored."""
    import polars as pl

    rng = np.random.default_rng(1)
    x = np.rint(np.exp(math.log(30) + 0.6 * rng.standard_normal(40_000))).clip(1).astype(int)
    cut = x >= 64
    for i, part in enumerate(np.array_split(np.arange(len(x)), 2)):
        pl.DataFrame(
            {
                "prompt_ids": [[1, 2, 3]] * len(part),
                "response_length": np.minimum(x[part], 64),
                "finish_reason": np.where(cut[part], "length", "stop"),
            }
        ).write_parquet(tmp_path / f"rollouts_{i}.parquet")
    fit, stored = sim.lengths_from({"rollouts": str(tmp_path / "rollouts_*.parquet"), "budget": 64}, {})
    assert stored["responses"] == 40_000
    assert stored["at_budget_share"] == pytest.approx(cut.mean())
    assert (fit.mu, fit.sigma, fit.prompt) == (pytest.approx(math.log(30), abs=0.01), pytest.approx(0.6, abs=0.01), 3)


def test_shared_cores_slow_everything_that_runs_at_once():
    """Two engines and a one-core trainer on two cores: less than with a device each."""
    own = sim.simulate(setup("one_step_off", engines=2))
    shared = sim.simulate(setup("one_step_off", engines=2, shared=True, cores=2, trainer_cores=1))
    assert shared["tokens_per_s"] < own["tokens_per_s"]
