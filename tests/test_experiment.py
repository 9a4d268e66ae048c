"""An experiment (workflow/experiment.smk): the reduced config/experiments/tiny.yaml end to end
(2 runs x 2 seeds on a shared Qwen2 + BPE + chat policy and prompt set: the whole pipeline on a
real architecture), its analysis (tokens to a target, paired comparisons), and bad experiment files."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import yaml
from conftest import REPO

from otbflow import schemas
from otbflow.config import ConfigError
from otbflow.io import read_metadata, read_table
from otbflow.studies.experiment_config import load_experiment, member_config

SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))
TINY_EXPERIMENT = REPO / "config" / "experiments" / "tiny.yaml"


def experiment(workdir: Path, configfile: Path, *args: str, check=True):
    cmd = [
        SNAKEMAKE,
        "-s",
        str(REPO / "workflow" / "experiment.smk"),
        "--directory",
        str(workdir),
        "--cores",
        "2",
        "--configfile",
        str(configfile),
        *args,
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if check and res.returncode != 0:
        raise AssertionError(f"snakemake failed ({res.returncode}):\n{res.stdout[-4000:]}\n{res.stderr[-6000:]}")
    return res


def check_qwen2_bpe_chat(shared: Path, r: Path) -> None:
    """The whole pipeline ran on a real architecture: the bootstrap built a Qwen2 with a BPE
    tokenizer and chat template, prompts went through the template, the trained policy is still
    a Qwen2 folder with that tokenizer, template and stop tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    curve = read_metadata(shared / "bootstrap/sft_curve.parquet")
    assert (curve["arch"], curve["tokenizer"], curve["chat"]) == ("qwen2", "bpe", True)
    ro = read_table(r / "iter_0/rollout/shard_0.parquet", schemas.ROLLOUTS)
    tok = AutoTokenizer.from_pretrained(shared / "bootstrap/policy")
    assert tok.decode(ro["prompt_ids"][0].to_list()) == (
        f"<|im_start|>system\nSolve step by step.<|im_end|>\n<|im_start|>user\n{ro['prompt'][0]}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    meta = read_metadata(r / "iter_0/rollout/shard_0.parquet")
    assert meta["chat"] is True and meta["stop_tokens"] == ["<|im_end|>", "<|endoftext|>"]
    fe = read_table(r / "iter_0/features/shard_0.parquet", schemas.FEATURES)
    assert fe["seq_max_k2"].max() < 1e-6  # fp32 trainer == rollout engine
    m = read_table(r / "iter_0/train/metrics.parquet", schemas.TRAIN_METRICS)
    assert m["grad_norm"].is_finite().all() and not m["skipped"].any()
    trained = r / "iter_0/train/policy"
    assert type(AutoModelForCausalLM.from_pretrained(trained)).__name__ == "Qwen2ForCausalLM"
    assert AutoTokenizer.from_pretrained(trained).chat_template == tok.chat_template
    assert json.loads((trained / "generation_config.json").read_text())["eos_token_id"] == meta["stop_token_ids"]
    assert read_table(shared / "scaling/sequences.parquet", schemas.SCALING_SEQUENCES).height >= 3


@pytest.mark.slow
def test_tiny_experiment(tmp_path):
    experiment(tmp_path, TINY_EXPERIMENT)
    root = tmp_path / "results" / "tiny_experiment"
    summary = read_table(root / "summary.parquet", schemas.EXPERIMENT_SUMMARY)
    assert summary["run"].to_list() == ["grpo_n4", "length_power_n4"] and summary["seeds"].to_list() == [2, 2]
    seeds = read_table(root / "seeds.parquet", schemas.EXPERIMENT_SEEDS)
    assert seeds.select("run", "seed").rows() == [
        ("grpo_n4", 0),
        ("grpo_n4", 1),
        ("length_power_n4", 0),
        ("length_power_n4", 1),
    ]
    pairs = read_table(root / "pairs.parquet", schemas.EXPERIMENT_PAIRS)
    assert pairs.select("a", "b", "seeds").row(0) == ("length_power_n4", "grpo_n4", 2)
    # one iteration of 8 prompts x 4 samples each: both evaluated after 32 responses, compared there
    assert pairs["matched_responses"].to_list() == [32]
    first = pairs.select("a_first_seeds", "b_first_seeds", "neither_seeds", "undecided_seeds").row(0)
    assert sum(first) == 2
    assert (summary["tokens_generated"] > 0).all() and (summary["tokens_trained"] > 0).all()
    curves = pl.read_parquet(root / "curves.parquet")
    assert curves.height == 2 * 2 * 2  # runs x seeds x (initial, iter_0)
    # plateau_window 1 over one iteration: the gain from the initial policy, per seed and on average
    assert np.allclose(seeds["late_gain"], seeds["final_accuracy"] - seeds["initial_accuracy"])
    assert summary["late_gain"].is_finite().all()
    # one initial policy and one prompt set for all members; the seeds differ
    slope = json.loads((root / "shared/results/scaling/summary.json").read_text())["grad_sq_norm_slope"]
    prompts = set()
    for run in ("grpo_n4", "length_power_n4"):
        for seed in (0, 1):
            member = root / run / f"seed_{seed}"
            cfg = yaml.safe_load((member / "member.yaml").read_text())
            assert cfg["seed"] == seed and cfg["model"]["path"] == str(
                (root / "shared/results/bootstrap/policy").resolve()
            )
            if run == "length_power_n4":
                assert cfg["advantages"]["exponent"] == pytest.approx(slope)
            prompts.add(tuple(pl.read_parquet(member / "results/data/train/shard_0.parquet")["prompt"]))
            assert not (member / "results/bootstrap").exists()
    assert len(prompts) == 1
    check_qwen2_bpe_chat(root / "shared" / "results", root / "grpo_n4" / "seed_0" / "results")
    for png in ("accuracy_vs_tokens", "training"):
        assert (root / f"{png}.png").read_bytes()[:4] == b"\x89PNG"
    assert read_table(root / "shared/results/variance/summary.parquet", schemas.VARIANCE).height >= 3
    assert pl.read_csv(root / "summary.tsv", separator="\t")["run"].to_list() == ["grpo_n4", "length_power_n4"]
    assert "otb" in pl.read_csv(root / "variance.tsv", separator="\t")["estimator"].to_list()
    # the README's commands, on this experiment: the HTML report, and one stage of one member rerun
    # like any workflow (a dry run here)
    experiment(tmp_path, TINY_EXPERIMENT, "--report", "results/tiny_experiment/report.html")
    html = (root / "report.html").read_text(errors="ignore")
    assert "accuracy_vs_tokens.png" in html and "variance.png" in html
    member = "results/tiny_experiment/grpo_n4/seed_0"
    res = subprocess.run(
        [
            SNAKEMAKE,
            "-s",
            str(REPO / "Snakefile"),
            "--directory",
            member,
            "--configfile",
            f"{member}/member.yaml",
            "--cores",
            "2",
            "--forcerun",
            "advantages",
            "-n",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert re.search(r"^rule advantages:", res.stdout, re.M) and not re.search(r"^rule rollout:", res.stdout, re.M)


def test_member_config_layers_base_run_and_seed():
    exp = load_experiment(TINY_EXPERIMENT)
    cfg = member_config(exp, "length_power_n4", 1, "/p", 1.7)
    assert cfg["seed"] == 1 and cfg["task"]["seed"] == 0 and cfg["model"]["path"] == "/p"
    assert cfg["advantages"] == {"estimator": "length_power", "exponent": 1.7}
    assert cfg["model"]["n_layer"] == 2 and cfg["iterations"] == 1


@pytest.mark.parametrize(
    "change, message",
    [
        ({"runs": {"bad": {"advantages": {"estimator": "foo"}}}}, "run 'bad': config key 'advantages.estimator'"),
        ({"runs": {"bad": {"rollout": {"groupsize": 4}}}}, "run 'bad': config key 'rollout.groupsize'"),
        ({"seeds": []}, "config key 'seeds': must be a non-empty list of integers (got [])"),
        ({"extra": 1}, "config key 'extra': unknown key. Allowed here: experiment, seeds, base, runs, analysis"),
        ({"analysis": {"plateau_window": 0}}, "config key 'analysis.plateau_window': must be >= 1 (got 0)"),
        ({"analysis": {"plateau_window": True}}, "config key 'analysis.plateau_window'"),
        ({"analysis": {"confidence": 1.0}}, "config key 'analysis.confidence': must be in (0, 1) (got 1.0)"),
        ({"analysis": {"plateau_margin": 0}}, "config key 'analysis.plateau_margin': must be > 0 (got 0.0)"),
        ({"analysis": {"target": 0}}, "config key 'analysis.target': must be in (0, 1] (got 0.0)"),
        (
            {"analysis": {"ci_resamples": 2000}},
            "config key 'analysis.ci_resamples' was removed: intervals are now t-intervals over the seeds",
        ),
        ({"analysis": {"bootstrap": 500}}, "config key 'analysis.bootstrap' was removed: intervals are now t-interv"),
        (
            {"analysis": {"target_fraction": 0.9}},
            "config key 'analysis.target_fraction' was removed: the target is now a fixed avg@k, analysis.target",
        ),
        ({"analysis": {"reference": "grpo_n4"}}, "config key 'analysis.reference' was removed: the target is now"),
        # names that become folders: results/<experiment>/<run>/seed_<seed>, never outside results/
        ({"experiment": "../../../x"}, "config key 'experiment': must be a folder name, free of slashes"),
        ({"experiment": ".."}, "config key 'experiment': must be a folder name, a name other than '.' and '..'"),
        ({"experiment": "-x"}, "config key 'experiment': must be a folder name, not starting with '-'"),
        ({"experiment": ""}, "config key 'experiment': must be a folder name, not empty"),
        ({"runs": {"a/b": {}}}, "config key 'runs.a/b': must be a folder name, free of slashes"),
        ({"runs": {"x\ny": {}}}, "config key 'runs.x\ny': must be a folder name, free of control characters"),
    ],
)
def test_bad_experiment_fails_before_any_job(tmp_path, change, message):
    exp = yaml.safe_load(TINY_EXPERIMENT.read_text()) | change
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(exp))
    with pytest.raises(ConfigError, match=re.escape(f"{path}: {message}")):
        load_experiment(path)


def test_bad_experiment_stops_the_workflow_before_any_job(tmp_path):
    exp = yaml.safe_load(TINY_EXPERIMENT.read_text())
    exp["runs"]["bad"] = {"advantages": {"estimator": "foo"}}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(exp))
    res = experiment(tmp_path, tmp_path / "bad.yaml", check=False)
    assert res.returncode != 0 and "run 'bad': config key 'advantages.estimator'" in res.stdout + res.stderr
    assert not any((tmp_path / "results").rglob("*.parquet"))


def test_tokens_to_target_interpolates_the_first_crossing():
    from otbflow.studies.experiment_stats import tokens_to_target

    tokens = np.array([0.0, 100.0, 300.0, 600.0])
    assert tokens_to_target(tokens, np.array([0.2, 0.4, 0.8, 0.5]), 0.6) == pytest.approx(200.0)  # halfway 100..300
    assert tokens_to_target(tokens, np.array([0.7, 0.4, 0.8, 0.5]), 0.6) == 0.0  # the initial policy already is there
    assert tokens_to_target(tokens, np.array([0.2, 0.4, 0.5, 0.55]), 0.6) is None  # censored


def test_t_quantiles_match_the_published_table():
    """Two-sided critical values t_{1-alpha/2, df} from the standard t table (e.g. NIST/SEMATECH
    e-Handbook 1.3.6.7.2), to its 3 decimals."""
    from otbflow.studies.stats import t_quantile

    table = {
        (0.95, 1): 12.706,
        (0.95, 2): 4.303,
        (0.95, 3): 3.182,
        (0.95, 4): 2.776,
        (0.95, 9): 2.262,
        (0.95, 30): 2.042,
        (0.90, 4): 2.132,
        (0.99, 2): 9.925,
        (0.99, 4): 4.604,
    }
    for (confidence, df), t in table.items():
        assert t_quantile(confidence, df) == pytest.approx(t, abs=6e-4), (confidence, df)


def test_t_interval_on_hand_computed_cases():
    """{1, 2, 3}: mean 2, s = 1, t_{0.975,2} = 4.303: 2 +- 4.303 / sqrt(3) = 2 +- 2.484. {0, 1}: mean
    0.5, s / sqrt(2) = 0.5, t_{0.975,1} = 12.706: 0.5 +- 6.353. A constant: a point; one value: none."""
    from otbflow.studies.stats import t_interval

    assert t_interval([1.0, 2.0, 3.0], 0.95) == pytest.approx((-0.484, 4.484), abs=1e-3)
    assert t_interval([0.0, 1.0], 0.95) == pytest.approx((-5.853, 6.853), abs=1e-3)
    assert t_interval([3.0, 3.0, 3.0], 0.95) == (3.0, 3.0)
    assert all(math.isnan(x) for x in t_interval([0.4], 0.95))


def _coverage(lo, hi, mean):
    return float(np.mean((lo <= mean) & (mean <= hi)))


@pytest.mark.parametrize("n", [3, 5])
@pytest.mark.parametrize(
    "name, draw, mean",
    [
        ("normal", lambda rng, size: rng.normal(0.55, 0.04, size), 0.55),
        ("Beta(2, 8): bounded, right-skewed", lambda rng, size: rng.beta(2, 8, size), 0.2),
        # an avg@k-like figure: 256 Bernoulli samples at a success rate that itself varies by seed, Beta(2, 8)
        ("avg@k of 256 samples", lambda rng, size: rng.binomial(256, rng.beta(2, 8, size)) / 256, 0.2),
    ],
)
def test_t_interval_covers_the_mean_at_3_and_5_seeds(n, name, draw, mean):
    """4,000 simulated experiments of n seeds: the 95% t-interval of the real function covers the
    true mean at least 90% of the time. Measured (5 simulation seeds each, n = 3 and 5): normal 0.95;
    Beta(2, 8) 0.93; avg@k at a Beta(2, 8) success rate 0.93. The limit of the normality assumption:
    a success rate from Beta(1, 9) gives 0.89-0.90, a strongly skewed Beta(0.5, 5) only 0.83-0.86.
    The percentile bootstrap this replaced fails the test: at n = 3 it covers about 0.67 (computed
    here exactly, over all 27 resamples), at n = 5 about 0.83 (all 3,125 resamples: too slow for
    this test)."""
    from otbflow.studies.stats import t_interval

    rng = np.random.default_rng(n)
    x = draw(rng, (4000, n))
    lo, hi = t_interval(x, 0.95)
    assert _coverage(lo, hi, mean) >= 0.90, name
    if n == 3:
        resamples = np.array(np.meshgrid(*[range(n)] * n)).reshape(n, -1).T  # all n^n resamples
        boot = np.quantile(x[:, resamples].mean(axis=2), [0.025, 0.975], axis=1)
        assert _coverage(boot[0], boot[1], mean) < 0.75, name


def test_late_trend_needs_an_equivalence_test_for_a_plateau():
    """A plateau only when the interval lies inside +-margin; an interval that holds 0 but reaches
    past the margin is unresolved, not a plateau (the issue's +0.04 gain under +-0.04 noise)."""
    from otbflow.studies.stats import late_trend

    assert late_trend(-0.01, 0.015, 0.02) == "plateau"
    assert late_trend(-0.02, 0.06, 0.02) == "unresolved"
    assert late_trend(0.001, 0.05, 0.02) == "rising" and late_trend(-0.08, -0.03, 0.02) == "falling"
    assert late_trend(0.005, 0.015, 0.02) == "plateau"  # a gain, but inside the margin
    assert late_trend(float("nan"), float("nan"), 0.02) == "no interval"


def test_per_seed_table_on_hand_made_curves():
    """Two runs x one seed, three evaluations each, target 0.72: s crosses it between 0.6 at 100
    tokens and 0.9 at 400 tokens, at 100 + (0.12 / 0.3) x 300 = 220 tokens; r between 0.4 at 100
    and 0.8 at 300: 100 + (0.32 / 0.4) x 200 = 260 tokens. At target 0.85, r (at most 0.8) is
    censored and s crosses at 100 + (0.25 / 0.3) x 300 = 350."""
    from otbflow.studies.experiment_stats import per_seed_table

    curves = pl.DataFrame(
        [
            ("r", 0, -1, 0.5, 0.5, 0.0, 10.0, 0),
            ("r", 0, 0, 0.4, 0.6, 100.0, 12.0, 8),
            ("r", 0, 1, 0.8, 0.9, 300.0, 30.0, 16),
            ("s", 0, -1, 0.5, 0.5, 0.0, 10.0, 0),
            ("s", 0, 0, 0.6, 0.7, 100.0, 8.0, 8),
            ("s", 0, 1, 0.9, 1.0, 400.0, 9.0, 16),
        ],
        schema=[
            "run",
            "seed",
            "iteration",
            "sampled_accuracy",
            "greedy_accuracy",
            "tokens_generated",
            "mean_response_length",
            "responses_generated",
        ],
        orient="row",
    )
    metrics = pl.DataFrame(
        [("r", 0, 50, 0.3), ("r", 0, 70, 1.5), ("s", 0, 40, 0.2)],
        schema=["run", "seed", "tokens", "grad_norm"],
        orient="row",
    )
    exp = {"runs": {"r": {}, "s": {}}, "analysis": {"target": 0.72, "plateau_window": 2}}
    rows = {r["run"]: r for r in per_seed_table(exp, curves, metrics).iter_rows(named=True)}
    # gain over the last 2 iterations: from the initial policy's 0.5 to 0.8 and 0.9
    assert rows["r"]["late_gain"] == pytest.approx(0.3) and rows["s"]["late_gain"] == pytest.approx(0.4)
    exp["analysis"]["plateau_window"] = 1  # over the last iteration: 0.4 -> 0.8 and 0.6 -> 0.9
    rows = {r["run"]: r for r in per_seed_table(exp, curves, metrics).iter_rows(named=True)}
    assert rows["r"]["late_gain"] == pytest.approx(0.4) and rows["s"]["late_gain"] == pytest.approx(0.3)
    exp["analysis"]["plateau_window"] = 3  # longer than the curves: no gain to read
    assert math.isnan(per_seed_table(exp, curves, metrics)["late_gain"][0])
    assert rows["r"]["target_accuracy"] == rows["s"]["target_accuracy"] == pytest.approx(0.72)
    assert rows["s"]["tokens_to_target"] == pytest.approx(220.0)
    assert rows["r"]["tokens_to_target"] == pytest.approx(260.0)
    assert rows["r"]["min_accuracy"] == 0.4 and rows["r"]["max_length_ratio"] == pytest.approx(3.0)
    assert rows["r"]["tokens_trained"] == 120 and rows["r"]["max_grad_norm"] == 1.5
    assert rows["s"]["final_greedy_accuracy"] == 1.0 and rows["s"]["max_length_ratio"] == pytest.approx(1.0)
    assert rows["r"]["reached_target"] and rows["s"]["reached_target"]
    exp["analysis"]["target"] = 0.85
    rows = {r["run"]: r for r in per_seed_table(exp, curves, metrics).iter_rows(named=True)}
    assert not rows["r"]["reached_target"] and math.isnan(rows["r"]["tokens_to_target"])
    assert rows["s"]["reached_target"] and rows["s"]["tokens_to_target"] == pytest.approx(350.0)


def test_late_gain_with_evaluations_every_other_iteration():
    """evaluate.every = 2 over 6 iterations: the initial policy (iteration -1), then iterations 1, 3
    and 5. The gain over the last 2 iterations is from iteration 3 (0.6) to 5 (0.65); over the last
    3 or 4, from iteration 1 (0.5): the last evaluation at least that many iterations before."""
    from otbflow.studies.experiment_stats import per_seed_table

    curves = pl.DataFrame(
        [
            ("r", 0, it, acc, acc, 100.0 * (it + 1), 10.0, 8 * (it + 1))
            for it, acc in [(-1, 0.3), (1, 0.5), (3, 0.6), (5, 0.65)]
        ],
        schema=[
            "run",
            "seed",
            "iteration",
            "sampled_accuracy",
            "greedy_accuracy",
            "tokens_generated",
            "mean_response_length",
            "responses_generated",
        ],
        orient="row",
    )
    metrics = pl.DataFrame([("r", 0, 50, 0.3)], schema=["run", "seed", "tokens", "grad_norm"], orient="row")
    exp = {"runs": {"r": {}}, "analysis": {"target": 0.6, "plateau_window": 2}}
    gain = {
        w: per_seed_table(exp | {"analysis": exp["analysis"] | {"plateau_window": w}}, curves, metrics)["late_gain"][0]
        for w in (1, 2, 3, 4, 6, 7)
    }
    assert gain[1] == pytest.approx(0.05) and gain[2] == pytest.approx(0.05)  # 3 -> 5
    assert gain[3] == pytest.approx(0.15) and gain[4] == pytest.approx(0.15)  # 1 -> 5
    assert gain[6] == pytest.approx(0.35)  # from the initial policy
    assert math.isnan(gain[7])


def _per_seed(rows):
    """Per-seed rows (run, seed, final_accuracy, tokens_to_target or None, tokens_generated)."""
    return pl.DataFrame(
        rows,
        schema={
            "run": pl.String,
            "seed": pl.Int64,
            "final_accuracy": pl.Float64,
            "tokens_to_target": pl.Float64,
            "tokens_generated": pl.Float64,
        },
        orient="row",
    ).with_columns(
        pl.col("tokens_to_target").is_not_null().alias("reached_target"), pl.col("tokens_to_target").fill_null(np.nan)
    )


def _curves(points):
    """Curves from (run, seed, responses_generated, tokens_generated, sampled_accuracy)."""
    return pl.DataFrame(
        points,
        schema=["run", "seed", "responses_generated", "tokens_generated", "sampled_accuracy"],
        orient="row",
    )


def test_paired_table_on_hand_made_seeds():
    """Final differences a - b: +0.1, +0.2, -0.1, +0.1 (mean 0.075, s = 0.1258, t_{0.975,3} =
    3.182: 0.075 +- 0.2002). Who reached the target first, seed by seed: 0 a (100 < 200); 1 b (a
    never did within its 500 tokens, b did at 400); 2 undecided (a reached it at 300 tokens, b
    never did but ran only 250); 3 a (0 tokens: the initial policy was there, b at 100); 4 neither;
    5 undecided (both at 0)."""
    from otbflow.studies.experiment_stats import paired_table

    per_seed = _per_seed(
        [
            ("a", 0, 0.5, 100.0, 500.0),
            ("a", 1, 0.6, None, 500.0),
            ("a", 2, 0.4, 300.0, 500.0),
            ("a", 3, 0.7, 0.0, 500.0),
            ("b", 0, 0.4, 200.0, 500.0),
            ("b", 1, 0.4, 400.0, 500.0),
            ("b", 2, 0.5, None, 250.0),
            ("b", 3, 0.6, 100.0, 500.0),
        ]
    )
    both_zero = _per_seed([("a", 4, 0.5, None, 500.0), ("b", 4, 0.5, None, 500.0)])
    both_zero = pl.concat([both_zero, _per_seed([("a", 5, 0.5, 0.0, 500.0), ("b", 5, 0.5, 0.0, 500.0)])])
    curves = _curves([(r, s, 0, 0.0, 0.3) for r in "ab" for s in range(6)])  # no evaluation at an equal budget
    exp = {"analysis": {"pairs": [["a", "b"]], "confidence": 0.95}}
    pairs = paired_table(exp, per_seed, curves).row(0, named=True)
    assert pairs["seeds"] == 4 and pairs["a_better_seeds"] == 3
    assert pairs["accuracy_diff"] == pytest.approx(0.075)
    assert (pairs["accuracy_diff_lo"], pairs["accuracy_diff_hi"]) == pytest.approx((-0.1252, 0.2752), abs=1e-3)
    first = pairs["a_first_seeds"], pairs["b_first_seeds"], pairs["neither_seeds"], pairs["undecided_seeds"]
    assert first == (2, 1, 0, 1)
    assert pairs["matched_responses"] == 0 and math.isnan(pairs["matched_responses_diff"])
    pairs = paired_table(exp, pl.concat([per_seed, both_zero]), curves).row(0, named=True)
    first = pairs["a_first_seeds"], pairs["b_first_seeds"], pairs["neither_seeds"], pairs["undecided_seeds"]
    assert first == (2, 1, 1, 2)


def test_paired_table_compares_at_an_equal_budget_without_interpolating():
    """a (N = 4) evaluated after 2,048, 4,096 and 6,144 responses; b (N = 16) after 2,048, 4,096,
    8,192 (its 3rd evaluation missing on purpose): the largest budget both were evaluated at is
    4,096, where a - b is +0.10 and +0.06 (mean 0.08, s = 0.02828, t_{0.975,1} = 12.706:
    0.08 +- 0.2541). b's value at a's last budget (6,144) is never interpolated."""
    from otbflow.studies.experiment_stats import paired_table

    curves = _curves(
        [
            ("a", s, r, 8.0 * r, acc)
            for s, accs in ((0, (0.4, 0.5, 0.6)), (1, (0.4, 0.46, 0.6)))
            for r, acc in zip((2048, 4096, 6144), accs)
        ]
        + [("b", s, r, 8.2 * r, acc) for s in (0, 1) for r, acc in zip((2048, 4096, 8192), (0.35, 0.4, 0.7))]
        + [(r, s, 0, 0.0, 0.3) for r in "ab" for s in (0, 1)]
    )
    per_seed = _per_seed([(r, s, 0.6, None, 60_000.0) for r in "ab" for s in (0, 1)])
    exp = {"analysis": {"pairs": [["a", "b"]], "confidence": 0.95}}
    pairs = paired_table(exp, per_seed, curves).row(0, named=True)
    assert pairs["matched_responses"] == 4096
    assert pairs["matched_responses_tokens_a"] == pytest.approx(8.0 * 4096) and pairs[
        "matched_responses_tokens_b"
    ] == pytest.approx(8.2 * 4096)
    assert pairs["matched_responses_diff"] == pytest.approx(0.08) and pairs["matched_responses_a_better_seeds"] == 2
    assert (pairs["matched_responses_diff_lo"], pairs["matched_responses_diff_hi"]) == pytest.approx(
        (-0.1741, 0.3341), abs=1e-3
    )


def test_summary_reports_censored_tokens_to_target_and_the_late_trend():
    """Tokens to the target over 5 seeds, 3 reached (100, 300, 200), 2 censored: the median counts
    the censored seeds as slowest, 300, not the survivors' mean 200; with 2 of 5 reached it is
    NaN, not a mean over the 2. Late gains +0.01, 0, -0.005, +0.005, 0 (mean 0.002, s = 0.00570,
    t_{0.975,4} = 2.776: 0.002 +- 0.00708) lie inside +-0.02: a plateau; +0.04, 0.0, +0.08, -0.02,
    +0.05 hold 0 but reach past the margin: unresolved."""
    from otbflow.studies.experiment_stats import summary_table

    def seeds(run, ttt, late):
        return [
            {
                "run": run,
                "seed": i,
                "initial_accuracy": 0.3,
                "final_accuracy": 0.5 + 0.01 * i,
                "final_greedy_accuracy": 0.6,
                "late_gain": g,
                "min_accuracy": 0.3,
                "target_accuracy": 0.45,
                "reached_target": t is not None,
                "tokens_to_target": float("nan") if t is None else t,
                "tokens_generated": 1000.0,
                "tokens_trained": 900.0,
                "final_response_length": 16.0,
                "max_length_ratio": 1.0,
                "responses_generated": 800.0,
                "max_grad_norm": 0.5,
                "nonfinite_steps": 0,
            }
            for i, (t, g) in enumerate(zip(ttt, late))
        ]

    rows = seeds("flat", [100.0, None, 300.0, None, 200.0], [0.01, 0.0, -0.005, 0.005, 0.0])
    rows += seeds("slow", [100.0, None, None, None, 400.0], [0.04, 0.0, 0.08, -0.02, 0.05])
    per_seed = pl.DataFrame(rows, schema=schemas.EXPERIMENT_SEEDS.columns)
    exp = {"runs": {"flat": {}, "slow": {}}, "analysis": {"confidence": 0.95, "target": 0.45, "plateau_margin": 0.02}}
    out = {r["run"]: r for r in summary_table(exp, per_seed).iter_rows(named=True)}
    flat, slow = out["flat"], out["slow"]
    assert flat["reached_seeds"] == 3 and flat["tokens_to_target"] == 300.0
    assert (flat["tokens_to_target_min"], flat["tokens_to_target_max"]) == (100.0, 300.0)
    assert slow["reached_seeds"] == 2 and math.isnan(slow["tokens_to_target"]) and slow["tokens_to_target_max"] == 400.0
    assert (flat["late_gain_lo"], flat["late_gain_hi"]) == pytest.approx((-0.00508, 0.00908), abs=1e-4)
    assert flat["late_trend"] == "plateau" and slow["late_trend"] == "unresolved"
    # final avg@k 0.50..0.54: mean 0.52, s = 0.01581, 0.52 +- 2.776 x 0.00707 = 0.52 +- 0.01963
    assert (flat["final_accuracy_lo"], flat["final_accuracy_hi"]) == pytest.approx((0.50037, 0.53963), abs=1e-4)


def _member_report(root: Path, run: str, seed: int, responses: list[int], grad_norms: list[float]) -> None:
    """A member's report/progress.parquet (the initial policy and one evaluation per entry of
    ``responses``, its cumulative responses generated; 10 tokens per response) and
    report/metrics.parquet (one step per entry of ``grad_norms``; NaN: a skipped step)."""
    from otbflow.io import write_parquet

    report = root / run / f"seed_{seed}" / "results" / "report"
    n = len(responses) + 1
    progress = {
        "policy": ["initial"] + [f"iter_{k}" for k in range(n - 1)],
        "iteration": list(range(-1, n - 1)),
        "greedy_accuracy": [0.3] * n,
        "sampled_accuracy": [0.3] + [0.3 + 0.01 * (k + 1) + 0.1 * (run == "dapo") for k in range(n - 1)],
        "k": [4] * n,
        "mean_response_length": [10.0] * n,
        "n_prompts": [64] * n,
        "tokens_generated": [10 * r for r in [0] + responses],
        "mean_reward": [float("nan")] + [0.5] * (n - 1),
        "mean_rollout_length": [float("nan")] + [10.0] * (n - 1),
        "responses_generated": [0] + responses,
    }
    write_parquet(pl.DataFrame(progress, schema=schemas.PROGRESS.columns), report / "progress.parquet")
    steps = len(grad_norms)
    metrics = {c: [0.0] * steps for c, t in schemas.METRICS.columns.items() if t == pl.Float64}
    metrics |= {c: list(range(steps)) for c, t in schemas.METRICS.columns.items() if t == pl.Int64}
    metrics |= {"iteration": [0] * steps, "grad_norm": grad_norms, "event": [""] * steps}
    metrics |= {"skipped": [g != g for g in grad_norms], "tokens": [100] * steps}
    write_parquet(pl.DataFrame(metrics, schema=schemas.METRICS.columns), report / "metrics.parquet")


def test_budgets_are_what_the_members_generated(tmp_path):
    """Two runs of the stability probe's shape (128 prompts x 4 per iteration: 512 responses by the
    config). GRPO's reports count 512, 1,024; DAPO's (dynamic sampling: dropped groups generated
    too) 1,800, 3,900 on seed 0 and 2,100, 4,000 on seed 1. There is no equal budget: the config's
    arithmetic gave both 512 and 1,024 and compared them at 1,024 as if equal. With DAPO's seed 0
    at 512, 2,000 and seed 1 at 512, 2,200 they meet at 512 only. The per-seed and summary tables
    carry the responses the reports counted."""
    from otbflow.stages.experiment import collect
    from otbflow.studies.experiment_stats import paired_table, per_seed_table, summary_table

    exp = {
        "experiment": "probe",
        "seeds": [0, 1],
        "base": {"iterations": 2, "rollout": {"prompts_per_iteration": 128, "group_size": 4}},
        "runs": {"dapo": {"rollout": {"filter_groups": True}}, "grpo": {}},
        "analysis": {"pairs": [["dapo", "grpo"]], "confidence": 0.95, "target": 0.9},
    }
    exp["analysis"] |= {"plateau_window": 1, "plateau_margin": 0.02}
    for seed, responses in ((0, [1800, 3900]), (1, [2100, 4000])):
        _member_report(tmp_path, "dapo", seed, responses, [0.5, 0.7])
        _member_report(tmp_path, "grpo", seed, [512, 1024], [0.4, 0.6])
    curves, metrics = collect(exp, tmp_path)
    per_seed = per_seed_table(exp, curves, metrics)
    pairs = paired_table(exp, per_seed, curves).row(0, named=True)
    assert pairs["matched_responses"] == 0 and math.isnan(pairs["matched_responses_diff"])
    assert per_seed.filter(pl.col("run") == "dapo")["responses_generated"].to_list() == [3900.0, 4000.0]
    assert per_seed.filter(pl.col("run") == "dapo")["tokens_generated"].to_list() == [39000.0, 40000.0]
    summary = summary_table(exp, per_seed)
    assert summary["responses_generated"].to_list() == [3950.0, 1024.0]
    for seed, responses in ((0, [512, 2000]), (1, [512, 2200])):
        _member_report(tmp_path, "dapo", seed, responses, [0.5, 0.7])
    curves, metrics = collect(exp, tmp_path)
    pairs = paired_table(exp, per_seed_table(exp, curves, metrics), curves).row(0, named=True)
    assert pairs["matched_responses"] == 512 and pairs["matched_responses_diff"] == pytest.approx(0.1)
    assert pairs["matched_responses_tokens_a"] == pairs["matched_responses_tokens_b"] == 5120.0


def test_skipped_steps_are_counted_beside_a_finite_max_grad_norm(tmp_path):
    """A seed whose steps read grad norms 0.4, NaN (skipped: non-finite), 0.9, NaN: the max over the
    finite steps is 0.9 and 2 steps are counted non-finite (polars' max skips NaN, so a max alone
    showed 0.9 and nothing else); a seed with every step finite counts 0; the summary adds them."""
    from otbflow.stages.experiment import collect
    from otbflow.studies.experiment_stats import per_seed_table, summary_table

    nan = float("nan")
    exp = {"seeds": [0, 1], "runs": {"lr_high": {}}, "analysis": {"confidence": 0.95, "target": 0.9}}
    exp["analysis"] |= {"plateau_window": 1, "plateau_margin": 0.02}
    _member_report(tmp_path, "lr_high", 0, [512], [0.4, nan, 0.9, nan])
    _member_report(tmp_path, "lr_high", 1, [512], [0.3, 0.5])
    per_seed = per_seed_table(exp, *collect(exp, tmp_path))
    assert per_seed["max_grad_norm"].to_list() == [0.9, 0.5]
    assert per_seed["nonfinite_steps"].to_list() == [2, 0]
    summary = summary_table(exp, per_seed).row(0, named=True)
    assert summary["max_grad_norm"] == 0.9 and summary["nonfinite_steps"] == 2


def test_analysis_section_is_checked(tmp_path):
    exp = yaml.safe_load(TINY_EXPERIMENT.read_text())
    for bad, message in [
        ({"pairs": [["grpo_n4", "x"]]}, "analysis.pairs"),
        ({"target": 1.5}, "analysis.target"),
        ({"colour": 1}, "'analysis.colour': unknown key. Allowed here: target, pairs, confidence, plateau_window"),
    ]:
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump(exp | {"analysis": bad}))
        with pytest.raises(ConfigError, match=message):
            load_experiment(path)


def test_experiment_schema_documents_every_key_and_reads_every_file():
    """The experiment file has a schema like the run config's: a docstring under each field, its
    bounds beside it; every experiment in config/experiments loads with the defaults filled in."""
    import dataclasses

    from otbflow.config import field_docs
    from otbflow.studies.experiment_config import AnalysisConfig, ExperimentConfig

    for cls in (ExperimentConfig, AnalysisConfig):
        assert set(field_docs(cls)) == {f.name for f in dataclasses.fields(cls)}, cls.__name__
    assert AnalysisConfig.__dataclass_fields__["plateau_margin"].metadata["gt"] == 0
    for path in sorted((REPO / "config" / "experiments").glob("*.yaml")):
        exp = load_experiment(path)
        assert exp["analysis"]["plateau_margin"] == 0.02 and 0 < exp["analysis"]["target"] <= 1
        assert set(exp) == {"experiment", "seeds", "base", "runs", "analysis"}
