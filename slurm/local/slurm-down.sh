#!/usr/bin/env bash
# Stop the daemons started by slurm-up.sh, by PID file (no pkill by name). Same SLURM_LAB as slurm-up.sh.
# Usage: slurm-down.sh [NAME ...]   (only these daemons, e.g. slurmd slurmctld; default: all)
LAB=${SLURM_LAB:-/tmp/slurm-lab}
# each PID file with the name its process must have: a stale file from before a restart can hold the
# pid of another process, which must not be killed
for entry in "$LAB/run/slurmd.pid:slurmd" "$LAB/run/slurmctld.pid:slurmctld" "$LAB/run/slurmdbd.pid:slurmdbd" \
             "/run/mysqld/mysqld.pid:mysqld|mariadbd" "/run/munge/munged.pid:munged"; do
  f=${entry%%:*}; name=${entry#*:}
  if (( $# )) && [[ " $* " != *" $(basename "$f" .pid) "* ]]; then continue; fi
  if [[ -s "$f" ]]; then
    pid=$(cat "$f")
    if [[ "$(ps -o comm= -p "$pid" 2>/dev/null)" =~ ^($name)$ ]]; then
      kill "$pid"; for i in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      echo "stopped $(basename "$f" .pid) pid $pid"
    fi
  fi
done
