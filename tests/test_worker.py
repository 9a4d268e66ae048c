"""Warm stage workers (otbflow.ops.worker, otbflow.ops.dispatch): the tiny run handed to workers gives the
outputs of the run without them, bitwise; a worker killed mid-job, a client killed mid-job, a stale
registration, a request without the run's secret, a worker of other code; the client's imports."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO
from test_workflow import copy_run, snakemake

from otbflow.ops import dispatch

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
    """One worker of each kind, registered (``env``: e.g. a train fault, which only the train worker meets)."""
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


def client_command(results, code: str) -> list[str]:
    """The rule-side client's command (``python -m otbflow.ops.dispatch``) up to the job's own options."""
    return [sys.executable, "-m", "otbflow.ops.dispatch", "--results", str(results), "--code", code]


# docs/workers.md's "Starting them" (test_docs_commands.HOW points here): the shell loop as shown,
# with an idle exit that ends the workers once the run is done (the train worker waits through
# iteration 0's rollouts, features and advantages before its first job, over 20 s on the loaded CI
# machine)
SHOWN_START = "for kind in generate features train; do otbflow worker $kind --results results --idle-exit 600 & done"
IDLE_EXIT_S = 90
START_FORM = SHOWN_START.replace("--idle-exit 600", f"--idle-exit {IDLE_EXIT_S}") + "; wait"


def test_the_start_command_shown_in_the_docs_runs_here():
    from test_docs_commands import HOW, WORKERS

    assert [c for c, how in HOW.items() if how == WORKERS] == [SHOWN_START]


@pytest.mark.slow
def test_the_tiny_run_on_workers_is_bitwise_the_run_without(tiny_run, tmp_path):
    """The docs' start command (SHOWN_START, in the run's folder) starts one worker of each kind;
    the tiny run's iterations redone (--forcerun rollout: every rollout, features, advantages,
    train and evaluation job) give every table and policy of the run without workers, bitwise; the
    train worker went on with its engine (iteration 1 read no optimizer state), the features worker
    with its resident module; the jobs' logs hold the stage's own lines; a rerun plans nothing; the
    workers end once idle and leave no registration behind."""
    work = copy_run(tiny_run, tmp_path / "run")
    results = work / "results"
    want = chain_outputs(tiny_run / "results")
    log = tmp_path / "workers.log"
    shell = subprocess.Popen(
        ["bash", "-c", START_FORM],
        cwd=work,
        env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"},  # otbflow: this venv's
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        for kind in KINDS:
            wait_for(lambda kind=kind: dispatch.live_workers(results, kind), 60, f"the {kind} worker to register")
        snakemake(work, "--forcerun", "rollout")
        assert shell.wait(timeout=IDLE_EXIT_S + 60) == 0, log.read_text()[-3000:]
    finally:
        if shell.poll() is None:
            os.killpg(shell.pid, signal.SIGTERM)
            shell.wait(timeout=30)
    assert chain_outputs(results) == want
    text = log.read_text()
    assert text.count(f"idle for {IDLE_EXIT_S} s: the worker ends") == len(KINDS), text[-3000:]
    assert text.count("runs train") == 2 and "AdamW resumes from the resident engine" in text
    assert "resident policy" in (results / "logs/features/iter_1_shard_0.log").read_text()
    train_1 = (results / "logs/train/iter_1.log").read_text()
    assert "runs train" in train_1 and "train finished in" in train_1
    assert "runs rollout" in (results / "logs/rollout/iter_1_shard_0.log").read_text()
    assert not any((results / ".workers").glob("*/*/worker.json"))
    res = snakemake(work, "-n")
    assert "Nothing to be done" in res.stdout + res.stderr


def test_the_client_imports_no_torch():
    code = "import sys, otbflow.ops.dispatch; assert 'torch' not in sys.modules and 'polars' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_without_a_live_worker_the_client_runs_the_stage_itself(tmp_path):
    """Stale registrations are ignored: a dead pid on this host, and one from before a reboot (another
    boot id) whose heartbeat is older than STALE_S; the client then execs the stage's CLI (here its
    --help, which a worker never sees)."""
    results = tmp_path / "results"
    dispatch.secret(results, create=True)
    folder = dispatch.root(results) / "features" / "gone"
    folder.mkdir(parents=True)
    (folder / "alive").touch()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    record = {**dispatch.me(), "pid": int(dead.stdout), "start": 1}
    (folder / "worker.json").write_text(json.dumps(record))
    rebooted = dispatch.root(results) / "features" / "rebooted"  # this host before a reboot: its heartbeat decides
    rebooted.mkdir()
    (rebooted / "worker.json").write_text(json.dumps({**dispatch.me(), "boot": "another boot"}))
    (rebooted / "alive").touch()
    assert dispatch.live_workers(results, "features") == [rebooted]  # its heartbeat is fresh
    old = time.time() - dispatch.STALE_S - 1
    os.utime(rebooted / "alive", (old, old))
    assert dispatch.live_workers(results, "features") == []
    res = subprocess.run(
        [*client_command(results, "x"), "features", "--help"],
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


@pytest.mark.slow
def test_a_worker_killed_between_the_policy_and_the_optimizer_state(tiny_run, tmp_path):
    """The train worker dies by SIGKILL right after it published iteration 0's policy, before the
    optimizer state (OTBFLOW_FAULT=train:after-policy): its client sees it gone and runs the job
    itself, the same command finishes the run, and every table and policy is bitwise the run
    without workers."""
    work = copy_run(tiny_run, tmp_path / "run")
    results = work / "results"
    want = chain_outputs(tiny_run / "results")
    procs = workers(results, tmp_path, {"OTBFLOW_FAULT": "train:after-policy"})
    try:
        snakemake(work, "--forcerun", "rollout")
    finally:
        stop(procs)
    assert procs["train"].returncode == -signal.SIGKILL
    assert "is gone: running the job here" in (results / "logs/train/iter_0.log").read_text()
    assert chain_outputs(results) == want


def train_args(results: Path, out: Path, iteration: int = 0, prev: Path | None = None) -> list[str]:
    """The train stage's arguments for the tiny run's iteration-0 advantages, writing under ``out``
    (``prev``: the outputs of the job before, whose policy and AdamW state it continues)."""
    args = [
        "--config",
        str(results / "config.yaml"),
        "--advantages",
        str(results / "iter_0/advantages/advantages.parquet"),
    ]
    args += ["--policy", str(prev / "policy" if prev else results / "bootstrap/policy"), "--out", str(out / "policy")]
    args += ["--metrics", str(out / "metrics.parquet"), "--state", str(out / "schedule.json")]
    args += [
        "--optimizer",
        str(out / "optimizer"),
        "--checkpoint-dir",
        str(out / "ckpt"),
        "--iteration",
        str(iteration),
    ]
    return args + (
        ["--prev-state", str(prev / "schedule.json"), "--prev-optimizer", str(prev / "optimizer")] if prev else []
    )


def test_a_client_killed_mid_job_gets_nothing_written(tiny_run, tmp_path):
    """A train job whose client (the rule's job) is killed while the worker trains: the worker
    abandons it and writes none of its outputs; it stays registered and runs the next request."""
    from otbflow.ops.codeversion import code_version

    results = tiny_run / "results"  # the inputs; the worker registers elsewhere (the shared run stays as it is)
    registry = tmp_path / "registry"
    worker = start_worker(registry, "train", tmp_path / "w.log", {"OTBFLOW_FAULT": "train:before-outputs:sleep"})
    try:
        wait_for(lambda: dispatch.live_workers(registry, "train"), 60, "the worker")
        out = tmp_path / "job"
        job = [*client_command(registry, code_version("train")), "train", *train_args(results, out)]
        cmd = " ".join(f"'{a}'" for a in job)
        shell = subprocess.Popen(["bash", "-c", f"{cmd} > '{tmp_path}/client.log' 2>&1"], cwd=tiny_run)
        wait_for(lambda: re.search(r"step (\d+)/\1:", (tmp_path / "w.log").read_text()), 120, "the last step")
        shell.send_signal(signal.SIGKILL)
        wait_for(lambda: "abandoned" in (tmp_path / "w.log").read_text(), 30, "the worker to abandon the job")
        time.sleep(2)
        assert not any(out.glob("*")) or sorted(p.name for p in out.iterdir()) == ["ckpt"]
        assert worker.poll() is None and dispatch.live_workers(registry, "train")
        res = subprocess.run(job, cwd=tiny_run, capture_output=True, text=True)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        assert (out / "policy").is_dir() and (out / "optimizer").is_dir() and "runs train" in res.stdout
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=30)


def test_a_publish_job_run_outside_the_worker_waits_for_its_background_write(tiny_run, tmp_path):
    """A train job returned by the worker, whose background write of the AdamW state starts 5 s
    late (OTBFLOW_FAULT=train:writing-optimizer:pause), then its publish job run in a process of its
    own at once (as a client does when no worker claims it): the publisher finds the worker's
    record, waits for the write and publishes the state of the job's policy."""
    from otbflow.ops.codeversion import code_version
    from otbflow.training.state import policy_digest

    results = tiny_run / "results"
    registry = tmp_path / "registry"
    worker = start_worker(registry, "train", tmp_path / "w.log", {"OTBFLOW_FAULT": "train:writing-optimizer:pause"})
    try:
        wait_for(lambda: dispatch.live_workers(registry, "train"), 60, "the worker")
        out = tmp_path / "job"
        args = train_args(results, out)
        args[args.index("--optimizer") + 1] = str(out / "optimizer.pending")
        train = [*client_command(registry, code_version("train")), "train", *args, "--optimizer-async"]
        res = subprocess.run(train, cwd=tiny_run, capture_output=True, text=True)
        assert res.returncode == 0 and "runs train" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]
        assert not (out / "optimizer.pending").exists()  # the write is held
        publish = [sys.executable, "-m", "otbflow", "publish-optimizer", "--config", str(results / "config.yaml")]
        publish += ["--pending", str(out / "optimizer.pending"), "--out", str(out / "optimizer")]
        publish += ["--policy", str(out / "policy"), "--train-outputs", str(out / "policy")]
        res = subprocess.run(publish, cwd=tiny_run, capture_output=True, text=True)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        meta = json.loads((out / "optimizer/meta.json").read_text())
        assert meta["policy_sha256"] == policy_digest(out / "policy")
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=60)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


