rule train:
    input:
        advantages=rules.advantages.output.advantages,
        policy=policy_for_iteration,
        prev_state=previous_schedule_state,
        prev_optimizer=previous_optimizer_state,
        reference=reference_policy,
    output:
        # AdamW state for iteration k+1 (a DeepSpeed checkpoint); none with train.reset_optimizer
        **train_optional_outputs(),
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
            + ([f"--optimizer {quote(output.optimizer)}"] if hasattr(output, "optimizer") else [])
        ),
    shell:
        "OTBFLOW_THREADS={threads} {params.cmd} --advantages {input.advantages:q} --policy {input.policy:q} --out {output.policy:q} "
        "--metrics {output.metrics:q} --state {output.state:q} --checkpoint-dir {params.checkpoint_dir:q} "
        "--iteration {wildcards.k} {params.optional} --tracking-name train/iter_{wildcards.k} > {log:q} 2>&1"
