rule train:
    input:
        # train.optimizer_every >= 2: the updates a job without the resident engine replays
        unpack(replay_inputs),
        advantages=rules.advantages.output.out,
        policy=policy_for_iteration,
        prev_state=previous_schedule_state,
        prev_optimizer=previous_optimizer_state,
        reference=reference_policy,
    output:
        # the AdamW state (where it writes one: otbflow.runtime.adamw) goes to
        # iter_k/train/optimizer.pending, published by publish_optimizer
        out=directory(f"{R}/iter_{{k}}/train/policy"),
        metrics=f"{R}/iter_{{k}}/train/metrics.parquet",
        state=f"{R}/iter_{{k}}/train/schedule.json",
    log:
        stage_log("train", "iter_{k}"),
    benchmark:
        stage_benchmark("train", "iter_{k}")
    # the chain from one policy to the next first (CHAIN_PRIORITY); evaluation, scaling and variance fill free cores
    priority: CHAIN_PRIORITY
    conda:
        stage_env("train")
    threads: stage_threads("train")
    resources:
        **stage_resources("train"),
    params:
        **stage_params(
            "train",
            iteration="{k}",
            # resumable DeepSpeed checkpoints live outside the outputs: a failed job's are kept
            checkpoint_dir=f"{R}/checkpoints/train/iter_{{k}}",
            # a warm worker's AdamW state when it ends, outside the outputs (otbflow.runtime.adamw)
            adamw_dir=f"{R}/checkpoints/train/adamw",
            optimizer=pending_optimizer_state,
            optimizer_async=not CFG.train.reset_optimizer,
            tracking_name="train/iter_{k}",
            trigger=["checkpoint_dir"],
        ),
    shell:
        STAGE_SHELL