@pytest.mark.slow
def test_a_workers_memory_stays_flat_over_50_iterations(tiny_run, tmp_path):
    """50 chained train jobs (each continues the policy and AdamW state of the one before) and 50
    features passes, each with the policy of its train job: the workers' RSS after the 50th job is
    within 10% of its value after the 5th. The first job's policy says in its config.json that it
    was saved in bf16 by another transformers version (as a downloaded checkpoint does; the train
    jobs write their own values): the second job goes on with the worker's engine all the same,
    and writes bitwise what it writes in a process of its own."""
    from otbflow.ops.codeversion import code_version

    results = tiny_run / "results"  # the inputs; the workers register elsewhere (the shared run stays as it is)
    registry = tmp_path / "registry"
    initial = tmp_path / "initial"
    shutil.copytree(results / "bootstrap/policy", initial)
    config = json.loads((initial / "config.json").read_text())
    assert config["dtype"] == "float32" and config["transformers_version"] != "4.57.0"
    (initial / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16", "transformers_version": "4.57.0"}))
    procs = {kind: start_worker(registry, kind, tmp_path / f"{kind}.log") for kind in ("features", "train")}
    rss: dict[str, dict[int, int]] = {"features": {}, "train": {}}
    try:
        for kind in procs:
            wait_for(lambda kind=kind: dispatch.live_workers(registry, kind), 60, f"the {kind} worker")
        prev = None
        for i in range(1, 51):
            out = tmp_path / f"train_{i}"
            args = train_args(results, out, i, prev)
            if prev is None:
                args[args.index("--policy") + 1] = str(initial)
            client = dispatch.Client(registry, "train", code_version("train"), args)
            with open(tmp_path / "client.log", "a") as log:
                assert client.run(log) == 0, (tmp_path / "client.log").read_text()[-3000:]
            if i == 2:  # the same job in a process of its own
                alone = tmp_path / "train_2_alone"
                args = [a.replace(str(out), str(alone)) for a in args]
                res = subprocess.run([sys.executable, "-m", "otbflow", "train", *args], capture_output=True, text=True)
                assert res.returncode == 0, res.stderr[-3000:]
                same_update(out, alone)
            features = [
                "--config",
                str(results / "config.yaml"),
                "--rollouts",
                str(results / "iter_0/rollout/shard_0.parquet"),
            ]
            features += ["--policy", str(out / "policy"), "--out", str(tmp_path / f"features_{i}.parquet")]
            client = dispatch.Client(registry, "features", code_version("features"), features)
            with open(tmp_path / "client.log", "a") as log:
                assert client.run(log) == 0, (tmp_path / "client.log").read_text()[-3000:]
            if i in (5, 50):
                rss["train"][i], rss["features"][i] = rss_kib(procs["train"].pid), rss_kib(procs["features"].pid)
            if prev is not None:
                shutil.rmtree(prev)
            prev = out
    finally:
        stop(procs)
    print(f"worker RSS after job 5 and 50 (KiB): {rss}")
    for kind, values in rss.items():
        assert values[50] <= 1.1 * values[5], (kind, values)
    assert (tmp_path / "train.log").read_text().count("AdamW resumes from the resident engine") == 49


def test_a_client_that_must_wait_for_a_worker_fails_clearly_when_none_comes(tmp_path):
    """workers.slurm: the client (a local job of the head) never runs the stage itself: with no worker
    within --wait-min it fails, saying so, and the stage's CLI never ran (its --help would print)."""
    results = tmp_path / "results"
    cmd = [*client_command(results, "x"), "--wait-min", "0.02", "--threads", "1", "features", "--help"]
    start = time.time()
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 1 and "teacher-forced" not in res.stdout, res.stdout + res.stderr
    assert "waiting for a features worker" in res.stdout and "no features worker started in" in res.stdout
    assert 1.2 <= time.time() - start < 30


def test_slurm_workers_are_refused_off_slurm(tmp_path):
    """workers.slurm with the local executor: the run stops before its first job, saying why."""
    work = tmp_path / "work"
    work.mkdir()
    res = snakemake(work, "--config", "workers={slurm: true}", check=False)
    assert res.returncode != 0 and "workers.slurm: the workers are Slurm jobs" in res.stdout + res.stderr
    assert not (work / "results/data").exists()


def test_a_worker_killed_while_it_writes_the_optimizer_state_after_its_job(tiny_run, tmp_path):
    """The train worker returns iteration 0's train job (its policy published) and dies by SIGKILL
    before its background write of the AdamW state (OTBFLOW_FAULT=train:writing-optimizer:later): the
    publish job finds the state lost, removes iteration 0's train outputs and fails, naming why;
    the next run (no workers) redoes that update from the initial policy, and every table and
    policy is bitwise the run without workers."""
    work = copy_run(tiny_run, tmp_path / "run")
    results = work / "results"
    want = chain_outputs(tiny_run / "results")
    procs = workers(results, tmp_path, {"OTBFLOW_FAULT": "train:writing-optimizer:later"})
    try:
        res = snakemake(work, "--forcerun", "rollout", check=False)
    finally:
        stop(procs)
    assert res.returncode != 0 and procs["train"].returncode == -signal.SIGKILL
    train_log = (results / "logs/train/iter_0.log").read_text()
    assert "runs train" in train_log and "is gone" not in train_log  # the job itself ended on the worker
    assert "holds no finished optimizer state" in (results / "logs/publish_optimizer/iter_0.log").read_text()
    assert not (results / "iter_0/train/policy").exists() and not (results / "iter_0/train/optimizer").exists()
    snakemake(work)
    assert chain_outputs(results) == want


@pytest.mark.parametrize("tasks", [1, 2])
def test_train_and_publish_jobs_go_to_the_train_worker(tmp_path, tasks):
    """Under workers.slurm the train job, of one process or of several, and its publish job are local
    jobs of the head that wait for the train worker, never starting a launcher themselves; the train
    job's request names its processes (a worker of as many ranks runs it), the publish job's does not
    (rank 0 of the train worker runs it alone)."""
    res = snakemake(
        tmp_path, "-n", "-p", "--config", f"resources={{train: {{tasks: {tasks}}}}}", "workers={slurm: true}"
    )
    commands = re.findall(r"^Shell command: (.*)$", res.stdout, flags=re.M)
    for stage in ("train", "publish-optimizer"):
        found = [c for c in commands if f" {stage} --" in c]
        assert len(found) == 2, commands  # one per iteration of the tiny run
        for command in found:
            assert "srun" not in command and "torch.distributed.run" not in command
            assert "-m otbflow.ops.dispatch" in command and "--wait-min" in command, command
            assert ("--tasks 2" in command) == (stage == "train" and tasks == 2), command


def launch_train(registry: Path, cwd: Path, out: Path, iteration: int, prev: Path | None, log: Path) -> str:
    """A train job of two processes and its publish job, as the rules start them (the client,
    ``python -m otbflow.ops.dispatch``), on the tiny run's iteration-0 advantages; returns the train
    client's output."""
    from otbflow.ops.codeversion import code_version

    results = cwd / "results"
    args = train_args(results, out, iteration, prev)
    args[args.index("--optimizer") + 1] = str(out / "optimizer.pending")
    args.append("--optimizer-async")
    publish = ["--config", str(results / "config.yaml"), "--pending", str(out / "optimizer.pending")]
    publish += ["--out", str(out / "optimizer"), "--policy", str(out / "policy"), "--train-outputs"]
    publish += [str(out / name) for name in ("policy", "metrics.parquet", "schedule.json")]
    outputs = []
    for stage, argv, tasks in (("train", args, 2), ("publish_optimizer", publish, 1)):
        cmd = [*client_command(registry, code_version(stage)), "--tasks", str(tasks), "--cpus-per-task", "1"]
        cmd += [stage.replace("_", "-"), *argv]
        res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env={**os.environ, "OTBFLOW_THREADS": "1"})
        with open(log, "a") as f:
            f.write(res.stdout + res.stderr)
        assert res.returncode == 0, f"{stage}: {res.stdout[-3000:]}{res.stderr[-3000:]}"
        outputs.append(res.stdout + res.stderr)
    return outputs[0]


