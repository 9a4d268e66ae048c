"""The head: the Snakemake process that runs a folder's workflow, and what it leaves behind when it
is killed.

Snakemake locks the folder while it runs (``.snakemake/locks/``) and marks each output of a started
job incomplete until it has seen the job finish (``.snakemake/incomplete/``, one JSON file per
output, named by its base64-encoded path, holding the Slurm job id of a submitted job). A head
killed by ``kill -9``, a node failure or its head job's requeue leaves both, and its jobs run on;
Snakemake's next start then stops (LockException, IncompleteFilesException) until ``--unlock``
and ``--rerun-incomplete``, which are only safe once those jobs are gone. ``guard`` (called by
the Snakefile when it is parsed) lets the same command continue instead:

- every real run (not a dry run, ``--touch``, ``--nolock``, ``--lint`` or a job's own Snakemake)
  records itself in ``.snakemake/otbflow-heads/<id>.json`` (pid, host, the process's start, the
  Slurm job id of a head job, the job-name prefix of its stage jobs) and removes that record
  when Snakemake returns; the processes of its local jobs carry its id (``OTBFLOW_HEAD``);
- a recorded head is gone when its process is: on the same host its pid (with the process's start
  time, against pid reuse), on another host its Slurm job, no longer running (a requeued head job's
  new run is not its previous run); a head on another host without a Slurm job cannot be told
  gone: it counts as alive;
- one head per results folder: a real run also holds ``<results_dir>/.otbflow-head.json`` (its
  record, with its working folder) from before its first job until Snakemake returns. Another
  head on the same results folder, from this working folder or any other, is refused before it
  touches anything, naming the holder; a gone holder's lock is taken over (gone as below), and
  when it ran from another working folder its jobs are stopped and the outputs it had not seen
  finish (its ``.snakemake/incomplete/`` there) are removed so that they are redone;
- while a recorded head is alive nothing is touched: Snakemake's lock decides;
- otherwise the gone heads' jobs are stopped before anything is redone: Slurm jobs by the ids in
  the incomplete markers and by name (stage jobs are named ``otbflow-<hash of the results
  folder>_...``) with scancel, the head waiting until they have left the queue, and local
  processes by their mark (SIGTERM, then SIGKILL); then the gone heads' locks are removed, and
  Snakemake redoes the incomplete outputs (``--rerun-incomplete``). Cancelled, not waited for:
  their outputs are redone either way (never adopted: a cluster job's own Snakemake leaves the
  markers to the head, ``keep_incomplete_markers``), and a cancelled train job resumes from its
  checkpoint, where one that ran to its end would start over.

No torch, and no otbflow module but the standard-library ``otbflow.runtime.process``: the Snakefile
imports this when it is parsed.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from otbflow.runtime.process import boot_id, process_stat

MARK = "OTBFLOW_HEAD"  # environment variable: the id of the head that started a process
HEAD_JOB = "OTBFLOW_HEAD_JOB_ID"  # the head job's Slurm id (otbflow submit drops SLURM_* for Snakemake)
RECORDS = "otbflow-heads"  # under .snakemake/
LOCK = ".otbflow-head.json"  # in the results folder: the head that holds it
# Slurm states of a job whose processes may still run; any other state, or none, is gone.
RUNNING = {"RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT", "RESIZING"}
# ... and of a job that may still start (a stage job from a gone head is cancelled in both).
QUEUED = RUNNING | {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "PREEMPTED"}

Log = Callable[[str], None]


class HeadError(RuntimeError):
    """The gone head's jobs could not be stopped, or Slurm could not be asked."""


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


def jobname_prefix(results_dir: str | Path) -> str:
    """The Slurm job-name prefix of a results folder's stage jobs: stable across heads, distinct
    between folders (a hash of its absolute path)."""
    return "otbflow-" + hashlib.sha256(str(Path(results_dir).resolve()).encode()).hexdigest()[:10]


def squeue(fmt: str) -> list[list[str]]:
    """The rows of ``squeue`` for this user's jobs in every state it still lists, in format ``fmt``
    (fields between '|', the last one may hold '|'); HeadError when Slurm does not answer."""
    cmd = ["squeue", "--me", "--noheader", "--states=all", "--format", fmt]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise HeadError(f"squeue failed: {e}") from e
    if res.returncode != 0:
        raise HeadError(f"squeue failed ({res.returncode}): {res.stderr.strip()}")
    return [line.split("|", fmt.count("|")) for line in res.stdout.splitlines() if line.strip()]


def slurm_state(job: str) -> str | None:
    """The state of a Slurm job, None once squeue no longer lists it."""
    for job_id, state in squeue("%i|%T"):
        if job_id == job:
            return state
    return None


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


