"""A generate worker killed mid-stream (issue "Laminar": failure isolation). Iteration 1's streamed
rollout of a shard, handed to a warm generate worker that dies once a response has finished and
others are in flight (the fault point ``rollout:mid-stream``): on this machine its client runs the
job itself; on the local Slurm, with workers as jobs, the head's supervisor replaces the killed
worker job and the client hands the job to the new one. Either way the rollout ends with the
tables of the same rollout run uninterrupted, bitwise: the responses the carry held continue from
the carry, which nothing changed, and those the dead worker had started are sampled again from
their first token (the same noise keys, the same weights). Nothing the dead worker did is
consumed: it published nothing, and the job's folder holds only the finished outputs."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import REPO, tiny_config
from test_laminar import STREAM
from test_slurm_integration import wait_for
from test_worker import client_command

from otbflow import schemas
from otbflow.config import to_yaml
from otbflow.io import read_metadata, read_table
from otbflow.ops import dispatch, slurm, workerjobs
from otbflow.runtime.codeversion import code_version

# the reference runs are shared by both tests, so both run on one xdist worker: the one of the
# Slurm tests with a sandbox of their own (test_slurm_integration's "slurm_heads")
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("slurm_heads")]
THREADS = "1"  # the reference's, the clients' and so the workers' torch threads: bitwise equal
FAULT = "rollout:mid-stream"


@pytest.fixture(scope="module")
def stream(tiny_run, tmp_path_factory):
    """Shard 0's stream at rollout.staleness 1 on the tiny run's policy: iteration 0's carry, the
    command of iteration 1's rollout (its outputs' folder given), and that rollout's tables
    uninterrupted."""
    tmp = tmp_path_factory.mktemp("laminar_workers")
    (tmp / "config.yaml").write_text(to_yaml(tiny_config("rollout.staleness=1", *STREAM)))
    policy, shard = tiny_run / "results/bootstrap/policy", tiny_run / "results/data/train/shard_0.parquet"
    base = ["rollout", "--config", str(tmp / "config.yaml"), "--prompts", str(shard), "--policy", str(policy)]

    def command(k: int, folder: Path, carry_in: Path | None = None) -> list[str]:
        folder.mkdir(exist_ok=True)
        cmd = [*base, "--out", str(folder / "rollouts.parquet"), "--iteration", str(k), "--behaviour-iteration", "0"]
        return cmd + (["--carry-in", str(carry_in)] if carry_in else []) + ["--carry", str(folder / "stream.parquet")]

    run(command(0, tmp / "iter_0"))
    carry = tmp / "iter_0/stream.parquet"
    run(command(1, tmp / "reference", carry))
    want = tables(tmp / "reference")
    meta = read_metadata(tmp / "reference/rollouts.parquet")["stream"]
    assert meta["resumed_responses"] > 0 and meta["slots_started"] > 0  # both kinds of response are at stake
    yield SimpleNamespace(carry=carry, command=lambda folder: command(1, folder, carry), want=want)


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO / "src"), "OTBFLOW_THREADS": THREADS, **extra}


def run(argv: list[str]) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "otbflow", *argv], env=env(), capture_output=True, text=True, stdin=subprocess.DEVNULL
    )
    assert res.returncode == 0, res.stderr[-3000:]


def tables(folder: Path) -> dict[str, object]:
    return {
        "rollouts": read_table(folder / "rollouts.parquet", schemas.ROLLOUTS),
        "stream": read_table(folder / "stream.parquet", schemas.STREAM),
    }


def assert_as_uninterrupted(stream, folder: Path, before: bytes) -> None:
    """The killed job's outputs are those of the uninterrupted rollout, the carry it continued
    is unchanged, and its folder holds nothing else (no partial file)."""
    got = tables(folder)
    for name, df in stream.want.items():
        assert got[name].equals(df), name
    assert stream.carry.read_bytes() == before
    assert sorted(p.name for p in folder.iterdir()) == ["rollouts.parquet", "stream.parquet"]


def client(results: Path, argv: list[str], log: Path, *options: str) -> subprocess.Popen:
    """The rule-side client of a rollout job (``python -m otbflow.ops.dispatch``)."""
    with open(log, "w") as out:
        return subprocess.Popen(
            [*client_command(results, code_version("rollout")), *options, *argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env(),
        )


def test_a_generate_worker_killed_mid_stream_on_this_machine(stream, tmp_path):
    """A warm generate worker (``otbflow worker generate``) kills itself (SIGKILL) mid-stream: the
    client finds it gone and runs the job itself, with the uninterrupted rollout's outputs."""
    results, folder = tmp_path / "results", tmp_path / "out"
    before = stream.carry.read_bytes()
    with open(tmp_path / "worker.log", "w") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "otbflow", "worker", "generate", "--results", str(results)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env(OTBFLOW_FAULT=FAULT),
        )
    proc = None
    try:
        wait_for(lambda: dispatch.live_workers(results, "generate"), 300, "the worker to register", every=0.2)
        proc = client(results, stream.command(folder), tmp_path / "client.log")
        assert proc.wait(timeout=600) == 0, (tmp_path / "client.log").read_text()[-3000:]
        died = worker.wait(timeout=60)  # it killed itself at the fault point
    finally:
        for p in (worker, proc):
            if p is not None and p.poll() is None:
                p.kill()
    assert died == -9
    out = (tmp_path / "client.log").read_text()
    assert "runs rollout" in out and "is gone: running the job here" in out, out[-3000:]
    assert_as_uninterrupted(stream, folder, before)


