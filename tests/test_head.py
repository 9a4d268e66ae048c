"""A killed head is continued by the same command (otbflow.ops.guard, .head, .results_lock): who
holds a folder, when that holder is gone, the jobs it left stopped (local processes by their mark,
Slurm jobs by the incomplete markers and by name: otbflow.ops.slurm) before anything is redone, and
the tiny workflow continued after ``kill -9`` of Snakemake to the policy of an uninterrupted run.
The Slurm side runs on the local cluster in tests/test_slurm_integration.py."""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import REPO, folder_digest, make_sandbox, sandbox_env

from otbflow.ops import head as H
from otbflow.ops import results_lock, slurm
from otbflow.runtime.process import process_stat

SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))


def wait_for(condition, timeout=120.0, what="the condition"):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def me() -> H.Head:
    return H.this_process()


# --- who holds a folder, and when it is gone ---


def test_this_process_is_alive_and_a_reaped_one_is_gone():
    assert H.is_gone(me(), me()) is False
    proc = subprocess.Popen(["sleep", "0"])
    stat = process_stat(proc.pid)
    child = replace(me(), id="child", pid=proc.pid, start=stat[2] if stat else 0)
    wait_for(lambda: (process_stat(proc.pid) or "Z")[0] == "Z", what="the child to exit")
    assert H.is_gone(child, me()) is True  # a zombie (killed, not yet reaped) is gone
    proc.wait()
    assert H.is_gone(child, me()) is True


def test_a_reused_pid_or_another_boot_is_another_process():
    assert H.is_gone(replace(me(), start=me().start + 1), me()) is True
    assert H.is_gone(replace(me(), boot="another boot"), me()) is True


def test_a_head_on_another_host_is_asked_of_slurm(fake_slurm):
    other = replace(me(), id="other", host="elsewhere", slurm_job="100")
    assert H.is_gone(replace(other, slurm_job=None), me()) is None  # cannot be told: counts as alive
    assert H.is_gone(other, replace(me(), slurm_job="100")) is True  # the requeued job's previous run
    fake_slurm("100|100|RUNNING|otbflow-head")
    assert H.is_gone(other, me()) is False
    fake_slurm("100|100|PENDING|otbflow-head")  # requeued, waiting to start again: no process
    assert H.is_gone(other, me()) is True
    fake_slurm("100|100|FAILED|otbflow-head")
    assert H.is_gone(other, me()) is True
    fake_slurm("")  # forgotten by squeue
    assert H.is_gone(other, me()) is True


def test_the_incomplete_markers_give_the_slurm_ids(tmp_path):
    root = tmp_path / ".snakemake" / "incomplete"
    long_name = "results/" + "x" * 300 + ".parquet"
    for path, job in [("results/a.parquet", "7"), ("results/b.parquet", "8_1"), ("results/c", None), (long_name, "9")]:
        b64 = base64.urlsafe_b64encode(path.encode()).decode()
        parts = [b64[i : i + 254] for i in range(0, len(b64), 254)]  # Snakemake's split of long names
        parts = ["@" + p for p in parts[:-1]] + parts[-1:]
        (root.joinpath(*parts)).parent.mkdir(parents=True, exist_ok=True)
        root.joinpath(*parts).write_text(json.dumps({"external_jobid": job}))
    assert slurm.incomplete_jobs(tmp_path / ".snakemake") == {
        "results/a.parquet": "7",
        "results/b.parquet": "8_1",
        long_name: "9",
    }


def test_the_job_name_prefix_is_one_per_results_folder(tmp_path):
    a = slurm.jobname_prefix(tmp_path / "results")
    assert a == slurm.jobname_prefix(tmp_path / "x" / ".." / "results")
    assert a != slurm.jobname_prefix(tmp_path / "other")
    assert a.startswith("otbflow-") and len(a) <= 50


