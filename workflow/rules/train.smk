rule train:
    input:
        advantages=rules.advantages.output.advantages,
        policy=policy_for_iteration,
    output:
        policy=directory(f"{R}/iter_{{k}}/train/policy"),
        metrics=f"{R}/iter_{{k}}/train/metrics.parquet",
    log:
        f"{R}/logs/train/iter_{{k}}.log",
    benchmark:
        f"{R}/benchmarks/train/iter_{{k}}.tsv"
    conda:
        ENV
    params:
        cmd=stage_cmd(
            "train", launcher=launch_processes(CFG.resources.train.tasks, CFG.resources.train.cpus_per_task)
        ),
        cfg=digest("seed", "train", "rollout.temperature"),
        code=code_version("train"),
    threads: CFG.resources.train.cpus_per_task
    resources:
        gpu=CFG.resources.train.gpu,
        cpus_per_gpu=CFG.resources.train.cpus_per_gpu,
        mem_mb=CFG.resources.train.mem_mb,
        runtime=runtime(CFG.resources.train.runtime),
        tasks=CFG.resources.train.tasks,
        nodes=CFG.resources.train.nodes,
        **task_resources(CFG.resources.train),
    shell:
        "{params.cmd} --advantages {input.advantages} --policy {input.policy} --out {output.policy} "
        "--metrics {output.metrics} --iteration {wildcards.k} > {log} 2>&1"
