rule advantages:
    input:
        features=expand(f"{R}/iter_{{{{k}}}}/features/shard_{{s}}.parquet", s=SHARDS),
    output:
        advantages=f"{R}/iter_{{k}}/advantages/advantages.parquet",
        comparison=f"{R}/iter_{{k}}/advantages/comparison.parquet",
    log:
        f"{R}/logs/advantages/iter_{{k}}.log",
    benchmark:
        f"{R}/benchmarks/advantages/iter_{{k}}.tsv"
    # the chain from one policy to the next first (CHAIN_PRIORITY); evaluation, scaling and variance fill free cores
    priority: CHAIN_PRIORITY
    conda:
        stage_env("advantages")
    threads: 1
    resources:
        mem_mb=CFG.resources.advantages.mem_mb,
        runtime=runtime(CFG.resources.advantages.runtime),
    params:
        cmd=stage_cmd("advantages"),
        cfg=stage_trigger("advantages"),
        code=code_version("advantages"),
    shell:
        "OTBFLOW_THREADS={threads} {params.cmd} --features {input.features:q} --out {output.advantages:q} "
        "--comparison {output.comparison:q} --iteration {wildcards.k} > {log:q} 2>&1"
