"""The AdamW state every N iterations (otbflow.runtime.adamw, train.optimizer_every): which
iterations write it and which one each train job reads, against an enumeration; and the tiny run
of 6 iterations with N = 2 on warm workers, its train worker killed (kill -9) at k = c + 2 in one
run and stopped (SIGTERM) in the middle of another, each finished by the same command with the
final policy and AdamW state (every tensor and scalar) of the run without workers."""

from __future__ import annotations

import os
import shutil
import signal
import threading
from pathlib import Path

import pytest
from conftest import folder_digest, tiny_config
from test_worker import KINDS, start_worker, stop, wait_for
from test_workflow import copy_run, snakemake

from otbflow.ops import dispatch
from otbflow.runtime import adamw, retention

pytestmark = pytest.mark.xdist_group("adamw")
ITERATIONS = 6
# the chain to iteration 5's policy and AdamW state, under the default retention (the tiny config
# keeps everything): the prune jobs of the iterations it does not keep run too
RUN = [f"iterations={ITERATIONS}", "retention={policy_every: 10, optimizer: last}", "evaluate={every: 100}"]
N2 = ["train={optimizer_every: 2}"]


def targets(every: int, prune: bool = True) -> list[str]:
    """The last policy and AdamW state, and the prune jobs of the policies the run does not keep."""
    keep = ("retention.policy_every=10", "retention.optimizer=last")
    cfg = tiny_config(f"iterations={ITERATIONS}", *keep, f"train.optimizer_every={every}")
    last = ITERATIONS - 1
    pruned = [k for k in range(last) if not retention.decision(cfg, k).policy]
    # after --cores: the helper's --configfile before them takes any number of files
    return ["--cores", "2", f"results/iter_{last}/train/policy", f"results/iter_{last}/train/optimizer"] + [
        f"results/iter_{k}/train/retention.json" for k in pruned if prune
    ]


def start_workers(results: Path, tmp: Path, train_env: dict | None = None) -> dict:
    """One worker of each kind; ``train_env`` (a fault) for the train worker alone."""
    procs = {
        kind: start_worker(results, kind, tmp / f"worker_{kind}.log", train_env if kind == "train" else None)
        for kind in KINDS
    }
    for kind in KINDS:
        wait_for(lambda kind=kind: dispatch.live_workers(results, kind), 60, f"the {kind} worker to register")
    return procs


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_each_train_job_reads_the_second_newest_checkpoint(n):
    """For N = 1 .. 5 over 23 iterations, against a loop over the regular checkpoints
    {N-1, 2N-1, ...}: with N = 1 job k reads k-1's state; with N >= 2 the second-newest checkpoint
    before k (none before the second), replays the iterations after it (all before k where none:
    at most 2N-1), and the newest checkpoint's write has the N iterations after it to finish
    before the first job that reads it; the run's last iteration writes too."""
    cfg = tiny_config("iterations=23", f"train.optimizer_every={n}")
    checkpoints = [c for c in range(23) if (c + 1) % n == 0]
    assert adamw.written(cfg) == sorted({*checkpoints, 22})
    for k in range(23):
        before = [c for c in checkpoints if c < k]
        if n == 1:
            want = k - 1 if k else None
            assert adamw.replayed(cfg, k) == []
        else:
            want = before[-2] if len(before) >= 2 else None
            assert adamw.replayed(cfg, k) == list(range(0 if want is None else want + 1, k))
            assert len(adamw.replayed(cfg, k)) <= 2 * n - 1
            if want is not None:
                assert k - before[-1] <= n and k - want > n  # the newest one read only N+1 jobs later
        assert adamw.declared(cfg, k) == want
        if want is not None:
            assert k in adamw.readers(cfg, want)


def test_null_is_5_with_a_train_worker_and_1_without():
    assert adamw.every(tiny_config()) == 1
    assert adamw.every(tiny_config("workers.slurm=true")) == adamw.AUTO_EVERY == 5
    assert adamw.every(tiny_config("workers.slurm=true", "workers.train=0")) == 1
    assert adamw.every(tiny_config("train.reset_optimizer=true", "train.optimizer_every=3")) == 0


def test_retention_keeps_the_two_checkpoints_a_longer_run_reads():
    """Extended from 12 to any longer run, the first train jobs read checkpoints 4 and 9 (N = 5):
    both are kept with their policies, with the last state; 2 more iterations only the newest two."""
    cfg = tiny_config("iterations=12", "train.optimizer_every=5", "retention.policy_every=100")
    kept = [k for k in range(12) if retention.decision(cfg, k).optimizer]
    assert kept == [4, 9, 11] and all(retention.decision(cfg, k).policy for k in kept)
    for longer in range(13, 30):
        more = tiny_config(f"iterations={longer}", "train.optimizer_every=5")
        read = {adamw.declared(more, k) for k in range(12, longer)} - {None}
        assert {c for c in read if c < 12} <= {4, 9}  # what the first run wrote


