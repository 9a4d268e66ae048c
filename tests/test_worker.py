"""Warm stage workers (otbflow.worker, otbflow.dispatch): the tiny run handed to workers gives the
outputs of the run without them, bitwise; a worker killed mid-job, a client killed mid-job, a stale
registration, a request without the run's secret, a worker of other code; the client's imports."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO
from test_workflow import copy_run, snakemake

from otbflow import dispatch

sys.path.insert(0, str(REPO / "tests"))
from fingerprint import fingerprints  # noqa: E402

pytestmark = pytest.mark.xdist_group("tiny_run")
KINDS = ("generate", "features", "train")


def start_worker(results: Path, kind: str, log: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "otbflow", "worker", kind, "--results", str(results)],
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )


def wait_for(predicate, timeout: float, what: str):
    end = time.time() + timeout
    while time.time() < end:
        if value := predicate():
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def workers(results: Path, tmp: Path, env: dict | None = None) -> dict[str, subprocess.Popen]:
    procs = {kind: start_worker(results, kind, tmp / f"worker_{kind}.log", env) for kind in KINDS}
    for kind in KINDS:
        wait_for(lambda kind=kind: dispatch.live_workers(results, kind), 60, f"the {kind} worker to register")
    return procs


def stop(procs: dict[str, subprocess.Popen]) -> None:
    for p in procs.values():
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs.values():
        p.wait(timeout=30)


def chain_outputs(results: Path) -> dict[str, str]:
    """The fingerprints of every iteration's rollouts, features, advantages, train outputs and
    evaluations (what the workers make)."""
    found = fingerprints(results)
    return {k: v for k, v in found.items() if "/iter_" in k or k.startswith(("table:iter_", "weights:iter_"))}


@pytest.mark.slow
def test_the_tiny_run_on_workers_is_bitwise_the_run_without(tiny_run, tmp_path):
    """The tiny run's iterations redone (--forcerun rollout: every rollout, features, advantages,
    train and evaluation job) with one worker of each kind: every table and policy equals the run
    without workers, bitwise; the train worker went on with its engine (iteration 1 read no
    optimizer state), the features worker with its resident module; the jobs' logs hold the stage's
    own lines; a rerun plans nothing; the workers left no registration behind."""
    work = copy_run(tiny_run, tmp_path / "run")
    results = work / "results"
    want = chain_outputs(tiny_run / "results")
    procs = workers(results, tmp_path)
    try:
        snakemake(work, "--forcerun", "rollout")
    finally:
        stop(procs)
    assert chain_outputs(results) == want
    train_log = (tmp_path / "worker_train.log").read_text()
    assert train_log.count("runs train") == 2 and "AdamW resumes from the resident engine" in train_log
    assert "resident policy" in (tmp_path / "worker_features.log").read_text()
    assert "train finished in" in (results / "logs/train/iter_1.log").read_text()
    assert "runs rollout" in (results / "logs/rollout/iter_1_shard_0.log").read_text()
    assert not any((results / ".workers").glob("*/*/worker.json"))
    res = snakemake(work, "-n")
    assert "Nothing to be done" in res.stdout + res.stderr


def test_the_client_imports_no_torch():
    code = "import sys, otbflow.dispatch; assert 'torch' not in sys.modules and 'polars' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_without_a_live_worker_the_client_runs_the_stage_itself(tmp_path):
    """A stale registration (a dead pid on this host) is ignored: the client execs the stage's CLI
    (here its --help, which a worker never sees)."""
    results = tmp_path / "results"
    dispatch.secret(results, create=True)
    folder = dispatch.root(results) / "features" / "gone"
    folder.mkdir(parents=True)
    (folder / "alive").touch()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    record = {**dispatch.me(), "pid": int(dead.stdout), "start": 1}
    (folder / "worker.json").write_text(json.dumps(record))
    assert dispatch.live_workers(results, "features") == []
    res = subprocess.run(
        [sys.executable, "-m", "otbflow.dispatch", "--results", str(results), "--code", "x", "features", "--help"],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0 and "teacher-forced" in res.stdout


def test_a_request_without_the_secret_is_not_run(tmp_path):
    """A request signed with another key is removed unrun; one for another code version is refused
    and its client told so (it then runs the job itself)."""
    results = tmp_path / "results"
    proc = start_worker(results, "features", tmp_path / "w.log")
    try:
        wait_for(lambda: dispatch.live_workers(results, "features"), 60, "the worker")
        queue = dispatch.root(results) / "features" / "queue"
        client = dispatch.Client(results, "features", "x", ["--help"])
        forged = client.request(b"not the secret")
        (queue / f"{client.id}.json").write_text(json.dumps(forged))
        wait_for(lambda: "refused, not run" in (tmp_path / "w.log").read_text(), 30, "the refusal")
        assert not (queue / f"{client.id}.json").exists() and not client.job.exists()
        other = dispatch.Client(results, "features", "another code version", ["--help"])
        with open(tmp_path / "client.log", "w") as out:
            assert other.run(out) is None
        assert "code version" in (tmp_path / "client.log").read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
