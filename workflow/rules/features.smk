rule features:
    input:
        rollouts=scored_rollouts(),
        policy=policy_for_iteration,
    output:
        f"{R}/iter_{{k}}/features/shard_{{s}}.parquet",
    log:
        f"{R}/logs/features/iter_{{k}}_shard_{{s}}.log",
    benchmark:
        f"{R}/benchmarks/features/iter_{{k}}_shard_{{s}}.tsv"
    # the chain from one policy to the next first (CHAIN_PRIORITY); evaluation, scaling and variance fill free cores
    priority: CHAIN_PRIORITY
    conda:
        stage_env("features")
    threads: stage_threads("features")
    resources:
        gpu=CFG.resources.features.gpu,
        cpus_per_gpu=CFG.resources.features.cpus_per_gpu,
        mem_mb=CFG.resources.features.mem_mb,
        runtime=runtime(CFG.resources.features.runtime),
    params:
        cmd=stage_cmd("features"),
        cfg=stage_trigger("features"),
        code=code_version("features"),
    shell:
        "OTBFLOW_THREADS={threads} {params.cmd} --rollouts {input.rollouts:q} --policy {input.policy:q} --out {output:q} > {log:q} 2>&1"