# --- taking over: the gone head's jobs stopped, its locks removed ---


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    """squeue and scancel on PATH over a table of jobs (id|array id|state|name per line); scancel
    marks a job, or every task of an array, CANCELLED and appends its arguments to scancel.log."""
    bin_dir, table = tmp_path / "fake_slurm", tmp_path / "fake_slurm" / "jobs.txt"
    bin_dir.mkdir()
    (bin_dir / "squeue").write_text(
        f"#!{sys.executable}\nimport sys\nrows = [r.split('|') for r in open({str(table)!r}).read().split()]\n"
        "fmt = sys.argv[sys.argv.index('--format') + 1]\n"
        "for i, a, s, n in rows:\n    print(fmt.replace('%i', i).replace('%F', a).replace('%T', s).replace('%j', n))\n"
    )
    (bin_dir / "scancel").write_text(
        f"#!{sys.executable}\nimport sys\nrows = [r.split('|') for r in open({str(table)!r}).read().split()]\n"
        "ids = set(sys.argv[1:])\n"
        "rows = [[i, a, 'CANCELLED' if i in ids or a in ids else s, n] for i, a, s, n in rows]\n"
        f"open({str(table)!r}, 'w').write(''.join('|'.join(r) + chr(10) for r in rows))\n"
        f"open({str(bin_dir / 'scancel.log')!r}, 'a').write(' '.join(sys.argv[1:]) + chr(10))\n"
    )
    for tool in ("squeue", "scancel"):
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")

    def jobs(*rows: str) -> Path:
        table.write_text("".join(r + "\n" for r in rows if r))
        return bin_dir

    jobs()
    return jobs


def killed_folder(tmp_path: Path, head: H.Head) -> H.Folder:
    """A .snakemake as a killed head leaves it: its record, its locks, incomplete markers with the
    Slurm ids 101 and the array task 102_0."""
    folder = H.Folder(tmp_path / ".snakemake")
    folder.record(head)
    (folder.root / "locks").mkdir(parents=True)
    (folder.root / "locks" / "0.output.lock").write_text("results/a.parquet\n")
    for name, job in [("results/a.parquet", "101"), ("results/b.parquet", "102_0")]:
        marker = folder.root / "incomplete" / base64.urlsafe_b64encode(name.encode()).decode()
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(json.dumps({"external_jobid": job}))
    return folder


def test_taking_over_cancels_the_gone_heads_jobs_and_removes_its_locks(tmp_path, fake_slurm):
    gone = replace(me(), id="gone", host="elsewhere", slurm_job="100", jobname_prefix="otbflow-abc")
    folder = killed_folder(tmp_path, gone)
    bin_dir = fake_slurm(
        "100|100|FAILED|otbflow-head",  # the killed head job
        "101|101|RUNNING|otbflow-abc_r1",
        "102_0|102|RUNNING|otbflow-abc_r1",
        "102_1|102|PENDING|otbflow-abc_r1",
        "103|103|PENDING|otbflow-abc_r1",  # submitted, not yet marked: found by its name
        "104|104|RUNNING|otbflow-def_r2",  # another folder's
        "105|105|COMPLETED|otbflow-abc_r1",
    )
    lines = []
    assert folder.take_over(me(), lines.append) is True
    assert (bin_dir / "scancel.log").read_text().split() == ["101", "102", "103"]
    assert not (folder.root / "locks").exists()
    assert [h.id for h in folder.heads()] == [me().id]
    assert any("is gone" in line for line in lines), lines


def test_a_live_head_keeps_its_locks_and_its_jobs(tmp_path, fake_slurm):
    live = replace(me(), id="live", host="elsewhere", slurm_job="100", jobname_prefix="otbflow-abc")
    folder = killed_folder(tmp_path, live)
    bin_dir = fake_slurm("100|100|RUNNING|otbflow-head", "101|101|RUNNING|otbflow-abc_r1")
    lines = []
    assert folder.take_over(me(), lines.append) is False
    assert not (bin_dir / "scancel.log").exists() and (folder.root / "locks" / "0.output.lock").is_file()
    assert {h.id for h in folder.heads()} == {"live", me().id}
    assert any("Slurm job 100" in line and "runs" in line for line in lines), lines


def test_the_processes_of_a_gone_head_are_found_by_their_mark_and_stopped():
    proc = subprocess.Popen(["sleep", "60"], env=dict(os.environ, **{H.MARK: "gone-head"}))
    other = subprocess.Popen(["sleep", "60"], env=dict(os.environ, **{H.MARK: "another-head"}))
    try:
        wait_for(lambda: proc.pid in H.marked_processes({"gone-head"}), what="the marked process")
        assert other.pid not in H.marked_processes({"gone-head"})
        H.stop_processes([proc.pid], lambda line: None)
        assert proc.wait(timeout=5) == -signal.SIGTERM and other.poll() is None
    finally:
        other.kill()
        other.wait()


