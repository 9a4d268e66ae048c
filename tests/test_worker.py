"""Warm stage workers (otbflow.ops.worker, otbflow.ops.dispatch): the tiny run handed to workers gives the
outputs of the run without them, bitwise; a worker killed mid-job, a client killed mid-job, a stale
registration, a request without the run's secret, a worker of other code; the client's imports.
Faults and forgery: a Ctrl-C while a job waits in a worker's queue, a request whose job folder is
gone, a malformed or replayed request, an I/O error in one job, links planted in ``.workers/``, a
forged or dead registration, the folder's modes, a full disk under the background AdamW write."""

from __future__ import annotations

import contextlib
import io
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
from conftest import REPO, TINY
from test_train_robustness import small_tmpfs_works
from test_workflow import SNAKEMAKE, copy_run, snakemake

from otbflow.ops import dispatch
from otbflow.runtime import process

sys.path.insert(0, str(REPO / "tests"))
from fingerprint import fingerprints  # noqa: E402

pytestmark = pytest.mark.xdist_group("tiny_run")
KINDS = tuple(dispatch.KINDS)  # every worker kind


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


@pytest.fixture(scope="module")
def features_worker(tmp_path_factory):
    """One features worker for the tests of requests (no job of theirs needs inputs): its results
    folder, process and log."""
    tmp = tmp_path_factory.mktemp("features_worker")
    results, log = tmp / "results", tmp / "worker.log"
    proc = start_worker(results, "features", log)
    try:
        wait_for(lambda: dispatch.live_workers(results, "features"), 60, "the worker")
        yield results, proc, log
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def serves_the_next_job(results: Path, kind: str = "features") -> None:
    """A worker of ``kind`` is registered and runs the next job a client hands it (the stage's
    --help: a job that needs no inputs), its output copied to the client's."""
    from otbflow.runtime.codeversion import code_version

    stage = dispatch.KINDS[kind][0]
    out = io.StringIO()
    assert dispatch.Client(results, stage, code_version(stage), ["--help"]).run(out) == 0, out.getvalue()
    assert "usage:" in out.getvalue() and f"runs {stage}" in out.getvalue(), out.getvalue()


def post(results: Path, argv=("--help",), folder: bool = True, request: dict | None = None) -> dispatch.Client:
    """A features request queued as a client queues it (signed with the run's secret; ``request``:
    these bytes instead), with its job folder and this process's heartbeat as the client's unless
    not ``folder``; nobody waits for the answer."""
    from otbflow.runtime.codeversion import code_version

    client = dispatch.Client(results, "features", code_version("features"), list(argv))
    if request is None:
        request = client.request(dispatch.secret(results))
    client.id, client.job = request["id"], client.base / "jobs" / request["id"]
    if folder:  # private, as a client makes them
        client.job.mkdir(mode=0o700)
        (client.job / "client").touch(mode=0o600)
    queued = client.base / "queue" / f"{client.id}.json"
    queued.write_text(json.dumps(request))
    queued.chmod(0o600)
    return client


def handled(client: dispatch.Client) -> bool:
    """Whether a worker took the request of ``client`` and is done with it (queued nor claimed)."""
    queued = (client.base / "queue" / f"{client.id}.json").exists()
    return not queued and not any(client.base.glob(f"*/running/{client.id}.json"))


