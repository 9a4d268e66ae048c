"""The tiny workflow through a real one-node Slurm on localhost (slurm/local/slurm-up.sh).

Runs the whole workflow with the slurm/ profile (rollout shards as a job array, a 2-process
DeepSpeed train step through srun), then `otbflow submit` (a head job that reruns one stage
with another estimator). Skipped, with the reason, where Slurm cannot be started (not root,
no apt-get). The daemons are stopped by their PID files if this test started them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from otbflow import schemas
from otbflow.io import read_metadata, read_table

from conftest import REPO, TINY

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))
LOCAL = REPO / "slurm" / "local"
LAB = Path(os.environ.get("SLURM_LAB", "/tmp/slurm-lab"))
# A test cluster: no accounts, first status check after 2 s instead of the profile's 20 s, one
# CPU per job so that two jobs share the 2-core machine.
TEST_ARGS = ["--slurm-no-account", "--slurm-init-seconds-before-status-checks", "2",
             "--set-threads", "bootstrap=1", "rollout=1", "features=1", "evaluate=1", "scaling=1"]
# One iteration, trained by 2 DeepSpeed ranks of 1 CPU each.
TEST_CONFIG = "iterations: 1\nresources:\n  train: {tasks: 2, cpus_per_task: 1}\n"


def _running(pid_file: Path) -> bool:
    try:
        os.kill(int(pid_file.read_text()), 0)
        return True
    except (OSError, ValueError):
        return False


@pytest.fixture(scope="module")
def local_slurm():
    already_up = _running(LAB / "run" / "slurmctld.pid")
    res = subprocess.run(["bash", str(LOCAL / "slurm-up.sh")], capture_output=True, text=True,
                         stdin=subprocess.DEVNULL, timeout=900)
    if res.returncode == 77 or (res.returncode != 0 and not shutil.which("slurmctld")):
        reason = f"cannot start a local Slurm here: {(res.stdout + res.stderr).strip()[-500:]}"
        print(reason)
        pytest.skip(reason)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    yield
    if not already_up:
        subprocess.run(["bash", str(LOCAL / "slurm-down.sh")], stdin=subprocess.DEVNULL, timeout=120)


@pytest.fixture(scope="module")
def slurm_run(local_slurm, tmp_path_factory):
    """The tiny workflow through Slurm, with 2 training ranks; returns (workdir, its output)."""
    work = tmp_path_factory.mktemp("slurm_workflow")
    (work / "test.yaml").write_text(TEST_CONFIG)
    cmd = [SNAKEMAKE, "-s", str(REPO / "Snakefile"), "--directory", str(work), "--workflow-profile",
           str(REPO / "slurm"), "--configfile", str(TINY), str(work / "test.yaml"), *TEST_ARGS]
    start = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=900)
    seconds = time.perf_counter() - start
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-6000:]
    print(f"tiny workflow through Slurm: {seconds:.0f} s")
    return work, res.stdout + res.stderr


def test_tiny_workflow_through_slurm(slurm_run):
    work, log = slurm_run
    r = work / "results"
    assert "Submitted array job" in log  # the rollout shards of an iteration: one job array
    for k in [0]:
        for s in range(2):
            ro = read_table(r / f"iter_{k}/rollout/shard_{s}.parquet", schemas.ROLLOUTS)
            fe = read_table(r / f"iter_{k}/features/shard_{s}.parquet", schemas.FEATURES)
            assert fe.height == ro.height > 0
        read_table(r / f"iter_{k}/advantages/advantages.parquet", schemas.ADVANTAGES)
        metrics = read_table(r / f"iter_{k}/train/metrics.parquet", schemas.TRAIN_METRICS)
        assert metrics["grad_norm"].is_finite().all()
        assert read_metadata(r / f"iter_{k}/train/metrics.parquet")["world_size"] == 2  # srun started 2 ranks
    progress = read_table(r / "report/progress.parquet", schemas.PROGRESS)
    assert progress["policy"].to_list() == ["initial", "iter_0"]
    assert list((work / ".snakemake" / "slurm_logs").rglob("*.log"))  # kept by the profile


def test_submit_reruns_one_stage_from_a_head_job(slurm_run, tmp_path):
    from otbflow import submit
    from otbflow.cli import build_parser

    work, _ = slurm_run
    target = "results/iter_0/advantages/advantages.parquet"
    ns = build_parser("submit").parse_args([
        "submit", "--rerun", "advantages", "--logs", str(tmp_path / "head"), "--time", "20", "--", target,
        "--directory", str(work), "--configfile", str(TINY), str(work / "test.yaml"),
        "--config", "advantages={estimator: grpo}", *TEST_ARGS])
    job = submit.submit(ns)
    assert job.result() == 0, Path(job.paths.stdout).read_text()[-3000:]
    head_log = Path(job.paths.stdout).read_text() + Path(job.paths.stderr).read_text()
    assert "--forcerun advantages" in head_log and "Job stats" in head_log
    adv = read_table(work / target, schemas.ADVANTAGES)
    assert set(adv["estimator"]) == {"grpo"}
    assert "rule rollout" not in head_log and "rule train" not in head_log  # only the advantages job ran
