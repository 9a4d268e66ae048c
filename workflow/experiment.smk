# An experiment: several runs x seeds of the whole workflow on one shared initial policy and
# prompt set, compared in one report (src/otbflow/stages/experiment.py explains the layout).
#   snakemake -s workflow/experiment.smk --configfile config/experiments/otb_vs_grpo.yaml --cores 2
#   snakemake -s workflow/experiment.smk --configfile ... --report results/otb_vs_grpo/report.html
# Every member is the default workflow (the root Snakefile) run in its own folder, so each one
# keeps its own caching: rerun a stage of one member with snakemake --directory on its folder.
import hashlib
import os
import re
import sys
from pathlib import Path
from shlex import quote

import yaml

import otbflow
from otbflow.runtime.codeversion import code_version
from otbflow.config import DEFAULT_CONFIG, load_config, to_yaml
from otbflow.studies.experiment_config import check_experiment, shared_config
from otbflow.io import write_text_if_changed

REPO = Path(workflow.basedir).resolve().parent
EXP = dict(config)
ENV = "../envs/otbflow.yaml"


# The experiment as given, checked (every member's config validated) before any job runs. Its
# files (the experiment as given, the shared part) are written by the first jobs, not here: a dry
# run, --lint or --summary writes nothing under results/. Their text is the rules' rerun trigger.
GIVEN = yaml.safe_dump(EXP, sort_keys=False)
EXP = check_experiment(yaml.safe_load(GIVEN), "the experiment (--configfile, --config)")
# a plain name (check_experiment): results/<experiment> is a folder of results/, never outside it
ROOT = f"results/{EXP['experiment']}"
SHARED = yaml.safe_dump(shared_config(EXP), sort_keys=False)
RUNS, SEEDS = list(EXP["runs"]), list(EXP["seeds"])
SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))
_SRC = str(Path(otbflow.__file__).resolve().parents[1])
# every path reaching a shell is quoted (shlex.quote here, {log:q}, {input.x:q} in the rules)
OTBFLOW = f"PYTHONPATH={quote(_SRC)}${{PYTHONPATH:+:$PYTHONPATH}} {quote(sys.executable)} -m otbflow"
DEFAULTS = hashlib.sha256(to_yaml(load_config(DEFAULT_CONFIG)).encode()).hexdigest()[:16]


def inner(directory, configfile, targets, threads):
    """The default workflow in its own folder (standard input closed, as for any Snakemake run)."""
    return (
        f"{quote(SNAKEMAKE)} -s {quote(f'{REPO}/Snakefile')} --directory {quote(directory)} "
        f"--configfile {quote(os.path.abspath(configfile))} --cores {threads} {' '.join(map(quote, targets))} < /dev/null"
    )


wildcard_constraints:
    run="|".join(map(re.escape, RUNS)),
    seed=r"\d+",


rule all:
    default_target: True
    input:
        f"{ROOT}/summary.parquet",


rule experiment_file:
    output:
        f"{ROOT}/experiment.yaml",
    log:
        f"{ROOT}/logs/experiment_file.log",
    localrule: True
    params:
        text=GIVEN,
    run:
        write_text_if_changed(output[0], params.text)
        write_text_if_changed(log[0], f"wrote {output[0]}\n")


rule shared_file:
    output:
        f"{ROOT}/shared/shared.yaml",
    log:
        f"{ROOT}/logs/shared_file.log",
    localrule: True
    params:
        text=SHARED,
    run:
        write_text_if_changed(output[0], params.text)
        write_text_if_changed(log[0], f"wrote {output[0]}\n")


