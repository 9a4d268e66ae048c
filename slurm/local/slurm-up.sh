#!/usr/bin/env bash
# Single-node Slurm (Debian bookworm slurm-wlm 22.05) on localhost inside a container/VM with no systemd,
# for otbflow's Slurm integration test (tests/test_slurm_integration.py). Adapted from the project's
# shared scripts. Run as root; exits 77 when it cannot start Slurm here (not root, no apt-get).
# Usage: [FAKE_GPUS=N] [MIN_CPUS=12] [SLURM_LAB=/tmp/slurm-lab] slurm-up.sh [--with-dbd]   (stop: slurm-down.sh)
#   --with-dbd : also MariaDB + slurmdbd, so `sacct` works (snakemake-executor-plugin-slurm's default status
#                command and submitit's job watcher both call sacct)
#   FAKE_GPUS=N: advertise N fake GPUs (gres/gpu backed by /dev/null-like char devices) so that
#                --gpus / --gres=gpu:N requests schedule and CUDA_VISIBLE_DEVICES gets set
set -euo pipefail
WITH_DBD=0; [[ "${1:-}" == "--with-dbd" ]] && WITH_DBD=1
FAKE_GPUS=${FAKE_GPUS:-0}
LAB=${SLURM_LAB:-/tmp/slurm-lab}
t0=$(date +%s%N)
# by pid file, never by pkill: PIDFILE NAME holds a live process called NAME (a stale file from before
# a restart can hold the pid of another process, even of another Slurm daemon)
running() { [[ -s "$1" ]] && [[ "$(ps -o comm= -p "$(cat "$1")" 2>/dev/null)" =~ ^($2)$ ]]; }

[[ $(id -u) == 0 ]] || { echo "slurm-up: needs root (it writes /etc/slurm and starts the daemons)"; exit 77; }
export DEBIAN_FRONTEND=noninteractive
if ! command -v slurmctld >/dev/null; then
  command -v apt-get >/dev/null || { echo "slurm-up: Slurm is not installed and there is no apt-get"; exit 77; }
  apt-get update -qq
  # the daemons, the client and munge, without the optional plugins they recommend (8 packages against
  # 42); another apt-get running (tests/install-chromium.sh, or this script started by another test) is waited for
  apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
fi
if [[ $WITH_DBD == 1 ]] && ! command -v slurmdbd >/dev/null; then
  apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends slurmdbd mariadb-server >/dev/null
fi

