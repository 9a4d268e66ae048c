"""Stage jobs handed to warm workers: the folder protocol and the rule-side client.

A worker (``otbflow worker KIND --results DIR``, ``otbflow.ops.worker``) is a long-running process that
runs one kind of stage job after another in its own process, keeping what the next job needs
(imports, the policy, the generation engine, the DeepSpeed engine and its AdamW state). A rule's
job starts the client (``python -m otbflow.ops.dispatch``): it hands the job to a live worker of its
kind (and, for a train job of several processes, of as many ranks) and waits for it, or, with none,
runs the stage in its own process as before (``os.execvp`` of ``python -m otbflow STAGE ...``, under
the ``launcher`` of several processes where it has them: the same command, the same outputs). The
client imports no torch and no otbflow module but this one and ``runtime.process`` (a
publish_optimizer client also ``runtime.retention``, whose writer it waits for: ``wait_before``).

The transport is the results folder itself (a shared filesystem reaches every node of a cluster,
and no port is opened): everything lives under ``<results>/.workers/``, a folder of the run's user
alone (folders 0700, files 0600; ``private_dir``), whose writes never follow a link
(``write_json_atomic``, ``open_log``):

- ``secret``: the run's key (created by the first worker, readable by its owner only); every request
  and every registration carries an HMAC-SHA256 of its body with it, and a worker runs no request,
  a client trusts no registration, without a valid one;
- ``<kind>/<worker>/worker.json``: a worker's signed record (host, pid, start, boot, Slurm job, the
  stages it runs and their code versions), its heartbeat ``alive`` (touched every ``HEARTBEAT_S``);
- ``<kind>/queue/<job>.json``: a request waiting; a worker claims it by renaming it into its own
  ``<worker>/running/`` (one rename wins);
- ``<kind>/jobs/<job>/``: the job's ``log`` (the client copies it to its own output, the rule's
  log), the client's heartbeat ``client`` and the worker's answer ``result.json`` (written last);
  the client removes it, and withdraws its request, when it ends;
- ``<kind>/served/<job>``: the ledger of the requests the kind's workers took (one file made
  exclusively per job: a replayed request finds its id there and is refused).

Liveness: a record whose heartbeat is older than ``STALE_S`` is gone (a host rebooted, a worker
killed by ``kill -9``); on the client's own host its pid and start time decide at once. A client
whose claimed job's worker goes stale withdraws the job and runs it itself; a worker whose client
is gone (the rule's job was killed) abandons the job and publishes nothing (``otbflow.io.check_job``).
A request is served only while its client waits for it (its job folder, its client live) and only
once (the ledger); the registrations of dead workers are removed (``Sweeper``). Which stages a kind
runs: ``KINDS``. Docs: docs/workers.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import shlex
import shutil
import stat
import sys
import time
import uuid
from pathlib import Path

from otbflow.runtime.process import HEARTBEAT_S, STALE_S, alive, die_with_parent, here, me, modified, process_start

KINDS = {
    "generate": ("rollout", "evaluate", "variance_pool"),
    "features": ("features", "advantages"),
    "train": ("train", "publish_optimizer", "export"),
}
"""Worker kinds and the stages each runs (one generation engine serves rollouts, evaluations and the
variance pool; the features pass, and the advantages job, which reads what it wrote and would
otherwise start an interpreter of its own on the chain between features and train; the train
update, and the publication of the AdamW state it writes after the job returned). The first stage
of a kind is the one whose resources size its Slurm worker jobs
(``otbflow.ops.workerjobs.STAGE_OF_KIND``)."""

KIND_OF = {stage: kind for kind, stages in KINDS.items() for stage in stages}
FOLDER = ".workers"
POLL_S = 0.05
"""How often a waiting client and an idle worker look at the folder."""
CLAIM_S = 30.0
"""A request no live worker has claimed after this long is withdrawn and run by its client."""
WAIT_POLL_S = 2.0
"""How often a client that must wait for a worker (Slurm workers) looks for one."""
TRIES = 3
"""Workers a job is handed to, one after another, when each dies under it (Slurm workers)."""
SWEEP_S = 300.0
"""A registration of another host whose heartbeat kept one modification time this long, by the
sweeping worker's own clock, is removed (``Sweeper``): far longer than a shared filesystem caches a
file's attributes (NFS: 60 s at most by default), so a live worker elsewhere is never swept."""
REQUEST_MAX_BYTES = 1 << 20
"""A request file larger than this is malformed (refused unread)."""


