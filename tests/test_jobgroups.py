"""Grouped iterations on Slurm (otbflow.ops.jobgroups): the groups come from one place, a dry run plans
one group job per iteration with the stale rollouts outside it, and a grouping that would make them
wait is refused. Needs no Slurm (dry runs); tests/test_slurm_integration.py runs the grouped form
on a local Slurm and counts its sbatch calls.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import yaml
from conftest import REPO, TINY

from otbflow.ops import jobgroups
from otbflow.ops.submit import add_arguments, snakemake_command

SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))
STALE = ["--config", "iterations=3", "rollout={staleness: 1}", "train={rollout_is: token}"]


def profile_groups_block() -> str:
    """The profile's commented ``groups:`` block."""
    lines = (REPO / "slurm" / "config.yaml").read_text().splitlines()
    start = lines.index("# groups:")
    end = next(i for i in range(start + 1, len(lines)) if not lines[i].startswith("#   "))
    return "\n".join(lines[start:end]) + "\n"


def uncommented(block: str) -> str:
    return "".join(line[2:] + "\n" for line in block.splitlines())


def test_the_profile_and_submit_give_the_same_groups():
    assert yaml.safe_load(uncommented(profile_groups_block())) == {"groups": jobgroups.ITERATION_GROUPS}
    p = argparse.ArgumentParser()
    add_arguments(p)
    cmd = snakemake_command(p.parse_args(["--group-iterations", "--configfile", "my.yaml"]))
    at = cmd.index("--groups")
    assert cmd[at : at + 4] == ["--groups", "features=chain_{k}", "advantages=chain_{k}", "train=chain_{k}"]
    assert "--groups" not in snakemake_command(p.parse_args([]))


def test_submit_workers_sets_workers_slurm_in_the_one_config_snakemake_keeps():
    """Snakemake keeps the last --config it is given: --workers joins the user's, or adds its own
    after the user's arguments (never before a target, which --config would take as a value)."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    own = snakemake_command(p.parse_args(["--workers", "--", "results/iter_1/train/policy", "--forcerun", "rollout"]))
    assert own[1:6] == ["results/iter_1/train/policy", "--forcerun", "rollout", "--config", "workers={slurm: true}"]
    joined = snakemake_command(p.parse_args(["--workers", "--", "--config", "advantages={estimator: grpo}", "-n"]))
    assert joined[1:5] == ["--config", "workers={slurm: true}", "advantages={estimator: grpo}", "-n"]
    assert joined.count("--config") == 1


def test_refusal_only_for_rollout_in_the_chain_group_when_stale():
    chain = dict(jobgroups.ITERATION_GROUPS)
    assert jobgroups.refusal(chain, 2) is None
    assert jobgroups.refusal(chain | {"rollout": "rollouts_{k}", "evaluate": "chain_{k}"}, 1) is None
    assert jobgroups.refusal(chain | {"rollout": "chain_{k}"}, 0) is None  # nothing to overlap
    assert "rollout.staleness" in jobgroups.refusal(chain | {"rollout": "chain_{k}"}, 1)


def dry_run(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [SNAKEMAKE, "-s", str(REPO / "Snakefile"), "--directory", str(workdir), "--configfile", str(TINY)]
    cmd += ["-n", "--cores", "2", *args]
    return subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)


def planned_jobs(stdout: str) -> list[dict]:
    """Every planned job: rule, inputs, outputs, resources and its group (None outside one). A
    group's jobs follow its "Group job <name>" line, indented."""
    jobs, group = [], None
    for block in re.split(r"\n(?=\[.*?\] Group job |(?:    )?(?:local)?rule \w+:)", stdout):
        if m := re.search(r"Group job (\S+) ", block):
            group = m.group(1)
            continue
        if not (m := re.match(r"( *)(?:local)?rule (\w+):", block)):
            continue
        field = {name: re.findall(rf"^\s+{name}: (.*)$", block, re.M) for name in ("input", "output", "resources")}
        jobs.append(
            {
                "rule": m.group(2),
                "group": group if m.group(1) else None,
                "input": {p.strip() for line in field["input"] for p in line.split(",")},
                "output": {p.strip() for line in field["output"] for p in line.split(",")},
                "resources": (field["resources"] or [""])[0],
            }
        )
        if not m.group(1):
            group = None
    return jobs


def iteration(job: dict) -> int | None:
    found = {int(k) for o in job["output"] for k in re.findall(r"iter_(\d+)/", o)}
    return found.pop() if len(found) == 1 else None


def test_one_group_per_iteration_with_the_stale_rollouts_outside(tmp_path):
    """The profile's groups (uncommented) in a dry run of 3 iterations at rollout.staleness 1: one
    group per iteration holding its 2 features jobs, advantages and train (each taking the group
    slot that sizes the group job for its members run one by one), everything else outside, and no
    rollout of iteration k+1 depending, even indirectly, on a job of iteration k's group."""
    profile = tmp_path / "profile"
    profile.mkdir()
    text, block = (REPO / "slurm" / "config.yaml").read_text(), profile_groups_block()
    (profile / "config.yaml").write_text(text.replace(block, uncommented(block)))
    res = dry_run(tmp_path / "work", "--workflow-profile", str(profile), "--slurm-no-account", *STALE)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    jobs = planned_jobs(res.stdout)
    groups: dict[str, list[dict]] = {}
    for job in jobs:
        if job["group"]:
            groups.setdefault(job["group"], []).append(job)
            assert f"{jobgroups.SLOT}=1" in job["resources"], job
        else:
            assert job["rule"] not in jobgroups.CHAIN and jobgroups.SLOT not in job["resources"], job
    assert sorted(groups) == ["chain_0", "chain_1", "chain_2"]
    for name, members in groups.items():
        assert sorted(j["rule"] for j in members) == ["advantages", "features", "features", "train"], name
        assert {iteration(j) for j in members} == {int(name.split("_")[1])}, name

    producer = {o: i for i, job in enumerate(jobs) for o in job["output"]}

    def upstream(i: int) -> set[int]:
        seen, todo = set(), [i]
        while todo:
            for f in jobs[todo.pop()]["input"]:
                if (j := producer.get(f)) is not None and j not in seen:
                    seen.add(j)
                    todo.append(j)
        return seen

    rollouts = [i for i, job in enumerate(jobs) if job["rule"] == "rollout"]
    assert len(rollouts) == 6
    for i in rollouts:
        k = iteration(jobs[i])
        before = {jobs[j]["group"] for j in upstream(i)} - {None}
        assert before == {f"chain_{j}" for j in range(k - 1)}, (k, before)  # never chain_{k-1}


def test_rollout_grouped_with_the_chain_is_refused_when_stale(tmp_path):
    groups = [f"{rule}=chain_{{k}}" for rule in ("rollout", *jobgroups.CHAIN)]
    res = dry_run(tmp_path, "--groups", *groups, *STALE)
    assert res.returncode != 0
    assert "config key 'rollout.staleness' is 1" in res.stdout + res.stderr, res.stderr[-3000:]
