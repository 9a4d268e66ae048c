rule advantages:
    input:
        features=expand(f"{R}/iter_{{{{k}}}}/features/shard_{{s}}.parquet", s=SHARDS),
    output:
        out=f"{R}/iter_{{k}}/advantages/advantages.parquet",
        comparison=f"{R}/iter_{{k}}/advantages/comparison.parquet",
    log:
        stage_log("advantages", "iter_{k}"),
    benchmark:
        stage_benchmark("advantages", "iter_{k}")
    # the chain from one policy to the next first (CHAIN_PRIORITY); evaluation, scaling and variance fill free cores
    priority: CHAIN_PRIORITY
    conda:
        stage_env("advantages")
    threads: stage_threads("advantages")
    resources:
        **stage_resources("advantages"),
    params:
        **stage_params("advantages", iteration="{k}"),
    shell:
        STAGE_SHELL
