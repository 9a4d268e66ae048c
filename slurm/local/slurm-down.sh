#!/usr/bin/env bash
# Stop the daemons started by slurm-up.sh, by PID file (no pkill by name). Same SLURM_LAB as slurm-up.sh.
LAB=${SLURM_LAB:-/tmp/slurm-lab}
for f in "$LAB/run/slurmd.pid" "$LAB/run/slurmctld.pid" "$LAB/run/slurmdbd.pid" /run/mysqld/mysqld.pid /run/munge/munged.pid; do
  if [[ -s "$f" ]]; then
    pid=$(cat "$f")
    if kill -0 "$pid" 2>/dev/null; then
      kill "$pid"; for i in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      echo "stopped $(basename "$f" .pid) pid $pid"
    fi
  fi
done
