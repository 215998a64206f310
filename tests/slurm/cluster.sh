#!/usr/bin/env bash
# A real Slurm (Debian's 22.05) on this one machine: slurmctld plus three slurmd daemons emulating node1 to node3,
# no munge (auth/none), no accounting database. tests/test_slurm.py submits the generated scripts to it (2-node jobs;
# the third node is where a job goes when the health check excludes one); it is also handy by hand:
#   tests/slurm/cluster.sh start    install Debian's slurmctld/slurmd/slurm-client if missing (root), write the
#                                   config, start the daemons, wait until all nodes are idle; prints SLURM_CONF=...
#   tests/slurm/cluster.sh status   sinfo, or "not running" (exit 1)
#   tests/slurm/cluster.sh stop     stop the daemons by their PIDs
# State (config, PID files, logs, spool) lives in $TRNRECIPES_SLURM_DIR (default /tmp/trnrecipes-slurm).
# Starting a running cluster does nothing but print SLURM_CONF again.
# The nodes' address (NodeAddr) is this machine's first non-loopback address (TRNRECIPES_SLURM_ADDR overrides it),
# which its host name does not resolve to (the name resolves to 127.0.0.1 in /etc/hosts, the emulated node names
# not at all): like a trn1 node with 8 network interfaces, a rendezvous that guesses the first node from host names
# finds none. `start` prints NODE_ADDR=... too.
set -euo pipefail

STATE=${TRNRECIPES_SLURM_DIR:-/tmp/trnrecipes-slurm}
CONF="$STATE/slurm.conf"
NODES=(node1 node2 node3)
CPUS=2           # per emulated node (config_overrides lets them all claim the machine's cores)
# and the machine's memory, in MB, as a real cluster declares it (eval.sbatch asks for --mem)
MEM_MB=$(awk '/^MemTotal:/ { print int($2 / 1024) }' /proc/meminfo)
CTLD_PORT=${TRNRECIPES_SLURM_PORT:-16817}
SLURMD_PORT0=17001  # node1 17001, node2 17002, ...

log() { echo "[cluster.sh] $*" >&2; }
die() {
  log "error: $*"
  exit 1
}

