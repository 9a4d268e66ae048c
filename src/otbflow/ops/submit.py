"""otbflow submit: run the workflow on Slurm from a small, long-running head job.

The head job (1 CPU, 2 GB, submitted with submitit) runs this repository's Snakefile with
``--workflow-profile slurm`` in the folder ``otbflow submit`` was called from (its ``results/``
and ``logs/submit/`` go there); Snakemake then submits every stage as its own Slurm job with the
resources its rule asks for. Arguments after ``--`` go to Snakemake unchanged.

Before its time limit (``--requeue-before`` seconds; on preemption too) the head job requeues
itself: it stops Snakemake with SIGKILL, so that the stage jobs in flight are not cancelled, and
its next run takes over as after any killed head (``otbflow.ops.head``: those jobs are cancelled and
waited for, their outputs redone). The same command continues a head job that was killed.

  otbflow submit                                  # the whole workflow
  otbflow submit --rerun advantages -- --config 'advantages={estimator: grpo}'
  otbflow submit --until rollout --partition long --account my_project
  otbflow submit --group-iterations               # one Slurm job per iteration for features, advantages, train
  otbflow submit --workers                        # warm workers as Slurm jobs of the run (docs/workers.md)
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from otbflow.ops.head import HEAD_JOB
from otbflow.ops.jobgroups import ITERATION_GROUPS, groups_args
from otbflow.runtime.process import process_stat

REPO = Path(__file__).resolve().parents[3]
SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--rerun",
        metavar="STAGE",
        nargs="+",
        default=[],
        help="run these stages again and everything after them (snakemake --forcerun)",
    )
    p.add_argument("--until", metavar="STAGE", help="stop after this stage (snakemake --until)")
    p.add_argument(
        "--group-iterations",
        action="store_true",
        help=f"fewer queued jobs: one Slurm job per iteration for its {', '.join(ITERATION_GROUPS)} jobs, run one "
        "after another (snakemake --groups; the rollouts stay their own jobs; README: Fewer queued jobs)",
    )
    p.add_argument(
        "--workers",
        action="store_true",
        help="start warm stage workers as Slurm jobs of the run (workers.slurm: true; sized from resources, "
        "counts in the workers section; docs/workers.md); the stages they run become cheap local jobs of the head",
    )
    p.add_argument("--configfile", nargs="+", default=[], help="config YAML(s) layered over config/config.yaml")
    p.add_argument("--profile", default="slurm", help="workflow profile folder (default: %(default)s)")
    p.add_argument("--partition", help="Slurm partition of the head job")
    p.add_argument("--account", help="Slurm account of the head job")
    p.add_argument("--time", type=int, default=3 * 24 * 60, help="head job time limit, minutes (default: 3 days)")
    p.add_argument(
        "--requeue-before",
        type=int,
        default=120,
        metavar="SECONDS",
        help="the head job requeues itself this long before its time limit (Slurm signals it up to 60 s "
        "earlier still; default: %(default)s)",
    )
    p.add_argument(
        "--max-requeues",
        type=int,
        default=30,
        help="time limits the head job may requeue itself at (default: %(default)s, 90 days of 3-day limits)",
    )
    p.add_argument("--logs", default="logs/submit", help="folder of the head job's logs (default: %(default)s)")
    p.add_argument(
        "snakemake_args",
        nargs="*",
        metavar="-- SNAKEMAKE_ARGS",
        help="passed to snakemake, e.g. -- --config 'advantages={estimator: grpo}' --dry-run",
    )


def profile_path(profile: str) -> str:
    """A profile folder as given (relative to the working folder), else this repository's."""
    return profile if Path(profile).is_dir() or not (REPO / profile).is_dir() else str(REPO / profile)


WORKERS_CONFIG = "workers={slurm: true}"


def snakemake_command(ns: argparse.Namespace) -> list[str]:
    # the passthrough first: its targets must not follow an option that takes several values
    passthrough = list(ns.snakemake_args)
    if getattr(ns, "workers", False):
        # one --config (Snakemake keeps the last one given): into the user's, else its own after them
        given = [i for i, a in enumerate(passthrough) if a in ("--config", "-C")]
        if given:
            passthrough.insert(given[-1] + 1, WORKERS_CONFIG)
        else:
            passthrough += ["--config", WORKERS_CONFIG]
    cmd = [SNAKEMAKE, *passthrough, "-s", str(REPO / "Snakefile"), "--workflow-profile", profile_path(ns.profile)]
    if ns.group_iterations:
        cmd += groups_args()
    if ns.configfile:
        cmd += ["--configfile", *(str(Path(c).resolve()) for c in ns.configfile)]
    if ns.rerun:
        cmd += ["--forcerun", *ns.rerun]
    if ns.until:
        cmd += ["--until", ns.until]
    return cmd