# --- one head per results folder: its lock ---


def test_the_results_folder_has_one_head(tmp_path, fake_slurm):
    """The lock in the results folder: taken when free, refused while its holder runs or cannot
    be asked (naming it and the folder, writing nothing), taken over from a gone holder, freed
    only by its holder."""
    lock = results_lock.ResultsLock(tmp_path / "results")
    mine = replace(me(), workdir=str(tmp_path / "a"))
    assert lock.acquire(mine, print) is None and lock.holder() == mine
    assert lock.acquire(mine, print) is None  # its own: held already
    held = lock.path.read_text()
    other = replace(me(), id="other", workdir=str(tmp_path / "b"))
    with pytest.raises(results_lock.FolderHeld) as refused:  # a live head of this host (this process)
        lock.acquire(other, print)
    assert f"{lock.folder} is held by the head pid {os.getpid()} on {mine.host}" in str(refused.value)
    assert f"from the working folder {tmp_path / 'a'}, which runs" in str(refused.value)
    assert lock.path.read_text() == held and sorted(p.name for p in lock.folder.iterdir()) == [results_lock.LOCK]
    lock.release(other)  # not its holder: nothing happens
    assert lock.path.read_text() == held
    lock.release(mine)
    assert not lock.path.exists()

    # a head on another host: asked of Slurm; without a Slurm job it cannot be asked (counts as alive)
    elsewhere = replace(me(), id="elsewhere", host="elsewhere", slurm_job=None)
    lock.acquire(elsewhere, print)
    with pytest.raises(results_lock.FolderHeld, match="may still run"):
        lock.acquire(mine, print)
    lock.path.unlink()
    head_job = replace(elsewhere, id="head-job", slurm_job="100")
    lock.acquire(head_job, print)
    fake_slurm("100|100|RUNNING|otbflow-head")
    with pytest.raises(results_lock.FolderHeld, match="Slurm job 100"):
        lock.acquire(mine, print)
    # the head job requeued (the same Slurm job id, maybe on another host): its dead run is taken over
    lines = []
    assert lock.acquire(replace(me(), id="requeued", slurm_job="100"), lines.append) == head_job
    assert lock.holder().id == "requeued" and any("is gone" in line for line in lines), lines
    # a dead process of this host (a reaped pid) is gone too
    proc = subprocess.Popen(["sleep", "0"])
    stat = process_stat(proc.pid)
    proc.wait()
    lock.path.unlink()
    dead = replace(me(), id="dead", pid=proc.pid, start=stat[2] if stat else 0)
    lock.acquire(dead, print)
    assert lock.acquire(mine, print) == dead and lock.holder() == mine
    assert sorted(p.name for p in lock.folder.iterdir()) == [results_lock.LOCK]


# --- a Snakefile with the guard: kill -9 of Snakemake, then the same command ---

TOY = """
from otbflow.ops.guard import guard

guard(workflow, "results")


rule all:
    input:
        expand("results/{i}.txt", i=range(2)),


rule slow:
    output:
        "results/{i}.txt",
    shell:
        "sleep $TOY_SLEEP; echo {wildcards.i} > {output}"
"""


def toy(work: Path, *args: str, sleep: float = 0.5, background=False, env: dict | None = None):
    cmd = [SNAKEMAKE, "--cores", "2", *args]
    env = dict(os.environ, TOY_SLEEP=str(sleep), PYTHONPATH=str(REPO / "src"), **(env or {}))
    if background:
        return subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)


def markers(work: Path) -> list[Path]:
    return [p for p in (work / ".snakemake" / "incomplete").rglob("*") if p.is_file()]


