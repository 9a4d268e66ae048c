rule rollout:
    input:
        prompts=f"{R}/data/train/shard_{{s}}.parquet",
        policy=policy_for_rollout,
    output:
        f"{R}/iter_{{k}}/rollout/shard_{{s}}.parquet",
    log:
        f"{R}/logs/rollout/iter_{{k}}_shard_{{s}}.log",
    benchmark:
        f"{R}/benchmarks/rollout/iter_{{k}}_shard_{{s}}.tsv"
    # after the chain from one policy to the next (at rollout.staleness >= 1 the rollouts of later
    # iterations fill the cores it leaves), before evaluation, scaling and variance
    priority: CHAIN_PRIORITY - 1
    conda:
        stage_env("rollout")
    threads: stage_threads("rollout")
    resources:
        gpu=CFG.resources.rollout.gpu,
        cpus_per_gpu=CFG.resources.rollout.cpus_per_gpu,
        mem_mb=CFG.resources.rollout.mem_mb,
        runtime=runtime(CFG.resources.rollout.runtime),
    params:
        cmd=stage_cmd("rollout"),
        cfg=stage_trigger("rollout"),
        code=code_version("rollout"),
        behaviour=behaviour_iteration,
    shell:
        "OTBFLOW_THREADS={threads} {params.cmd} --prompts {input.prompts:q} --policy {input.policy:q} --out {output:q} "
        "--iteration {wildcards.k} --behaviour-iteration {params.behaviour} > {log:q} 2>&1"


rule score:
    input:
        rollouts=rules.rollout.output[0],
    output:
        f"{R}/iter_{{k}}/rollout/scored_{{s}}.parquet",
    log:
        f"{R}/logs/score/iter_{{k}}_shard_{{s}}.log",
    benchmark:
        f"{R}/benchmarks/score/iter_{{k}}_shard_{{s}}.tsv"
    priority: CHAIN_PRIORITY
    conda:
        stage_env("score")
    threads: CFG.resources.score.threads
    resources:
        gpu=CFG.resources.score.gpu,
        cpus_per_gpu=CFG.resources.score.cpus_per_gpu,
        mem_mb=CFG.resources.score.mem_mb,
        runtime=runtime(CFG.resources.score.runtime),
    params:
        cmd=stage_cmd("score"),
        cfg=stage_trigger("score"),
        code=code_version("score"),
    shell:
        "OTBFLOW_THREADS={threads} {params.cmd} --rollouts {input.rollouts:q} --out {output:q} > {log:q} 2>&1"
