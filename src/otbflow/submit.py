"""otbflow submit: run the workflow on Slurm from a small, long-running head job.

The head job (1 CPU, 2 GB, submitted with submitit) runs this repository's Snakefile with
``--workflow-profile slurm`` in the folder ``otbflow submit`` was called from (its ``results/``
and ``logs/submit/`` go there); Snakemake then submits every stage as its own Slurm job with the
resources its rule asks for. Arguments after ``--`` go to Snakemake unchanged.

  otbflow submit                                  # the whole workflow
  otbflow submit --rerun advantages -- --config 'advantages={estimator: grpo}'
  otbflow submit --until rollout --partition long --account my_project
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
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
    p.add_argument("--configfile", nargs="+", default=[], help="config YAML(s) layered over config/config.yaml")
    p.add_argument("--profile", default="slurm", help="workflow profile folder (default: %(default)s)")
    p.add_argument("--partition", help="Slurm partition of the head job")
    p.add_argument("--account", help="Slurm account of the head job")
    p.add_argument("--time", type=int, default=3 * 24 * 60, help="head job time limit, minutes (default: 3 days)")
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


def snakemake_command(ns: argparse.Namespace) -> list[str]:
    # the passthrough first: its targets must not follow an option that takes several values
    cmd = [SNAKEMAKE, *ns.snakemake_args, "-s", str(REPO / "Snakefile"), "--workflow-profile", profile_path(ns.profile)]
    if ns.configfile:
        cmd += ["--configfile", *(str(Path(c).resolve()) for c in ns.configfile)]
    if ns.rerun:
        cmd += ["--forcerun", *ns.rerun]
    if ns.until:
        cmd += ["--until", ns.until]
    return cmd


def run_head(cmd: list[str], cwd: str) -> int:
    """What the head job runs. Its own SLURM_* variables are dropped: Snakemake submits
    independent jobs, not steps of this one."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    print("+", " ".join(cmd), flush=True)
    returncode = subprocess.run(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL).returncode
    if returncode != 0:
        raise RuntimeError(f"snakemake exited with {returncode}")
    return returncode


def submit(ns: argparse.Namespace):
    """Submit the head job; returns the submitit Job (``job.result()`` waits for it)."""
    import submitit

    executor = submitit.AutoExecutor(folder=Path(ns.logs).resolve() / "%j", cluster="slurm")
    executor.update_parameters(
        name="otbflow-head",
        timeout_min=ns.time,
        cpus_per_task=1,
        mem_gb=2,
        slurm_partition=ns.partition,
        slurm_account=ns.account,
    )
    return executor.submit(run_head, snakemake_command(ns), os.getcwd())


def main(ns: argparse.Namespace) -> int:
    job = submit(ns)
    print(f"submitted the head job {job.job_id}: {' '.join(snakemake_command(ns))}")
    print(f"  head log:    {job.paths.stdout}  (errors: {job.paths.stderr})")
    print(f"  job logs:    {os.getcwd()}/.snakemake/slurm_logs/ and the stage logs under results/logs/")
    print(f"  follow it:   tail -f {job.paths.stdout}")
    print(f"  its jobs:    squeue --me   (stop: scancel {job.job_id})")
    return 0
