rule variance_pool:
    input:
        prompts=f"{R}/data/train/shard_0.parquet",
        policy=initial_policy(),
    output:
        out=f"{R}/variance/pool.parquet",
    log:
        stage_log("variance_pool", "variance_pool"),
    benchmark:
        stage_benchmark("variance_pool", "variance_pool")
    conda:
        stage_env("variance_pool")
    threads: stage_threads("variance_pool")
    resources:
        **stage_resources("variance_pool"),
    params:
        **stage_params("variance_pool"),
    shell:
        STAGE_SHELL
