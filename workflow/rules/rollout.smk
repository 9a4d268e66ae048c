rule rollout:
    input:
        prompts=f"{R}/data/train/shard_{{s}}.parquet",
        policy=policy_for_rollout,
        carry_in=previous_stream,
    output:
        **stream_output(),
        out=f"{R}/iter_{{k}}/rollout/shard_{{s}}.parquet",
    log:
        stage_log("rollout", "iter_{k}_shard_{s}"),
    benchmark:
        stage_benchmark("rollout", "iter_{k}_shard_{s}")
    # after the chain from one policy to the next (at rollout.staleness >= 1 the rollouts of later
    # iterations fill the cores it leaves), before evaluation, scaling and variance
    priority: CHAIN_PRIORITY - 1
    conda:
        stage_env("rollout")
    threads: stage_threads("rollout")
    resources:
        **stage_resources("rollout"),
    params:
        **stage_params(
            "rollout",
            iteration="{k}",
            behaviour_iteration=behaviour_iteration,
            newer_policies=newer_policies,
            trigger=["behaviour_iteration"],
        ),
    shell:
        STAGE_SHELL


# The rollouts table the chain (features, the report) reads: this rule's, unless a stage that
# rewrites it replaces it (score.smk, with a learned reward model).
CHAIN_ROLLOUTS = rules.rollout.output.out
