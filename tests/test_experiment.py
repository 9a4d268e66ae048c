"""An experiment (workflow/experiment.smk): the reduced config/experiments/tiny.yaml end to end
(2 runs x 2 seeds on a shared policy and prompt set), and bad experiment files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
import yaml

from otbflow import schemas
from otbflow.config import ConfigError
from otbflow.experiment import load_experiment, member_config
from otbflow.io import read_table

from conftest import REPO

SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))
TINY_EXPERIMENT = REPO / "config" / "experiments" / "tiny.yaml"


def experiment(workdir: Path, configfile: Path, *args: str, check=True):
    cmd = [SNAKEMAKE, "-s", str(REPO / "workflow" / "experiment.smk"), "--directory", str(workdir), "--cores", "2",
           "--configfile", str(configfile), *args]
    res = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if check and res.returncode != 0:
        raise AssertionError(f"snakemake failed ({res.returncode}):\n{res.stdout[-4000:]}\n{res.stderr[-6000:]}")
    return res


@pytest.mark.slow
def test_tiny_experiment(tmp_path):
    experiment(tmp_path, TINY_EXPERIMENT)
    root = tmp_path / "results" / "tiny_experiment"
    summary = read_table(root / "summary.parquet", schemas.EXPERIMENT_SUMMARY)
    assert summary["run"].to_list() == ["grpo_n4", "length_power_n4"] and summary["seeds"].to_list() == [2, 2]
    assert (summary["tokens_generated"] > 0).all() and (summary["tokens_trained"] > 0).all()
    curves = pl.read_parquet(root / "curves.parquet")
    assert curves.height == 2 * 2 * 2  # runs x seeds x (initial, iter_0)
    # one initial policy and one prompt set for all members; the seeds differ
    slope = json.loads((root / "shared/results/scaling/summary.json").read_text())["grad_sq_norm_slope"]
    prompts = set()
    for run in ("grpo_n4", "length_power_n4"):
        for seed in (0, 1):
            member = root / run / f"seed_{seed}"
            cfg = yaml.safe_load((member / "member.yaml").read_text())
            assert cfg["seed"] == seed and cfg["model"]["path"] == str((root / "shared/results/bootstrap/policy").resolve())
            if run == "length_power_n4":
                assert cfg["advantages"]["exponent"] == pytest.approx(slope)
            prompts.add(tuple(pl.read_parquet(member / "results/data/train/shard_0.parquet")["prompt"]))
            assert not (member / "results/bootstrap").exists()
    assert len(prompts) == 1
    for png in ("accuracy_vs_tokens", "training"):
        assert (root / f"{png}.png").read_bytes()[:4] == b"\x89PNG"
    assert read_table(root / "shared/results/variance/summary.parquet", schemas.VARIANCE).height >= 3
    assert pl.read_csv(root / "summary.tsv", separator="\t")["run"].to_list() == ["grpo_n4", "length_power_n4"]
    assert "otb" in pl.read_csv(root / "variance.tsv", separator="\t")["estimator"].to_list()
    experiment(tmp_path, TINY_EXPERIMENT, "--report", "report.html")
    html = (tmp_path / "report.html").read_text(errors="ignore")
    assert "accuracy_vs_tokens.png" in html and "variance.png" in html


def test_member_config_layers_base_run_and_seed():
    exp = load_experiment(TINY_EXPERIMENT)
    cfg = member_config(exp, "length_power_n4", 1, "/p", 1.7)
    assert cfg["seed"] == 1 and cfg["task"]["seed"] == 0 and cfg["model"]["path"] == "/p"
    assert cfg["advantages"] == {"estimator": "length_power", "exponent": 1.7}
    assert cfg["model"]["n_layer"] == 2 and cfg["iterations"] == 1


@pytest.mark.parametrize("change, message", [
    ({"runs": {"bad": {"advantages": {"estimator": "foo"}}}}, "run 'bad': config key 'advantages.estimator'"),
    ({"runs": {"bad": {"rollout": {"groupsize": 4}}}}, "run 'bad': config key 'rollout.groupsize'"),
    ({"seeds": []}, "'seeds' must be a non-empty list"),
    ({"extra": 1}, "unknown: ['extra']"),
])
def test_bad_experiment_fails_before_any_job(tmp_path, change, message):
    exp = yaml.safe_load(TINY_EXPERIMENT.read_text()) | change
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(exp))
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_experiment(path)


def test_bad_experiment_stops_the_workflow_before_any_job(tmp_path):
    exp = yaml.safe_load(TINY_EXPERIMENT.read_text())
    exp["runs"]["bad"] = {"advantages": {"estimator": "foo"}}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(exp))
    res = experiment(tmp_path, tmp_path / "bad.yaml", check=False)
    assert res.returncode != 0 and "run 'bad': config key 'advantages.estimator'" in res.stdout + res.stderr
    assert not any((tmp_path / "results").rglob("*.parquet"))