class Head:
    """What the head job runs: Snakemake, in a subprocess, until it returns. submitit checkpoints
    a callable with a ``checkpoint`` method when Slurm signals the job (USR2, ``--requeue-before``
    seconds before its time limit, or on preemption) and requeues the job: ``checkpoint`` stops
    Snakemake with SIGKILL first, not SIGTERM, on which Snakemake would cancel its stage jobs;
    the requeued run then takes over from it (``otbflow.ops.head``)."""

    def __init__(self, cmd: list[str], cwd: str):
        self.cmd, self.cwd = cmd, cwd
        self.proc: subprocess.Popen | None = None

    def __getstate__(self) -> dict:
        return {"cmd": self.cmd, "cwd": self.cwd, "proc": None}

    def __call__(self) -> int:
        """Snakemake without the job's SLURM_* variables (it submits independent jobs, not steps of
        this one), told the head job's id (HEAD_JOB) instead."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env[HEAD_JOB] = os.environ.get("SLURM_JOB_ID", "")
        print("+", shlex.join(self.cmd), flush=True)
        self.proc = subprocess.Popen(self.cmd, cwd=self.cwd, env=env, stdin=subprocess.DEVNULL)
        returncode = self.proc.wait()
        if returncode != 0:
            raise RuntimeError(f"snakemake exited with {returncode}")
        return returncode

    def checkpoint(self):
        """Called by submitit's signal handler, which interrupted ``__call__``'s wait for Snakemake
        (holding the Popen's wait lock: no ``wait`` or ``poll`` here); returns the requeued run."""
        from submitit.helpers import DelayedSubmission

        if self.proc is not None and self.proc.returncode is None:  # not yet reaped: its pid is its own
            print("otbflow: the head job is requeued: Snakemake stopped (SIGKILL), its jobs run on", flush=True)
            stop_now(self.proc.pid)
        return DelayedSubmission(Head(self.cmd, self.cwd))


def stop_now(pid: int, timeout_s: float = 30) -> None:
    """SIGKILL a child process and wait until it has died (a zombie: nobody reaps it here)."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while (stat := process_stat(pid)) and stat[0] not in "ZX" and time.monotonic() < deadline:
        time.sleep(0.1)


def submit(ns: argparse.Namespace):
    """Submit the head job; returns the submitit Job (``job.result()`` waits for it)."""
    import submitit

    executor = submitit.AutoExecutor(
        folder=Path(ns.logs).resolve() / "%j", cluster="slurm", slurm_max_num_timeout=ns.max_requeues
    )
    executor.update_parameters(
        name="otbflow-head",
        timeout_min=ns.time,
        slurm_signal_delay_s=ns.requeue_before,
        cpus_per_task=1,
        mem_gb=2,
        slurm_partition=ns.partition,
        slurm_account=ns.account,
    )
    return executor.submit(Head(snakemake_command(ns), os.getcwd()))


def main(ns: argparse.Namespace) -> int:
    if ns.workers and ns.group_iterations:
        print(
            "otbflow submit: --workers and --group-iterations: the stages the workers run are the head's "
            "local jobs, nothing to group; use one or the other",
            file=sys.stderr,
        )
        return 2
    job = submit(ns)
    # the commands it prints are quoted, to be pasted into a shell as they are
    print(f"submitted the head job {job.job_id}: {shlex.join(snakemake_command(ns))}")
    print(f"  head log:    {job.paths.stdout}  (errors: {job.paths.stderr})")
    print(f"  job logs:    {os.getcwd()}/.snakemake/slurm_logs/ and the stage logs under results/logs/")
    print(f"  follow it:   tail -f {shlex.quote(str(job.paths.stdout))}")
    print(f"  its jobs:    squeue --me   (stop: scancel {job.job_id})")
    return 0
