# otbflow's workflow. Its stages, what each writes and the config keys that rerun it are the stage
# table (src/otbflow/pipeline.py; `otbflow <stage> --help`). The rules are in workflow/rules/,
# their helpers in workflow/rules/common.smk.
# Config: config/config.yaml, validated against the schema in src/otbflow/config.py
# (workflow/schemas/config.schema.yaml is generated from it). Override any key with
# `--config 'section={key: value}'`, or layer a partial YAML with `--configfile FILE`.
from snakemake.utils import min_version

min_version("9.0")


include: "workflow/rules/common.smk"


# The HTML report opens on what the run did (the report stage's front.rst), before the workflow's graph.
report: front_page()


wildcard_constraints:
    k=r"\d+",
    s=r"\d+",
    policy=r"initial|iter_\d+",


# Before the first job of a real run (never in a dry run, --lint, --summary or --report).
onstart:
    refuse_pruned_inputs()
    write_resolved_config()
    start_slurm_workers()


# workers.slurm: the worker jobs end with the run.
onsuccess:
    stop_slurm_workers()


onerror:
    stop_slurm_workers()


rule all:
    default_target: True
    input:
        lambda wildcards: rules.report.output,
        lambda wildcards: rules.scaling.output,
        lambda wildcards: rules.variance.output,
        lambda wildcards: expand(rules.prune.output, k=PRUNED_ITERATIONS),
        published_optimizer_states,


include: "workflow/rules/bootstrap.smk"
include: "workflow/rules/shard.smk"
include: "workflow/rules/rollout.smk"
include: "workflow/rules/features.smk"
include: "workflow/rules/advantages.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/prune.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/scaling.smk"
include: "workflow/rules/variance.smk"
