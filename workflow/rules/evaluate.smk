rule evaluate:
    input:
        prompts=rules.shard.output.eval,
        policy=policy_by_name,
        train_state=train_state_of_policy,
    output:
        samples=f"{R}/{{policy}}/eval/samples.parquet",
        summary=f"{R}/{{policy}}/eval/summary.parquet",
    log:
        f"{R}/logs/evaluate/{{policy}}.log",
    benchmark:
        f"{R}/benchmarks/evaluate/{{policy}}.tsv"
    conda:
        stage_env("evaluate")
    threads: stage_threads("evaluate")
    resources:
        gpu=CFG.resources.evaluate.gpu,
        cpus_per_gpu=CFG.resources.evaluate.cpus_per_gpu,
        mem_mb=CFG.resources.evaluate.mem_mb,
        runtime=runtime(CFG.resources.evaluate.runtime),
    params:
        cmd=stage_cmd("evaluate"),
        cfg=stage_trigger("evaluate"),
        code=code_version("evaluate"),
        iteration=policy_iteration,
        train_state=lambda wildcards, input: (
            f"--train-state {' '.join(map(quote, input.train_state))}" if input.train_state else ""
        ),
    shell:
        "OTBFLOW_THREADS={threads} {params.cmd} --prompts {input.prompts:q} --policy {input.policy:q} --name {wildcards.policy} "
        "--samples {output.samples:q} --summary {output.summary:q} --iteration {params.iteration} {params.train_state} "
        "--tracking-name evaluate/{wildcards.policy} > {log:q} 2>&1"
