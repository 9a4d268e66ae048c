rule shard:
    input:
        dataset_files(),
    output:
        train=expand(f"{R}/data/train/shard_{{s}}.parquet", s=SHARDS),
        eval=f"{R}/data/eval.parquet",
    log:
        f"{R}/logs/shard/shard.log",
    benchmark:
        f"{R}/benchmarks/shard/shard.tsv"
    conda:
        stage_env("shard")
    threads: 1
    resources:
        mem_mb=CFG.resources.shard.mem_mb,
        runtime=runtime(CFG.resources.shard.runtime),
    params:
        cmd=stage_cmd("shard"),
        cfg=stage_trigger("shard"),
        code=code_version("shard"),
        out_dir=lambda wildcards, output: os.path.dirname(output.eval),
    shell:
        "OTBFLOW_THREADS={threads} {params.cmd} --out-dir {params.out_dir:q} > {log:q} 2>&1"
