rule train:
    input:
        advantages=rules.advantages.output.advantages,
        policy=policy_for_iteration,
        prev_state=previous_schedule_state,
        prev_optimizer=previous_optimizer_state,
        reference=reference_policy,
    output:
        # the AdamW state goes to iter_k/train/optimizer.pending, published by publish_optimizer
        policy=directory(f"{R}/iter_{{k}}/train/policy"),
        metrics=f"{R}/iter_{{k}}/train/metrics.parquet",
        state=f"{R}/iter_{{k}}/train/schedule.json",
    log:
        f"{R}/logs/train/iter_{{k}}.log",
    benchmark:
        f"{R}/benchmarks/train/iter_{{k}}.tsv"
    # the chain from one policy to the next first (CHAIN_PRIORITY); evaluation, scaling and variance fill free cores
    priority: CHAIN_PRIORITY
    conda:
        stage_env("train")
    threads: stage_threads("train")
    resources:
        **task_resources(CFG.resources.train),
        gpu=CFG.resources.train.gpu,
        cpus_per_gpu=CFG.resources.train.cpus_per_gpu,
        mem_mb=CFG.resources.train.mem_mb,
        runtime=runtime(CFG.resources.train.runtime),
        tasks=CFG.resources.train.tasks,
        nodes=CFG.resources.train.nodes,
    params:
        cmd=stage_cmd("train"),
        cfg=stage_trigger("train"),
        code=code_version("train"),
        # resumable DeepSpeed checkpoints live outside the outputs: a failed job's are kept
        checkpoint_dir=f"{R}/checkpoints/train/iter_{{k}}",
        optional=lambda wildcards, input, output: " ".join(
            [
                f"--{name.replace('_', '-')} {' '.join(map(quote, getattr(input, name)))}"
                for name in ("prev_state", "prev_optimizer", "reference")
                if getattr(input, name)
            ]
            + (
                []
                if CFG.train.reset_optimizer
                else [f"--optimizer {quote(pending_optimizer_state(wildcards))} --optimizer-async"]
            )
        ),
    shell:
        "OTBFLOW_THREADS={threads} {params.cmd} --advantages {input.advantages:q} --policy {input.policy:q} --out {output.policy:q} "
        "--metrics {output.metrics:q} --state {output.state:q} --checkpoint-dir {params.checkpoint_dir:q} "
        "--iteration {wildcards.k} {params.optional} --tracking-name train/iter_{wildcards.k} > {log:q} 2>&1"


# The AdamW state iteration k trained, for iteration k+1 (a DeepSpeed checkpoint; none with
# train.reset_optimizer): the train job writes it to optimizer.pending (a warm train worker in the
# background, after the job returned: the next rollouts and features need only the policy); this
# local job waits for it, checks it is of the published policy and renames it into place
# (otbflow.stages.publish_optimizer). A lost state removes iteration k's train outputs: the same
# command redoes the update.
rule publish_optimizer:
    input:
        policy=rules.train.output.policy,
        metrics=rules.train.output.metrics,
        state=rules.train.output.state,
    output:
        directory(f"{R}/iter_{{k}}/train/optimizer"),
    log:
        f"{R}/logs/publish_optimizer/iter_{{k}}.log",
    priority: CHAIN_PRIORITY
    localrule: True
    conda:
        stage_env("publish_optimizer")
    params:
        cmd=stage_cmd("publish_optimizer"),
        cfg=stage_trigger("publish_optimizer"),
        code=code_version("publish_optimizer"),
        pending=pending_optimizer_state,
    shell:
        "{params.cmd} --pending {params.pending:q} --out {output:q} --policy {input.policy:q} "
        "--train-outputs {input.policy:q} {input.metrics:q} {input.state:q} > {log:q} 2>&1"
