rule prune:
    input:
        # the jobs that read iteration k's policy and AdamW state: once they are done (and their
        # completion recorded), what retention does not keep is deleted
        readers=train_output_readers,
        policy=f"{R}/iter_{{k}}/train/policy",
        optimizer=own_optimizer_state,
    output:
        out=f"{R}/iter_{{k}}/train/retention.json",
    log:
        stage_log("prune", "iter_{k}"),
    # a few deletions: in the head process, not a queued job
    localrule: True
    conda:
        stage_env("prune")
    threads: stage_threads("prune")
    params:
        # what iteration k keeps is its rerun trigger (extending `iterations` turns the last
        # policies into pruned ones: only those jobs rerun)
        **stage_params(
            "prune",
            iteration="{k}",
            keep_policy=lambda wildcards: retention_decision(CFG, int(wildcards.k)).policy,
            keep_optimizer=lambda wildcards: retention_decision(CFG, int(wildcards.k)).optimizer,
            trigger=["keep_policy", "keep_optimizer"],
        ),
    shell:
        STAGE_SHELL
