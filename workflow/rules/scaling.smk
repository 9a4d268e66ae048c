rule scaling:
    input:
        rollouts=expand(f"{R}/iter_0/rollout/shard_{{s}}.parquet", s=SHARDS),
        policy=initial_policy(),
    output:
        sequences=f"{R}/scaling/sequences.parquet",
        summary=f"{R}/scaling/summary.parquet",
        json=f"{R}/scaling/summary.json",
        plot=report(
            f"{R}/scaling/scaling.png",
            caption="../report/scaling.rst",
            category="Gradient scaling",
        ),
    log:
        f"{R}/logs/scaling/scaling.log",
    benchmark:
        f"{R}/benchmarks/scaling/scaling.tsv"
    conda:
        stage_env("scaling")
    threads: CFG.resources.features.threads  # forward and backward passes, as in features
    resources:
        mem_mb=8000,
        runtime=60,
    params:
        cmd=stage_cmd("scaling"),
        cfg=stage_trigger("scaling"),
        code=code_version("scaling"),
        out_dir=lambda wildcards, output: os.path.dirname(output.summary),
    shell:
        "OTBFLOW_THREADS={threads} {params.cmd} --rollouts {input.rollouts:q} --policy {input.policy:q} --out-dir {params.out_dir:q} > {log:q} 2>&1"
