"""A warm worker: ``otbflow worker KIND --results DIR`` runs the stage jobs of one kind (``generate``:
rollout, evaluate and the variance pool; ``features``; ``train``) that the rules of the run in
``DIR`` hand it (``otbflow.ops.dispatch``), one after another, in this one process, keeping what the
next job needs (``otbflow.runtime.resident``): the imports, the policy, the DeepSpeed engine and its AdamW
state. A job runs exactly as ``otbflow STAGE ...`` would run it in its own process (the same
code, the same arguments, the same thread count): the outputs are the same. A train worker of
several processes (``--tasks N``, for train jobs of N DeepSpeed ranks) is N such processes started
by the train jobs' launcher: rank 0 serves, and hands each train job to the others (``Ranks``).

What a worker checks before it runs a request: its signature (the run's secret) and form, that no
worker of its kind took that request before (the ledger ``served/``: a replayed copy is refused),
that its client still waits for it (its job folder, a real folder, and its client live), that its
stage is one of the worker's kind, that the rule expects the code version the worker has loaded
(else it refuses and the client runs the job itself), that a train job has as many processes as
the worker has ranks, and the stage's own arguments and inputs, as every job does. Nothing a
request holds ends the worker: a request it cannot serve, or an I/O error of one job (its log, its
answer), ends that job and the worker takes the next. While a job runs, a thread keeps the
worker's heartbeat and watches the client: a client that is gone (its rule's job was killed) or
withdrew the job makes the worker abandon it, and nothing is published after that
(``otbflow.io.check_job``); the resident state of a job that failed or was abandoned is dropped.
While idle, it removes the registrations of dead workers of its kind (``Worker.tidy``). Docs:
docs/workers.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import logging
import os
import re
import shutil
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from otbflow.ops import dispatch
from otbflow.runtime import process, resident

log = logging.getLogger("otbflow.ops.worker")


class JobAbandoned(BaseException):
    """Raised in the worker's main thread when the job's client is gone or withdrew the job."""


class Stopped(BaseException):
    """SIGTERM (scancel, the run's end): the worker ends; a job it runs is not answered, so that its
    client, seeing the worker gone, hands it on or runs it itself (never taken for a finished job)."""


def stopped(*_) -> None:
    raise Stopped


class Worker:
    """One worker of ``kind`` for the run whose results folder is ``results``."""

    def __init__(
        self,
        kind: str,
        results: str | Path,
        run_stage,
        idle_exit_s: float = 0.0,
        max_jobs: int = 0,
        retire_after_s: float = 0.0,
        ranks: Ranks | None = None,
    ):
        """``run_stage(argv) -> exit code`` runs one stage command in this process (the CLI's);
        ``retire_after_s``: no new job after this long (a Slurm worker before its time limit);
        ``ranks``: the other ranks of a worker of several processes (this one is rank 0)."""
        if kind not in dispatch.KINDS:
            raise ValueError(f"unknown worker kind {kind!r}: one of {', '.join(dispatch.KINDS)}")
        from otbflow.runtime.codeversion import code_version

        self.kind, self.results, self.run_stage = kind, Path(results).resolve(), run_stage
        self.idle_exit_s, self.max_jobs, self.retire_after_s = idle_exit_s, max_jobs, retire_after_s
        self.key = dispatch.secret(self.results, create=True)
        self.base = dispatch.root(self.results) / kind
        self.me = process.me()
        self.id = f"{self.me['host']}-{self.me['pid']}-{self.me['start']}"
        self.folder = self.base / self.id
        self.sweeper = dispatch.Sweeper(self.base, self.key, own=self.folder)
        self.swept_at = 0.0
        self.ledger_gone: dict[str, float] = {}  # served ids whose job folder is gone -> since (own clock)
        self.codes = {stage: code_version(stage) for stage in dispatch.KINDS[kind]}
        self.job: dict | None = None
        self.abandoned: str | None = None
        self.main_thread = threading.get_ident()
        self.stop = threading.Event()
        self.lock = threading.Lock()  # the job's start and end against the heartbeat's abandoning it
        self.jobs_done = 0
        self.ranks = ranks
        self.tasks = ranks.world_size if ranks is not None else 1
        self.failed: str | None = None  # why a worker of several ranks ends (a rank's job failed)

    # --- registration and heartbeat ---------------------------------------------------------

    def register(self) -> None:
        dispatch.kind_dir(self.results, self.kind)
        dispatch.private_dir(dispatch.private_dir(self.folder) / "running")
        dispatch.touch(self.folder / "alive")
        resident.HEARTBEAT = str(self.folder / "alive")
        record = {
            **self.me,
            "kind": self.kind,
            "stages": list(dispatch.KINDS[self.kind]),
            "codes": self.codes,
            "tasks": self.tasks,
            "slurm_job": os.environ.get("SLURM_JOB_ID"),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        dispatch.write_json_atomic(self.folder / "worker.json", dispatch.signed(self.key, record))
        self.tidy()
        log.info("worker %s (%s: %s) serves %s", self.id, self.kind, ", ".join(dispatch.KINDS[self.kind]), self.results)

    def unregister(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)

    def heartbeat(self) -> None:
        """Touch ``alive`` every HEARTBEAT_S; abandon the job whose client is gone or withdrew it."""
        while not self.stop.wait(process.HEARTBEAT_S):
            with contextlib.suppress(OSError):
                dispatch.touch(self.folder / "alive")
            with self.lock:
                job = self.job
                try:
                    reason = self.unwanted(job) if job is not None and self.abandoned is None else None
                except OSError as e:  # a shared filesystem's hiccup: the next beat looks again
                    log.warning("job %s: its client could not be checked: %s", job["id"], e)
                    reason = None
                if reason:
                    self.abandoned = reason
                    log.warning("job %s abandoned: %s", job["id"], reason)
                    raise_in(self.main_thread, JobAbandoned)

    def unwanted(self, job: dict) -> str | None:
        """Why ``job`` is no longer wanted (its client is gone, it withdrew it), or None."""
        if not (self.folder / "running" / f"{job['id']}.json").exists():
            return "its client withdrew it"
        if not (self.base / "jobs" / job["id"]).is_dir():
            return "its client withdrew it (its job folder is gone)"
        if not process.alive(job["client"], self.base / "jobs" / job["id"] / "client"):
            return "its client is gone (the rule's job was killed)"
        return None

    def tidy(self) -> None:
        """Sweep the kind's dead registrations (``dispatch.Sweeper``) and forget the served ids whose
        job folder has been gone for ``SWEEP_S`` by this worker's clock (a copy of such a request
        finds no folder, and is refused for that); every ``TIDY_S`` at most."""
        now = time.monotonic()
        if now - self.swept_at < TIDY_S:
            return
        self.swept_at = now
        try:
            for folder in self.sweeper.sweep(now):
                log.info("removed the registration of a dead worker: %s", folder.name)
            served = {p.name for p in (self.base / "served").iterdir()}
            jobs = {p.name for p in (self.base / "jobs").iterdir()}
            self.ledger_gone = {i: self.ledger_gone.get(i, now) for i in served - jobs}
            for job_id, since in self.ledger_gone.items():
                if now - since >= dispatch.SWEEP_S:
                    (self.base / "served" / job_id).unlink(missing_ok=True)
        except OSError as e:  # a shared filesystem's hiccup: the next round tries again
            log.warning("the sweep of %s failed: %s", self.base, e)

    # --- the loop -------------------------------------------------------------------------------

    def claim(self) -> Path | None:
        """The oldest queued request, renamed into this worker's ``running/`` (one claimer wins)."""
        waiting = []
        for path in (self.base / "queue").glob("*.json"):
            with contextlib.suppress(OSError):  # withdrawn meanwhile
                waiting.append((path.lstat().st_mtime, path))
        for _, path in sorted(waiting):
            mine = self.folder / "running" / path.name
            try:
                os.rename(path, mine)
            except FileNotFoundError:
                continue  # another worker took it
            return mine
        return None

    def serve(self) -> None:
        self.register()
        beat = threading.Thread(target=self.heartbeat, name="heartbeat", daemon=True)
        beat.start()
        idle_since = started = time.time()
        try:
            while not (self.max_jobs and self.jobs_done >= self.max_jobs) and not self.failed:
                if self.retire_after_s and time.time() - started > self.retire_after_s:
                    log.info("%.0f s since its start: the worker takes no new job and ends", self.retire_after_s)
                    break
                mine = self.claim()
                if mine is None:
                    self.tidy()
                    if self.idle_exit_s and time.time() - idle_since > self.idle_exit_s:
                        log.info("idle for %.0f s: the worker ends", self.idle_exit_s)
                        break
                    time.sleep(dispatch.POLL_S)
                    continue
                self.handle(mine)
                self.jobs_done += 1
                idle_since = time.time()
        finally:
            resident.join_writes()  # an AdamW state written in the background: registered until it is
            # a train engine's state not yet written (otbflow.runtime.adamw), before the job after
            # (which waits while this worker is registered) looks for it
            resident.retire()
            self.stop.set()
            self.unregister()
            if self.ranks is not None:
                self.ranks.stop()  # the other ranks end too (once this one answered its last client)

    def handle(self, mine: Path) -> None:
        """Serve the claimed request ``mine``, or refuse it; nothing it holds ends the worker (a
        job's failure is its answer; an error of the request, logged, ends it unanswered)."""
        try:
            body = self.admit(mine)
            if body is not None:
                job_dir = self.base / "jobs" / body["id"]
                answer = self.refusal(body) or self.execute(body, job_dir)
                try:
                    dispatch.write_json_atomic(job_dir / "result.json", answer)
                except OSError as e:  # its client withdrew it meanwhile (an abandoned job), a full disk
                    log.warning("job %s: no answer written: %s", body["id"], e)
        except Exception as e:  # never the worker's end: the next request is served
            log.exception("%s: dropped: %s", mine.name, e)
        finally:
            mine.unlink(missing_ok=True)

    def admit(self, mine: Path) -> dict | None:
        """The body of the request ``mine`` when it may be served; None (the reason logged) for one
        not signed with the run's secret or malformed, one served before (a replayed copy), one
        whose client no longer waits for it (its job folder gone, or a link; its client gone)."""
        try:
            body = dispatch.verify(self.key, dispatch.read_record(mine))
            malformed(body)
        except (OSError, ValueError, dispatch.DispatchError) as e:
            log.error("%s: refused, not run: %s", mine.name, e)
            return None
        try:  # the ledger: one file per id, made exclusively, whichever worker of the kind claims it
            os.close(os.open(self.base / "served" / body["id"], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except FileExistsError:
            log.error("%s: refused, not run: served before (a replayed request)", mine.name)
            return None
        job_dir = self.base / "jobs" / body["id"]
        try:
            os.close(dispatch.open_folder(job_dir))
        except OSError as e:
            why = "its job folder is gone (its client withdrew it)" if isinstance(e, FileNotFoundError) else e
            log.error("%s: refused, not run: %s", mine.name, why)
            return None
        if not process.alive(body["client"], job_dir / "client"):
            log.error("%s: refused, not run: its client is gone", mine.name)
            return None
        return body

    def refusal(self, body: dict) -> dict | None:
        stage = body["stage"]
        if stage not in dispatch.KINDS[self.kind]:
            return {"status": "refused", "error": f"a {self.kind} worker does not run {stage}"}
        if stage in ALL_RANKS and int(body.get("tasks", 1)) != self.tasks:
            return {
                "status": "refused",
                "error": f"the job runs {stage} in {body.get('tasks', 1)} process(es), this worker has {self.tasks}",
            }
        if body["code"] != self.codes[stage]:
            return {
                "status": "refused",
                "error": f"the rule expects {stage}'s code version {body['code']}, this worker runs "
                f"{self.codes[stage]} (the code changed since it started: restart it)",
            }
        return None

    def execute(self, body: dict, job_dir: Path) -> dict:
        """Run the job in this process as ``otbflow STAGE ARGV`` would run it (a train job on every
        rank of a worker of several); its log goes to ``job_dir/log``."""
        from otbflow import io as otbflow_io

        with self.lock:
            self.job, self.abandoned = body, None
        otbflow_io.WANTED[:] = [lambda: self.abandoned or self.unwanted(body)]
        everyone = self.ranks is not None and body["stage"] in ALL_RANKS
        status, code, error = "failed", 1, ""
        try:
            try:
                if everyone:
                    self.ranks.post({**body, "log": str(job_dir / "log")})
                status, code, error = run_job(self.run_stage, body, job_dir / "log", f"worker {self.id}")
                if everyone and status == "ok":
                    status, code, error = self.ranks.outcome()
            except JobAbandoned:
                status, error = "abandoned", self.abandoned or "abandoned"
        except JobAbandoned:  # delivered between the job's end and here
            status, error = "abandoned", self.abandoned or "abandoned"
        finally:
            with self.lock:
                self.job = None
                if self.abandoned:  # an interruption raised but not yet delivered goes unused
                    raise_in(self.main_thread, None)
                    status, error = "abandoned", self.abandoned
            otbflow_io.WANTED[:] = []
        if status != "ok":
            if everyone or self.ranks is None:  # the other ranks keep theirs: all ranks hold the same
                resident.drop()  # a failed or abandoned job's state is not trusted
            log.warning("job %s (%s) %s%s", body["id"], body["stage"], status, f": {error}" if error else "")
            if everyone:  # its ranks may wait in a collective for each other: the worker ends
                self.failed = f"job {body['id']} ({body['stage']}) {status}"
        else:
            log.info("job %s (%s) done", body["id"], body["stage"])
        return {"status": status, "exit": code if status != "abandoned" else 1, "error": error}


TIDY_S = 2.0
"""How often an idle worker sweeps dead registrations and the ledger (``Worker.tidy``)."""

REQUEST_FIELDS = {"id": str, "stage": str, "code": str, "argv": list, "cwd": str, "threads": str, "client": dict}
"""The fields every request has, and their types (``dispatch.Client.request``)."""


def malformed(body: dict) -> None:
    """DispatchError when ``body`` lacks a field of a request or holds one of another form."""
    for name, kind in REQUEST_FIELDS.items():
        if not isinstance(body.get(name), kind):
            raise dispatch.DispatchError(f"malformed request: {name} is {body.get(name)!r}")
    if not re.fullmatch(r"[0-9a-f]{32}", body["id"]):
        raise dispatch.DispatchError(f"malformed job id {body['id']!r}")
    if not all(isinstance(a, str) for a in body["argv"]) or not isinstance(body.get("tasks", 1), int):
        raise dispatch.DispatchError("malformed request: its arguments are not strings, or its tasks not a number")
    client = body["client"]
    forms = {"host": (str,), "pid": (int,), "start": (int, type(None)), "boot": (str,)}
    if not all(isinstance(client.get(name, ...), form) for name, form in forms.items()):
        raise dispatch.DispatchError(f"malformed request: its client is {client!r}")


ALL_RANKS = ("train",)
"""The stages whose jobs every rank of a worker of several processes runs (DeepSpeed's collectives);
rank 0 runs the others (publish_optimizer) alone."""

RANK_WAIT_S = 600.0
"""How long rank 0 waits for the other ranks' outcome of a job it finished."""
ACK_WAIT_S = 30.0
"""How long a rank whose job failed waits for rank 0 to answer the client and stop the ranks (and
rank 0, stopping them, for each to say it ends)."""


class Ranks:
    """The other ranks of a worker of several processes (``otbflow worker train --tasks N``), seen
    from rank 0, through the store of their launcher's rendezvous (``distributed.init_worker_group``):
    each job it runs on every rank goes to them as ``job/<n>`` (its JSON text; a stop ends them),
    and each rank answers ``done/<n>/<rank>``. JSON text only, between the worker's own processes."""

    def __init__(self, store, world_size: int):
        self.store, self.world_size, self.n = store, world_size, 0

    def post(self, body: dict) -> None:
        self.n += 1
        self.store.set(f"job/{self.n}", json.dumps(body))

    def stop(self) -> None:
        """End the other ranks: a stop, then a short wait for each to say so (under srun this
        process holds the store; were it gone first, a rank would end with an error)."""
        with contextlib.suppress(Exception):  # the store may be gone with the other ranks
            self.post({"stop": True})
            wait_for_keys(self.store, [f"bye/{rank}" for rank in range(1, self.world_size)], ACK_WAIT_S)

    def outcome(self) -> tuple[str, int, str]:
        """("ok", 0, "") once every other rank finished job ``n`` well; the first failure else."""
        keys = [f"done/{self.n}/{rank}" for rank in range(1, self.world_size)]
        if not wait_for_keys(self.store, keys, RANK_WAIT_S):
            return "failed", 1, f"the other ranks did not finish the job in {RANK_WAIT_S:.0f} s"
        for rank, key in enumerate(keys, start=1):
            answer = json.loads(self.store.get(key))
            if answer["status"] != "ok":
                return "failed", int(answer.get("exit") or 1), f"rank {rank}: {answer.get('error') or 'failed'}"
        return "ok", 0, ""


def wait_for_keys(store, keys: list[str], timeout_s: float | None = None) -> bool:
    """Whether every key of ``keys`` is in the ranks' store within ``timeout_s`` (None: no limit);
    polled, so that a worker's heartbeat and signals run meanwhile."""
    end = None if timeout_s is None else time.time() + timeout_s
    while not store.check(keys):
        if end is not None and time.time() > end:
            return False
        time.sleep(dispatch.POLL_S)
    return True


def follow(store, rank: int, run_stage) -> int:
    """Rank ``rank`` > 0 of a worker of several processes: run each job rank 0 hands out (``Ranks``)
    until it stops them. After a job that failed here the process ends (exit 1) once rank 0 has
    answered the client and stopped the ranks, or after ``ACK_WAIT_S`` (rank 0 may wait in a
    collective for this rank: the launcher, torchrun or srun --kill-on-bad-exit, then ends it)."""
    n = 0
    while True:
        n += 1
        key = f"job/{n}"
        wait_for_keys(store, [key])  # raises once rank 0's store is gone
        body = json.loads(store.get(key))
        if body.get("stop"):
            log.info("rank %d: rank 0 ended the worker", rank)
            store.set(f"bye/{rank}", "")
            return 0
        status, code, error = run_job(run_stage, body, Path(body["log"]), f"rank {rank}")
        store.set(f"done/{n}/{rank}", json.dumps({"status": status, "exit": code, "error": error}))
        if status != "ok":
            log.error("rank %d: job %s failed (%s): the worker ends", rank, body["id"], error or f"exit {code}")
            with contextlib.suppress(Exception):
                wait_for_keys(store, [f"job/{n + 1}"], ACK_WAIT_S)
                store.set(f"bye/{rank}", "")
            sys.stdout.flush()
            os._exit(1)


def run_job(run_stage, body: dict, log_path: Path, who: str) -> tuple[str, int, str]:
    """Run ``body``'s stage in this process as ``otbflow STAGE ARGV`` would (its working folder, its
    threads), its output appended to ``log_path``: ("ok" or "failed", exit code, error). A job's
    exception is its failure, its traceback in its log; JobAbandoned goes through."""
    import torch

    import otbflow

    threads = body.get("threads") or ""
    env = {"OTBFLOW_THREADS": threads} if threads else {}
    code, error = 1, ""
    cwd = os.getcwd()
    try:
        with dispatch.open_log(log_path) as stream, OUTPUT.to(stream):
            try:
                os.chdir(body["cwd"])
                with environment(env):
                    if not threads:
                        torch.set_num_threads(DEFAULT_THREADS)
                    otbflow.STARTED_AT = time.time()
                    log.info("%s runs %s (job %s)", who, body["stage"], body["id"])
                    try:
                        code = run_stage([body["stage"].replace("_", "-"), *body["argv"]])
                    except SystemExit as e:  # argparse
                        code = e.code if isinstance(e.code, int) else 2
            except Exception as e:  # the job failed: its traceback into its log, the worker goes on
                traceback.print_exc()
                error = f"{type(e).__name__}: {e}"
    except OSError as e:  # its log (a folder gone, a link, a full disk): the job ends, the worker goes on
        log.error("job %s: its log %s: %s", body["id"], log_path, e)
        code, error = 1, f"{type(e).__name__}: {e}"
    finally:
        os.chdir(cwd)
    return ("ok" if code == 0 and not error else "failed"), code, error


class Output(io.TextIOBase):
    """The worker's standard output and error for its whole life: what is written goes to the
    worker's own stream and, while a job runs, to the job's log too. Installed once, before anything
    is imported, so that a library that keeps a reference to ``sys.stdout`` (vLLM's log handler,
    the root logger's) writes to the job that runs, never to a closed file of an earlier one."""

    def __init__(self, own):
        self.own, self.job = own, None

    @contextlib.contextmanager
    def to(self, stream):
        self.job = stream
        try:
            yield
        finally:
            self.flush()
            self.job = None

    def write(self, text: str) -> int:
        self.own.write(text)
        if self.job is not None:
            self.job.write(text)
        return len(text)

    def flush(self) -> None:
        self.own.flush()
        if self.job is not None:
            self.job.flush()

    def fileno(self) -> int:
        return self.own.fileno()

    def isatty(self) -> bool:
        return False

    def writable(self) -> bool:
        return True


OUTPUT = Output(sys.stdout)


def raise_in(thread_id: int, exc: type[BaseException] | None) -> None:
    """Raise ``exc`` in the thread ``thread_id`` at its next Python instruction (None: clear one
    pending there)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc is not None else None
    )


DEFAULT_THREADS = 0
"""torch's thread count when the worker started: a job without OTBFLOW_THREADS runs with it, as a
fresh process would."""


WARM_UP = {"generate": ("transformers.generation",), "features": (), "train": ("deepspeed",)}
"""Modules a kind's jobs import lazily (inside the functions that need them), imported before the
worker registers, so that its first job starts warm too."""


def warm_up(kind: str) -> None:
    """Import the stage modules of ``kind`` and what their jobs import lazily (``WARM_UP``)."""
    import importlib

    from otbflow.pipeline import STAGES

    start = time.perf_counter()
    for name in (*(STAGES[s].module for s in dispatch.KINDS[kind]), "transformers", *WARM_UP[kind]):
        importlib.import_module(name)
    log.info("imports of the %s stages done in %.1f s", kind, time.perf_counter() - start)


@contextlib.contextmanager
def environment(values: dict[str, str]):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main(
    kind: str,
    results: str,
    run_stage,
    idle_exit_s: float = 0.0,
    max_jobs: int = 0,
    retire_after_s: float = 0.0,
    tasks: int = 1,
) -> int:
    """``otbflow worker``: serve until stopped (SIGTERM, SIGINT), idle for ``idle_exit_s``,
    ``max_jobs`` jobs done or ``retire_after_s`` after its start; its registration goes with it.
    ``run_stage`` is the CLI's (the CLI imports this module, not the other way round). ``tasks`` >
    1: this process is one rank of a train worker of that many, started by the launcher (the CLI
    starts it): rank 0 serves, the others follow it; 1 where a rank's job failed."""
    global DEFAULT_THREADS
    OUTPUT.own = sys.stderr  # the worker's own log; its standard output goes there too
    sys.stdout = sys.stderr = OUTPUT
    import torch

    root = logging.getLogger()
    for handler in root.handlers[:]:  # the CLI's, on the stream before Output
        root.removeHandler(handler)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    DEFAULT_THREADS = torch.get_num_threads()
    resident.enable(dispatch.secret(results, create=True))  # the key that the policy manifests' MACs use
    warm_up(kind)
    signal.signal(signal.SIGTERM, stopped)
    ranks = None
    try:
        if tasks > 1:
            from otbflow.training.distributed import init_worker_group

            rank, world_size, store = init_worker_group()
            if world_size != tasks:
                raise RuntimeError(f"the launcher started {world_size} ranks, the worker was asked for {tasks}")
            if rank > 0:
                return follow(store, rank, run_stage)
            ranks = Ranks(store, world_size)
        worker = Worker(kind, results, run_stage, idle_exit_s, max_jobs, retire_after_s, ranks)
        worker.serve()
    except Stopped:
        log.info("SIGTERM: the worker ends")
        return 0
    if worker.failed:
        log.error("%s: the worker of %d ranks ends", worker.failed, tasks)
        return 1
    return 0
