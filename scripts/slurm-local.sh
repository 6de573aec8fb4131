#!/usr/bin/env bash
# A real single-machine Slurm cluster (munge + slurmctld + slurmd on this host), for trying
# `tmax learn --nodes 1` through its generated sbatch script without a site cluster.
#
#   bash scripts/slurm-local.sh start    # install (Debian, as root) if missing, configure, start
#   bash scripts/slurm-local.sh stop
#   bash scripts/slurm-local.sh status   # exit 0 when the node is idle and accepts jobs
#
# The configuration lives in its own directory (SLURM_CONF points at it), so a site's
# /etc/slurm is never touched. No cgroup plugins: proctrack/linuxproc works inside
# containers and VMs where slurmd cannot manage cgroups.
set -euo pipefail

STATE=${TMAX_SLURM_DIR:-/var/tmp/tmax-slurm}
CONF=$STATE/slurm.conf
export SLURM_CONF=$CONF

install_packages() {
  local need=()
  for pkg in slurm-wlm munge; do dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg"); done
  if ((${#need[@]})); then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  fi
}

write_config() {
  local host cpus mem
  host=$(hostname -s)
  cpus=$(nproc)
  # Leave 1 GB to the system; slurmd refuses to start if RealMemory exceeds what it sees.
  mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
  mkdir -p "$STATE/spool" "$STATE/ctld" "$STATE/log"
  cat >"$CONF" <<EOF
ClusterName=tmax-local
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
NodeName=$host CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=local Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
}

start_munge() {
  if ! pgrep -x munged >/dev/null; then
    [ -s /etc/munge/munge.key ] || /usr/sbin/mungekey --create --force
    mkdir -p /run/munge && chown munge:munge /run/munge
    runuser -u munge -- /usr/sbin/munged
  fi
}

node_ready() {
  sinfo -h -N -o '%T' 2>/dev/null | grep -Eq '^(idle|mixed|allocated)'
}

start() {
  install_packages
  write_config
  start_munge
  pgrep -x slurmctld >/dev/null || slurmctld -f "$CONF"
  pgrep -x slurmd >/dev/null || slurmd -f "$CONF"
  for _ in $(seq 60); do
    if node_ready; then echo "slurm: $(sinfo -h -N -o '%N %T %c CPUs')"; return 0; fi
    sleep 1
  done
  echo "slurm: the node did not become ready; logs in $STATE/log" >&2
  tail -5 "$STATE/log/slurmctld.log" "$STATE/log/slurmd.log" >&2 || true
  return 1
}

stop() {
  pkill -x slurmd || true
  pkill -x slurmctld || true
}

case "${1:-start}" in
  start) start ;;
  stop) stop ;;
  status) node_ready ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
