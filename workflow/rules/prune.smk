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
        # the rerun trigger of iteration k's job: what it keeps (extending `iterations` turns the
        # last policies into pruned ones)
        keep=lambda wildcards: retention_decision(CFG, int(wildcards.k)).describe(),
        optional=lambda wildcards, input: f"--optimizer {input.optimizer}" if input.optimizer else "",
    shell:
        "{params.cmd} --iteration {wildcards.k} --policy {input.policy} {params.optional} --out {output} > {log} 2>&1"
