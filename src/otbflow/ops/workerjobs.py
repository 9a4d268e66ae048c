"""Warm workers as Slurm jobs of a run (``workers.slurm``; ``otbflow submit --workers``).

The head (the Snakemake process, or the head job that runs it) keeps ``workers.<kind>`` worker jobs
queued or running for each kind whose stages the run hands to workers (``Supervisor``, a thread
started by the Snakefile's ``onstart``): it submits them with ``sbatch`` (the script on standard
input, no file to plant), checks them every ``EVERY_S`` with ``squeue`` and submits a new one for
each that left the queue (time limit, preemption, a node lost, ``scancel``), and cancels them when
Snakemake returns (``onsuccess``/``onerror``). A worker job is named ``<the folder's job-name
prefix>_worker-<kind>``, so that a new head cancels a killed head's workers as it cancels its stage
jobs (``otbflow.ops.head``, by name: ``otbflow.ops.slurm``). Each is sized from ``resources`` of
its stage (rollout's for the generation workers; GPUs, CPUs, memory) with the site's partition,
account, GPU model and extra flags of that rule in the profile (default-resources, set-resources).
No torch, no otbflow imports but ``otbflow.ops.slurm`` and ``otbflow.ops.dispatch``'s table of
worker kinds (the Snakefile imports this when it is parsed).
"""

from __future__ import annotations

import shlex
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from otbflow.ops.dispatch import KINDS
from otbflow.ops.slurm import QUEUED, HeadError, jobname_prefix, squeue

EVERY_S = 15.0
"""How often the head looks at its worker jobs."""
STAGE_OF_KIND = {kind: stages[0] for kind, stages in KINDS.items()}
"""The stage whose resources size a kind's worker job, the first it runs (``dispatch.KINDS``;
generation workers: the rollout's)."""
SITE_KEYS = ("slurm_partition", "slurm_account", "gpu_model", "gres", "constraint", "qos", "slurm_extra")
"""The profile's per-rule Slurm settings a worker job takes from its stage's rule."""


def job_name(results: str | Path, kind: str) -> str:
    return f"{jobname_prefix(results)}_worker-{kind}"


@dataclass
class WorkerJob:
    """How to start the worker jobs of one kind."""

    kind: str
    count: int
    sbatch: list[str]  # sbatch's options
    script: str  # the batch script, given on standard input
    log_dir: Path  # where its Slurm log goes (made before the first submission)


def sbatch_options(results: str | Path, kind: str, res, site: dict, time_min: int, log_dir: Path) -> list[str]:
    """sbatch's options for a worker job of ``kind``: ``res`` the stage's resources (``gpu``,
    ``cpus_per_gpu``, ``threads`` or ``cpus_per_task``, ``mem_mb``; a train stage's ``tasks`` and
    ``nodes``: one rank per task, one per GPU), ``site`` the profile's settings of the stage's rule
    (SITE_KEYS)."""
    tasks = int(getattr(res, "tasks", 1))
    out = [
        f"--job-name={job_name(results, kind)}",
        f"--output={log_dir}/{kind}-%j.log",
        f"--time={time_min}",
        f"--mem={res.mem_mb}M",
        f"--nodes={getattr(res, 'nodes', 1)}",
        f"--ntasks={tasks}",
    ]
    gpu = int(getattr(res, "gpu", 0) or 0)
    if gpu and tasks > 1:
        out.append("--ntasks-per-gpu=1")
    if gpu and site.get("gres"):
        out.append(f"--gres={site['gres']}")
    elif gpu:
        model = site.get("gpu_model")
        out += [f"--gpus={model}:{gpu}" if model else f"--gpus={gpu}", f"--cpus-per-gpu={res.cpus_per_gpu}"]
    if not gpu:
        threads = getattr(res, "threads", None) or getattr(res, "cpus_per_task", 1)
        out.append(f"--cpus-per-task={threads}")
    for key, flag in (("slurm_partition", "partition"), ("slurm_account", "account"), ("constraint", "constraint")):
        if site.get(key):
            out.append(f"--{flag}={site[key]}")
    if site.get("qos"):
        out.append(f"--qos={site['qos']}")
    if site.get("slurm_extra"):
        out += shlex.split(str(site["slurm_extra"]))
    return out