# The PID in file $1 if that process is alive.
alive_pid() {
  local pid
  [[ -s "$1" ]] || return 1
  pid=$(<"$1")
  [[ "$pid" =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null && echo "$pid"
}

have_slurm() { command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null; }

install_slurm() {
  if have_slurm; then return 0; fi
  [[ "$(id -u)" == 0 ]] || die "Slurm is not installed and this is not root: apt-get install slurmctld slurmd slurm-client"
  command -v apt-get >/dev/null || die "Slurm is not installed and there is no apt-get to install it with"
  log "installing Debian's slurmctld slurmd slurm-client"
  export DEBIAN_FRONTEND=noninteractive
  # The packages' postinst scripts try to start the services; there is no init here and we start them by hand.
  local policy=/usr/sbin/policy-rc.d made_policy=0
  if [[ ! -e "$policy" ]]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && made_policy=1
  fi
  local ok=0
  { apt-get update -qq && apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client >/dev/null; } || ok=$?
  if ((made_policy)); then rm -f "$policy"; fi
  ((ok == 0)) || die "apt-get install slurmctld slurmd slurm-client failed (exit $ok)"
  have_slurm || die "Slurm packages installed but slurmctld/slurmd/sbatch are not on PATH"
}

# This machine's first non-loopback IPv4 address, else 127.0.0.1.
node_addr() {
  local addr
  if [[ -n "${TRNRECIPES_SLURM_ADDR:-}" ]]; then
    echo "$TRNRECIPES_SLURM_ADDR"
    return
  fi
  for addr in $(hostname -I 2>/dev/null); do
    if [[ "$addr" =~ ^[0-9.]+$ && "$addr" != 127.* ]]; then
      echo "$addr"
      return
    fi
  done
  echo 127.0.0.1
}

write_conf() {
  local host user addr
  host=$(hostname -s)
  addr=$(node_addr)
  user=$(id -un)
  mkdir -p "$STATE/ctld" "$STATE/log" "$STATE/run"
  for node in "${NODES[@]}"; do mkdir -p "$STATE/$node"; done
  cat >"$CONF.tmp" <<EOF
# Written by tests/slurm/cluster.sh: a test cluster, ${#NODES[@]} emulated nodes on one machine.
ClusterName=trnrecipes
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=$user
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
# A requeued job may start again once its credential expired: the default (120 s) makes a requeue take ~2 minutes;
# 10 s is still far more than a step launch takes here.
AuthInfo=cred_expire=10
SchedulerParameters=sched_interval=2
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
EnforcePartLimits=ALL
SlurmdParameters=config_overrides
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/%n
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
InactiveLimit=0
KillWait=10
MinJobAge=600
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName=node[1-${#NODES[@]}] NodeHostname=$host NodeAddr=$addr Port=[$SLURMD_PORT0-$((SLURMD_PORT0 + ${#NODES[@]} - 1))] CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  mv "$CONF.tmp" "$CONF"
}

ctld_up() { SLURM_CONF=$CONF scontrol ping 2>/dev/null | grep -q 'is UP'; }

# All nodes idle (or busy with a job: a running cluster is fine too).
nodes_ready() {
  local states
  states=$(SLURM_CONF=$CONF sinfo --noheader --Node --format='%N %t' 2>/dev/null) || return 1
  [[ $(grep -cE ' (idle|alloc|mix)$' <<<"$states") == "${#NODES[@]}" ]]
}

start() {
  install_slurm
  if alive_pid "$STATE/run/slurmctld.pid" >/dev/null && nodes_ready; then
    log "already running"
    echo "SLURM_CONF=$CONF"
    echo "NODE_ADDR=$(node_addr)"
    return 0
  fi
  stop quiet
  write_conf
  log "starting slurmctld and slurmd ${NODES[*]} (state in $STATE)"
  # -c: a clean start (no jobs from an earlier cluster); -i would ignore state errors
  SLURM_CONF=$CONF slurmctld -c -f "$CONF"
  for node in "${NODES[@]}"; do
    SLURM_CONF=$CONF slurmd -f "$CONF" -N "$node"
  done
  local i
  for ((i = 0; i < 120; i++)); do
    if ctld_up && nodes_ready; then
      log "all ${#NODES[@]} nodes idle"
      echo "SLURM_CONF=$CONF"
      echo "NODE_ADDR=$(node_addr)"
      return 0
    fi
    sleep 0.5
  done
  log "the nodes did not become idle within 60 s; sinfo and the log tails follow"
  SLURM_CONF=$CONF sinfo --Node --long >&2 || true
  tail -n 20 "$STATE"/log/*.log >&2 || true
  die "cluster did not start"
}

stop() {
  local quiet=${1:-} pidfile pid i stopped=0
  for pidfile in "$STATE"/run/slurmd-*.pid "$STATE/run/slurmctld.pid"; do
    [[ -e "$pidfile" ]] || continue
    if pid=$(alive_pid "$pidfile"); then
      kill -TERM "$pid" 2>/dev/null || true
      for ((i = 0; i < 100; i++)); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
      done
      if kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid" 2>/dev/null || true; fi
      stopped=$((stopped + 1))
    fi
    rm -f "$pidfile"
  done
  [[ -n "$quiet" ]] || log "stopped $stopped daemon(s)"
}

status() {
  if alive_pid "$STATE/run/slurmctld.pid" >/dev/null && ctld_up; then
    echo "SLURM_CONF=$CONF"
    SLURM_CONF=$CONF sinfo --Node --long
  else
    echo "not running"
    return 1
  fi
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *)
    echo "usage: $0 start|stop|status   (state in \$TRNRECIPES_SLURM_DIR, default /tmp/trnrecipes-slurm)" >&2
    exit 2
    ;;
esac