def test_a_killed_snakemake_is_continued_by_the_same_command(tmp_path):
    """kill -9 of Snakemake while its two jobs run: a dry run changes nothing and plans them again;
    the same command stops the orphaned jobs (still running, started by the dead head), removes
    its locks and redoes them; --unlock forgets a recorded head."""
    (tmp_path / "Snakefile").write_text(TOY)
    first = toy(tmp_path, sleep=60, background=True)
    wait_for(lambda: len(markers(tmp_path)) == 2, what="both jobs to start")
    (record,) = (tmp_path / ".snakemake" / H.RECORDS).glob("*.json")
    dead = H.Head(**json.loads(record.read_text()))
    assert dead.pid == first.pid and dead.slurm_job is None
    first.kill()
    first.wait()
    orphans = H.marked_processes({dead.id})
    assert orphans, "the jobs of a killed Snakemake run on"

    dry = toy(tmp_path, "-n")
    assert dry.returncode == 0 and "slow" in dry.stdout, dry.stdout + dry.stderr
    assert record.is_file() and (tmp_path / ".snakemake" / "locks").is_dir()
    assert H.marked_processes({dead.id}) == orphans  # a dry run stops nothing

    res = toy(tmp_path)
    log = res.stdout + res.stderr
    assert res.returncode == 0, log
    assert f"the head pid {dead.pid} on {dead.host}" in log and "is gone" in log
    assert not H.marked_processes({dead.id})
    assert [(tmp_path / f"results/{i}.txt").read_text() for i in range(2)] == ["0\n", "1\n"]
    assert not markers(tmp_path) and not list((tmp_path / ".snakemake" / H.RECORDS).glob("*.json"))

    H.Folder(tmp_path / ".snakemake").record(replace(dead, id="elsewhere", host="elsewhere"))
    dry = toy(tmp_path, "-n")
    assert "may still run" in dry.stdout + dry.stderr
    assert toy(tmp_path, "--unlock").returncode == 0
    assert not list((tmp_path / ".snakemake" / H.RECORDS).glob("*.json"))


def test_a_live_snakemake_keeps_the_folder(tmp_path):
    """A second Snakemake on the same outputs while the first runs: it is refused at the results
    folder's lock, before Snakemake's own, naming the head that holds the folder, and neither the
    first's record, its lock nor its jobs are touched."""
    (tmp_path / "Snakefile").write_text(TOY)
    first = toy(tmp_path, sleep=15, background=True)
    lock = results_lock.ResultsLock(tmp_path / "results")
    try:
        wait_for(lambda: len(markers(tmp_path)) == 2, what="both jobs to start")
        held = lock.path.read_text()
        second = toy(tmp_path)
        log = second.stdout + second.stderr
        assert second.returncode != 0 and f"is held by the head pid {first.pid}" in log, log
        assert "nothing was run" in log and lock.path.read_text() == held
        assert len(list((tmp_path / ".snakemake" / H.RECORDS).glob("*.json"))) == 1
        assert first.poll() is None and len(markers(tmp_path)) == 2
    finally:
        first.terminate()  # SIGTERM: Snakemake waits for its jobs, then removes its record
        first.wait(timeout=60)
    assert not list((tmp_path / ".snakemake" / H.RECORDS).glob("*.json")) and not lock.path.exists()


# A toy whose outputs are in a results folder outside its working folder (TOY_RESULTS), each
# written half first: a job killed mid-way leaves a file that must not be taken for finished.
SHARED_TOY = """
import os

from otbflow.ops.guard import guard

R = os.environ["TOY_RESULTS"]
guard(workflow, R)


rule all:
    input:
        expand(f"{R}/{{i}}.txt", i=range(2)),


rule slow:
    output:
        f"{R}/{{i}}.txt",
    shell:
        "echo half > {output:q}; sleep $TOY_SLEEP; echo {wildcards.i} > {output:q}"
"""