def script(
    python: str,
    src: str,
    kind: str,
    results: str | Path,
    idle_exit_s: float,
    retire_after_s: float,
    tasks: int = 1,
    cpus_per_task: int = 1,
) -> str:
    """The worker job's batch script: this checkout's code with the head's interpreter; a worker of
    several ranks (``tasks``) starts them itself (``otbflow worker --tasks``, with srun)."""
    ranks = ["--tasks", str(tasks), "--cpus-per-task", str(cpus_per_task)] if tasks > 1 else []
    command = [
        python,
        "-m",
        "otbflow",
        "worker",
        kind,
        "--results",
        str(Path(results).resolve()),
        "--idle-exit",
        f"{idle_exit_s:g}",
        "--retire-after",
        f"{retire_after_s:g}",
        *ranks,
    ]
    return (
        "#!/bin/bash\n"
        f'export PYTHONPATH={shlex.quote(src)}"${{PYTHONPATH:+:$PYTHONPATH}}"\n'
        f"exec {shlex.join(command)}\n"
    )


def site_settings(workflow, rule: str) -> dict:
    """The profile's SITE_KEYS for ``rule``: set-resources over default-resources, plain values only."""
    rs = workflow.resource_settings
    layers = [getattr(rs, "_parsed_default_resources", None)]
    layers.append(getattr(rs, "_parsed_overwrite_resources", {}).get(rule))
    out = {}
    for layer in layers:
        if not layer:
            continue
        for key in SITE_KEYS:
            try:
                value = layer.get(key).value
            except Exception:  # an unevaluated (per-job) value: not for a worker job
                continue
            if isinstance(value, (str, int)) and value not in ("", None):
                out[key] = str(value).strip("'\"")
    return out


class Supervisor:
    """Keeps each kind's worker jobs queued or running while the run lasts (``start``/``stop``)."""

    def __init__(
        self, results: str | Path, jobs: list[WorkerJob], log: Callable[[str], None], every_s: float = EVERY_S
    ):
        self.results, self.jobs, self.log, self.every_s = Path(results), [j for j in jobs if j.count], log, every_s
        self.known: dict[str, str] = {}  # job id -> kind, of the jobs this head submitted
        self.done = threading.Event()
        self.thread: threading.Thread | None = None

    def queued(self) -> dict[str, list[str]]:
        """The ids of each kind's worker jobs that are queued or running."""
        names = {job_name(self.results, j.kind): j.kind for j in self.jobs}
        out: dict[str, list[str]] = {j.kind: [] for j in self.jobs}
        for job_id, state, name in squeue("%i|%T|%j"):
            if name in names and state in QUEUED:
                out[names[name]].append(job_id)
        return out

    def ensure(self) -> None:
        """Submit the worker jobs that are missing; say which ones left the queue."""
        queued = self.queued()
        listed = {i for ids in queued.values() for i in ids}
        for job_id in [i for i in self.known if i not in listed]:
            self.log(f"otbflow: the {self.known.pop(job_id)} worker job {job_id} left the queue: replaced")
        for job in self.jobs:
            for _ in range(job.count - len(queued[job.kind])):
                job_id = self.submit(job)
                self.known[job_id] = job.kind
                self.log(f"otbflow: submitted the {job.kind} worker job {job_id}")

    @staticmethod
    def submit(job: WorkerJob) -> str:
        cmd = ["sbatch", "--parsable", *job.sbatch]
        res = subprocess.run(cmd, input=job.script, capture_output=True, text=True, timeout=120)
        if res.returncode != 0:
            raise HeadError(f"{shlex.join(cmd)} failed ({res.returncode}): {res.stderr.strip()}")
        return res.stdout.strip().split(";")[0]

    def run(self) -> None:
        while True:
            try:
                self.ensure()
            except (HeadError, OSError, subprocess.SubprocessError) as e:  # Slurm busy: the next round tries again
                self.log(f"otbflow: the worker jobs could not be checked: {e}")
            if self.done.wait(self.every_s):
                return

    def start(self) -> None:
        """The first worker jobs submitted now (a failure stops the run here), then a thread."""
        for job in self.jobs:
            job.log_dir.mkdir(parents=True, exist_ok=True)
        self.ensure()
        self.thread = threading.Thread(target=self.run, name="otbflow-workers", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Stop replacing, and cancel every worker job of this results folder (not waited for)."""
        self.done.set()
        if self.thread is not None:
            self.thread.join(timeout=60)
        try:
            ids = sorted({i for ids in self.queued().values() for i in ids})
        except HeadError as e:
            self.log(f"otbflow: the worker jobs could not be listed to cancel them: {e}")
            return
        if ids:
            subprocess.run(["scancel", *ids], capture_output=True, text=True, stdin=subprocess.DEVNULL)
            self.log(f"otbflow: cancelled the worker jobs {', '.join(ids)}")
