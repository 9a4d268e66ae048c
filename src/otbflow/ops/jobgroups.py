"""Fewer queued jobs on Slurm: an iteration's features, advantages and train jobs as one Slurm job.

``ITERATION_GROUPS`` is the one declaration of the grouping: ``otbflow submit --group-iterations``
passes it to Snakemake as ``--groups`` (``groups_args``), and the commented ``groups:`` block of
slurm/config.yaml shows the same mapping (tests/test_jobgroups.py checks that they agree). The group
name carries the iteration (``chain_{k}``): one name for every iteration would join the chain
features -> advantages -> train -> features of the next iteration, through the rollouts, into one
group that depends on itself (Snakemake refuses it). The rollouts stay their own job array, so at
rollout.staleness >= 1 the rollouts of iteration k+1 still run while the group job of iteration k
trains; evaluation, the report, the studies and the local ``prune`` job stay outside too.

The Slurm executor plugin (2.8) runs a group job's members one after another (the Snakemake inside
the group job gets ``--jobs 1``), but Snakemake sizes a group job as if the members of one level, the
features jobs of the shards, ran side by side: it would ask for the sum of their GPUs, memory and
CPUs and for the longest of their runtimes, not their sum. ``size_group_jobs`` makes the request
match how the members run: each grouped job takes one ``group_slot``, of which a group job has one
(a local resource: not counted across the jobs in flight), so Snakemake puts each member in a layer
of its own; the group job then asks for the largest GPUs, memory, CPUs and tasks of its members and
for the sum of their runtimes.

No torch imports: the Snakefile imports this when it is parsed.
"""

from __future__ import annotations

# The chain that makes the next policy (CHAIN_PRIORITY in workflow/rules/common.smk): one group per iteration.
CHAIN = ("features", "advantages", "train")
ITERATION_GROUPS = {rule: "chain_{k}" for rule in CHAIN}
SLOT = "group_slot"  # a resource every grouped job takes one of; a group job has one


def groups_args() -> list[str]:
    """Snakemake's arguments for ITERATION_GROUPS."""
    return ["--groups", *(f"{rule}={group}" for rule, group in ITERATION_GROUPS.items())]


def grouped_rules(workflow) -> dict[str, str]:
    """{rule: group name} of the rules that are in a group: ``--groups`` (or a profile's ``groups:``)
    over the rules' ``group:`` directives."""
    overwrite = workflow.group_settings.overwrite_groups
    groups = {rule.name: overwrite.get(rule.name, rule._group) for rule in workflow.rules}
    return {name: group for name, group in groups.items() if group is not None}


def refusal(groups: dict[str, str], staleness: int) -> str | None:
    """Why a grouping cannot run, None when it can: at rollout.staleness >= 1 a rollout in the group
    of features, advantages or train would wait for the previous iteration's group job to train
    (its group holds the features that read that policy), so nothing would overlap."""
    shared = sorted(r for r in CHAIN if r in groups and groups[r] == groups.get("rollout"))
    if staleness >= 1 and shared:
        return (
            f"config key 'rollout.staleness' is {staleness}, but the rule groups (--groups or the profile's "
            f"groups:) put rollout in the group {groups['rollout']!r} with {', '.join(shared)}: the rollouts of "
            "iteration k+1 would wait for iteration k's update instead of running while it trains. Leave rollout "
            f"out of the group (otbflow submit --group-iterations groups {', '.join(CHAIN)}) or set "
            "rollout.staleness 0."
        )
    return None


def size_group_jobs(workflow, staleness: int, worker_rules: tuple[str, ...] | list[str] = ()) -> None:
    """Make ``workflow`` (the Snakefile's) refuse a grouping that loses the stale rollouts' overlap
    (``refusal``) or groups the rules that Slurm workers run (``worker_rules``: local jobs of the
    head, nothing to group) and size each group job for its members run one after another (module docstring).
    Wraps ``workflow.execute``: Snakemake sets the groups after the Snakefile is parsed; only runs
    where groups apply (a cluster executor, or a dry run) are changed."""
    from snakemake.exceptions import WorkflowError

    execute = workflow.execute

    def execute_grouped(*args, **kwargs):
        plugin = kwargs.get("executor_plugin", args[0] if args else None)
        groups = grouped_rules(workflow)
        common = getattr(plugin, "common_settings", None)
        if groups and common is not None and (not common.local_exec or common.dryrun_exec):
            if why := refusal(groups, staleness):
                raise WorkflowError(why)
            if both := sorted(set(groups) & set(worker_rules)):
                raise WorkflowError(
                    f"workers.slurm: {', '.join(both)} run on the run's worker jobs (the head's local jobs), "
                    "and the rule groups (--groups, the profile's groups:, otbflow submit --group-iterations) "
                    "put them in Slurm group jobs: use one or the other"
                )
            for name in groups:
                workflow.get_rule(name).resources[SLOT] = 1
            workflow.register_resource(SLOT, 1)
            workflow.resource_scopes.update({SLOT: "local"})
        return execute(*args, **kwargs)

    workflow.execute = execute_grouped
