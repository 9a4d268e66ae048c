rule score:
    input:
        rollouts=rules.rollout.output.out,
    output:
        out=f"{R}/iter_{{k}}/rollout/scored_{{s}}.parquet",
    log:
        stage_log("score", "iter_{k}_shard_{s}"),
    benchmark:
        stage_benchmark("score", "iter_{k}_shard_{s}")
    priority: CHAIN_PRIORITY
    conda:
        stage_env("score")
    threads: stage_threads("score")
    resources:
        **stage_resources("score"),
    params:
        **stage_params("score"),
    shell:
        STAGE_SHELL


# With task.reward_model.path the chain reads the scored table (the learned reward added).
if CFG.task.reward_model.path is not None:
    CHAIN_ROLLOUTS = rules.score.output.out