@pytest.fixture(scope="module")
def uninterrupted(tiny_run, tmp_path_factory):
    """The tiny run extended to 6 iterations, without workers (N = 1: every state read by the next job)."""
    work = copy_run(tiny_run, tmp_path_factory.mktemp("adamw") / "run")
    snakemake(work, *targets(1, prune=False), "--config", *RUN)
    return work / "results"


def same_state(a: Path, b: Path) -> list[str]:
    """The names of the tensors and scalars that differ between the AdamW states (DeepSpeed
    checkpoints) in ``a`` and ``b`` (the .pt bytes may differ: pickling)."""
    import torch

    from otbflow.training.state import load_checkpoint_file

    def flat(obj, prefix=""):
        if isinstance(obj, dict):
            for k, v in obj.items():
                yield from flat(v, f"{prefix}/{k}")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                yield from flat(v, f"{prefix}/{i}")
        else:
            yield prefix, obj

    def equal(x, y):
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
        return x == y

    files = sorted(p.relative_to(a / "state") for p in (a / "state").rglob("*.pt"))
    assert files and files == sorted(p.relative_to(b / "state") for p in (b / "state").rglob("*.pt"))
    bad = []
    for f in files:
        x, y = (dict(flat(load_checkpoint_file(str(root / f)))) for root in (a / "state", b / "state"))
        assert any(n.endswith("exp_avg_sq") for n in x)  # the moments are in there
        bad += [
            f"{f}{n}" for n in sorted(x.keys() | y.keys()) if "ds_" not in n and not (n in x and equal(x[n], y.get(n)))
        ]
    return bad


def same_end(results: Path, want: Path) -> None:
    last = f"iter_{ITERATIONS - 1}/train"
    assert folder_digest(results / last / "policy") == folder_digest(want / last / "policy")
    assert same_state(results / last / "optimizer", want / last / "optimizer") == []


def test_a_train_worker_killed_at_c_plus_2_is_replayed_from_the_checkpoint_before(uninterrupted, tiny_run, tmp_path):
    """N = 2 (checkpoints 1, 3, 5): the train worker dies by SIGKILL in iteration 5's job, once it
    loaded its inputs (the newest checkpoint is 3 = k - 2). The job's client runs it itself: from
    checkpoint 1's policy and AdamW state it replays iterations 2, 3 and 4 from their cached
    advantages, each checked against its published policy (2's pruned by then or not: its manifest
    stays), then trains iteration 5: the final policy and AdamW state are the uninterrupted run's."""
    work = copy_run(tiny_run, tmp_path / "run")
    results = work / "results"
    # the train worker's 6th train job (--forcerun train: iterations 0 .. 5 all run in it)
    procs = start_workers(results, tmp_path, {"OTBFLOW_FAULT": "policy:loaded", "OTBFLOW_FAULT_SKIP": "5"})
    try:
        snakemake(work, *targets(2), "--forcerun", "train", "--config", *RUN, *N2)
    finally:
        stop(procs)
    assert procs["train"].returncode == -signal.SIGKILL
    log = (results / "logs/train/iter_5.log").read_text()
    assert "is gone: running the job here" in log
    assert f"AdamW resumes from {Path('results/iter_1/train/optimizer')}" in log, log[-3000:]
    assert [f"replayed iteration {j} " in log for j in range(6)] == [False, False, True, True, True, False]
    same_end(results, uninterrupted)


