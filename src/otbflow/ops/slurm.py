"""What Slurm and Snakemake's markers say about a results folder's jobs, and cancelling them.

Snakemake marks each output of a started job incomplete until it has seen the job finish
(``.snakemake/incomplete/``, one JSON file per output, named by its base64-encoded path, holding
the Slurm job id of a submitted job: ``incomplete_outputs``). A results folder's stage jobs are
named ``otbflow-<hash of the results folder>_...`` (``jobname_prefix``), so that they are found by
name too, a marker or not. ``squeue`` asks Slurm about this user's jobs; ``stop_slurm_jobs``
cancels jobs with scancel and waits until they have left the queue. ``otbflow.ops.head`` stops a
gone head's jobs with these; ``otbflow.ops.workerjobs`` watches the worker jobs with them.

No torch, and no otbflow module: the Snakefile imports this when it is parsed.
"""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import time
from pathlib import Path
from typing import Callable

# Slurm states of a job whose processes may still run; any other state, or none, is gone.
RUNNING = {"RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT", "RESIZING"}
# ... and of a job that may still start (a stage job from a gone head is cancelled in both).
QUEUED = RUNNING | {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "PREEMPTED"}

Log = Callable[[str], None]


class HeadError(RuntimeError):
    """The gone head's jobs could not be stopped, or Slurm could not be asked."""


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
