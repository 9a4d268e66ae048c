#!/usr/bin/env bash
# Smoke test of the local cluster started by slurm-up.sh: sinfo, sbatch, srun, sacct (if accounting).
set -u
cd "$(mktemp -d /tmp/slurm-check.XXXX)"
sinfo -o '%P %a %D %T %c %m %G'
jid=$(sbatch --parsable --wrap 'hostname; echo job=$SLURM_JOB_ID cpus=$SLURM_CPUS_ON_NODE')
timeout 60 srun -n 2 bash -c 'echo srun task $SLURM_PROCID on $(hostname)'
for i in $(seq 60); do squeue -h -j "$jid" 2>/dev/null | grep -q . || break; sleep 0.5; done
echo "sbatch output:"; cat slurm-"$jid".out
scontrol show job "$jid" | grep -o 'JobState=[A-Z]*'
if sinfo -h -o '%G' | grep -q gpu; then timeout 60 srun --gpus=1 bash -c 'echo gpu job CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES'; fi
sacct -X --format=JobID,JobName,State,ExitCode 2>&1 | tail -4
