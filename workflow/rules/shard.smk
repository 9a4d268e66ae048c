rule shard:
    input:
        dataset_files(),
    output:
        train=expand(f"{R}/data/train/shard_{{s}}.parquet", s=SHARDS),
        eval=f"{R}/data/eval.parquet",
    log:
        stage_log("shard", "shard"),
    benchmark:
        stage_benchmark("shard", "shard")
    conda:
        stage_env("shard")
    threads: stage_threads("shard")
    resources:
        **stage_resources("shard"),
    params:
        **stage_params("shard", out_dir=f"{R}/data"),
    shell:
        STAGE_SHELL
