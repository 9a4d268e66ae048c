rule bootstrap:
    output:
        policy=directory(f"{R}/bootstrap/policy"),
        curve=f"{R}/bootstrap/sft_curve.parquet",
    log:
        f"{R}/logs/bootstrap/bootstrap.log",
    benchmark:
        f"{R}/benchmarks/bootstrap/bootstrap.tsv"
    conda:
        stage_env("bootstrap")
    threads: 2
    resources:
        mem_mb=4000,
        runtime=60,
    params:
        cmd=stage_cmd("bootstrap"),
        cfg=stage_trigger("bootstrap"),
        code=code_version("bootstrap"),
    shell:
        "OTBFLOW_THREADS={threads} {params.cmd} --out {output.policy:q} --metrics {output.curve:q} > {log:q} 2>&1"
