"""The head: the Snakemake process that runs a folder's workflow, and what it leaves behind when it
is killed.

Snakemake locks the folder while it runs (``.snakemake/locks/``) and marks each output of a started
job incomplete until it has seen the job finish (``.snakemake/incomplete/``, one JSON file per
output, named by its base64-encoded path, holding the Slurm job id of a submitted job). A head
killed by ``kill -9``, a node failure or its head job's requeue leaves both, and its jobs run on;
Snakemake's next start then stops (LockException, IncompleteFilesException) until ``--unlock``
and ``--rerun-incomplete``, which are only safe once those jobs are gone. ``guard``
(``otbflow.ops.guard``, called by the Snakefile when it is parsed) lets the same command continue
instead:

- every real run (not a dry run, ``--touch``, ``--nolock``, ``--lint`` or a job's own Snakemake)
  records itself in ``.snakemake/otbflow-heads/<id>.json`` (pid, host, the process's start, the
  Slurm job id of a head job, the job-name prefix of its stage jobs) and removes that record
  when Snakemake returns; the processes of its local jobs carry its id (``OTBFLOW_HEAD``);
- a recorded head is gone when its process is: on the same host its pid (with the process's start
  time, against pid reuse), on another host its Slurm job, no longer running (a requeued head job's
  new run is not its previous run); a head on another host without a Slurm job cannot be told
  gone: it counts as alive;
- one head per results folder, which it holds from before its first job until Snakemake returns;
  a gone holder's hold is taken over (``otbflow.ops.results_lock``);
- while a recorded head is alive nothing is touched: Snakemake's lock decides;
- otherwise the gone heads' jobs are stopped before anything is redone: Slurm jobs by the ids in
  the incomplete markers and by name (stage jobs are named ``otbflow-<hash of the results
  folder>_...``) with scancel, the head waiting until they have left the queue, and local
  processes by their mark (SIGTERM, then SIGKILL); then the gone heads' locks are removed, and
  Snakemake redoes the incomplete outputs (``--rerun-incomplete``). Cancelled, not waited for:
  their outputs are redone either way (never adopted: a cluster job's own Snakemake leaves the
  markers to the head, ``keep_incomplete_markers``), and a cancelled train job resumes from its
  checkpoint, where one that ran to its end would start over.

Slurm and Snakemake's markers are read, and Slurm jobs cancelled, by ``otbflow.ops.slurm``.

No torch, and no otbflow module but ``otbflow.ops.slurm`` and the standard-library
``otbflow.runtime.process``: the Snakefile imports this when it is parsed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from otbflow.ops.slurm import RUNNING, HeadError, Log, incomplete_jobs, queued_jobs, slurm_state, stop_slurm_jobs
from otbflow.runtime.process import boot_id, process_stat

MARK = "OTBFLOW_HEAD"  # environment variable: the id of the head that started a process
HEAD_JOB = "OTBFLOW_HEAD_JOB_ID"  # the head job's Slurm id (otbflow submit drops SLURM_* for Snakemake)
RECORDS = "otbflow-heads"  # under .snakemake/


@dataclass
class Head:
    id: str
    pid: int
    host: str
    boot: str  # /proc/sys/kernel/random/boot_id: a pid and start time are those of one boot
    start: int  # the process's start, clock ticks after boot (/proc/<pid>/stat field 22)
    slurm_job: str | None  # the Slurm job the head runs in (otbflow submit's head job)
    jobname_prefix: str | None  # its stage jobs' Slurm names start with this and "_"
    started: str  # wall clock, for people
    argv: list[str]
    workdir: str = ""  # its working folder (where its .snakemake is); "" in records written before it

    def describe(self) -> str:
        job = f", Slurm job {self.slurm_job}" if self.slurm_job else ""
        return f"pid {self.pid} on {self.host}{job}, started {self.started}"


def this_process(jobname_prefix: str | None = None, argv: list[str] | None = None, workdir: str = "") -> Head:
    pid = os.getpid()
    stat = process_stat(pid)
    host = socket.gethostname()
    start = stat[2] if stat else 0
    return Head(
        id=f"{host}-{pid}-{start}",
        pid=pid,
        host=host,
        boot=boot_id(),
        start=start,
        slurm_job=os.environ.get(HEAD_JOB) or os.environ.get("SLURM_JOB_ID") or None,
        jobname_prefix=jobname_prefix,
        started=time.strftime("%Y-%m-%d %H:%M:%S"),
        argv=list(argv or []),
        workdir=workdir,
    )


def is_gone(head: Head, me: Head, wait_s: float = 120) -> bool | None:
    """Whether a recorded head's process has ended; None when that cannot be told (another host
    without a Slurm job, or Slurm not answering)."""
    if head.host == me.host:
        if head.boot != me.boot:
            return True  # the host rebooted since
        stat = process_stat(head.pid)
        return stat is None or stat[0] in "ZX" or stat[2] != head.start
    if not head.slurm_job:
        return None
    if head.slurm_job == me.slurm_job:
        return True  # the previous run of this (requeued) head job
    deadline = time.monotonic() + wait_s
    while True:
        try:
            state = slurm_state(head.slurm_job)
        except HeadError:
            return None
        if state != "COMPLETING" or time.monotonic() > deadline:
            return state not in RUNNING
        time.sleep(2)


def marked_processes(ids: set[str]) -> list[int]:
    """Processes of this host whose environment carries one of the head ids (their local jobs),
    less this process and its ancestors."""
    keep, pid = set(), os.getpid()
    while pid > 1 and pid not in keep:
        keep.add(pid)
        stat = process_stat(pid)
        pid = stat[1] if stat else 0
    marks = {f"{MARK}={i}".encode() for i in ids}
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in keep:
            continue
        try:
            environ = set((entry / "environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if environ & marks:
            found.append(int(entry.name))
    return found


def stop_processes(pids: list[int], log: Log, grace_s: float = 10) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``; returns once they have all ended."""
    log(f"otbflow: stopping the processes {' '.join(map(str, pids))} that the gone head started")
    starts = {pid: process_stat(pid) for pid in pids}

    def alive() -> list[int]:
        out = []
        for pid, before in starts.items():
            now = process_stat(pid)
            if before and now and now[2] == before[2] and now[0] not in "ZX":
                out.append(pid)
        return out

    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 60)):
        for pid in alive():
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + wait
        while alive() and time.monotonic() < deadline:
            time.sleep(0.2)
    if left := alive():
        raise HeadError(f"the processes {left} did not end after SIGKILL")


