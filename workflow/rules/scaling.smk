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
        stage_log("scaling", "scaling"),
    benchmark:
        stage_benchmark("scaling", "scaling")
    conda:
        stage_env("scaling")
    threads: stage_threads("scaling")
    resources:
        **stage_resources("scaling"),
    params:
        **stage_params("scaling", out_dir=f"{R}/scaling"),
    shell:
        STAGE_SHELL
