# otbflow's workflow. Its stages, what each writes and the config keys that rerun it are the stage
# table (src/otbflow/pipeline.py; `otbflow <stage> --help`). Each stage's rule is in
# workflow/rules/<stage>.smk: its inputs and outputs, named as its CLI's flags; the rest (log,
# resources, the command) comes from the stage's entry through workflow/rules/common.smk.
# Config: config/config.yaml, validated against the schema in src/otbflow/config/sections.py
# (workflow/schemas/config.schema.json is generated from it). Override any key with
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
        stream_carries,
        # a run that publishes bf16 policies: its last one in fp32 too
        lambda wildcards: rules.export.output if EXPORTED else [],


# One rule file per stage, in the stage table's order (a rule file reads the rules before it).
for stage in STAGES.values():
    if stage.rule:

        include: f"workflow/rules/{stage.name}.smk"
