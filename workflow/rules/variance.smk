rule variance_pool:
    input:
        prompts=f"{R}/data/train/shard_0.parquet",
        policy=initial_policy(),
    output:
        f"{R}/variance/pool.parquet",
    log:
        f"{R}/logs/variance_pool/variance_pool.log",
    benchmark:
        f"{R}/benchmarks/variance_pool/variance_pool.tsv"
    conda:
        stage_env("variance_pool")
    threads: stage_threads("variance_pool")
    resources:
        gpu=CFG.resources.rollout.gpu,
        cpus_per_gpu=CFG.resources.rollout.cpus_per_gpu,
        mem_mb=CFG.resources.rollout.mem_mb,
        runtime=runtime(CFG.resources.rollout.runtime),
    params:
        cmd=stage_cmd("variance_pool"),
        cfg=stage_trigger("variance_pool"),
        code=code_version("variance_pool"),
    shell:
        "OTBFLOW_THREADS={threads} {params.cmd} --prompts {input.prompts:q} --policy {input.policy:q} --out {output:q} > {log:q} 2>&1"


rule variance:
    input:
        pool=rules.variance_pool.output[0],
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
        f"{R}/logs/variance/variance.log",
    benchmark:
        f"{R}/benchmarks/variance/variance.tsv"
    conda:
        stage_env("variance")
    threads: CFG.resources.features.threads  # forward and backward passes, as in features
    resources:
        mem_mb=8000,
        runtime=60,
    params:
        cmd=stage_cmd("variance"),
        cfg=stage_trigger("variance"),
        code=code_version("variance"),
        out_dir=lambda wildcards, output: os.path.dirname(output.summary),
    shell:
        "OTBFLOW_THREADS={threads} {params.cmd} --rollouts {input.pool:q} --policy {input.policy:q} --out-dir {params.out_dir:q} > {log:q} 2>&1"
