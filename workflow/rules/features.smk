rule features:
    input:
        rollouts=CHAIN_ROLLOUTS,
        policy=policy_for_iteration,
    output:
        out=f"{R}/iter_{{k}}/features/shard_{{s}}.parquet",
    log:
        stage_log("features", "iter_{k}_shard_{s}"),
    benchmark:
        stage_benchmark("features", "iter_{k}_shard_{s}")
    # the chain from one policy to the next first (CHAIN_PRIORITY); evaluation, scaling and variance fill free cores
    priority: CHAIN_PRIORITY
    conda:
        stage_env("features")
    threads: stage_threads("features")
    resources:
        **stage_resources("features"),
    params:
        **stage_params("features"),
    shell:
        STAGE_SHELL