def test_two_working_folders_share_one_results_folder(tmp_path):
    """Two checkouts (two working folders) on one results folder: while the first runs, the
    second is refused before any job, naming the holder and the folder, and touches nothing of
    the first's; its dry run works and says so. Once the first is killed with kill -9, the second
    takes the folder over: the first's orphaned jobs are stopped and its half-written outputs
    redone, not adopted; it frees the folder when it ends, and the first checkout runs again."""
    results = tmp_path / "shared results"
    a, b = tmp_path / "a", tmp_path / "b"
    for work in (a, b):
        work.mkdir()
        (work / "Snakefile").write_text(SHARED_TOY)
    env = {"TOY_RESULTS": str(results)}
    lock = results_lock.ResultsLock(results)
    first = toy(a, sleep=60, background=True, env=env)
    try:
        wait_for(lambda: len(markers(a)) == 2, what="both jobs of the first head to start")
        wait_for(lambda: all((results / f"{i}.txt").is_file() for i in range(2)), what="the half-written outputs")
        before = {p.name: p.read_text() for p in results.iterdir()}
        second = toy(b, sleep=0.5, env=env)
        log = second.stdout + second.stderr
        assert second.returncode != 0, log
        assert f"the results folder {results} is held by the head pid {first.pid}" in log, log
        assert f"from the working folder {a}, which runs" in log and "nothing was run" in log, log
        assert "rule slow" not in log and not (b / ".snakemake" / H.RECORDS).exists()
        assert {p.name: p.read_text() for p in results.iterdir()} == before
        assert first.poll() is None and len(markers(a)) == 2
        dry = toy(b, "-n", env=env)
        assert dry.returncode == 0 and "a real run here is refused" in dry.stdout + dry.stderr, dry.stderr
        assert {p.name: p.read_text() for p in results.iterdir()} == before

        dead = lock.holder()
        assert dead.pid == first.pid and dead.workdir == str(a)
        first.kill()
        first.wait()
        assert H.marked_processes({dead.id}), "the jobs of a killed Snakemake run on"
        second = toy(b, sleep=0.5, env=env)
        log = second.stdout + second.stderr
        assert second.returncode == 0, log
        assert f"the head pid {first.pid} on {dead.host}" in log and f"it ran from {a}" in log, log
        assert not H.marked_processes({dead.id})
        assert [(results / f"{i}.txt").read_text() for i in range(2)] == ["0\n", "1\n"]
        assert not lock.path.exists()
        again = toy(a, sleep=0.5, env=env)  # the first checkout, after its own killed head
        assert again.returncode == 0, again.stdout + again.stderr
        assert not lock.path.exists()
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()


# --- the tiny workflow: kill -9 of `snakemake --cores 2` mid-run, then the same command ---


def start_train_and_kill(command: str, work: Path, train_log: Path) -> H.Head:
    """Start ``command`` (a Snakemake run) in ``work``; once its train job has started (the job's
    log appears), kill Snakemake with SIGKILL. The train job holds before its outputs (up to 60 s:
    OTBFLOW_FAULT=train:before-outputs:sleep), so that it is still running when the next head
    starts, however fast it is. Returns the killed head's record."""
    env = {**sandbox_env(work), "OTBFLOW_FAULT": "train:before-outputs:sleep"}
    first = subprocess.Popen(command, shell=True, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    wait_for(lambda: train_log.is_file() or first.poll() is not None, timeout=600, what="the train job")
    assert first.poll() is None, first.stdout.read().decode()[-3000:]
    (record,) = (work / ".snakemake" / H.RECORDS).glob("*.json")
    dead = H.Head(**json.loads(record.read_text()))
    os.kill(dead.pid, signal.SIGKILL)  # Snakemake itself (the shell waits for it)
    first.wait()
    return dead


@pytest.mark.slow
@pytest.mark.xdist_group("workflow")
def test_the_tiny_workflow_continues_after_kill_9(tiny_run, tmp_path):
    """The tiny run's iteration 1 again, from its rollouts: Snakemake killed with kill -9 once the
    train job has started (rollouts, features and advantages done), then the same command stops
    that orphaned train job and finishes with the policy of the uninterrupted tiny run, bitwise."""
    work = make_sandbox(tmp_path / "work")
    for name in ("results", ".snakemake"):
        shutil.copytree(
            tiny_run / name, work / name, symlinks=True, ignore=shutil.ignore_patterns("locks", "incomplete")
        )
    want = folder_digest(tiny_run / "results/iter_1/train/policy")
    for stage in ("rollout", "features", "advantages", "train"):
        shutil.rmtree(work / "results/iter_1" / stage)
    train_log = work / "results/logs/train/iter_1.log"
    train_log.unlink()
    command = "snakemake results/iter_1/train/policy --cores 2 --configfile config/tiny.yaml < /dev/null"
    start = time.perf_counter()
    dead = start_train_and_kill(command, work, train_log)
    assert H.marked_processes({dead.id}), "the train job of a killed Snakemake runs on"
    killed_at = time.perf_counter() - start
    res = subprocess.run(command, shell=True, cwd=work, env=sandbox_env(work), capture_output=True, text=True)
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-5000:]
    assert "is gone" in log and "stopping the processes" in log and "rule train" in log, log[-3000:]
    assert folder_digest(work / "results/iter_1/train/policy") == want
    print(f"killed after {killed_at:.0f} s, continued in {time.perf_counter() - start - killed_at:.0f} s")
