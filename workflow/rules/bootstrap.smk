rule bootstrap:
    output:
        out=directory(f"{R}/bootstrap/policy"),
        metrics=f"{R}/bootstrap/sft_curve.parquet",
    log:
        stage_log("bootstrap", "bootstrap"),
    benchmark:
        stage_benchmark("bootstrap", "bootstrap")
    conda:
        stage_env("bootstrap")
    threads: stage_threads("bootstrap")
    resources:
        **stage_resources("bootstrap"),
    params:
        **stage_params("bootstrap"),
    shell:
        STAGE_SHELL