def stop_jobs(gone: list[Head], snakemake_dir: Path, me: Head, log: Log) -> None:
    """Stop what the gone heads started: the Slurm jobs in the incomplete markers of their working
    folder's ``snakemake_dir`` and those named for the results folder, then the local processes
    that carry their mark. Called once no other head is alive: a job named for the folder is a gone
    head's, even one whose record is lost (a head killed while it took over, after forgetting the
    records)."""
    jobs = set(incomplete_jobs(snakemake_dir).values())
    prefixes = {h.jobname_prefix for h in [*gone, me] if h.jobname_prefix}
    if jobs or prefixes:
        try:
            queued = queued_jobs(jobs, prefixes)
        except HeadError as e:
            raise HeadError(f"cannot tell whether the Slurm jobs of a gone head still run: {e}") from e
        if queued:  # first: their processes carry the mark too (sbatch --export=ALL)
            stop_slurm_jobs(queued, log)
    if pids := marked_processes({h.id for h in gone}):
        stop_processes(pids, log)


class Folder:
    """The head records of one working folder (its ``.snakemake``)."""

    def __init__(self, snakemake_dir: Path):
        self.root = Path(snakemake_dir)
        self.records = self.root / RECORDS

    def heads(self) -> list[Head]:
        out = []
        for path in sorted(self.records.glob("*.json")) if self.records.is_dir() else ():
            try:
                out.append(Head(**json.loads(path.read_text())))
            except (OSError, ValueError, TypeError):
                continue  # half-written by a head killed while it wrote: it never ran a job
        return out

    def record(self, head: Head) -> None:
        self.records.mkdir(parents=True, exist_ok=True)
        tmp = self.records / f".{head.id}.json.tmp"
        tmp.write_text(json.dumps(asdict(head), indent=1))
        tmp.replace(self.records / f"{head.id}.json")

    def forget(self, head: Head) -> None:
        (self.records / f"{head.id}.json").unlink(missing_ok=True)

    def forget_all(self) -> None:
        shutil.rmtree(self.records, ignore_errors=True)

    def alive(self, me: Head, log: Log | None = None) -> list[Head]:
        """The recorded heads other than ``me`` that run, or may run (asks, changes nothing)."""
        alive = []
        for head in self.heads():
            if head.id != me.id and not (gone := is_gone(head, me)):
                if log:
                    how = "runs" if gone is False else "may still run (it cannot be asked from here)"
                    log(f"otbflow: the head {head.describe()} {how}: its locks stay (snakemake --unlock clears them)")
                alive.append(head)
        return alive

    def take_over(self, me: Head, log: Log) -> bool:
        """Stop the jobs of this folder's gone heads and remove their locks, then record ``me``.
        Returns whether no other head is alive: then every incomplete output is a gone head's
        and is redone."""
        if alive := self.alive(me, log):
            self.record(me)
            return False
        gone = [h for h in self.heads() if h.id != me.id]
        for head in gone:
            log(f"otbflow: the head {head.describe()} is gone: its jobs are stopped, their outputs redone")
        stop_jobs(gone, self.root, me, log)
        if gone:
            shutil.rmtree(self.root / "locks", ignore_errors=True)
        for head in gone:
            self.forget(head)
        self.record(me)
        return not alive
