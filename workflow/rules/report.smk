rule report:
    input:
        summaries=[f"{R}/initial/eval/summary.parquet"] + expand(f"{R}/iter_{{k}}/eval/summary.parquet", k=EVALUATED),
        metrics=expand(rules.train.output.metrics, k=ITERATIONS),
        rollouts=expand(CHAIN_ROLLOUTS, k=ITERATIONS, s=SHARDS),
        comparisons=expand(rules.advantages.output.comparison, k=ITERATIONS),
        features=expand(rules.features.output[0], k=ITERATIONS, s=SHARDS),
        # the disk it reports is after the retention policy
        pruned=expand(rules.prune.output, k=PRUNED_ITERATIONS),
    output:
        progress=f"{R}/report/progress.parquet",
        metrics=f"{R}/report/metrics.parquet",
        comparison=f"{R}/report/comparison.parquet",
        mismatch=f"{R}/report/mismatch.parquet",
        # per iteration: tokens generated (dropped groups' included), rewards, dynamic sampling
        rollout_summary=f"{R}/report/rollouts.parquet",
        # bytes under results/ after the retention policy (otbflow.runtime.usage.used)
        disk=f"{R}/report/disk.json",
        # the HTML report's landing page: the Snakefile's report description and --report-metadata
        front=f"{R}/report/front.rst",
        report_metadata=f"{R}/report/metadata.yaml",
        accuracy=report(
            f"{R}/report/accuracy.png",
            caption="../report/accuracy.rst",
            category="Learning curves",
        ),
        reward=report(
            f"{R}/report/reward.png",
            caption="../report/reward.rst",
            category="Learning curves",
        ),
        grad_norm=report(
            f"{R}/report/grad_norm.png",
            caption="../report/grad_norm.rst",
            category="Training",
        ),
        response_length=report(
            f"{R}/report/response_length.png",
            caption="../report/response_length.rst",
            category="Training",
        ),
        mismatch_plot=report(
            f"{R}/report/mismatch.png",
            caption="../report/mismatch.rst",
            category="Training-inference mismatch",
        ),
    log:
        stage_log("report", "report"),
    benchmark:
        stage_benchmark("report", "report")
    conda:
        stage_env("report")
    threads: stage_threads("report")
    resources:
        **stage_resources("report"),
    params:
        **stage_params("report", out_dir=f"{R}/report"),
    shell:
        STAGE_SHELL
