"""The sbatch flags of every rule, from the slurm/ profile and the config.

Each job's resources are the ones Snakemake resolves in a dry run with the real profile
(``--workflow-profile``, set-resources, the rules' config-sized resources and runtime callables);
the sbatch command is built from them by the plugin's own code (``get_submit_command`` and
``set_gres_string``, as its executor does). Needs no Slurm.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, TINY

SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))


class Resources(dict):
    """Resolved job resources with the attribute access the plugin uses."""

    __getattr__ = dict.__getitem__


def dry_run_jobs(workdir: Path, profile: Path, *args: str) -> dict[str, tuple[int, Resources]]:
    """rule -> (threads, resources) of the first job of each rule in a dry run."""
    cmd = [
        SNAKEMAKE,
        "-s",
        str(REPO / "Snakefile"),
        "--directory",
        str(workdir),
        "--workflow-profile",
        str(profile),
        "--configfile",
        str(TINY),
        "--slurm-no-account",
        "-n",
        "--cores",
        "64",
        *args,
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    jobs = {}
    for block in re.split(r"\n(?=rule \w+:)", res.stdout):
        m = re.match(r"rule (\w+):", block)
        if not m or m.group(1) in jobs or m.group(1) == "all":
            continue
        threads = re.search(r"^\s+threads: (\d+)", block, re.M)
        resources = Resources()
        for item in re.search(r"^\s+resources: (.*)$", block, re.M).group(1).split(", "):
            key, value = item.split("=", 1)
            resources[key] = int(value) if value.isdigit() else value
        jobs[m.group(1)] = (int(threads.group(1)) if threads else 1, resources)
    return jobs


def sbatch_flags(threads: int, resources: Resources) -> str:
    """The resource part of the plugin's sbatch call for a job."""
    from snakemake_executor_plugin_slurm.submit_string import get_submit_command
    from snakemake_executor_plugin_slurm.utils import set_gres_string

    class Job:  # the two attributes the plugin reads
        pass

    job = Job()
    job.threads, job.resources = threads, resources
    params = {
        "run_uuid": "RUN",
        "slurm_logfile": "LOG",
        "comment_str": "C",
        "account": "",
        "partition": "",
        "workdir": None,
    }
    call = get_submit_command(job, params) + set_gres_string(job)
    return call.split("--comment C", 1)[1].split()


@pytest.fixture(scope="module")
def site_profile(tmp_path_factory):
    """The slurm/ profile with a site's set-resources: a GPU partition, an A100 model, gres."""
    folder = tmp_path_factory.mktemp("profile")
    profile = yaml.safe_load((REPO / "slurm" / "config.yaml").read_text())
    profile["set-resources"] = {
        "rollout": {"slurm_partition": "gpu", "gpu_model": "a100"},
        "train": {"slurm_partition": "gpu", "gpu_model": "a100"},
        "evaluate": {"slurm_partition": "gpu", "gpu": 0, "gres": "gpu:a100:1"},
    }
    (folder / "config.yaml").write_text(yaml.safe_dump(profile))
    return folder


def test_profile_is_commented_and_uses_squeue():
    text = (REPO / "slurm" / "config.yaml").read_text()
    profile = yaml.safe_load(text)
    assert profile["executor"] == "slurm" and profile["slurm-status-command"] == "squeue"
    assert profile["retries"] >= 1 and profile["slurm-array-jobs"] == "rollout"
    lines = text.splitlines()
    for i, line in enumerate(lines):  # every entry has a comment line right above it
        if re.match(r"^[a-z][\w-]*:", line):
            assert lines[i - 1].startswith("#"), f"uncommented profile entry: {line}"


def test_cpu_defaults(tmp_path):
    jobs = dry_run_jobs(tmp_path, REPO / "slurm")
    assert sbatch_flags(*jobs["shard"]) == ["-t", "30", "--mem", "2000", "--ntasks=1", "--cpus-per-task=1"]
    assert sbatch_flags(*jobs["advantages"]) == ["-t", "30", "--mem", "4000", "--ntasks=1", "--cpus-per-task=1"]
    assert sbatch_flags(*jobs["report"]) == ["-t", "15", "--mem", "2000", "--ntasks=1", "--cpus-per-task=1"]
    for rule, minutes in [("rollout", "120"), ("features", "60"), ("evaluate", "60")]:
        assert sbatch_flags(*jobs[rule]) == ["-t", minutes, "--mem", "8000", "--ntasks=1", "--cpus-per-task=1"]
    assert sbatch_flags(*jobs["train"]) == [
        "-t",
        "120",
        "--mem",
        "8000",
        "--nodes=1",
        "--ntasks=1",
        "--cpus-per-task=1",
    ]
    assert "mpi" not in jobs["train"][1]  # one process: the job step runs the command itself


def test_threads_of_a_cpu_job_come_from_the_config(tmp_path):
    """resources.<stage> overrides its stage's defaults key by key: the scaling study takes the
    features' threads and its own memory, the variance pool the rollout's resources."""
    (tmp_path / "threads.yaml").write_text(
        "resources:\n  features: {threads: 4}\n  rollout: {mem_mb: 3000}\n  scaling: {mem_mb: 16000}\n"
    )
    jobs = dry_run_jobs(tmp_path, REPO / "slurm", "--configfile", str(tmp_path / "threads.yaml"))
    assert sbatch_flags(*jobs["features"])[-1] == "--cpus-per-task=4"
    assert sbatch_flags(*jobs["rollout"]) == ["-t", "120", "--mem", "3000", "--ntasks=1", "--cpus-per-task=1"]
    assert sbatch_flags(*jobs["scaling"]) == ["-t", "60", "--mem", "16000", "--ntasks=1", "--cpus-per-task=4"]
    assert sbatch_flags(*jobs["variance_pool"]) == ["-t", "120", "--mem", "3000", "--ntasks=1", "--cpus-per-task=1"]


