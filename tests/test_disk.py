"""otbflow disk and the retention rule: parameter counts against the published ones, the estimate
against what the tiny run wrote, and which iterations keep what in a hand-worked case."""

from __future__ import annotations

import pytest
from conftest import REPO, TINY

from otbflow.config import DEFAULT_CONFIG, load_config
from otbflow.ops.disk import built_model_config, count_parameters, estimate
from otbflow.runtime.retention import decision

SHAPES = REPO / "benchmarks" / "shapes"


@pytest.mark.parametrize(
    "shape, published",
    # the model cards' parameter counts (Qwen2.5 0.5B, 7B, 32B: 0.49B, 7.61B, 32.5B; exact sums
    # of the released safetensors' tensors)
    [("qwen2.5-0.5b", 494_032_768), ("qwen2.5-7b", 7_615_616_512), ("qwen2.5-32b", 32_763_876_352)],
)
def test_parameters_are_counted_as_released(shape, published):
    assert count_parameters(SHAPES / f"{shape}.json") == published


def test_retention_keeps_every_nth_the_last_staleness_plus_one_and_the_last_optimizer():
    cfg = load_config(DEFAULT_CONFIG, ["iterations=25", "rollout.staleness=1", "train.rollout_is=token"])
    kept = [k for k in range(25) if decision(cfg, k).policy]
    assert kept == [9, 19, 23, 24]  # after 10 and 20 updates; 23 and 24 start and sample iteration 25
    assert [k for k in range(25) if decision(cfg, k).optimizer] == [24]
    everything = load_config(DEFAULT_CONFIG, ["retention.policy_every=0", "retention.optimizer=all"])
    assert all(decision(everything, k).policy and decision(everything, k).optimizer for k in range(4))


def test_the_estimate_matches_what_the_tiny_run_wrote(tiny_run):
    """The tiny run keeps everything (config/tiny.yaml): its policy and optimizer folders are the
    estimate's per-iteration sizes, and its data tables are below the uncompressed bound."""
    cfg = load_config(DEFAULT_CONFIG, extra=__import__("yaml").safe_load(TINY.read_text()))
    est = estimate(cfg, count_parameters(built_model_config(cfg)))
    r = tiny_run / "results"

    def size(path):
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())

    for k in range(cfg.iterations):
        weights = (r / f"iter_{k}/train/policy/model.safetensors").stat().st_size
        assert abs(weights - est["bytes"]["policy"]) < 0.02 * weights  # + the safetensors header
        optimizer = size(r / f"iter_{k}/train/optimizer")
        assert abs(optimizer - est["bytes"]["optimizer"]) < 0.05 * optimizer
        data = sum(size(r / f"iter_{k}/{stage}") for stage in ("rollout", "features", "advantages"))
        assert 0 < data < est["bytes"]["data_per_iteration"] + 3 * 2**16  # + Parquet's per-file overhead
