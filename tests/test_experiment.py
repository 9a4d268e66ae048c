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
from otbflow.experiment_config import load_experiment, member_config
from otbflow.io import read_metadata, read_table

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
        ({"analysis": {"ci_resamples": 99}}, "config key 'analysis.ci_resamples': must be >= 100 (got 99)"),
        ({"analysis": {"confidence": 1.0}}, "config key 'analysis.confidence': must be in (0, 1) (got 1.0)"),
        ({"analysis": {"bootstrap": 500}}, "config key 'analysis.bootstrap' was renamed to 'analysis.ci_resamples'"),
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
    from otbflow.stages.experiment import tokens_to_target

    tokens = np.array([0.0, 100.0, 300.0, 600.0])
    assert tokens_to_target(tokens, np.array([0.2, 0.4, 0.8, 0.5]), 0.6) == pytest.approx(200.0)  # halfway 100..300
    assert tokens_to_target(tokens, np.array([0.7, 0.4, 0.8, 0.5]), 0.6) == 0.0  # the initial policy already is there
    assert np.isnan(tokens_to_target(tokens, np.array([0.2, 0.4, 0.5, 0.55]), 0.6))


def test_bootstrap_interval_of_two_values_is_their_range():
    """Resampling {0, 1} twice gives means 0, 0.5, 1 with probabilities 1/4, 1/2, 1/4: the
    central 95% interval is [0, 1]; a constant has a point interval."""
    from otbflow.stages.experiment import bootstrap_ci

    assert bootstrap_ci(np.array([0.0, 1.0]), 4000, 0.95, seed=0) == (0.0, 1.0)
    lo, hi = bootstrap_ci(np.array([0.0, 1.0]), 4000, 0.40, seed=0)
    assert lo == hi == 0.5  # the central 40% lies inside the 50% mass at 0.5
    assert bootstrap_ci(np.array([3.0, 3.0, 3.0]), 500, 0.95, seed=1) == (3.0, 3.0)


def test_per_seed_table_on_hand_made_curves():
    """Two runs x one seed, three evaluations each. Reference r ends at 0.8, so the target is
    0.9 x 0.8 = 0.72; s crosses it between 0.6 at 100 tokens and 0.9 at 400 tokens, at 100 +
    (0.12 / 0.3) x 300 = 220 tokens; r between 0.4 at 100 and 0.8 at 300: 100 + (0.32 / 0.4) x 200
    = 260 tokens."""
    from otbflow.stages.experiment import per_seed_table

    curves = pl.DataFrame(
        [
            ("r", 0, -1, 0.5, 0.5, 0.0, 10.0),
            ("r", 0, 0, 0.4, 0.6, 100.0, 12.0),
            ("r", 0, 1, 0.8, 0.9, 300.0, 30.0),
            ("s", 0, -1, 0.5, 0.5, 0.0, 10.0),
            ("s", 0, 0, 0.6, 0.7, 100.0, 8.0),
            ("s", 0, 1, 0.9, 1.0, 400.0, 9.0),
        ],
        schema=[
            "run",
            "seed",
            "iteration",
            "sampled_accuracy",
            "greedy_accuracy",
            "tokens_generated",
            "mean_response_length",
        ],
        orient="row",
    )
    metrics = pl.DataFrame(
        [("r", 0, 50, 0.3), ("r", 0, 70, 1.5), ("s", 0, 40, 0.2)],
        schema=["run", "seed", "tokens", "grad_norm"],
        orient="row",
    )
    exp = {"runs": {"r": {}, "s": {}}, "analysis": {"reference": "r", "target_fraction": 0.9, "plateau_window": 2}}
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