rule shared:
    input:
        cfg=rules.shared_file.output[0],
    output:
        policy=directory(f"{ROOT}/shared/results/bootstrap/policy"),
        scaling=f"{ROOT}/shared/results/scaling/summary.json",
        variance=f"{ROOT}/shared/results/variance/summary.parquet",
        scaling_plot=report(
            f"{ROOT}/shared/results/scaling/scaling.png",
            caption="report/scaling.rst",
            category="Gradient scaling",
        ),
        variance_plot=report(
            f"{ROOT}/shared/results/variance/variance.png",
            caption="report/variance.rst",
            category="Gradient variance",
        ),
    log:
        f"{ROOT}/logs/shared.log",
    conda:
        ENV
    threads: 2
    params:
        cmd=lambda wildcards, threads: inner(
            f"{ROOT}/shared",
            f"{ROOT}/shared/shared.yaml",
            ["results/bootstrap/policy", "results/scaling/summary.json", "results/variance/summary.parquet"],
            threads,
        ),
    shell:
        "{params.cmd} > {log:q} 2>&1"


rule member_config:
    input:
        experiment=rules.experiment_file.output[0],
        policy=rules.shared.output.policy,
        scaling=rules.shared.output.scaling,
    output:
        f"{ROOT}/{{run}}/seed_{{seed}}/member.yaml",
    log:
        f"{ROOT}/logs/member_config/{{run}}_seed_{{seed}}.log",
    conda:
        ENV
    params:
        cmd=f"{OTBFLOW} experiment-member",
        code=code_version("experiment"),
        # a member config is the whole resolved config: a changed default (which no code version
        # covers: the config module declares, the stages' triggers see values) writes it anew
        defaults=DEFAULTS,
    shell:
        "{params.cmd} --experiment {input.experiment:q} --run {wildcards.run:q} --seed {wildcards.seed} "
        "--policy {input.policy:q} --scaling {input.scaling:q} --out {output:q} > {log:q} 2>&1"


rule member:
    input:
        cfg=rules.member_config.output[0],
    output:
        progress=f"{ROOT}/{{run}}/seed_{{seed}}/results/report/progress.parquet",
        metrics=f"{ROOT}/{{run}}/seed_{{seed}}/results/report/metrics.parquet",
    log:
        f"{ROOT}/logs/member/{{run}}_seed_{{seed}}.log",
    conda:
        ENV
    threads: 1
    resources:
        mem_mb=8000,
        runtime=24 * 60,
    params:
        cmd=lambda wildcards, input, threads: inner(
            f"{ROOT}/{wildcards.run}/seed_{wildcards.seed}",
            input.cfg,
            ["results/report/progress.parquet", "results/report/metrics.parquet"],
            threads,
        ),
    shell:
        "{params.cmd} > {log:q} 2>&1"


rule experiment_report:
    input:
        experiment=rules.experiment_file.output[0],
        progress=expand(rules.member.output.progress, run=RUNS, seed=SEEDS),
        metrics=expand(rules.member.output.metrics, run=RUNS, seed=SEEDS),
        variance=rules.shared.output.variance,
    output:
        summary=f"{ROOT}/summary.parquet",
        seeds=f"{ROOT}/seeds.parquet",
        pairs=f"{ROOT}/pairs.parquet",
        table=report(f"{ROOT}/summary.tsv", caption="report/experiment_summary.rst", category="Experiment"),
        pairs_table=report(f"{ROOT}/pairs.tsv", caption="report/experiment_pairs.rst", category="Experiment"),
        variance=report(f"{ROOT}/variance.tsv", caption="report/variance_table.rst", category="Gradient variance"),
        curves=f"{ROOT}/curves.parquet",
        metrics=f"{ROOT}/metrics.parquet",
        accuracy=report(
            f"{ROOT}/accuracy_vs_tokens.png", caption="report/experiment_accuracy.rst", category="Experiment"
        ),
        training=report(f"{ROOT}/training.png", caption="report/experiment_training.rst", category="Experiment"),
    log:
        f"{ROOT}/logs/experiment_report.log",
    conda:
        ENV
    params:
        cmd=f"{OTBFLOW} experiment",
        code=code_version("experiment"),
        root=lambda wildcards, output: os.path.dirname(output.summary),
    shell:
        "{params.cmd} --experiment {input.experiment:q} --root {params.root:q} --out-dir {params.root:q} > {log:q} 2>&1"
