#!/usr/bin/env bash
# Starts or stops a one-node Slurm 22.05 cluster with 4 GPU devices for the
# slurm launch tests, or a two-node one on simulated hosts for the cross-host
# tests (../shared/docs/ENGINES.md has how both were worked out).
#
#   tests/launch/slurm.sh start DIR   # DIR/env then holds SLURM_CONF=DIR/slurm.conf
#   tests/launch/slurm.sh start DIR HOSTS
#   tests/launch/slurm.sh stop DIR
#
# With HOSTS, the state directory of simulated hosts head, n1 and n2
# (tests/python/_hosts.py, whose HOSTS/on-NAME runs a command there), the
# cluster is slurmctld on head and one slurmd on each of n1 and n2 (each
# finds its node by its hostname), 2 GPU devices per node. The daemons run in
# the foreground under one supervisor that is a child subreaper, since PID 1
# here does not reap and slurmstepd double-forks. Commands reach that
# cluster only from the simulated hosts: `HOSTS/on-head sinfo`.
#
# Everything lives in the scratch directory DIR: the config, state, spool,
# logs, the GPU device nodes (mknod: gres refuses plain files) and a munged of
# its own on a private socket, so that the cluster shares nothing with the
# machine's munged or another cluster. The daemons listen on ports the kernel
# picked. `start` first stops whatever an earlier run in DIR left (also after
# a crash that lost the PID files), so it can be run twice. Where Slurm or
# munge is not installed, or we may not mknod, `start` says so and exits 0
# without writing DIR/env: the tests then skip with that reason.
#
# Killed daemons stay zombies here (PID 1 does not reap); they hold nothing.
set -euo pipefail