def ran(log: Path, client: dispatch.Client) -> bool:
    """Whether the worker whose log is ``log`` started the job of ``client``."""
    return f"(job {client.id})" in log.read_text()


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
    with its resident module and ran the advantages jobs too; the jobs' logs hold the stage's own
    lines; a rerun plans nothing; the workers end once idle and leave no registration behind."""
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
    assert text.count("runs train") == 2 and "AdamW goes on in the resident engine" in text
    assert text.count("runs advantages") == 2  # in the features worker: no interpreter of its own
    assert "resident policy" in (results / "logs/features/iter_1_shard_0.log").read_text()
    # the policy the train worker published carries a MAC with the run's key, which the features
    # worker trusted: it read each tensor once (every one changed, in fp32), hashing as it copied
    from otbflow.io import read_metadata
    from otbflow.runtime import manifest

    published = results / "iter_0/train/policy"
    assert manifest.trusted(published, manifest.read(published), dispatch.secret(results))
    # the shard the worker ran first read them (Snakemake's order); the other found them resident
    loads = [read_metadata(p)["policy_load"] for p in sorted((results / "iter_1/features").glob("shard_*.parquet"))]
    load = max(loads, key=lambda x: x["bytes"])
    weights = (published / "model.safetensors").stat().st_size
    assert all(x["trusted"] for x in loads) and 0 < load["bytes"] < weights
    assert load["tensors"] == len(manifest.read(published)["tensors"])
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
    key = dispatch.secret(results)
    record = {**process.me(), "pid": int(dead.stdout), "start": 1}
    (folder / "worker.json").write_text(json.dumps(dispatch.signed(key, record)))
    rebooted = dispatch.root(results) / "features" / "rebooted"  # this host before a reboot: its heartbeat decides
    rebooted.mkdir()
    (rebooted / "worker.json").write_text(json.dumps(dispatch.signed(key, {**process.me(), "boot": "another boot"})))
    (rebooted / "alive").touch()
    assert dispatch.live_workers(results, "features") == [rebooted]  # its heartbeat is fresh
    old = time.time() - process.STALE_S - 1
    os.utime(rebooted / "alive", (old, old))
    assert dispatch.live_workers(results, "features") == []
    res = subprocess.run(
        [*client_command(results, "x"), "features", "--help"],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0 and "teacher-forced" in res.stdout


def test_a_request_without_the_secret_is_not_run(features_worker, tmp_path):
    """A request signed with another key is removed unrun; one for another code version is refused
    and its client told so (it then runs the job itself)."""
    results, proc, log = features_worker
    queue = dispatch.root(results) / "features" / "queue"
    client = dispatch.Client(results, "features", "x", ["--help"])
    forged = client.request(b"not the secret")
    (queue / f"{client.id}.json").write_text(json.dumps(forged))
    wait_for(lambda: handled(client), 30, "the worker to take the request")
    assert not ran(log, client) and not client.job.exists()
    other = dispatch.Client(results, "features", "another code version", ["--help"])
    with open(tmp_path / "client.log", "w") as out:
        assert other.run(out) is None
    assert "code version" in (tmp_path / "client.log").read_text()


def test_a_request_whose_job_folder_is_gone_ends_that_request_not_the_worker(features_worker):
    """A signed request left queued without its job folder (what a client interrupted before the
    fix left behind) is taken and dropped unrun; the worker lives on and serves the next job."""
    results, proc, log = features_worker
    client = post(results, folder=False)
    wait_for(lambda: handled(client), 30, "the worker to take the request")
    assert not client.job.exists() and not ran(log, client)
    assert proc.poll() is None
    serves_the_next_job(results)


def test_malformed_and_replayed_requests_are_refused_and_the_worker_serves_on(features_worker, monkeypatch):
    """Requests that are not JSON, signed but of another form, or a byte-for-byte copy of a request
    the worker served (replayed while a job folder and a live client are there for it, and after)
    are refused unrun; the worker lives on and serves the next job."""
    results, proc, log = features_worker
    key = dispatch.secret(results)
    queue = dispatch.root(results) / "features" / "queue"
    (queue / "0123456789abcdef0123456789abcdef.json").write_text("{not json")
    good = post(results, folder=False).request(key)  # a fresh body to spoil (never queued as it is)
    (queue / f"{good['id']}.json").unlink()
    spoils = [{**good, "argv": 3}, {k: v for k, v in good.items() if k != "client"}, {**good, "id": "../x"}]
    spoils.append({**good, "client": {**good["client"], "pid": str(good["client"]["pid"])}})
    for spoiled in spoils:
        body = {k: v for k, v in spoiled.items() if k != "mac"}
        (queue / f"{uuid_hex()}.json").write_text(json.dumps(dispatch.signed(key, body)))
    wait_for(lambda: not list(queue.glob("*.json")) and not list(queue.parent.glob("*/running/*")), 30, "the refusals")
    assert proc.poll() is None

    captured = []  # the request as the client queued it
    write = dispatch.write_json_atomic
    monkeypatch.setattr(dispatch, "write_json_atomic", lambda p, d: (captured.append(d), write(p, d)))
    serves_the_next_job(results)
    monkeypatch.undo()
    served = captured[0]
    replay = post(results, request=served)  # its job folder and a live client, as while it waited
    wait_for(lambda: handled(replay), 30, "the worker to take the replayed request")
    time.sleep(0.5)
    assert not (replay.job / "result.json").exists() and log.read_text().count(f"(job {served['id']})") == 1
    shutil.rmtree(replay.job)
    replay = post(results, request=served, folder=False)  # after its client ended
    wait_for(lambda: handled(replay), 30, "the worker to take the replayed request")
    assert log.read_text().count(f"(job {served['id']})") == 1 and proc.poll() is None
    serves_the_next_job(results)


def uuid_hex() -> str:
    import uuid

    return uuid.uuid4().hex


def test_an_io_error_or_a_planted_link_ends_that_job_not_the_worker(features_worker, tmp_path):
    """A job whose log cannot be opened (a folder in its place) is answered as failed, naming the
    error; a job folder that is a link out of the results folder, and a log that is a link to a file
    outside, get nothing written through them; the worker lives on and serves the next job."""
    results, proc, log = features_worker
    client = post(results)
    (client.job / "log").mkdir()
    wait_for(lambda: (client.job / "result.json").exists(), 30, "the answer")
    answer = json.loads((client.job / "result.json").read_text())
    assert answer["status"] == "failed" and "IsADirectoryError" in answer["error"], answer
    assert proc.poll() is None

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "client").touch()
    linked = post(results, folder=False)
    linked.job.symlink_to(outside)
    victim = tmp_path / "victim.txt"
    victim.write_text("mine\n")
    logged = post(results)
    (logged.job / "log").symlink_to(victim)
    for c in (linked, logged):
        wait_for(lambda c=c: handled(c), 30, "the worker to take the request")
    wait_for(lambda: (logged.job / "result.json").exists(), 30, "the answer")
    assert sorted(p.name for p in outside.iterdir()) == ["client"] and victim.read_text() == "mine\n"
    assert json.loads((logged.job / "result.json").read_text())["status"] == "failed"
    assert proc.poll() is None
    linked.job.unlink()  # the planted links, gone with their test
    shutil.rmtree(logged.job)
    shutil.rmtree(client.job)
    serves_the_next_job(results)


def test_the_workers_folder_is_private_to_the_runs_user(features_worker, tmp_path):
    """Every folder and file under ``.workers/`` (a client's queued request, job folder and
    heartbeat; a worker's registration, heartbeat and ledger; the job's log and answer) is neither
    writable by the group nor open to others; a ``.workers/`` left 0755 (by an earlier version) is
    made private by the next client."""
    import threading

    from otbflow.runtime.codeversion import code_version

    results, proc, log = features_worker

    def modes(root: Path) -> dict[Path, int]:
        found = {}
        for path in [root, *root.rglob("*")]:
            with contextlib.suppress(FileNotFoundError):
                found[path] = os.lstat(path).st_mode
        return found

    unserved = tmp_path / "unserved"  # a run whose worker never claims: the request stays queued a while
    dispatch.secret(unserved, create=True)
    os.chmod(dispatch.root(unserved), 0o755)  # as an earlier version left it
    client = dispatch.Client(unserved, "features", code_version("features"), ["--help"])
    waiting = threading.Thread(target=client.attempt, args=(dispatch.secret(unserved), io.StringIO(), 1.0))
    waiting.start()
    queued = client.base / "queue" / f"{client.id}.json"
    wait_for(queued.exists, 30, "the request queued")
    seen = modes(dispatch.root(unserved))
    waiting.join()
    assert not queued.exists() and not client.job.exists()  # withdrawn when it gave up

    job = post(results)  # a job folder of the test's own: the worker's log and answer in it
    wait_for(lambda: (job.job / "result.json").exists(), 30, "the answer")
    seen.update(modes(dispatch.root(results)))
    wanted = {
        "a request": queued,
        "a client's job folder": client.job,
        "its heartbeat": client.job / "client",
        "a job's log": job.job / "log",
        "its answer": job.job / "result.json",
    }
    for what, path in wanted.items():
        assert path in seen, what
    for what, pattern in {"registration": "*/worker.json", "heartbeat": "*/alive", "ledger": "served/*"}.items():
        assert any(p.match(f"*/features/{pattern}") for p in seen), what
    assert dispatch.root(unserved) in seen
    for path, mode in seen.items():
        assert not mode & 0o027, f"{path}: {mode & 0o777:o}"


def test_forged_and_dead_registrations(features_worker, tmp_path):
    """A registration not signed with the run's secret, of a live process with a fresh heartbeat,
    is no worker: a client runs its job itself at once, not after the claim window. A signed one of
    a dead process on this host is removed by the live worker of its kind."""
    results, proc, log = features_worker
    forged_run = tmp_path / "forged"
    dispatch.secret(forged_run, create=True)
    folder = dispatch.root(forged_run) / "features" / "forged"
    folder.mkdir(parents=True)
    (folder / "worker.json").write_text(json.dumps({**process.me(), "kind": "features"}))
    (folder / "alive").touch()
    res = subprocess.run([*client_command(forged_run, "x"), "features", "--help"], capture_output=True, text=True)
    assert res.returncode == 0 and "teacher-forced" in res.stdout
    # A client that posted its request and waited out CLAIM_S says so ("... running the job here");
    # one that saw no live worker runs the job without a word and posts nothing.
    assert "otbflow dispatch" not in res.stdout + res.stderr

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = dispatch.root(results) / "features" / "gone"
    gone.mkdir()
    record = {**process.me(), "pid": int(dead.stdout), "start": 1}
    (gone / "worker.json").write_text(json.dumps(dispatch.signed(dispatch.secret(results), record)))
    (gone / "alive").touch()
    wait_for(lambda: not gone.exists(), 30, "the dead registration to be swept")
    assert proc.poll() is None


def test_the_sweep_waits_out_a_shared_filesystems_attribute_cache(tmp_path):
    """A registration of another host is swept only once its heartbeat kept one modification time
    for SWEEP_S by the sweeper's own clock (an old time read once may be a cached attribute, or a
    clock of another node); a heartbeat that moves starts the wait again; a fresh one is never swept."""
    results = tmp_path / "results"
    key = dispatch.secret(results, create=True)
    base = dispatch.kind_dir(results, "train")
    old = time.time() - 3600
    for name in ("elsewhere", "fresh"):
        (base / name).mkdir()
        record = {**process.me(), "host": f"{name}.example"}
        (base / name / "worker.json").write_text(json.dumps(dispatch.signed(key, record)))
        (base / name / "alive").touch()
    os.utime(base / "elsewhere" / "alive", (old, old))
    sweeper = dispatch.Sweeper(base, key)
    assert sweeper.sweep(now=0.0) == [] and sweeper.sweep(now=dispatch.SWEEP_S - 1) == []
    os.utime(base / "elsewhere" / "alive", (old + 1, old + 1))  # it beat (late, or seen late)
    assert sweeper.sweep(now=dispatch.SWEEP_S + 1) == []
    assert sweeper.sweep(now=2 * dispatch.SWEEP_S) == []
    assert sweeper.sweep(now=2 * dispatch.SWEEP_S + 2) == [base / "elsewhere"]
    assert sorted(p.name for p in base.iterdir()) == ["fresh", "jobs", "queue", "served"]


def test_a_ctrl_c_while_a_job_waits_in_a_workers_queue(tiny_run, tmp_path):
    """One generation worker, two rollout shards (one job runs on the worker, the other's request
    waits in its queue) and a Ctrl-C (SIGINT to Snakemake's process group): the clients withdraw
    their requests, and the worker lives on and serves the next job."""
    work = copy_run(tiny_run, tmp_path / "run")
    results = work / "results"
    worker = start_worker(results, "generate", tmp_path / "w.log")
    try:
        wait_for(lambda: dispatch.live_workers(results, "generate"), 60, "the worker")
        base = dispatch.root(results) / "generate"
        cmd = [SNAKEMAKE, "-s", str(REPO / "Snakefile"), "--directory", str(work), "--cores", "2"]
        cmd += ["--configfile", str(TINY), "--forcerun", "rollout", "--until", "rollout"]
        with open(tmp_path / "snakemake.log", "w") as out:
            run = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        waiting = lambda: list(base.glob("queue/*.json")) and list(base.glob("*/running/*.json"))  # noqa: E731
        wait_for(waiting, 120, "one job on the worker and one waiting in its queue")
        os.killpg(run.pid, signal.SIGINT)
        assert run.wait(timeout=120) != 0
        wait_for(lambda: not list(base.glob("queue/*")) and not list(base.glob("*/running/*")), 60, "an empty queue")
        assert worker.poll() is None, (tmp_path / "w.log").read_text()[-3000:]
        serves_the_next_job(results, "generate")
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=30)


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
    from otbflow.runtime.codeversion import code_version

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


@pytest.mark.parametrize("publisher", ["own process", "client"])
def test_a_publish_job_waits_for_its_background_write(tiny_run, tmp_path, publisher):
    """A train job returned by the worker, whose background write of the AdamW state starts 5 s
    late (OTBFLOW_FAULT=train:writing-optimizer:pause), then its publish job started at once: in a
    process of its own (as a client does when no worker claims it), the publisher finds the
    worker's record, waits for the write and publishes the state of the job's policy; through the
    client while the worker runs, the client waits for the write itself and hands the job over
    only after it (no request queued or running meanwhile, so that a train job of the next
    iteration would find the worker free), and the worker publishes it."""
    from otbflow.runtime.codeversion import code_version
    from otbflow.runtime.manifest import weights_digest

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
        if publisher == "client":
            publish = [*client_command(registry, code_version("publish_optimizer")), "publish-optimizer"]
        else:
            publish = [sys.executable, "-m", "otbflow", "publish-optimizer"]
        publish += ["--config", str(results / "config.yaml"), "--pending", str(out / "optimizer.pending")]
        publish += ["--out", str(out / "optimizer"), "--policy", str(out / "policy"), "--train-outputs"]
        publish += [str(out / "policy")]
        job = subprocess.Popen(publish, cwd=tiny_run, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        base, handed = dispatch.root(registry) / "train", []
        while job.poll() is None and not (out / "optimizer.pending/meta.json").exists():
            handed += [*base.glob("queue/*.json"), *base.glob("*/running/*.json")]
            time.sleep(0.05)
        text = job.communicate(timeout=120)[0]
        assert job.returncode == 0, text[-3000:]
        assert not handed, handed
        assert ("runs publish_optimizer" in text) == (publisher == "client"), text[-3000:]
        assert json.loads((out / "optimizer/meta.json").read_text())["policy_weights"] == weights_digest(out / "policy")
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=60)


@pytest.mark.skipif(not small_tmpfs_works(), reason="needs unshare -rm to mount a small tmpfs (user namespaces)")
def test_a_full_disk_under_the_background_write_is_named_in_the_publish_jobs_log(tiny_run, tmp_path):
    """A train worker whose AdamW state goes to a full disk (a 32 KiB tmpfs, mounted for the
    worker alone): the train job returns its policy, the background write fails, and the publish
    job (on the worker, as the rule's client hands it) fails naming errno 28 and a path on that
    disk in its own log (the client's output), not a writer that died."""
    from otbflow.runtime.codeversion import code_version

    results, registry, full = tiny_run / "results", tmp_path / "registry", tmp_path / "full"
    full.mkdir()
    command = [sys.executable, "-m", "otbflow", "worker", "train", "--results", str(registry)]
    script = 'mount -t tmpfs -o size=32k tmpfs "$0" && exec "$@"'
    with open(tmp_path / "w.log", "w") as log:
        worker = subprocess.Popen(["unshare", "-rm", "sh", "-c", script, str(full), *command], stdout=log, stderr=log)
    try:
        wait_for(lambda: dispatch.live_workers(registry, "train"), 60, "the worker")
        out = tmp_path / "job"
        args = train_args(results, out)
        args[args.index("--optimizer") + 1] = str(full / "optimizer.pending")
        train = [*client_command(registry, code_version("train")), "train", *args, "--optimizer-async"]
        res = subprocess.run(train, cwd=tiny_run, capture_output=True, text=True)
        assert res.returncode == 0 and "runs train" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]
        publish = [*client_command(registry, code_version("publish_optimizer")), "publish-optimizer"]
        publish += ["--config", str(results / "config.yaml"), "--pending", str(full / "optimizer.pending")]
        publish += ["--out", str(full / "optimizer"), "--policy", str(out / "policy"), "--train-outputs"]
        publish += [str(out / "policy")]
        res = subprocess.run(publish, cwd=tiny_run, capture_output=True, text=True)
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=60)
    assert res.returncode != 0 and "runs publish_optimizer" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]
    error = re.search(r"\[Errno 28\] No space left on device: '([^']+)'", res.stdout)
    assert error and Path(error.group(1)).is_relative_to(full), res.stdout[-3000:]
    assert "writer died" not in res.stdout


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
    from otbflow.runtime.codeversion import code_version

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
    assert (tmp_path / "train.log").read_text().count("AdamW goes on in the resident engine") == 49