def incomplete_outputs(snakemake_dir: Path) -> dict[str, str | None]:
    """{output path: Slurm job id or None} of every output Snakemake marked incomplete (paths as
    the workflow names them: relative to its working folder unless absolute)."""
    out: dict[str, str | None] = {}
    root = Path(snakemake_dir) / "incomplete"
    for path in root.rglob("*") if root.is_dir() else ():
        if not path.is_file() or path.name == "migration_underway":
            continue
        try:
            job = json.loads(path.read_text() or "{}").get("external_jobid")
        except (OSError, ValueError, AttributeError):
            job = None
        parts = path.relative_to(root).parts  # a long name is split in folders "@chunk"
        name = "".join(p.removeprefix("@") for p in parts)
        try:
            out[base64.urlsafe_b64decode(name).decode()] = str(job) if job else None
        except ValueError:
            out[name] = str(job) if job else None
    return out


def incomplete_jobs(snakemake_dir: Path) -> dict[str, str]:
    """{output path: Slurm job id} of the outputs Snakemake marked incomplete with a job id."""
    return {path: job for path, job in incomplete_outputs(snakemake_dir).items() if job}


def queued_jobs(job_ids: set[str], prefixes: set[str]) -> set[str]:
    """The Slurm jobs still queued or running among ``job_ids`` (an array task counts by its array)
    and those named ``<prefix>_...``, as ids that scancel takes (an array's own id)."""
    bases = {j.split("_")[0] for j in job_ids}
    found = set()
    for job_id, array_id, state, name in squeue("%i|%F|%T|%j"):
        if state not in QUEUED:
            continue
        if array_id in bases or job_id in bases or any(name.startswith(p + "_") for p in prefixes):
            found.add(array_id or job_id.split("_")[0])
    return found


