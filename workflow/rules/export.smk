# The run's last policy in fp32 (runs that publish bf16 policies, policy_folder.publishes_bf16):
# the fp32 master weights of the last AdamW state, read in the train stage's layout (a job of its
# processes; handed to the train worker where one runs, which writes them from its engine).
rule export:
    input:
        policy=f"{R}/iter_{CFG.iterations - 1}/train/policy",
        optimizer=f"{R}/iter_{CFG.iterations - 1}/train/optimizer",
    output:
        out=directory(f"{R}/final/policy_fp32"),
    log:
        stage_log("export", "final"),
    conda:
        stage_env("export")
    threads: stage_threads("export")
    resources:
        **stage_resources("export"),
    params:
        **stage_params("export"),
    shell:
        STAGE_SHELL
