rule prune:
    input:
        # the jobs that read iteration k's policy and AdamW state: once they are done (and their
        # completion recorded), what retention does not keep is deleted
        readers=train_output_readers,
        policy=f"{R}/iter_{{k}}/train/policy",
        optimizer=own_optimizer_state,
    output:
        f"{R}/iter_{{k}}/train/retention.json",
    log:
        f"{R}/logs/prune/iter_{{k}}.log",
    # a few deletions: in the head process, not a queued job
    localrule: True
    conda:
        stage_env("prune")
    params:
        cmd=stage_cmd("prune"),
        cfg=stage_trigger("prune"),
        code=code_version("prune"),
        # what iteration k keeps, and its rerun trigger (extending `iterations` turns the last
        # policies into pruned ones: only those jobs rerun)
        keep=lambda wildcards: retention_decision(CFG, int(wildcards.k)).flags(),
        optional=lambda wildcards, input: (
            f"--optimizer {' '.join(map(quote, input.optimizer))}" if input.optimizer else ""
        ),
    shell:
        "{params.cmd} --iteration {wildcards.k} --policy {input.policy:q} {params.optional} {params.keep} --out {output:q} > {log:q} 2>&1"