def same_update(a: Path, b: Path) -> None:
    """Two train jobs' policies bitwise, and their metrics but for the step times."""
    import polars as pl

    for name in ("model.safetensors", "config.json"):
        assert (a / "policy" / name).read_bytes() == (b / "policy" / name).read_bytes(), name
    metrics = [pl.read_parquet(x / "metrics.parquet").drop("step_time_s", "tokens_per_s") for x in (a, b)]
    assert metrics[0].equals(metrics[1])


def rank_pid(launcher: int, rank: int) -> int | None:
    """The process of ``rank`` that the launcher process ``launcher`` (torchrun) started."""
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) != launcher:
                continue
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            return int(proc.name)
    return None


def start_ranks(registry: Path, log: Path, env: dict | None = None) -> subprocess.Popen:
    """``otbflow worker train --tasks 2`` (torchrun starts its two ranks), registered."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "otbflow", "worker", "train", "--results", str(registry), "--tasks", "2"],
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )
    wait_for(lambda: dispatch.live_workers(registry, "train"), 120, "the worker of two ranks")
    return proc


@pytest.mark.slow
def test_a_train_worker_of_two_ranks(tiny_run, two_rank_update, tmp_path):
    """resources.train.tasks 2: a train worker of two ranks runs two chained train jobs and their
    publish jobs: the second goes on with both ranks' resident engines, and the policies and metrics
    equal those of the same jobs run by their client itself under torchrun (no worker), bitwise. A
    worker whose rank 1 is killed (SIGKILL) mid-job ends whole (the launcher ends rank 0): the client
    sees it gone and runs the job itself, with the same outputs. A job that fails on every rank is
    answered as failed, and the worker then ends."""
    cwd, log = tiny_run, tmp_path / "clients.log"  # the shared run's inputs; outputs and workers under tmp_path
    alone = {0: two_rank_update, 1: tmp_path / "alone1"}  # the jobs run by their clients, no worker
    out = launch_train(tmp_path / "none", cwd, alone[1], 1, alone[0], log)
    assert out.count("train finished in") == 2 and "runs train" not in out  # two ranks, no worker

    registry = tmp_path / "registry"
    # held before its outputs in both ranks: time to kill rank 1 mid-job
    faulty = start_ranks(registry, tmp_path / "faulty.log", {"OTBFLOW_FAULT": "train:before-outputs:sleep"})
    try:
        code = (
            "import sys; from pathlib import Path; from test_worker import launch_train; "
            f"print(launch_train(*map(Path, {[str(registry), str(cwd), str(tmp_path / 'fault0')]!r}), 0, None, "
            f"Path({str(log)!r})))"
        )
        job = subprocess.Popen([sys.executable, "-c", code], cwd=REPO / "tests", stdout=subprocess.PIPE, text=True)
        # both ranks held at the fault point (rank 0 then ends on the launcher's SIGTERM, unregistering)
        held = lambda: (tmp_path / "faulty.log").read_text().count("held here") == 2  # noqa: E731
        wait_for(held, 120, "both ranks at the fault point")
        os.kill(wait_for(lambda: rank_pid(faulty.pid, 1), 30, "rank 1"), signal.SIGKILL)
        stdout, _ = job.communicate(timeout=300)
        assert job.returncode == 0 and "is gone: running the job here" in stdout, stdout[-3000:]
        assert faulty.wait(timeout=60) != 0
    finally:
        if faulty.poll() is None:
            faulty.kill()
    same_update(tmp_path / "fault0", alone[0])

    worker = start_ranks(registry, tmp_path / "worker.log")
    try:
        launch_train(registry, cwd, tmp_path / "warm0", 0, None, log)
        launch_train(registry, cwd, tmp_path / "warm1", 1, tmp_path / "warm0", log)
        # a job that fails on every rank: its client is told so (not "gone", not rerun), and the
        # worker ends once it has answered
        from otbflow.ops.codeversion import code_version

        bad = train_args(cwd / "results", tmp_path / "bad")
        bad[bad.index("--advantages") + 1] = str(tmp_path / "missing.parquet")
        cmd = [*client_command(registry, code_version("train")), "--tasks", "2", "train", *bad]
        res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
        assert res.returncode != 0 and "runs train" in res.stdout and "is gone" not in res.stdout, res.stdout[-3000:]
        assert worker.wait(timeout=120) != 0
    finally:
        if worker.poll() is None:
            worker.send_signal(signal.SIGTERM)
            worker.wait(timeout=60)
    text = (tmp_path / "worker.log").read_text()
    assert text.count("rank 1 runs train") == 3 and text.count("runs publish_optimizer") == 2, text[-3000:]
    assert text.count("AdamW resumes from the resident engine") == 1  # rank 0's line
    for i in (0, 1):
        same_update(tmp_path / f"warm{i}", alone[i])
    assert not any(registry.glob(".workers/*/*/worker.json"))
