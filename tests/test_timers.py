"""What the compute timers hold (benchmarks/bench_iteration.py's ``timer_s``: generation's and the
features pass's Progress rate, the train metrics' ``step_time_s``): the work alone. A policy's load,
its digests and in-place copies (``policy:loaded``, at the end of them) and the train job's writes
of the next policy and AdamW state (``train:before-outputs``, before them) fall outside: a pause
injected there (``OTBFLOW_FAULT=...:pause``) lengthens the job, never its timer."""

from __future__ import annotations

import logging
import re
import time

import pytest
import train_helpers
from train_helpers import run_stage

from otbflow import io
from otbflow.stages import features, rollout

PAUSE_S = 1.5

# the module-scoped fixtures of train_helpers: a policy and features for the train stage
policy_dir = train_helpers.policy_dir
features_path = train_helpers.features_path


def paused(monkeypatch, point: str) -> None:
    monkeypatch.setenv("OTBFLOW_FAULT", f"{point}:pause")
    monkeypatch.setenv("OTBFLOW_FAULT_PAUSE_S", str(PAUSE_S))
    monkeypatch.setattr(io, "_FAULTS_HIT", set())


def progress_timer(text: str, what: str) -> float:
    """Items over rate of a Progress's final line (otbflow.progress), as the benchmark reads it."""
    m = re.search(rf"{what}.*: (\d+)/\d+ \S+ \(100%\), ([\d.e+]+) \S+, done", text)
    assert m, text
    return int(m.group(1)) / float(m.group(2))


@pytest.mark.parametrize("stage", ["rollout", "features"])
def test_a_policy_load_is_outside_the_timer(
    stage, cfg, tiny_policy, data_dir, rollouts_path, tmp_path, monkeypatch, caplog
):
    paused(monkeypatch, "policy:loaded")
    caplog.set_level(logging.INFO)
    t0 = time.perf_counter()
    if stage == "rollout":
        args = rollout.Args(
            prompts=str(data_dir / "train" / "shard_0.parquet"),
            policy=str(tiny_policy),
            out=str(tmp_path / "r.parquet"),
        )
        rollout.run(cfg, args)
    else:
        features.run(cfg, features.Args(rollouts=str(rollouts_path), policy=str(tiny_policy), out=str(tmp_path / "f")))
    elapsed = time.perf_counter() - t0
    timer = progress_timer(caplog.text, "generation" if stage == "rollout" else "features")
    assert elapsed >= PAUSE_S and timer < PAUSE_S / 2, (elapsed, timer)


@pytest.mark.parametrize("point", ["policy:loaded", "train:before-outputs"])
def test_the_train_step_timer_holds_neither_loads_nor_writes(point, policy_dir, features_path, tmp_path, monkeypatch):
    paused(monkeypatch, point)
    t0 = time.perf_counter()
    metrics, _ = run_stage(
        policy_dir, features_path, tmp_path, "train.mini_batch_size=8", optimizer=str(tmp_path / "opt")
    )
    elapsed = time.perf_counter() - t0
    assert elapsed >= PAUSE_S and metrics["step_time_s"].sum() < PAUSE_S / 2, (elapsed, metrics["step_time_s"])