# one caller at a time (the suite's pytest-xdist workers may start it together); the daemons it starts
# get the lock's descriptor closed (9>&-), or they would hold the lock for as long as they run
exec 9>"$LAB.lock"
flock 9
mkdir -p "$LAB"/{spool/ctld,spool/d,log,run}
chown -R slurm:slurm "$LAB/spool/ctld" "$LAB/log" "$LAB/run"
chmod 755 "$LAB" "$LAB"/*

# ---- munge (needs /etc/munge/munge.key owned by munge, mode 0400/0600; the Debian package creates it) ----
[[ -s /etc/munge/munge.key ]] || { mungekey --create --force; chown munge:munge /etc/munge/munge.key; chmod 600 /etc/munge/munge.key; }
install -d -o munge -g munge -m 0755 /run/munge
running /run/munge/munged.pid 'munged' || runuser -u munge -- /usr/sbin/munged 9>&-   # munged refuses to run as root
for i in $(seq 50); do munge -n </dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
munge -n </dev/null | unmunge | grep -q 'STATUS: *Success' || { echo "munge not working"; exit 1; }

# node topology as slurmd sees it (avoids "Node reconfigured socket/core boundaries"), minus 1 GB memory headroom
TOPO=$(slurmd -C | head -1 | grep -o -E '(CPUs|Boards|SocketsPerBoard|CoresPerSocket|ThreadsPerCore)=[0-9]+' | tr '\n' ' ')
# A test node advertises at least MIN_CPUS (default 12) CPUs, so that two tests' runs fit on a 2-core
# machine at once (the suite runs two Slurm tests side by side), each with a head job (1 CPU) and a
# 2-rank training job (2 CPUs), or a head job, three worker jobs and a stage job (1 CPU each); jobs
# are not CPU-pinned (TaskPlugin=task/none).
MIN_CPUS=${MIN_CPUS:-12}
OVERRIDES=""
if (( $(echo "$TOPO" | grep -o -E 'CPUs=[0-9]+' | cut -d= -f2) < MIN_CPUS )); then
  TOPO="CPUs=$MIN_CPUS Boards=1 SocketsPerBoard=1 CoresPerSocket=$MIN_CPUS ThreadsPerCore=1"
  OVERRIDES="SlurmdParameters=config_overrides"
fi
MEM=$(( $(slurmd -C | head -1 | grep -o -E 'RealMemory=[0-9]+' | cut -d= -f2) - 1024 ))

if [[ $WITH_DBD == 1 ]]; then
  ACCT="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=6819
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30"
else
  ACCT="AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none"
fi

GRES_NODE=""; GRES_TYPES=""
rm -f /etc/slurm/gres.conf
if (( FAKE_GPUS > 0 )); then
  mkdir -p "$LAB/dev"
  for ((g=0; g<FAKE_GPUS; g++)); do [[ -c "$LAB/dev/gpu$g" ]] || mknod "$LAB/dev/gpu$g" c 1 3; done  # same dev as /dev/null
  printf 'AutoDetect=off\nNodeName=localhost Name=gpu Count=%d File=%s/dev/gpu[0-%d]\n' "$FAKE_GPUS" "$LAB" $((FAKE_GPUS-1)) > /etc/slurm/gres.conf
  GRES_NODE="Gres=gpu:$FAKE_GPUS"; GRES_TYPES="GresTypes=gpu"
fi

# AuthInfo cred_expire: a requeued job may start again after 10 s instead of 120 s (Slurm holds it
# that long; started sooner, by hand, its batch step is refused: "Job credential revoked").
cat > "$LAB/slurm.conf.new" <<EOF
ClusterName=localcluster
$GRES_TYPES
SlurmctldHost=localhost
SlurmUser=slurm
MailProg=/bin/true
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=10
CredType=cred/munge
MpiDefault=none
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=$LAB/spool/ctld
SlurmdSpoolDir=$LAB/spool/d
SlurmctldPidFile=$LAB/run/slurmctld.pid
SlurmdPidFile=$LAB/run/slurmd.pid
SlurmctldLogFile=$LAB/log/slurmctld.log
SlurmdLogFile=$LAB/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
LaunchParameters=use_interactive_step
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
$OVERRIDES
DefMemPerCPU=1024
MinJobAge=600
InactiveLimit=0
KillWait=5
Waittime=0
SlurmctldTimeout=30
SlurmdTimeout=60
$ACCT
JobCompType=jobcomp/filetxt
JobCompLoc=$LAB/log/jobcomp.txt
NodeName=localhost NodeAddr=127.0.0.1 $TOPO RealMemory=$MEM $GRES_NODE State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
# daemons running with another configuration (an older version of this script) are restarted with this one
cmp -s "$LAB/slurm.conf.new" /etc/slurm/slurm.conf || SLURM_LAB=$LAB bash "$(dirname "$0")/slurm-down.sh" slurmd slurmctld
mv "$LAB/slurm.conf.new" /etc/slurm/slurm.conf
chmod 644 /etc/slurm/slurm.conf
# No cgroup.conf: 22.05 has no CgroupPlugin=disabled ("cannot find cgroup plugin for disabled");
# left alone, slurmd autodetects cgroup/v1 (only loaded, not used with proctrack/linuxproc + task/none).
rm -f /etc/slurm/cgroup.conf

if [[ $WITH_DBD == 1 ]]; then
  # ---- MariaDB + slurmdbd ----
  install -d -o mysql -g mysql /run/mysqld
  if ! running /run/mysqld/mysqld.pid 'mysqld|mariadbd'; then
    [[ -d /var/lib/mysql/mysql ]] || mariadb-install-db --user=mysql --datadir=/var/lib/mysql >/dev/null
    (runuser -u mysql -- /usr/sbin/mariadbd --datadir=/var/lib/mysql --socket=/run/mysqld/mysqld.sock \
        --bind-address=127.0.0.1 --pid-file=/run/mysqld/mysqld.pid >"$LAB/log/mariadb.log" 2>&1 9>&- &)
    for i in $(seq 100); do mariadb -uroot -e 'select 1' >/dev/null 2>&1 && break; sleep 0.2; done
  fi
  # Fresh slurmctld state => job ids restart at 1; drop the old accounting DB too, or sacct/submitit can read
  # stale rows that carry the same job ids.
  if [[ ! -e "$LAB/spool/ctld/job_state" ]] && ! running "$LAB/run/slurmdbd.pid" 'slurmdbd'; then
    mariadb -uroot -e 'DROP DATABASE IF EXISTS slurm_acct_db'
  fi
  mariadb -uroot <<'SQL'
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurmpw';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
FLUSH PRIVILEGES;
SQL
  cat > /etc/slurm/slurmdbd.conf <<EOF
AuthType=auth/munge
DbdHost=localhost
DbdPort=6819
SlurmUser=slurm
DebugLevel=info
LogFile=$LAB/log/slurmdbd.log
PidFile=$LAB/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageLoc=slurm_acct_db
StorageUser=slurm
StoragePass=slurmpw
EOF
  chown slurm:slurm /etc/slurm/slurmdbd.conf; chmod 600 /etc/slurm/slurmdbd.conf
  running "$LAB/run/slurmdbd.pid" 'slurmdbd' || /usr/sbin/slurmdbd 9>&-
  for i in $(seq 100); do sacctmgr -n show cluster >/dev/null 2>&1 && break; sleep 0.2; done
  sacctmgr -i add cluster localcluster >/dev/null 2>&1 || true
fi

# ---- slurmctld (runs as SlurmUser=slurm, started by root) and slurmd (root) ----
running "$LAB/run/slurmctld.pid" 'slurmctld' || /usr/sbin/slurmctld -i 9>&-        # -i: ignore missing/unreadable state on first start
for i in $(seq 100); do scontrol ping 2>/dev/null | grep -q 'UP' && break; sleep 0.2; done
if [[ $WITH_DBD == 1 ]]; then
  sacctmgr -i add account default Cluster=localcluster >/dev/null 2>&1 || true
  sacctmgr -i add user root Account=default >/dev/null 2>&1 || true
  [[ -n "${SUDO_USER:-}" ]] && sacctmgr -i add user "$SUDO_USER" Account=default >/dev/null 2>&1 || true
fi
running "$LAB/run/slurmd.pid" 'slurmd' || /usr/sbin/slurmd -N localhost 9>&-   # -N: NodeName differs from hostname
for i in $(seq 150); do sinfo -h -N -o '%T' 2>/dev/null | grep -q -E '^(idle|mixed|allocated)' && break; sleep 0.2; done
scontrol update NodeName=localhost State=RESUME 2>/dev/null || true
sinfo
echo "slurm up in $(( ($(date +%s%N) - t0) / 1000000 )) ms"