def test_runtime_grows_with_each_attempt(tmp_path):
    jobs = dry_run_jobs(tmp_path, REPO / "slurm", "--attempt", "3")
    assert jobs["rollout"][1]["runtime"] == 3 * 120 and jobs["shard"][1]["runtime"] == 3 * 30


def test_multi_process_cpu_training(tmp_path):
    (tmp_path / "ranks.yaml").write_text("resources:\n  train: {tasks: 4, nodes: 2, cpus_per_task: 3}\n")
    threads, res = dry_run_jobs(tmp_path, REPO / "slurm", "--configfile", str(TINY), str(tmp_path / "ranks.yaml"))[
        "train"
    ]
    assert res["mpi"] == "srun"  # the command calls srun itself
    assert sbatch_flags(threads, res) == ["-t", "120", "--mem", "8000", "--nodes=2", "--ntasks=4", "--cpus-per-task=3"]


def test_site_gpus_partition_model_and_gres(tmp_path, site_profile):
    (tmp_path / "gpus.yaml").write_text(
        "resources:\n  rollout: {gpu: 1, cpus_per_gpu: 6}\n  train: {gpu: 2, tasks: 2, cpus_per_gpu: 4}\n"
    )
    jobs = dry_run_jobs(tmp_path, site_profile, "--configfile", str(TINY), str(tmp_path / "gpus.yaml"))
    assert jobs["rollout"][1]["slurm_partition"] == "gpu"
    assert sbatch_flags(*jobs["rollout"]) == ["-t", "120", "--mem", "8000", "--cpus-per-gpu=6", "--gpus=a100:1"]
    assert sbatch_flags(*jobs["train"]) == [
        "-t",
        "120",
        "--mem",
        "8000",
        "--nodes=1",
        "--ntasks-per-gpu=1",
        "--ntasks=2",
        "--cpus-per-gpu=4",
        "--gpus=a100:2",
    ]
    assert sbatch_flags(*jobs["evaluate"]) == ["-t", "60", "--mem", "8000", "--cpus-per-gpu=8", "--gres=gpu:a100:1"]
    assert sbatch_flags(*jobs["features"]) == ["-t", "60", "--mem", "8000", "--ntasks=1", "--cpus-per-task=1"]


def test_a_worker_job_is_sized_from_its_stage_and_the_profiles_rule_settings(tmp_path):
    """otbflow submit --workers: a GPU train worker's sbatch options, written out by hand; its batch
    script starts the worker with the results folder as one word, whatever it holds."""
    import shlex
    from types import SimpleNamespace

    from otbflow.ops import slurm, workerjobs

    res = SimpleNamespace(gpu=2, cpus_per_gpu=8, threads=1, mem_mb=64000)
    site = {"slurm_partition": "gpu", "gpu_model": "a100", "slurm_extra": "'--exclusive'"}
    opts = workerjobs.sbatch_options("/r", "train", res, site, 60, Path("/r/logs/workers"))
    assert opts == [
        f"--job-name={slurm.jobname_prefix('/r')}_worker-train",
        "--output=/r/logs/workers/train-%j.log",
        "--time=60",
        "--mem=64000M",
        "--nodes=1",
        "--ntasks=1",
        "--gpus=a100:2",
        "--cpus-per-gpu=8",
        "--partition=gpu",
        "--exclusive",
    ]
    cpu = workerjobs.sbatch_options(
        "/r", "generate", SimpleNamespace(gpu=0, threads=4, mem_mb=8000), {}, 60, Path("/l")
    )
    assert cpu[-1] == "--cpus-per-task=4" and not any(o.startswith("--gpus") for o in cpu)
    odd = tmp_path / "res $(touch X) 'q"
    script = workerjobs.script("/usr/bin/python3", "/src dir", "train", odd, 1800, 3600)
    last = shlex.split(script.strip().splitlines()[-1])
    assert last == ["exec", "/usr/bin/python3", "-m", "otbflow", "worker", "train", "--results", str(odd)] + [
        "--idle-exit",
        "1800",
        "--retire-after",
        "3600",
    ]
    # resources.train {tasks: 4, nodes: 2, gpu: 4}: one job of four tasks, one per GPU, the worker
    # starting its four ranks itself (with srun, as a train job does)
    ranks = SimpleNamespace(gpu=4, cpus_per_gpu=8, tasks=4, nodes=2, cpus_per_task=1, mem_mb=64000)
    opts = workerjobs.sbatch_options("/r", "train", ranks, {}, 60, Path("/l"))
    assert opts[3:] == ["--mem=64000M", "--nodes=2", "--ntasks=4", "--ntasks-per-gpu=1", "--gpus=4", "--cpus-per-gpu=8"]
    script = workerjobs.script("/py", "/src", "train", "/r", 1800, 3600, tasks=4, cpus_per_task=1)
    assert shlex.split(script.strip().splitlines()[-1])[-4:] == ["--tasks", "4", "--cpus-per-task", "1"]
