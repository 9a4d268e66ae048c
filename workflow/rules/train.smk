rule train:
    input:
        advantages=rules.advantages.output.advantages,
        policy=policy_for_iteration,
    output:
        policy=directory(f"{R}/iter_{{k}}/train/policy"),
        metrics=f"{R}/iter_{{k}}/train/metrics.parquet",
    log:
        f"{R}/logs/train/iter_{{k}}.log",
    benchmark:
        f"{R}/benchmarks/train/iter_{{k}}.tsv"
    conda:
        ENV
    params:
        cmd=stage_cmd("train"),
        cfg=digest("seed", "train", "rollout.temperature"),
        code=code_version("train"),
    threads: 2
    resources:
        mem_mb=8000,
        runtime=120,
    shell:
        "{params.cmd} --advantages {input.advantages} --policy {input.policy} --out {output.policy} "
        "--metrics {output.metrics} --iteration {wildcards.k} > {log} 2>&1"