class DispatchError(RuntimeError):
    """A request that cannot be made or served (no secret, a bad signature, an unknown stage)."""


# ------------------------------------------------------------------------------------------
# The folder and its records
# ------------------------------------------------------------------------------------------


def root(results: str | Path) -> Path:
    return Path(results).resolve() / FOLDER


def private_dir(path: Path) -> Path:
    """``path``, a folder of this user's alone (mode 0700), made where absent (its parent must
    exist). A link or another user's folder there is refused (DispatchError): what a process writes
    under ``.workers/`` stays in the results folder, and no one else reads a request or a log."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise DispatchError(f"{path}: not a folder of this user's (a link, a file or another user's folder)")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)  # made by an older version, or under another umask
    return path


def kind_dir(results: str | Path, kind: str) -> Path:
    """``<results>/.workers/<kind>/`` with its ``queue``, ``jobs`` and ``served`` folders, private."""
    Path(results).resolve().mkdir(parents=True, exist_ok=True)
    base = private_dir(private_dir(root(results)) / kind)
    for name in ("queue", "jobs", "served"):
        private_dir(base / name)
    return base


def secret(results: str | Path, create: bool = False) -> bytes | None:
    """The run's key: ``<results>/.workers/secret`` (32 random bytes, hex, mode 0600). ``create``:
    made when absent (workers do; clients only read it). None when absent."""
    path = root(results) / "secret"
    if create and not path.exists():
        Path(results).resolve().mkdir(parents=True, exist_ok=True)
        private_dir(path.parent)
        tmp = path.with_name(f".secret.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        try:
            os.link(tmp, path)  # only one of two workers starting at once creates it
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if st.st_mode & 0o077 or not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        raise DispatchError(f"{path}: not a file of this user's alone (mode {st.st_mode & 0o777:o}); it must be 0600")
    return path.read_text().strip().encode()


def sign(key: bytes, body: dict) -> str:
    return hmac.new(key, canonical(body), hashlib.sha256).hexdigest()


def canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def signed(key: bytes, body: dict) -> dict:
    return {**body, "mac": sign(key, body)}


def verify(key: bytes, record: dict) -> dict:
    """The body of a request or registration when its signature is the key's, else DispatchError."""
    if not isinstance(record, dict):
        raise DispatchError("not a JSON object")
    body = {k: v for k, v in record.items() if k != "mac"}
    if not hmac.compare_digest(str(record.get("mac", "")), sign(key, body)):
        raise DispatchError("its signature does not match the run's secret")
    return body


def open_folder(path: Path) -> int:
    """A descriptor of the folder ``path``, opened without following a link there (OSError else)."""
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)


def write_json_atomic(path: Path, data: dict) -> None:
    """``data`` as the file ``path`` (mode 0600) in one rename, never through a link: neither the
    file nor its folder may be one (the folders above are ``private_dir``s)."""
    folder = open_folder(path.parent)
    tmp = f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=folder)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f)
            os.replace(tmp, path.name, src_dir_fd=folder, dst_dir_fd=folder)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=folder)
            raise
    finally:
        os.close(folder)


def open_log(path: Path):
    """The job log ``path`` opened to append (made 0600), never through a link (OSError else)."""
    folder = open_folder(path.parent)
    try:
        fd = os.open(path.name, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600, dir_fd=folder)
    finally:
        os.close(folder)
    return os.fdopen(fd, "a")