usage() { echo "usage: $0 start DIR [HOSTS] | stop DIR" >&2; exit 2; }
[[ $# -eq 2 || ( $# -eq 3 && $1 == start ) ]] || usage
action=$1
dir=$2
hosts=${3:-}
[[ $dir == /* ]] || { echo "slurm.sh: DIR must be absolute, got $dir" >&2; exit 2; }
dir=${dir%/}
sbin=${SLURM_SBIN:-/usr/sbin}
bin=${SLURM_BIN:-/usr/bin}
PYTHON=${PYTHON:-/usr/bin/python3}
[[ -z $hosts || -x $hosts/on-head ]] || { echo "slurm.sh: $hosts/on-head not found" >&2; exit 2; }

# Runs a Slurm client command where it reaches slurmctld: on the head host
# of a two-node cluster. (A stop finds the hosts from the config it wrote.)
ctl() {
  local on=${hosts:-$(sed -n 's/^# hosts: //p' "$dir/slurm.conf" 2>/dev/null)}
  if [[ -n $on && -x $on/on-head ]]; then
    SLURM_CONF=$dir/slurm.conf "$on/on-head" "$@"
  else
    SLURM_CONF=$dir/slurm.conf "$@"
  fi
}

# Processes that belong to this cluster: those whose command line or open
# files name $dir (the daemons, slurmstepd with its log, job scripts in the
# spool). Zombies and this shell are left out.
cluster_pids() {
  local pid
  {
    grep -lsF -- "$dir/" /proc/[0-9]*/cmdline | cut -d/ -f3 || true
    find /proc/[0-9]*/fd -lname "$dir/*" 2>/dev/null | cut -d/ -f3 || true
  } | sort -u | while read -r pid; do
    if [[ $pid != "$$" && $pid != "$BASHPID" &&
          $(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) =~ ^[^Z]$ ]]; then
      echo "$pid"
    fi
  done
}

stop() {
  if [[ -f $dir/slurm.conf ]] && [[ -n $(cluster_pids) ]]; then
    # Cancel jobs first so that slurmstepd kills their process trees.
    ctl timeout 5 "$bin/scancel" --full --signal=KILL --user="$(id -un)" >/dev/null 2>&1 || true
  fi
  local pids tries
  for sig in TERM KILL; do
    pids=$(cluster_pids)
    [[ -z $pids ]] && break
    # shellcheck disable=SC2086
    kill -s "$sig" $pids 2>/dev/null || true
    for tries in $(seq 30); do
      [[ -z $(cluster_pids) ]] && break
      sleep 0.1
    done
  done
  pids=$(cluster_pids)
  if [[ -n $pids ]]; then
    echo "slurm.sh: processes of $dir still alive: $pids" >&2
    return 1
  fi
  rm -rf "$dir"
}

# Prints a reason when this machine cannot run the cluster.
missing() {
  local f
  for f in "$sbin/slurmctld" "$sbin/slurmd" "$sbin/munged" "$sbin/mungekey" \
           "$bin/sbatch" "$bin/sinfo" "$bin/squeue" "$bin/scancel" "$bin/scontrol"; do
    [[ -x $f ]] || { echo "$f not found (apt-get install slurmctld slurmd slurm-client munge)"; return; }
  done
  id munge >/dev/null 2>&1 || { echo "no munge user"; return; }
  [[ $(id -u) == 0 ]] || { echo "not root: slurmd and mknod need root"; return; }
  [[ -x $PYTHON ]] || { echo "$PYTHON not found (picks free ports)"; return; }
}

# Two TCP ports free now on this host.
free_ports() {
  "$PYTHON" - <<'EOF'
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks:
    s.bind(("", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
}

wait_idle() {
  local state="" deadline=$((SECONDS + 120))
  while (( SECONDS < deadline )); do
    state=$(ctl timeout 5 "$bin/sinfo" -h -o %t 2>/dev/null || true)
    [[ $state == idle ]] && return 0
    sleep 0.1
  done
  echo "slurm.sh: nodes not idle after 120 s (state: ${state:-no answer})" >&2
  return 1
}

start() {
  local why
  why=$(missing)
  if [[ -n $why ]]; then
    echo "slurm.sh: cannot start a Slurm cluster here: $why; the slurm tests will skip"
    stop
    return 0
  fi
  stop
  mkdir -p "$dir"/{state,spool,log,dev,munge}
  # munged checks that every directory above its socket is searchable by all
  # and that its key is the munge user's alone.
  chmod 755 "$dir" "$dir/munge"
  mungekey --create --keyfile="$dir/munge/munge.key" >/dev/null
  chown -R munge:munge "$dir/munge"
  local socket=$dir/munge/munge.socket
  if (( ${#socket} > 100 )); then
    echo "slurm.sh: $socket is too long for a unix socket; use a shorter DIR" >&2
    return 1
  fi
  # In this machine's network namespace even for simulated hosts: they
  # reach its socket through the shared filesystem.
  runuser -u munge -- "$sbin/munged" --socket="$socket" --key-file="$dir/munge/munge.key" \
    --pid-file="$dir/munge/munged.pid" --log-file="$dir/munge/munged.log" \
    --seed-file="$dir/munge/munged.seed"
  # batch_sched_delay=0: schedule a batch job at submit, not up to 3 s later.
  # config_overrides: 8 CPUs on a smaller machine, so that CPU cores never
  # keep a test's jobs pending; nothing enforces them (task/none).
  # KillWait=2: scancel'd processes that ignore SIGTERM get SIGKILL after
  # 2 s, not 30.
  cat >"$dir/slurm.conf" <<EOF
ClusterName=ci
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket=$socket
StateSaveLocation=$dir/state
SlurmctldPidFile=$dir/slurmctld.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
SchedulerParameters=batch_sched_delay=0
SlurmdParameters=config_overrides
KillWait=2
EOF
  if [[ -n $hosts ]]; then
    start_on_hosts
  else
    start_here
  fi
  if ! wait_idle; then
    tail -n 20 "$dir"/log/*.log >&2 || true
    stop || true
    return 1
  fi
  echo "SLURM_CONF=$dir/slurm.conf" >"$dir/env"
  echo "slurm.sh: cluster up, SLURM_CONF=$dir/slurm.conf"
}

# One node, this machine, daemons that daemonize.
start_here() {
  local host i ports
  host=$(hostname -s)
  for i in 0 1 2 3; do mknod "$dir/dev/nvidia$i" c 195 "$i"; done
  read -r -a ports <<<"$(free_ports)"
  # 127.0.0.1: the host name need not resolve.
  cat >>"$dir/slurm.conf" <<EOF
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=${ports[0]}
SlurmdPort=${ports[1]}
SlurmdSpoolDir=$dir/spool
SlurmdPidFile=$dir/slurmd.pid
SlurmdLogFile=$dir/log/slurmd.log
NodeName=$host NodeAddr=127.0.0.1 CPUs=8 RealMemory=2000 Gres=gpu:4 State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
  cat >"$dir/gres.conf" <<EOF
AutoDetect=off
Name=gpu File=$dir/dev/nvidia[0-3]
EOF
  "$sbin/slurmctld" -f "$dir/slurm.conf"
  "$sbin/slurmd" -f "$dir/slurm.conf"
}

# slurmctld on simulated host head, a slurmd on each of n1 and n2, in the
# foreground under a supervisor that reaps what they leave.
start_on_hosts() {
  local head_addr n node addr
  head_addr=$("$hosts/on-head" hostname -I | awk '{print $1}')
  # Each host has its own network namespace: the default ports are free.
  cat >>"$dir/slurm.conf" <<EOF
# hosts: $hosts
SlurmctldHost=head($head_addr)
SlurmdSpoolDir=$dir/spool/%n
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmdLogFile=$dir/log/slurmd-%n.log
EOF
  echo "AutoDetect=off" >"$dir/gres.conf"
  for node in n1 n2; do
    addr=$("$hosts/on-$node" hostname -I | awk '{print $1}')
    mkdir -p "$dir/dev/$node" "$dir/spool/$node"
    for n in 0 1; do mknod "$dir/dev/$node/nvidia$n" c 195 "$n"; done
    echo "NodeName=$node NodeAddr=$addr CPUs=8 RealMemory=2000 Gres=gpu:2 State=UNKNOWN" \
      >>"$dir/slurm.conf"
    echo "NodeName=$node Name=gpu File=$dir/dev/$node/nvidia[0-1]" >>"$dir/gres.conf"
  done
  echo "PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP" \
    >>"$dir/slurm.conf"
  # The supervisor: PR_SET_CHILD_SUBREAPER (36), the three daemons, then it
  # reaps every child until none is left; SIGTERM goes on to the daemons.
  setsid "$PYTHON" -c '
import ctypes, os, signal, subprocess, sys
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)
conf, hosts, sbin = sys.argv[1:4]
daemons = [subprocess.Popen([f"{hosts}/on-{h}", f"{sbin}/{d}", "-D", "-f", conf])
           for h, d in (("head", "slurmctld"), ("n1", "slurmd"), ("n2", "slurmd"))]
pids = [d.pid for d in daemons]
def forward(signum, frame):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
signal.signal(signal.SIGTERM, forward)
while True:
    try:
        os.wait()
    except ChildProcessError:
        break
' "$dir/slurm.conf" "$hosts" "$sbin" >"$dir/log/supervisor.log" 2>&1 </dev/null &
}

case $action in
  start) start ;;
  stop) stop ;;
  *) usage ;;
esac