@pytest.mark.slurm
def test_a_generate_worker_job_killed_mid_stream_on_slurm(local_slurm, stream, tmp_path):
    """Workers as Slurm jobs, kept by the head's supervisor (``workerjobs.Supervisor``, one generate
    worker): the first worker job is held mid-stream (``rollout:mid-stream:sleep``; the job's script
    sets the fault for the first job only) and killed there with ``scancel --signal=KILL``; the
    supervisor submits a new worker job, the client (a head's local job: ``--wait-min``) hands the
    rollout to it, and the rollout ends as uninterrupted."""
    results, folder, logs = tmp_path / "results", tmp_path / "out", tmp_path / "logs"
    before = stream.carry.read_bytes()
    res = SimpleNamespace(gpu=0, tasks=1, nodes=1, cpus_per_task=1, mem_mb=2000)
    script = workerjobs.script(sys.executable, str(REPO / "src"), "generate", results, 300, 0)
    first = tmp_path / "first-job-started"
    hold = f"export OTBFLOW_FAULT={FAULT}:sleep OTBFLOW_FAULT_SLEEP_S=900"  # until it is killed
    script = script.replace("exec ", f"if mkdir {shlex.quote(str(first))} 2>/dev/null; then {hold}; fi\nexec ", 1)
    sbatch = workerjobs.sbatch_options(results, "generate", res, {}, 30, logs)
    said: list[str] = []
    supervisor = workerjobs.Supervisor(
        results, [workerjobs.WorkerJob("generate", 1, sbatch, script, logs)], said.append, 1
    )
    supervisor.start()
    proc = None
    try:
        (victim,) = [line.split()[-1] for line in said if "submitted the generate worker job" in line]
        options = ("--wait-min", "10", "--threads", THREADS)
        proc = client(results, stream.command(folder), tmp_path / "client.log", *options)
        held = lambda: "held here" in (tmp_path / "client.log").read_text()  # noqa: E731
        wait_for(held, 600, "the first worker job to reach the fault point", every=0.2)
        subprocess.run(["scancel", "--full", "--signal=KILL", victim], check=True)
        assert proc.wait(timeout=900) == 0, (tmp_path / "client.log").read_text()[-3000:]
    finally:
        supervisor.stop()
        if proc is not None and proc.poll() is None:
            proc.kill()
    assert slurm.slurm_state(victim) not in slurm.RUNNING
    out = (tmp_path / "client.log").read_text()
    assert "is gone: the job goes to the next worker" in out and out.count("runs rollout") == 2, out[-3000:]
    assert any(f"the generate worker job {victim} left the queue: replaced" in line for line in said), said
    assert_as_uninterrupted(stream, folder, before)
