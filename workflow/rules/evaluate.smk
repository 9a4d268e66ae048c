rule evaluate:
    input:
        prompts=rules.shard.output.eval,
        policy=policy_by_name,
        train_state=train_state_of_policy,
    output:
        samples=f"{R}/{{policy}}/eval/samples.parquet",
        summary=f"{R}/{{policy}}/eval/summary.parquet",
    log:
        stage_log("evaluate", "{policy}"),
    benchmark:
        stage_benchmark("evaluate", "{policy}")
    conda:
        stage_env("evaluate")
    threads: stage_threads("evaluate")
    resources:
        **stage_resources("evaluate"),
    params:
        **stage_params(
            "evaluate",
            name="{policy}",
            iteration=policy_iteration,
            tracking_name="evaluate/{policy}",
            trigger=["iteration"],
        ),
    shell:
        STAGE_SHELL