def read_record(path: Path) -> dict:
    """A request or registration file (JSON, at most REQUEST_MAX_BYTES), not through a link."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        data = f.read(REQUEST_MAX_BYTES + 1)
    if len(data) > REQUEST_MAX_BYTES:
        raise DispatchError(f"larger than {REQUEST_MAX_BYTES} bytes")
    return json.loads(data)


def touch(path: Path) -> None:
    """Make the heartbeat ``path`` (0600) or renew its modification time, never through a link."""
    try:
        os.utime(path, follow_symlinks=False)
    except FileNotFoundError:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600))


def registration(folder: Path, key: bytes) -> dict | None:
    """The record of the worker registered in ``folder`` when it is signed with ``key`` (None: no
    record, or one unsigned, forged or half-removed)."""
    try:
        return verify(key, read_record(folder / "worker.json"))
    except (OSError, ValueError, DispatchError):
        return None


def worker_alive(folder: Path, key: bytes) -> bool:
    """Whether the worker registered in ``folder`` runs (a folder it removed when it ended, or a
    registration not signed with the run's key: no)."""
    info = registration(folder, key)
    return info is not None and alive(info, folder / "alive")


def live_workers(results: str | Path, kind: str, key: bytes | None = None) -> list[Path]:
    """The folders of the live workers of ``kind`` (stale and unsigned registrations ignored);
    ``key``: the run's secret (read when not given; none: no worker)."""
    key = key or secret(results)
    if key is None:
        return []
    found = sorted((root(results) / kind).glob("*/worker.json"))
    return [record.parent for record in found if worker_alive(record.parent, key)]


class Sweeper:
    """Removes the registrations of a kind's dead workers (run by its workers while idle). One on
    this host whose process is gone goes at once; one of another host (or one unsigned) once its
    heartbeat file kept one modification time for ``SWEEP_S`` by this process's own clock and is
    stale: never from one look at a clock of another node, or at attributes a shared filesystem
    cached."""

    SKIP = ("queue", "jobs", "served")

    def __init__(self, base: Path, key: bytes, own: Path | None = None):
        self.base, self.key, self.own = base, key, own
        self.seen: dict[str, tuple[float | None, float]] = {}  # folder -> (heartbeat mtime, since when)

    def sweep(self, now: float | None = None) -> list[Path]:
        """Remove what is dead now; the folders removed. ``now``: this process's monotonic clock."""
        now = time.monotonic() if now is None else now
        removed, present = [], set()
        for folder in sorted(self.base.iterdir()):
            if folder.name in self.SKIP or folder == self.own:
                continue
            present.add(folder.name)
            if self.dead(folder, now):
                if folder.is_symlink() or not folder.is_dir():
                    folder.unlink(missing_ok=True)
                else:
                    shutil.rmtree(folder, ignore_errors=True)
                self.seen.pop(folder.name, None)
                removed.append(folder)
        self.seen = {name: seen for name, seen in self.seen.items() if name in present}
        return removed

    def dead(self, folder: Path, now: float) -> bool:
        info = registration(folder, self.key)
        if info is not None and here(info):
            return process_start(int(info["pid"])) != info.get("start")
        beat = modified(folder / "alive")
        if beat is not None and time.time() - beat < STALE_S:
            self.seen.pop(folder.name, None)
            return False
        mtime, since = self.seen.get(folder.name, (None, None))
        if since is None or mtime != beat:
            self.seen[folder.name] = (beat, now)
            return False
        return now - since >= SWEEP_S


# ------------------------------------------------------------------------------------------
# The client: one rule's job
# ------------------------------------------------------------------------------------------


class Client:
    """Hand one stage job to a worker of its kind and wait for it (``run``)."""

    def __init__(
        self, results: str | Path, stage: str, code: str, argv: list[str], threads: str | None = None, tasks: int = 1
    ):
        """``threads``: the job's torch threads (default: OTBFLOW_THREADS of this process);
        ``tasks``: its processes (a train job's DeepSpeed ranks): a worker of as many ranks runs it."""
        self.results, self.stage, self.code, self.argv = Path(results), stage, code, list(argv)
        self.threads, self.tasks = threads, tasks
        self.kind = KIND_OF[stage]
        self.id = uuid.uuid4().hex
        self.base = root(results) / self.kind
        self.job = self.base / "jobs" / self.id

    def request(self, key: bytes) -> dict:
        body = {
            "id": self.id,
            "stage": self.stage,
            "code": self.code,
            "argv": self.argv,
            "tasks": self.tasks,
            "cwd": os.getcwd(),
            "threads": self.threads if self.threads is not None else os.environ.get("OTBFLOW_THREADS", ""),
            "client": me(),
            "created": time.time(),
        }
        return signed(key, body)

    def run(self, out=sys.stdout) -> int | None:
        """The job's exit code once a worker ran it; None where no worker did (none is live, none
        claimed it in ``CLAIM_S``, its worker went stale or refused it): the caller runs it itself."""
        key = secret(self.results)
        if key is None or not live_workers(self.results, self.kind, key):
            return None
        outcome, value = self.attempt(key, out, claim_s=CLAIM_S)
        if outcome == "done":
            return value
        print(f"otbflow dispatch: {value}: running the job here", file=out)
        return None

    def run_on_worker(self, wait_s: float, out=sys.stdout) -> int:
        """The job's exit code, run by a worker and never here (the workers are Slurm jobs of the
        run, this client a local job of the head): waits up to ``wait_s`` for a live worker (its
        job pending in the queue); a job whose worker is gone is handed to the next one, up to
        ``TRIES`` times. 1 with the reason where no worker ran it."""
        deadline, said, tries = time.time() + wait_s, False, 0
        while True:
            key = secret(self.results)
            if key is None or not live_workers(self.results, self.kind, key):
                if time.time() > deadline:
                    print(
                        f"otbflow dispatch: no {self.kind} worker started in {wait_s / 60:.0f} min "
                        "(workers.wait_min): the job is not run",
                        file=out,
                    )
                    return 1
                if not said:
                    print(f"otbflow dispatch: waiting for a {self.kind} worker (its Slurm job is queued)", file=out)
                    out.flush()
                    said = True
                time.sleep(WAIT_POLL_S)
                continue
            outcome, value = self.attempt(key, out, claim_s=None, deadline=deadline)
            if outcome == "done":
                return value
            tries += 1
            if outcome != "gone" or tries >= TRIES:
                print(f"otbflow dispatch: {value}: the job is not run (after {tries} worker(s))", file=out)
                return 1
            print(f"otbflow dispatch: {value}: the job goes to the next worker", file=out)
            self.id = uuid.uuid4().hex
            self.job = self.base / "jobs" / self.id

    def attempt(self, key: bytes, out, claim_s: float | None, deadline: float | None = None) -> tuple[str, object]:
        """Post the request and follow it: ("done", exit code) once its worker answered, else
        (why, a sentence): "refused" (another code version), "unclaimed" (no worker took it in
        ``claim_s``, or before ``deadline``) or "gone" (its worker died); the request is withdrawn
        then (a worker checks it before it publishes) and the job's folder removed. However it
        ends (an answer, an interruption, an error), the request is withdrawn and the folder removed:
        no request of a client that is gone stays queued."""
        kind_dir(self.results, self.kind)
        self.job.mkdir(mode=0o700)
        heartbeat = self.job / "client"
        touch(heartbeat)
        queued = self.base / "queue" / f"{self.id}.json"
        write_json_atomic(queued, self.request(key))
        log = self.job / "log"
        offset, started, beat, worker = 0, time.time(), 0.0, None
        try:
            while True:
                now = time.time()
                if now - beat >= HEARTBEAT_S:
                    touch(heartbeat)
                    beat = now
                offset = copy_new(log, offset, out)
                result = self.job / "result.json"
                if result.exists():
                    answer = json.loads(result.read_text())
                    copy_new(log, offset, out)
                    if answer.get("status") == "refused":  # another code version, or not its stage
                        return "refused", f"the worker refused the job ({answer.get('error')})"
                    return "done", int(answer.get("exit", 1))
                if worker is None:
                    worker = next(iter(self.base.glob(f"*/running/{self.id}.json")), None)
                    late = (claim_s is not None and now - started > claim_s) or (
                        deadline is not None and now > deadline
                    )
                    if worker is None and late and self.withdraw(queued):
                        return "unclaimed", "no worker took the job in time"
                elif not worker_alive(worker.parents[1], key):
                    # the worker answers before it removes the request: without an answer it is gone
                    if self.withdraw(worker) or not result.exists():
                        return "gone", f"the worker {worker.parents[1].name} is gone"
                time.sleep(POLL_S)
        finally:
            self.withdraw(queued)
            for claimed in self.base.glob(f"*/running/{self.id}.json"):
                self.withdraw(claimed)  # the worker abandons it
            out.flush()
            shutil.rmtree(self.job, ignore_errors=True)

    @staticmethod
    def withdraw(path: Path) -> bool:
        """Take the request back (the worker checks it before it publishes): whether it was there."""
        try:
            path.unlink()
            return True
        except FileNotFoundError:
            return False


def copy_new(path: Path, offset: int, out) -> int:
    """Write what ``path`` gained since ``offset`` to ``out``; the new offset."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return offset
    if data:
        out.write(data.decode(errors="replace"))
        out.flush()
    return offset + len(data)


def launcher(tasks: int, cpus_per_task: int, python: str = sys.executable) -> list[str]:
    """The words that start ``tasks`` copies of the command that follows them (none for one): srun
    inside a Slurm job (``otbflow.training.distributed`` maps SLURM_PROCID/LOCALID/NTASKS to ranks), torchrun
    on this machine otherwise. Decided when the job runs, so the command is the same under every
    executor. A ``bash -c`` script that receives the command as its arguments ("$@"): the command's
    quoted words reach srun or torchrun as they are. Used by this client where it runs a job itself
    and by ``otbflow worker --tasks``."""
    if tasks == 1:
        return []
    srun = f"srun --ntasks={tasks} --cpus-per-task={cpus_per_task} --kill-on-bad-exit=1"
    torchrun = f"{shlex.quote(python)} -m torch.distributed.run --standalone --nproc_per_node={tasks} --no-python"
    script = f'if [ -n "${{SLURM_JOB_ID:-}}" ]; then exec {srun} "$@"; else exec {torchrun} "$@"; fi'
    return ["bash", "-c", script, "launch"]


@contextlib.contextmanager
def exit_on_signals():
    """SIGTERM and SIGHUP (Snakemake stopping its jobs, a closed terminal) end the client as SIGINT
    does, through its ``finally`` (the request withdrawn), with the signal's exit status; the
    default handlers again after it (the stage's CLI, exec'd, sets its own)."""
    import signal

    def leave(signum, _frame):
        raise SystemExit(128 + signum)

    saved = {sig: signal.signal(sig, leave) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


OPTIONS = ("--results", "--code", "--wait-min", "--threads", "--tasks", "--cpus-per-task")


def wait_before(stage: str, argv: list[str]) -> None:
    """What a job would only wait for once on its worker, waited for here first, so that the
    worker stays free: a publish_optimizer job, for the AdamW state that the train worker is still
    writing in the background (``--pending``; ``otbflow.runtime.retention.wait_for_writer``), which
    would otherwise hold the train worker, and the next train job behind it, until the write ends."""
    if stage == "publish_optimizer" and "--pending" in argv[:-1]:
        from otbflow.runtime.retention import wait_for_writer

        wait_for_writer(argv[argv.index("--pending") + 1])


def main(argv: list[str] | None = None) -> int:
    """``python -m otbflow.ops.dispatch --results DIR --code VERSION [--tasks T --cpus-per-task C]
    [--wait-min M --threads N] STAGE [stage arguments]``: the job on a worker (of T ranks), or in
    this process where none runs it: exec of ``python -m otbflow STAGE ...``, under the ``launcher``
    of T processes of C threads where T > 1. With ``--wait-min`` (workers.slurm: this is a local
    job of the head) the job only ever runs on a worker, waiting up to M minutes for one, with N
    threads."""
    args = list(sys.argv[1:] if argv is None else argv)
    opts = {}
    while args and args[0] in OPTIONS:
        opts[args[0][2:]] = args[1]
        args = args[2:]
    stage, rest = args[0].replace("-", "_"), args[1:]
    tasks = int(opts.get("tasks", 1))
    die_with_parent()
    wait_before(stage, rest)
    if stage in KIND_OF and "results" in opts:
        client = Client(opts["results"], stage, opts.get("code", ""), rest, threads=opts.get("threads"), tasks=tasks)
        with exit_on_signals():
            if "wait-min" in opts:
                return client.run_on_worker(float(opts["wait-min"]) * 60)
            code = client.run()
        if code is not None:
            return code
    sys.stdout.flush()
    command = [*launcher(tasks, int(opts.get("cpus-per-task", 1))), sys.executable, "-m", "otbflow", args[0], *rest]
    os.execvp(command[0], command)
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