def stop_slurm_jobs(jobs: set[str], log: Log, timeout_s: float = 1800) -> None:
    """scancel the jobs, then wait until squeue lists none of them queued or running."""
    log(f"otbflow: cancelling the Slurm jobs {' '.join(sorted(jobs))} and waiting until they have left the queue")
    res = subprocess.run(["scancel", *sorted(jobs)], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if res.returncode != 0:
        log(f"otbflow: scancel: {res.stderr.strip()}")
    deadline = time.monotonic() + timeout_s
    while left := queued_jobs(jobs, set()):
        if time.monotonic() > deadline:
            raise HeadError(f"the Slurm jobs {' '.join(sorted(left))} are still in the queue after {timeout_s:.0f} s")
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


class FolderHeld(HeadError):
    """Another head holds the results folder (it runs, or cannot be told gone)."""


class ResultsLock:
    """One head per results folder: ``<results>/.otbflow-head.json`` holds the record of the head
    that runs on it (whatever its working folder). Created whole in one step (a hard link of a
    written file: never half-written, and only one of two heads creates it); taken over only from a
    holder that ``is_gone``, as the records of ``Folder`` are."""

    def __init__(self, results_dir: str | Path):
        self.folder = Path(results_dir).resolve()
        self.path = self.folder / LOCK

    def holder(self) -> Head | None:
        """The head that holds the folder, None when none does."""
        try:
            return Head(**json.loads(self.path.read_text()))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError) as e:
            raise HeadError(f"the lock {self.path} cannot be read ({e}): remove it once no head runs there") from e

    def refusal(self, holder: Head, gone: bool | None, outcome: str = "nothing was run") -> str:
        """Who holds the folder, and how to free it."""
        how = "runs" if gone is False else "may still run (it cannot be asked from here)"
        where = f" from the working folder {holder.workdir}" if holder.workdir else ""
        return (
            f"otbflow: the results folder {self.folder} is held by the head {holder.describe()}{where}, "
            f"which {how}: one head per results folder, {outcome}. Wait for it to end, or stop it; "
            f"if it is gone, `snakemake --unlock` in its working folder (or removing {self.path}) frees the folder"
        )

    def acquire(self, me: Head, log: Log) -> Head | None:
        """Hold the folder for ``me``; returns the gone holder it was taken over from (None when it
        was free). FolderHeld, having written nothing, when another head holds it and is not gone."""
        taken: Head | None = None
        for _ in range(100):  # another turn when the lock was released or taken over meanwhile
            holder = self.holder()
            if holder is None:
                self.folder.mkdir(parents=True, exist_ok=True)
                tmp = self.folder / f"{LOCK}.{me.id}.tmp"
                tmp.write_text(json.dumps(asdict(me), indent=1))
                try:
                    os.link(tmp, self.path)
                    return taken
                except FileExistsError:
                    continue
                finally:
                    tmp.unlink(missing_ok=True)
            if holder.id == me.id:
                return taken
            gone = is_gone(holder, me)
            if not gone:
                raise FolderHeld(self.refusal(holder, gone))
            log(f"otbflow: the head {holder.describe()} that held {self.folder} is gone: the folder is taken over")
            stale = self.folder / f"{LOCK}.{me.id}.gone"
            try:
                os.rename(self.path, stale)
            except FileNotFoundError:
                continue
            moved = self.holder_at(stale)
            if moved is not None and moved.id != holder.id:  # another head's, taken over meanwhile: put back
                try:
                    os.link(stale, self.path)
                except FileExistsError:
                    pass
            else:
                taken = holder
            stale.unlink(missing_ok=True)
        raise HeadError(f"the lock {self.path} changed hands 100 times while this head tried to take it")

    @staticmethod
    def holder_at(path: Path) -> Head | None:
        try:
            return Head(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def release(self, me: Head) -> None:
        """Free the folder, if ``me`` holds it."""
        holder = self.holder_at(self.path)
        if holder is not None and holder.id == me.id:
            self.path.unlink(missing_ok=True)


def take_over_elsewhere(gone: Head, lock: ResultsLock, me: Head, log: Log) -> None:
    """The results folder was held by a head, now gone, of another working folder: stop its jobs
    (``stop_jobs``, with its folder's incomplete markers) and remove the outputs under the results
    folder that it had not seen finish, so that this head redoes them instead of taking a
    half-written file for a finished one. HeadError when its working folder cannot be read."""
    snakemake_dir = Path(gone.workdir) / ".snakemake"
    if not snakemake_dir.is_dir():
        raise HeadError(
            f"the head {gone.describe()} that held {lock.folder} is gone, but its working folder "
            f"{gone.workdir} has no .snakemake to say which outputs it left unfinished: run the same command "
            f"there, or remove what it was writing and {lock.path}"
        )
    log(f"otbflow: it ran from {gone.workdir}: its jobs are stopped, the outputs it left unfinished redone")
    stop_jobs([gone], snakemake_dir, me, log)
    for name in incomplete_outputs(snakemake_dir):
        path = Path(gone.workdir, name).resolve()
        if path.is_relative_to(lock.folder) and path != lock.path and (path.exists() or path.is_symlink()):
            log(f"otbflow: removing {path} (left unfinished)")
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()


# The Slurm executor (snakemake-executor-plugin-slurm 2.x) submits each job's command line inside
# double quotes (sbatch --wrap="..."), run by a shell: there these characters are shell syntax
# even inside the single quotes the command line puts around each path.
WRAP_SYNTAX = "$`\\"


def wrap_refusal(paths: list[str]) -> str | None:
    """Why the Slurm executor cannot be given jobs whose command lines hold these paths (the
    results folder, the config's input paths), or None. Locally every path is quoted."""
    bad = [p for p in paths if any(c in p for c in WRAP_SYNTAX)]
    if not bad:
        return None
    return (
        f"otbflow: {bad[0]!r} holds a character among {' '.join(WRAP_SYNTAX)}: the Slurm executor passes each "
        'job\'s command line (with its input paths) to sbatch inside double quotes (--wrap="..."), where '
        "the shell would read it as syntax. Nothing was run: rename it (it is quoted everywhere else: such a "
        "path runs locally)"
    )


def run_kind(workflow, executor_plugin) -> str | None:
    """ "head" for a run that executes jobs from this process, "dry" for a dry run, "job" for the
    Snakemake that runs one job inside a cluster job, None for the rest (--touch, --nolock, a
    local subprocess)."""
    from snakemake_interface_executor_plugins.settings import ExecMode

    common = executor_plugin.common_settings
    mode = workflow.workflow_settings.exec_mode
    if mode == ExecMode.REMOTE:
        return "job"
    if mode != ExecMode.DEFAULT or common.touch_exec:
        return None
    if common.dryrun_exec:
        return "dry"
    return "head" if workflow.execution_settings.lock else None


def keep_incomplete_markers(workflow) -> None:
    """In the Snakemake of a cluster job: leave the incomplete markers to the head. That Snakemake
    marks its outputs incomplete again when it starts (without the Slurm id the head recorded)
    and unmarks them when it ends, without writing their metadata (the head does, once it has
    seen the job finish). A job that ends after its head died would otherwise leave its outputs
    looking finished, adopted by the next head unseen; with the markers kept, its Slurm id stays
    readable while it runs, and what no head saw finish is redone."""
    prepare = workflow._prepare_dag

    def prepare_keeping_markers(*args, **kwargs):
        out = prepare(*args, **kwargs)
        persistence = workflow.persistence
        persistence._mark_incomplete = lambda key, external_jobid: None
        persistence._unmark_incomplete = lambda key: None
        return out

    workflow._prepare_dag = prepare_keeping_markers


def guard(workflow, results_dir: str, job_paths: list[str] | tuple[str, ...] = ()) -> None:
    """Make ``workflow`` (the Snakefile's ``workflow``) hold its results folder while it executes,
    and take over from a killed head.

    Wraps ``workflow.execute``: Snakemake reads the folder's locks and incomplete markers there,
    after the Snakefile has been parsed, and only there is it known whether jobs will run (a dry
    run, --touch and a job's own Snakemake parse the same Snakefile). A real run takes the results
    folder's lock (``ResultsLock``) before anything else, and is refused there while another head
    holds it; it frees it when Snakemake returns. A dry run changes nothing and writes nothing: it
    says who holds the results folder, and plans the incomplete outputs as redone where no
    recorded head is alive, as the run would. Also names the Slurm executor's stage jobs
    ``otbflow-<hash>_<run uuid>`` (unless a prefix is set), leaves the incomplete markers to the
    head in a cluster job's own Snakemake (``keep_incomplete_markers``), and makes ``snakemake
    --unlock`` forget the recorded heads and free the results folder held from this working folder.
    Under the Slurm executor, a run whose results folder or ``job_paths`` (the config's input
    paths) its sbatch call would read as shell syntax is refused (``wrap_refusal``)."""
    from snakemake.exceptions import WorkflowError
    from snakemake.logging import logger

    execute, unlock = workflow.execute, workflow.unlock
    prefix = jobname_prefix(results_dir)

    def guarded_execute(*args, **kwargs):
        plugin = kwargs.get("executor_plugin", args[0] if args else None)
        settings = kwargs.get("executor_settings", args[1] if len(args) > 1 else None)
        kind = run_kind(workflow, plugin) if plugin is not None else None
        if kind is None:
            return execute(*args, **kwargs)
        if kind == "job":
            keep_incomplete_markers(workflow)
            return execute(*args, **kwargs)
        folder = Folder(Path(".snakemake").resolve())
        workdir = str(folder.root.parent)
        lock = ResultsLock(results_dir)
        if getattr(settings, "pass_command_as_script", True) is False:  # the Slurm executor's sbatch --wrap
            if refusal := wrap_refusal([str(lock.folder), *map(str, job_paths)]):
                raise WorkflowError(refusal)
        if kind == "dry":
            me = this_process(workdir=workdir)
            if (holder := lock.holder_at(lock.path)) is not None and holder.id != me.id:
                gone = is_gone(holder, me)
                if not gone:
                    logger.info(lock.refusal(holder, gone, outcome="a real run here is refused while it holds it"))
                elif holder.workdir and holder.workdir != workdir:
                    logger.info(
                        f"otbflow: the head {holder.describe()} that held {lock.folder} from {holder.workdir} is "
                        "gone: a real run takes the folder over and redoes the outputs it left unfinished"
                    )
            if not folder.alive(me, logger.info):
                workflow.dag_settings.force_incomplete = True
            return execute(*args, **kwargs)
        named = None
        if settings is not None and hasattr(settings, "jobname_prefix"):  # the Slurm executor
            settings.jobname_prefix = settings.jobname_prefix or prefix
            named = settings.jobname_prefix
        me = this_process(named, argv=sys.argv, workdir=workdir)
        try:
            gone = lock.acquire(me, logger.info)
        except FolderHeld as e:
            raise WorkflowError(str(e)) from None
        try:
            if gone is not None and gone.workdir and gone.workdir != workdir:
                take_over_elsewhere(gone, lock, me, logger.info)
            if folder.take_over(me, logger.info):
                workflow.dag_settings.force_incomplete = True
            os.environ[MARK] = me.id
            try:
                return execute(*args, **kwargs)
            finally:
                folder.forget(me)
        finally:
            lock.release(me)

    def guarded_unlock(*args, **kwargs):
        out = unlock(*args, **kwargs)
        folder = Folder(Path(".snakemake").resolve())
        folder.forget_all()
        lock = ResultsLock(results_dir)
        if (holder := lock.holder_at(lock.path)) is not None:
            if holder.workdir in ("", str(folder.root.parent)):
                lock.path.unlink(missing_ok=True)
                logger.info(f"otbflow: freed the results folder {lock.folder} (held by the head {holder.describe()})")
            else:
                logger.info(
                    f"otbflow: the results folder {lock.folder} is held from another working folder, "
                    f"{holder.workdir} (the head {holder.describe()}): unlock it there"
                )
        return out

    workflow.execute = guarded_execute
    workflow.unlock = guarded_unlock