def test_a_train_worker_stopped_mid_run_writes_its_state_and_the_jobs_after_replay_less(
    uninterrupted, tiny_run, tmp_path
):
    """N = 2, the background writes snapshotting first (as on a GPU): the train worker is stopped
    (SIGTERM, as Slurm's --signal before a time limit) once
    iteration 2's job is done: it writes its engine's AdamW state (iteration 2 is no checkpoint)
    outside the outputs and ends. The jobs after run without a worker: iteration 3's starts from
    that state and replays nothing, 4's replays 3, 5's replays 3 and 4; the final policy and
    AdamW state are the uninterrupted run's."""
    work = copy_run(tiny_run, tmp_path / "run")
    results = work / "results"
    # its background writes (checkpoints 1 and 3) first copy the state to host memory, as on a GPU:
    # the next job waits only for that copy
    procs = start_workers(results, tmp_path, {"OTBFLOW_SNAPSHOT_ON_CPU": "1"})
    done = results / "iter_2/train/schedule.json"

    def remove():
        wait_for(done.exists, 600, "iteration 2's train job")
        procs["train"].send_signal(signal.SIGTERM)

    remover = threading.Thread(target=remove, daemon=True)
    remover.start()
    try:
        snakemake(work, *targets(2), "--forcerun", "train", "--config", *RUN, *N2)
    finally:
        remover.join(timeout=5)
        stop(procs)
    assert procs["train"].returncode == 0
    worker_log = (tmp_path / "worker_train.log").read_text()
    assert "the worker ends: its AdamW state after iteration 2 goes to" in worker_log, worker_log[-3000:]
    logs = {k: (results / f"logs/train/iter_{k}.log").read_text() for k in (3, 4, 5)}
    for k, log in logs.items():
        assert "written by a warm worker" in log, log[-3000:]
        assert [f"replayed iteration {j} " in log for j in range(k)] == [j in range(3, k) for j in range(k)]
    assert sorted(p.name for p in (results / "checkpoints/train/adamw").iterdir()) == ["iter_2"]
    same_end(results, uninterrupted)
    assert not os.path.exists(results / "iter_2/train/optimizer")


def test_a_warm_worker_writes_its_state_every_optimizer_every_min(tiny_run, tmp_path):
    """train.optimizer_every_min (here a few microseconds: every job) with N = 2: the warm train
    worker writes the AdamW state of each job that writes none as an output, after the job
    returned, outside the outputs (--adamw-dir), the newest only. A job of iteration 2 without the
    resident engine (a process of its own), given iterations 0 and 1 to replay, starts from the
    state the worker wrote after iteration 1 and replays nothing: its policy and metrics are the
    warm worker's job's."""
    import subprocess
    import sys

    import yaml
    from test_worker import same_update, train_args

    from otbflow.runtime.codeversion import code_version

    results, registry, adamw_dir = tiny_run / "results", tmp_path / "registry", tmp_path / "adamw"
    config = yaml.safe_load((results / "config.yaml").read_text())
    config["train"] |= {"optimizer_every": 2, "optimizer_every_min": 1e-7}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    advantages = str(results / "iter_0/advantages/advantages.parquet")

    def args(k: int, out: Path) -> list[str]:
        """Iteration k's job (no AdamW state of its own: N = 2 writes 1's), replaying 0 .. k-1."""
        a = train_args(results, out, k, None)
        a[a.index("--config") + 1] = str(tmp_path / "config.yaml")
        a[a.index("--policy") + 1] = str(tmp_path / f"train_{k - 1}/policy" if k else results / "bootstrap/policy")
        del a[a.index("--optimizer") : a.index("--optimizer") + 2]
        a += ["--adamw-dir", str(adamw_dir)]
        if k:
            a += ["--replay-start", str(results / "bootstrap/policy"), "--replay-advantages", *[advantages] * k]
            a += ["--replay-policies", *[str(tmp_path / f"train_{j}/policy") for j in range(k)]]
        return a

    proc = start_worker(registry, "train", tmp_path / "worker.log")
    try:
        wait_for(lambda: dispatch.live_workers(registry, "train"), 60, "the train worker")
        for k in range(3):
            client = dispatch.Client(registry, "train", code_version("train"), args(k, tmp_path / f"train_{k}"))
            with open(tmp_path / "client.log", "a") as log:
                assert client.run(log) == 0, (tmp_path / "client.log").read_text()[-3000:]
            wait_for(lambda k=k: (adamw_dir / f"iter_{k}/meta.json").is_file(), 60, f"iteration {k}'s state")
            wait_for(lambda k=k: [p.name for p in adamw_dir.iterdir()] == [f"iter_{k}"], 60, "the older ones gone")
            if k == 1:  # the state iteration 2's job without the worker starts from
                shutil.copytree(adamw_dir / "iter_1", tmp_path / "kept")
    finally:
        stop({"train": proc})
    shutil.rmtree(adamw_dir)
    shutil.copytree(tmp_path / "kept", adamw_dir / "iter_1")
    alone = tmp_path / "alone"
    a = [x.replace(str(tmp_path / "train_2"), str(alone)) for x in args(2, tmp_path / "train_2")]
    res = subprocess.run([sys.executable, "-m", "otbflow", "train", *a], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "written by a warm worker: 0 update(s) to replay" in res.stderr, res.stderr[-3000:]
    same_update(tmp_path / "train_2", alone)
