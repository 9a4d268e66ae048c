"""The tiny workflow through a real one-node Slurm on localhost (slurm/local/slurm-up.sh).

Runs the README's Slurm commands in a sandbox checkout that holds a copy of the session's tiny
run: `otbflow submit` (a head job) reruns the workflow from the rollouts on with the slurm/ profile
(rollout shards as a job array, a 2-process DeepSpeed train step through srun), the README's
watch commands, a rerun after a config change, `--rerun`, a resubmission with nothing to do, and
the profile without a head job. Then a head that survives (otbflow.ops.head): the tiny run's
iteration 1 again, once with the head job killed (kill -9) while its train job runs and the same
command submitted again, once with a head job whose time limit is shorter than the work, which
requeues itself; both end with the uninterrupted run's policy, bitwise. Skipped, with the reason,
where Slurm cannot be started (not root, no apt-get). The cluster stays up afterwards (see
``local_slurm``).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, TINY, folder_digest, make_sandbox, sandbox_env

from otbflow import schemas
from otbflow.io import read_metadata, read_table
from otbflow.ops import head as H
from otbflow.ops import slurm

# one worker for the module (its Slurm run is a module fixture); the tiny run it copies is shared across workers
# The tests that share slurm_run's sandbox run on one pytest-xdist worker ("slurm"); those with a
# sandbox of their own (a head that survives, worker jobs) on another ("slurm_heads"), beside them on
# the test cluster (slurm-up.sh: room for both).
pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.xdist_group("slurm")]
HEADS = pytest.mark.xdist_group("slurm_heads")
SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))
# A test cluster: no accounts, first status check after 2 s instead of the profile's 20 s, one
# CPU per job so that two jobs share the 2-core machine.
TEST_ARGS = [
    "--slurm-no-account",
    "--slurm-init-seconds-before-status-checks",
    "2",
    "--set-threads",
    "bootstrap=1",
    "rollout=1",
    "features=1",
    "evaluate=1",
    "scaling=1",
]
# One iteration, trained by 2 DeepSpeed ranks of 1 CPU each.
TEST_CONFIG = "iterations: 1\nresources:\n  train: {tasks: 2, cpus_per_task: 1}\n"


@pytest.fixture(scope="module")
def slurm_sandbox(local_slurm, tiny_run, tmp_path_factory):
    """A sandbox checkout holding a copy of the session's tiny run (README command 1) and the
    user's ``my.yaml`` (config/tiny.yaml plus TEST_CONFIG): the README's Slurm commands run here."""
    work = make_sandbox(tmp_path_factory.mktemp("slurm"))
    for name in ("results", ".snakemake"):
        shutil.copytree(
            tiny_run / name, work / name, symlinks=True, ignore=shutil.ignore_patterns("locks", "incomplete")
        )
    config = yaml.safe_load(TINY.read_text()) | yaml.safe_load(TEST_CONFIG)
    (work / "my.yaml").write_text(yaml.safe_dump(config))
    yield work
    # a failed test must not leave its head job (or the stage jobs) holding the test cluster
    listed = subprocess.run(["squeue", "-h", "-o", "%i %Z"], capture_output=True, text=True).stdout.split("\n")
    ours = [line.split()[0] for line in listed if line.strip() and line.split()[-1].startswith(str(work))]
    if ours:
        subprocess.run(["scancel", *ours], capture_output=True)


def sh(work: Path, command: str, ok=(0,), env: dict | None = None) -> str:
    """A README command in the sandbox's shell (``env``: variables added to its environment);
    returns its output."""
    res = subprocess.run(
        command,
        shell=True,
        cwd=work,
        env={**sandbox_env(work), **(env or {})},
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=900,
    )
    assert res.returncode in ok, f"{command!r} failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res.stdout + res.stderr


def head_log(work: Path, job_id: str) -> str:
    """Wait until a head job has left Slurm's queue; returns its log. A head job that did not end
    COMPLETED (one that Slurm killed or could not start) fails here, with its log: submitit's
    ``result()`` would wait forever for the result file such a job never writes."""
    import submitit

    def ended() -> str | None:
        state = slurm.slurm_state(job_id)
        return None if state in slurm.QUEUED else state or "gone"

    state = wait_for(ended, 1800, f"the head job {job_id}")
    job = submitit.SlurmJob(folder=work / "logs" / "submit" / "%j", job_id=job_id)
    log = "".join(Path(p).read_text() for p in (job.paths.stdout, job.paths.stderr) if Path(p).is_file())
    assert state == "COMPLETED", f"the head job {job_id} ended {state}:\n{log[-3000:]}"
    assert job.result() == 0, log[-3000:]
    return log


def submit(work: Path, command: str) -> tuple[str, str]:
    """Run an `otbflow submit` command, wait for its head job; returns (job id, head log)."""
    job_id = re.search(r"submitted the head job (\d+)", sh(work, command)).group(1)
    return job_id, head_log(work, job_id)


# The README's Slurm commands (test_docs_commands.HOW marks them SLURM), in the tiny form run here:
# my.yaml is the test config, the test cluster's partition is `debug`, and TEST_ARGS make the
# cluster quick. The first submission starts from the copied tiny run and reruns it from the rollouts
# on (--forcerun rollout: the rollout job array, features, advantages, 2-rank training, evaluation,
# the report), the others target iteration 0's advantages.
ADV = "results/iter_0/advantages/advantages.parquet"
FAST = " ".join(TEST_ARGS)
# The grouped submission: iteration 0's features, advantages and train (forced) as one group job and
# iteration 1's rollouts (forced; rollout.staleness 1: from the initial policy) as a job array beside
# it. Memory and runtimes differ per stage (and fit the test node beside the head job), so that the
# group job's request shows the largest memory and the sum of the runtimes (20 + 20 + 10 + 30 minutes).
GROUPED_TARGETS = (
    "results/iter_0/train/policy results/iter_1/rollout/shard_0.parquet results/iter_1/rollout/shard_1.parquet"
)
GROUPED_CONFIG = (
    "--config iterations=2 'rollout={staleness: 1}' 'train={rollout_is: token}' 'resources={features: "
    "{mem_mb: 3000, runtime: 20}, advantages: {mem_mb: 1000, runtime: 10}, train: {mem_mb: 2000, runtime: 30}, "
    "rollout: {mem_mb: 2000}}'"
)
# Worker jobs of 1 CPU and 2 GB beside the head job and a stage job on the test node; a short
# time limit and idle exit, so that a worker job a failed test leaves ends by itself.
WORKERS_CONFIG = (
    "--config 'resources={rollout: {mem_mb: 2000}, features: {mem_mb: 2000}, train: {mem_mb: 2000}}' "
    "'workers={time_min: 30, idle_exit_min: 5}'"
)
README_FORMS = {
    "otbflow submit --configfile my.yaml --partition long --account my_project": f"otbflow submit --configfile my.yaml --partition debug --account my_project -- --forcerun rollout {FAST}",
    "squeue --me": "squeue --me",
    "tail -f logs/submit/4242/4242_0_log.out": "timeout 5 tail -f logs/submit/{job}/{job}_0_log.out",
    "ls .snakemake/slurm_logs/rule_train/": "ls .snakemake/slurm_logs/rule_train/",
    "otbflow submit --configfile my.yaml -- --config 'advantages={estimator: grpo}'": f"otbflow submit --configfile my.yaml -- {ADV} --config 'advantages={{estimator: grpo}}' {FAST}",
    "otbflow submit --configfile my.yaml --rerun advantages": f"otbflow submit --configfile my.yaml --rerun advantages -- {ADV} {FAST}",
    "otbflow submit --configfile my.yaml": f"otbflow submit --configfile my.yaml -- {ADV} {FAST}",
    "snakemake --workflow-profile slurm --configfile my.yaml < /dev/null": f"snakemake --workflow-profile slurm --configfile my.yaml -n {FAST} < /dev/null",
    # iteration 0's update again, grouped, beside iteration 1's stale rollouts (test_grouped_iterations)
    "otbflow submit --configfile my.yaml --group-iterations": "otbflow submit --configfile my.yaml --group-iterations "
    f"--rerun features -- {GROUPED_TARGETS} --force {GROUPED_CONFIG} {FAST}",
    # iteration 1 again on worker jobs (test_slurm_workers_...)
    "otbflow submit --configfile my.yaml --workers": "otbflow submit --configfile my.yaml --workers -- "
    f"results/iter_1/train/policy {WORKERS_CONFIG} {FAST}",
}


@pytest.fixture(scope="module")
def slurm_run(slurm_sandbox):
    """README step 1 and 2: submit the workflow, watch it; returns (workdir, head log)."""
    work = slurm_sandbox
    start = time.perf_counter()
    out = sh(work, README_FORMS["otbflow submit --configfile my.yaml --partition long --account my_project"])
    job = re.search(r"submitted the head job (\d+)", out).group(1)
    assert re.search(rf"^\s*{job}\s", sh(work, README_FORMS["squeue --me"]), re.M)  # listed while it runs
    log_file = work / "logs" / "submit" / job / f"{job}_0_log.out"
    for _ in range(600):  # the head job writes its log once it starts
        if log_file.is_file():
            break
        time.sleep(0.2)
    sh(work, README_FORMS["tail -f logs/submit/4242/4242_0_log.out"].format(job=job), ok=(0, 124))
    log = head_log(work, job)
    print(f"tiny workflow from the rollouts on, through Slurm: {time.perf_counter() - start:.0f} s")
    return work, log


def test_tiny_workflow_through_slurm(slurm_run):
    work, log = slurm_run
    r = work / "results"
    assert "Submitted array job" in log  # the rollout shards of an iteration: one job array
    for s in range(2):
        ro = read_table(r / f"iter_0/rollout/shard_{s}.parquet", schemas.ROLLOUTS)
        fe = read_table(r / f"iter_0/features/shard_{s}.parquet", schemas.FEATURES)
        assert fe.height == ro.height > 0
    read_table(work / ADV, schemas.ADVANTAGES)
    metrics = read_table(r / "iter_0/train/metrics.parquet", schemas.TRAIN_METRICS)
    assert metrics["grad_norm"].is_finite().all()
    assert read_metadata(r / "iter_0/train/metrics.parquet")["world_size"] == 2  # srun started 2 ranks
    progress = read_table(r / "report/progress.parquet", schemas.PROGRESS)
    assert progress["policy"].to_list() == ["initial", "iter_0"]
    assert sh(work, README_FORMS["ls .snakemake/slurm_logs/rule_train/"]).strip()  # kept by the profile


def test_submit_reruns_what_changed(slurm_run):
    """README step 3 and 4: a config change and --rerun redo one stage; a resubmission with
    nothing missing runs nothing; the profile without a head job plans from the same state."""
    work, _ = slurm_run
    _, log = submit(
        work, README_FORMS["otbflow submit --configfile my.yaml -- --config 'advantages={estimator: grpo}'"]
    )
    assert set(read_table(work / ADV, schemas.ADVANTAGES)["estimator"]) == {"grpo"}
    assert "rule rollout" not in log and "rule train" not in log  # only the advantages job ran
    _, log = submit(work, README_FORMS["otbflow submit --configfile my.yaml --rerun advantages"])
    assert "--forcerun advantages" in log and set(read_table(work / ADV, schemas.ADVANTAGES)["estimator"]) == {"otb"}
    _, log = submit(work, README_FORMS["otbflow submit --configfile my.yaml"])
    assert "Nothing to be done" in log
    assert "Nothing to be done" in sh(
        work, README_FORMS["snakemake --workflow-profile slurm --configfile my.yaml < /dev/null"]
    )


def test_every_readme_slurm_command_has_a_form_here():
    from test_docs_commands import HOW, SLURM

    assert {c for c, how in HOW.items() if how == SLURM} == set(README_FORMS)


def job_interval(log: Path) -> tuple[float, float]:
    """A stage job's own [start, end] (seconds since the epoch) from its log: '<stage> started X s
    ago' (the process's start, before its imports) and '<stage> finished in Y s'."""
    from datetime import datetime

    text = log.read_text()
    stamp = r"^(\S+ \S+) otbflow INFO \S+ {} ([\d.]+) s"
    started, finished = (
        re.search(stamp.format("started"), text, re.M),
        re.search(stamp.format("finished in"), text, re.M),
    )
    assert started and finished, f"{log} lacks its start or end line:\n{text[-2000:]}"
    at = lambda m: datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()  # noqa: E731
    return at(started) - float(started.group(2)), at(finished)


def test_a_stale_rollout_runs_while_the_policy_trains(slurm_run):
    """rollout.staleness 1 on the test cluster: iteration 1's rollout samples from the initial policy,
    so it does not wait for iteration 0's update. With iteration 0's features and advantages made
    first (locally, same config), one submission has train 0 and both rollouts of iteration 1 ready
    at once, and Slurm runs them side by side (one CPU each): their own start and end stamps overlap."""
    work, _ = slurm_run
    stale = "--config iterations=2 'rollout={staleness: 1}' 'train={rollout_is: token}' 'resources={train: {tasks: 1, mem_mb: 2000}, rollout: {mem_mb: 2000}}'"
    sh(
        work, f"snakemake {ADV} --cores 2 --configfile my.yaml {stale} < /dev/null"
    )  # targets before --configfile (it takes several files)
    targets = (
        "results/iter_0/train/policy results/iter_1/rollout/shard_0.parquet results/iter_1/rollout/shard_1.parquet"
    )
    _, log = submit(work, f"otbflow submit --configfile my.yaml -- {targets} {stale} {FAST}")
    assert "rule train" in log and "rule rollout" in log and "rule features" not in log, log[-3000:]
    r = work / "results"
    rows = read_table(r / "iter_1/rollout/shard_0.parquet", schemas.ROLLOUTS)
    assert rows["behaviour_iteration"].unique().to_list() == [0]
    assert read_metadata(r / "iter_1/rollout/shard_0.parquet")["policy"].endswith("bootstrap/policy")
    train = job_interval(r / "logs/train/iter_0.log")
    rollouts = [job_interval(r / f"logs/rollout/iter_1_shard_{s}.log") for s in (0, 1)]
    overlap = max(min(train[1], end) - max(train[0], start) for start, end in rollouts)
    assert overlap > 0, f"no rollout of iteration 1 ran while iteration 0 trained: train {train}, rollouts {rollouts}"


def sbatch_calls(head_log: str) -> list[str]:
    """One entry per sbatch call in a head's log: the Slurm log folder of a job under
    .snakemake/slurm_logs (rule_<rule>/<wildcard values>, group_<group>_<its rules>), "array" for a
    job array (the profile's arrays: the rollouts)."""
    jobs = re.findall(r"has been submitted with SLURM jobid \d+ \(log: \S*/slurm_logs/(\S+)/\d+\.log\)", head_log)
    return jobs + ["array"] * len(re.findall(r"^Submitted array job ", head_log, re.M))


def test_grouped_iterations_submit_one_job_per_update(slurm_run):
    """docs/slurm.md "Fewer queued jobs": `otbflow submit --group-iterations` submits iteration 0's two
    features jobs, advantages and 2-rank train as one Slurm job, and iteration 1's stale rollouts (one
    job array) beside it, submitted before it ends. Counted per iteration: the ungrouped run of slurm_run
    took 5 sbatch calls (the rollout array, 2 features, advantages, train), this one 2 (the rollout
    array, the group job). The group job asks for its largest member's memory and the sum of its
    members' runtimes; its name carries the folder's prefix and the incomplete markers of all its
    members hold its Slurm id while it runs, which is how a later head finds it (otbflow.ops.head)."""
    work, ungrouped_log = slurm_run
    start = time.perf_counter()
    out = sh(work, README_FORMS["otbflow submit --configfile my.yaml --group-iterations"])
    head_job = re.search(r"submitted the head job (\d+)", out).group(1)
    chain = {f"results/iter_0/features/shard_{s}.parquet" for s in (0, 1)}
    chain |= {"results/iter_0/advantages/advantages.parquet", "results/iter_0/train/policy"}

    def marked() -> dict[str, str] | None:
        found = slurm.incomplete_jobs(work / ".snakemake")
        return found if chain <= set(found) else None

    markers = wait_for(marked, 600, "the group job's incomplete markers", every=0.5)
    (group,) = {markers[p] for p in chain}  # one Slurm job holds the whole chain
    assert group in slurm.queued_jobs(set(), {slurm.jobname_prefix(work / "results")})  # found by its name too
    request = subprocess.run(["scontrol", "show", "job", group], capture_output=True, text=True).stdout
    for field in ("TimeLimit=01:20:00", "NumTasks=2", "CPUs/Task=1", "MinMemoryNode=3000M"):
        assert field in request, f"{field} not in the group job's request:\n{request}"
    log = head_log(work, head_job)

    grouped = sbatch_calls(log)
    assert sorted(grouped) == ["array", "group_chain_0_advantages_features_train"], grouped
    assert f"SLURM jobid {group} (log: " in log
    calls = sbatch_calls(ungrouped_log)
    update = [c for c in calls if re.fullmatch(r"rule_(features|advantages|train)/0(_\d+)?", c)]
    assert sorted(update) == ["rule_advantages/0", "rule_features/0_0", "rule_features/0_1", "rule_train/0"], calls
    assert calls.count("array") == 1, calls  # iteration 0's rollouts
    print(
        f"sbatch calls per iteration: {len(update) + 1} without grouping (rollout array, {', '.join(update)}), 2 with"
    )

    r = work / "results"
    for s in range(2):
        fe = read_table(r / f"iter_0/features/shard_{s}.parquet", schemas.FEATURES)
        assert fe.height == read_table(r / f"iter_0/rollout/shard_{s}.parquet", schemas.ROLLOUTS).height > 0
        rows = read_table(r / f"iter_1/rollout/shard_{s}.parquet", schemas.ROLLOUTS)
        assert rows["behaviour_iteration"].unique().to_list() == [0]
    assert read_table(r / "iter_0/train/metrics.parquet", schemas.TRAIN_METRICS)["grad_norm"].is_finite().all()
    assert read_metadata(r / "iter_0/train/metrics.parquet")["world_size"] == 2  # srun inside the group job
    # the stale rollouts did not wait for the group job: the head submitted both before any job ended
    # (which of them Slurm starts first depends on the test node's free CPUs)
    first_end = log.index("Finished jobid")
    assert log.index(f"SLURM jobid {group} (log: ") < first_end and log.index("Submitted array job") < first_end
    print(f"grouped submission: {time.perf_counter() - start:.0f} s")


# --- a head that survives: kill -9 of the head job, and a head job's time limit ---

AGAIN = f"otbflow submit --configfile my.yaml -- results/iter_1/train/policy {FAST}"


def redo_in_sandbox(tiny_run: Path, tmp_path: Path, stages: tuple[str, ...]):
    """A sandbox with a copy of the tiny run less iteration 1's ``stages``, and my.yaml =
    config/tiny.yaml: ``AGAIN`` redoes them through Slurm. Yields (folder, the tiny run's
    iteration-1 policy digest); cancels the folder's jobs afterwards."""
    work = make_sandbox(tmp_path / "work")
    for name in ("results", ".snakemake"):
        shutil.copytree(
            tiny_run / name, work / name, symlinks=True, ignore=shutil.ignore_patterns("locks", "incomplete")
        )
    for stage in stages:
        shutil.rmtree(work / "results/iter_1" / stage)
    (work / "results/logs/train/iter_1.log").unlink()
    (work / "my.yaml").write_text(TINY.read_text())
    yield work, folder_digest(tiny_run / "results/iter_1/train/policy")
    listed = subprocess.run(["squeue", "-h", "-o", "%i %Z"], capture_output=True, text=True).stdout.split("\n")
    ours = [line.split()[0] for line in listed if line.strip() and line.split()[-1].startswith(str(work))]
    if ours:
        subprocess.run(["scancel", *ours], capture_output=True)


@pytest.fixture
def iteration_1_again(local_slurm, tiny_run, tmp_path):
    """The tiny run less iteration 1's rollouts, features, advantages and train (``redo_in_sandbox``)."""
    yield from redo_in_sandbox(tiny_run, tmp_path, ("rollout", "features", "advantages", "train"))


@pytest.fixture
def train_1_again(local_slurm, tiny_run, tmp_path):
    """The tiny run less iteration 1's train job only: the tests of a head that survives assert on
    that job (in flight when its head dies), so the jobs before it are not redone."""
    yield from redo_in_sandbox(tiny_run, tmp_path, ("train",))


def wait_for(condition, timeout: float, what: str, every: float = 1.0):
    deadline = time.monotonic() + timeout
    while not (out := condition()):
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(every)
    return out


@HEADS
def test_a_killed_head_job_is_continued_by_the_same_command(train_1_again):
    """scancel --full --signal=KILL of the head job while its train job runs: the train job runs on
    unsupervised (held before its outputs, OTBFLOW_FAULT=train:before-outputs:sleep, until it is
    suspended here, so that it is still in flight when the next head starts, however fast the
    machine); the same submit command's head finds the killed head gone, cancels that train job,
    waits until it has left the queue, redoes it and ends with the uninterrupted run's policy,
    bitwise."""
    work, want = train_1_again
    start = time.perf_counter()
    hold = {"OTBFLOW_FAULT": "train:before-outputs:sleep"}  # this submission's jobs only
    first = re.search(r"submitted the head job (\d+)", sh(work, AGAIN, env=hold)).group(1)
    wait_for(lambda: (work / "results/logs/train/iter_1.log").is_file(), 600, "the train job")
    (record,) = (work / ".snakemake" / H.RECORDS).glob("*.json")
    dead = H.Head(**json.loads(record.read_text()))
    assert dead.slurm_job == first and dead.jobname_prefix == slurm.jobname_prefix(work / "results")
    subprocess.run(["scancel", "--full", "--signal=KILL", first], check=True)
    wait_for(lambda: slurm.slurm_state(first) not in slurm.RUNNING, 120, "the killed head job to end")
    (orphan,) = slurm.queued_jobs(set(), {dead.jobname_prefix})  # the train job, named with the folder's prefix
    assert orphan in slurm.incomplete_jobs(work / ".snakemake").values()  # its marker keeps its Slurm id
    subprocess.run(["scontrol", "suspend", orphan], check=True)
    killed_at = time.perf_counter() - start

    _, log = submit(work, AGAIN)
    assert f"the head pid {dead.pid} on {dead.host}, Slurm job {first}" in log and "is gone" in log, log[-3000:]
    assert f"cancelling the Slurm jobs {orphan}" in log and slurm.slurm_state(orphan) == "CANCELLED", log[-3000:]
    assert "rule train" in log  # redone, never adopted
    assert folder_digest(work / "results/iter_1/train/policy") == want
    print(f"head killed after {killed_at:.0f} s; continued in {time.perf_counter() - start - killed_at:.0f} s")


@HEADS
def test_a_head_job_requeues_itself_before_its_time_limit(train_1_again):
    """A head job with 2 minutes for more than 2 minutes of work: Slurm signals it 30 s (up to 90 s)
    before its limit, it stops Snakemake (SIGKILL: the stage jobs are not cancelled) and requeues
    itself; its next run takes over and finishes with the uninterrupted run's policy, bitwise. The
    train job is suspended until the head job has been requeued, so that the work outlasts the
    signal however fast the machine (on a fast one the iteration took 85 s: no requeue); the next
    run cancels it and redoes it. A requeued job waits before Slurm starts it again (its BeginTime:
    the credential lifetime, 120 s by default, 10 s on the test cluster; started sooner, by hand,
    Slurm refuses its batch step and the job fails)."""
    work, want = train_1_again
    start = time.perf_counter()
    out = sh(work, AGAIN.replace("--configfile my.yaml", "--configfile my.yaml --time 2 --requeue-before 30"))
    job = re.search(r"submitted the head job (\d+)", out).group(1)
    wait_for(lambda: (work / "results/logs/train/iter_1.log").is_file(), 600, "the train job")
    (train,) = wait_for(lambda: slurm.queued_jobs(set(), {slurm.jobname_prefix(work / "results")}), 60, "its Slurm id")
    subprocess.run(["scontrol", "suspend", train], check=True)

    log = head_log(work, job)
    assert "Snakemake stopped (SIGKILL), its jobs run on" in log and f"Requeued job {job}" in log, log[-3000:]
    assert f"Slurm job {job}" in log and "is gone" in log  # the requeued run took over from its previous run
    assert f"cancelling the Slurm jobs {train}" in log and "rule train" in log  # redone, never adopted
    assert folder_digest(work / "results/iter_1/train/policy") == want
    print(f"finished after {log.count('Requeued job')} requeue(s), {time.perf_counter() - start:.0f} s")


# --- warm workers as Slurm jobs: otbflow submit --workers ---


def worker_jobs(work: Path) -> dict[str, list[str]]:
    """{kind: ids} of the folder's worker jobs queued or running."""
    prefix = slurm.jobname_prefix(work / "results") + "_worker-"
    out: dict[str, list[str]] = {}
    for job_id, state, name in slurm.squeue("%i|%T|%j"):
        if name.startswith(prefix) and state in slurm.QUEUED:
            out.setdefault(name.removeprefix(prefix), []).append(job_id)
    return out


@HEADS
def test_slurm_workers_run_the_iteration_and_replace_a_killed_worker_job(iteration_1_again):
    """otbflow submit --workers redoes the tiny run's iteration 1 with a generation, a features and a
    train worker, each a Slurm job of its own; the rollouts, features and update run on them (their
    rules are local jobs of the head job). The train worker's job is killed (scancel --signal=KILL,
    frozen first by scontrol suspend so that it is killed with the train job in hand, however fast
    the machine) while it trains: the waiting client hands the job to the next worker, the head
    submits a new worker job in its place, the run ends with the uninterrupted run's policy, bitwise,
    and the worker jobs are cancelled with the run."""

    work, want = iteration_1_again
    start = time.perf_counter()
    command = README_FORMS["otbflow submit --configfile my.yaml --workers"]
    job = re.search(r"submitted the head job (\d+)", sh(work, command)).group(1)
    train_queue = work / "results/.workers/train"
    claimed = wait_for(lambda: list(train_queue.glob("*/running/*.json")), 600, "a train worker to take the job", 0.1)
    record = json.loads((claimed[0].parents[1] / "worker.json").read_text())
    victim = record["slurm_job"]
    assert victim in worker_jobs(work).get("train", []), (victim, worker_jobs(work))
    subprocess.run(["scontrol", "suspend", victim], check=True)
    subprocess.run(["scancel", "--full", "--signal=KILL", victim], check=True)
    killed_at = time.perf_counter() - start

    log = head_log(work, job)
    assert folder_digest(work / "results/iter_1/train/policy") == want
    for kind in ("generate", "features", "train"):
        assert f"submitted the {kind} worker job" in log, log[-3000:]
    assert f"the train worker job {victim} left the queue: replaced" in log, log[-3000:]
    assert "localrule train" in log and "localrule rollout" in log, log[-3000:]  # clients on the head
    train_log = (work / "results/logs/train/iter_1.log").read_text()
    assert "is gone: the job goes to the next worker" in train_log and "runs train" in train_log, train_log[-3000:]
    for stage, path in (("rollout", "rollout/iter_1_shard_0.log"), ("features", "features/iter_1_shard_0.log")):
        assert f"runs {stage}" in (work / "results/logs" / path).read_text()  # on a worker
    assert "cancelled the worker jobs" in log
    wait_for(lambda: not worker_jobs(work), 120, "the worker jobs to leave the queue")
    print(
        f"worker job killed after {killed_at:.0f} s; the run ended {time.perf_counter() - start:.0f} s after its start"
    )


@HEADS
def test_a_train_worker_job_of_two_ranks_runs_them_with_srun(local_slurm, tiny_run, two_rank_update, tmp_path):
    """otbflow submit --workers with resources.train.tasks 2: the train worker's Slurm job as the
    head submits it (``workerjobs.sbatch_options`` and ``script``: --ntasks=2, the worker starting
    its ranks with srun) runs a train job of two processes and its publish job, both ranks in the
    job's log, with the policy and metrics of the same job run by its client under torchrun (no
    worker), bitwise; scancel ends both ranks and their registration."""
    from types import SimpleNamespace

    from test_worker import launch_train, same_update

    from otbflow.ops import dispatch, workerjobs

    registry, log, logs = tmp_path / "registry", tmp_path / "clients.log", tmp_path / "logs"
    logs.mkdir()
    res = SimpleNamespace(gpu=0, tasks=2, nodes=1, cpus_per_task=1, mem_mb=3000)
    sbatch = workerjobs.sbatch_options(registry, "train", res, {}, 30, logs)
    assert "--ntasks=2" in sbatch and "--cpus-per-task=1" in sbatch
    script = workerjobs.script(sys.executable, str(REPO / "src"), "train", registry, 600, 0, tasks=2, cpus_per_task=1)
    job_id = workerjobs.Supervisor.submit(workerjobs.WorkerJob("train", 1, sbatch, script, logs))
    try:
        folders = wait_for(lambda: dispatch.live_workers(registry, "train"), 600, "the worker job's ranks")
        record = json.loads((folders[0] / "worker.json").read_text())
        assert record["slurm_job"] == job_id and record["tasks"] == 2
        out = launch_train(registry, tiny_run, tmp_path / "slurm", 0, None, log)
        assert "runs train" in out and "is gone" not in out, out[-3000:]
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
    same_update(tmp_path / "slurm", two_rank_update)
    wait_for(lambda: not list(registry.glob(".workers/train/*/worker.json")), 120, "the worker to unregister")
    text = (logs / f"train-{job_id}.log").read_text()
    assert "rank 1 runs train" in text and "runs publish_optimizer" in text, text[-3000:]
