rule variance:
    input:
        rollouts=rules.variance_pool.output.out,
        policy=initial_policy(),
    output:
        summary=f"{R}/variance/summary.parquet",
        json=f"{R}/variance/summary.json",
        plot=report(
            f"{R}/variance/variance.png",
            caption="../report/variance.rst",
            category="Gradient variance",
        ),
    log:
        stage_log("variance", "variance"),
    benchmark:
        stage_benchmark("variance", "variance")
    conda:
        stage_env("variance")
    threads: stage_threads("variance")
    resources:
        **stage_resources("variance"),
    params:
        **stage_params("variance", out_dir=f"{R}/variance"),
    shell:
        STAGE_SHELL
