# The AdamW state iteration k trained, for iteration k+1 (a DeepSpeed checkpoint; none with
# train.reset_optimizer): the train job writes it to optimizer.pending (a warm train worker in the
# background, after the job returned: the next rollouts and features need only the policy); this
# local job waits for it, checks it is of the published policy and renames it into place
# (otbflow.stages.publish_optimizer). A lost state removes iteration k's train outputs: the same
# command redoes the update.
rule publish_optimizer:
    input:
        train_outputs=rules.train.output,
    output:
        out=directory(f"{R}/iter_{{k}}/train/optimizer"),
    log:
        stage_log("publish_optimizer", "iter_{k}"),
    priority: CHAIN_PRIORITY
    localrule: True
    conda:
        stage_env("publish_optimizer")
    threads: stage_threads("publish_optimizer")
    params:
        **stage_params(
            "publish_optimizer",
            policy=rules.train.output.out,
            pending=pending_optimizer_state,
            trigger=["pending"],
        ),
    shell:
        STAGE_SHELL