def test_a_client_that_must_wait_for_a_worker_fails_clearly_when_none_comes(tmp_path):
    """workers.slurm: the client (a local job of the head) never runs the stage itself: with no worker
    within --wait-min it fails, saying so, and the stage's CLI never ran (its --help would print)."""
    results = tmp_path / "results"
    cmd = [*client_command(results, "x"), "--wait-min", "0.02", "--threads", "1", "features", "--help"]
    start = time.time()
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 1 and "teacher-forced" not in res.stdout, res.stdout + res.stderr
    assert "waiting for a features worker" in res.stdout and "no features worker started in" in res.stdout
    assert 1.2 <= time.time() - start < 120  # it waited --wait-min, then ended (no hang)


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
    # a train job per iteration of the tiny run; with the train worker the AdamW state every 5th
    # iteration and the last (otbflow.runtime.adamw): of 2 iterations, the last's only
    for stage, jobs in (("train", 2), ("publish-optimizer", 1)):
        found = [c for c in commands if f" {stage} --" in c]
        assert len(found) == jobs, commands
        for command in found:
            assert "srun" not in command and "torch.distributed.run" not in command
            assert "-m otbflow.ops.dispatch" in command and "--wait-min" in command, command
            assert ("--tasks 2" in command) == (stage == "train" and tasks == 2), command


def launch_train(registry: Path, cwd: Path, out: Path, iteration: int, prev: Path | None, log: Path) -> str:
    """A train job of two processes and its publish job, as the rules start them (the client,
    ``python -m otbflow.ops.dispatch``), on the tiny run's iteration-0 advantages; returns the train
    client's output."""
    from otbflow.runtime.codeversion import code_version

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
        from otbflow.runtime.codeversion import code_version

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
    assert text.count("AdamW goes on in the resident engine") == 1  # rank 0's line
    for i in (0, 1):
        same_update(tmp_path / f"warm{i}", alone[i])
    assert not any(registry.glob(".workers/*/*/worker.json"))