def test_late_gain_with_evaluations_every_other_iteration():
    """evaluate.every = 2 over 6 iterations: the initial policy (iteration -1), then iterations 1, 3
    and 5. The gain over the last 2 iterations is from iteration 3 (0.6) to 5 (0.65); over the last
    3 or 4, from iteration 1 (0.5): the last evaluation at least that many iterations before."""
    from otbflow.stages.experiment import per_seed_table

    curves = pl.DataFrame(
        [("r", 0, it, acc, acc, 100.0 * (it + 1), 10.0) for it, acc in [(-1, 0.3), (1, 0.5), (3, 0.6), (5, 0.65)]],
        schema=[
            "run",
            "seed",
            "iteration",
            "sampled_accuracy",
            "greedy_accuracy",
            "tokens_generated",
            "mean_response_length",
        ],
        orient="row",
    )
    metrics = pl.DataFrame([("r", 0, 50, 0.3)], schema=["run", "seed", "tokens", "grad_norm"], orient="row")
    exp = {"runs": {"r": {}}, "analysis": {"reference": "r", "target_fraction": 0.9, "plateau_window": 2}}
    gain = {
        w: per_seed_table(exp | {"analysis": exp["analysis"] | {"plateau_window": w}}, curves, metrics)["late_gain"][0]
        for w in (1, 2, 3, 4, 6, 7)
    }
    assert gain[1] == pytest.approx(0.05) and gain[2] == pytest.approx(0.05)  # 3 -> 5
    assert gain[3] == pytest.approx(0.15) and gain[4] == pytest.approx(0.15)  # 1 -> 5
    assert gain[6] == pytest.approx(0.35)  # from the initial policy
    assert math.isnan(gain[7])


def test_paired_table_on_hand_made_seeds():
    from otbflow.stages.experiment import paired_table

    nan = float("nan")
    rows = [  # run a needs half the tokens of b on the seeds where both reach the target by training
        ("a", 0, 0.5, 100.0),
        ("a", 1, 0.6, 200.0),
        ("a", 2, 0.4, nan),
        ("a", 3, 0.7, 0.0),  # seed 3: at it already
        ("b", 0, 0.4, 200.0),
        ("b", 1, 0.4, 400.0),
        ("b", 2, 0.5, 300.0),
        ("b", 3, 0.6, 100.0),
    ]
    per_seed = pl.DataFrame(rows, schema=["run", "seed", "final_accuracy", "tokens_to_target"], orient="row")
    exp = {"analysis": {"pairs": [["a", "b"]], "ci_resamples": 500, "confidence": 0.95}}
    pairs = paired_table(exp, per_seed).row(0, named=True)
    assert pairs["seeds"] == 4 and pairs["both_reached"] == 2 and pairs["a_better_seeds"] == 3
    assert pairs["accuracy_diff"] == pytest.approx((0.1 + 0.2 - 0.1 + 0.1) / 4)
    assert pairs["tokens_ratio"] == pytest.approx(0.5) and pairs["tokens_ratio_lo"] == pytest.approx(0.5)


def test_analysis_section_is_checked(tmp_path):
    exp = yaml.safe_load(TINY_EXPERIMENT.read_text())
    for bad, message in [
        ({"reference": "nope"}, "analysis.reference"),
        ({"pairs": [["grpo_n4", "x"]]}, "analysis.pairs"),
        ({"target_fraction": 1.5}, "analysis.target_fraction"),
        ({"colour": 1}, "'analysis.colour': unknown key. Allowed here: reference, target_fraction, pairs"),
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
    from otbflow.experiment_config import AnalysisConfig, ExperimentConfig

    for cls in (ExperimentConfig, AnalysisConfig):
        assert set(field_docs(cls)) == {f.name for f in dataclasses.fields(cls)}, cls.__name__
    assert AnalysisConfig.__dataclass_fields__["ci_resamples"].metadata["ge"] == 100
    for path in sorted((REPO / "config" / "experiments").glob("*.yaml")):
        exp = load_experiment(path)
        assert exp["analysis"]["ci_resamples"] == 2000 and exp["analysis"]["reference"] in exp["runs"]
        assert set(exp) == {"experiment", "seeds", "base", "runs", "analysis"}
