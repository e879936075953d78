#!/usr/bin/env bash
# A multi-host Spark standalone cluster on one machine: the master and every worker run in
# their own Linux network namespace ("host"), each with its own address on a private bridge.
# Used by tests/spark/test_netns_cluster.py (pytest -m netns) to test tfos across hosts:
# TF addresses, feed routing, TensorBoard, and a host cut off or killed mid-training.
#
#   sudo scripts/netns_cluster.sh up 2        # master + 2 workers (1 core each); prints the master URL
#   sudo scripts/netns_cluster.sh status      # processes, namespaces, links (exit 1 if anything is gone)
#   sudo scripts/netns_cluster.sh cut 1       # link of worker host 1 down (host unreachable, processes live)
#   sudo scripts/netns_cluster.sh heal 1      # link of worker host 1 up again
#   sudo scripts/netns_cluster.sh kill-worker 1   # SIGKILL every process of worker host 1 (host crash)
#   sudo scripts/netns_cluster.sh add-worker  # one more worker host (N+1) on the running bed; prints its line
#   sudo scripts/netns_cluster.sh down        # stop what "up" started (by PID), delete namespaces/veths/bridge
#
# Layout (SUBNET=10.77.0 by default; a /24 that must not be in use on the machine):
#   bridge ${PREFIX}br0  SUBNET.1/24  (host side: the driver binds here, spark.driver.host=SUBNET.1)
#   namespace ${PREFIX}-m   SUBNET.2   the master, spark://SUBNET.2:7077 (UI :8080 inside the namespace)
#   namespace ${PREFIX}-wI  SUBNET.(10+I)   worker I (I = 1..N), 1 core, WORKER_MEMORY
# Each namespace has its loopback up and one veth leg on the bridge, and NO default route;
# the host does not forward (the script refuses to run when net.ipv4.ip_forward=1 unless
# TFOS_NETNS_ALLOW_FORWARD=1), so no packet can leave the bridge and the namespaces.
# Processes start with `ip netns exec NS env SPARK_LOCAL_IP=<ns address> ...`; executors,
# their Python workers and tfos's node processes inherit it, so TF servers, TensorBoard and
# tfos data listeners register with the namespace's own address.
#
# Crash safety: every resource is recorded in the state file *before* it is created, and
# every process right after it starts, so `down` removes exactly what `up` made even when
# `up` or the caller died half-way; `down` is idempotent. A recorded PID is signalled only
# while it still lives in the recorded namespace (no harm after PID reuse); the processes
# the workers started (executors, Python workers, tfos nodes) are ended through
# `ip netns pids` of our own namespaces before they are deleted.
#
# Needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN) and iproute2. Settings (environment):
#   PYTHON              Python whose PySpark to use (default: the repo's .venv, else python3)
#   TFOS_NETNS_PREFIX   name prefix of namespaces, veths and bridge (default tfosnet; <= 8 chars)
#   TFOS_NETNS_SUBNET   first three octets of the private /24 (default 10.77.0)
#   TFOS_NETNS_DIR      state file, logs and work dirs (default /tmp/tfos-netns)
#   WORKER_MEMORY       memory each worker offers (default 1g)
#   TFOS_NETNS_WAIT_S   longest wait for the master to listen and the workers to register (default 180)
set -Eeuo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"
  else PYTHON=python3; fi
fi
PREFIX="${TFOS_NETNS_PREFIX:-tfosnet}"
SUBNET="${TFOS_NETNS_SUBNET:-10.77.0}"
DIR="${TFOS_NETNS_DIR:-/tmp/tfos-netns}"
STATE="$DIR/state"
WORKER_MEMORY="${WORKER_MEMORY:-1g}"
WAIT_S="${TFOS_NETNS_WAIT_S:-180}"
BRIDGE="${PREFIX}br0"
DRIVER_IP="$SUBNET.1"
MASTER_NS="${PREFIX}-m"
MASTER_IP="$SUBNET.2"
MASTER_PORT=7077
MASTER_URL="spark://$MASTER_IP:$MASTER_PORT"

die() { echo "netns_cluster: $*" >&2; exit 1; }
log() { echo "netns_cluster: $*" >&2; }

worker_ns() { echo "${PREFIX}-w$1"; }
worker_ip() { echo "$SUBNET.$((10 + $1))"; }
host_veth() { echo "${PREFIX}v$1"; }   # host side leg; the peer is ${PREFIX}p$1 inside the namespace
ns_veth() { echo "${PREFIX}p$1"; }

record() { echo "$*" >> "$STATE"; }   # record KIND ARGS... (state file, one resource a line)

ns_inode() { stat -L -c %i "/run/netns/$1" 2>/dev/null || true; }

pid_in_ns() {  # pid_in_ns PID NS -> true while PID lives and is in namespace NS
  local pid=$1 ns=$2 want have
  want=$(ns_inode "$ns"); [[ -n "$want" ]] || return 1
  have=$(readlink "/proc/$pid/ns/net" 2>/dev/null) || return 1
  [[ "$have" == "net:[$want]" ]]
}

spark_home() { "$PYTHON" -c 'import os, pyspark; print(os.path.dirname(pyspark.__file__))'; }

wait_for_port() {  # wait_for_port IP PORT SECONDS (connects over the bridge from the host side)
  local ip=$1 port=$2 secs=$3
  "$PYTHON" - "$ip" "$port" "$secs" <<'EOF'
import socket, sys, time
ip, port, secs = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
end = time.monotonic() + secs
while time.monotonic() < end:
    try:
        socket.create_connection((ip, port), timeout=1).close()
        sys.exit(0)
    except OSError:
        time.sleep(0.5)
sys.exit(1)
EOF
}

preflight() {
  [[ $EUID -eq 0 ]] || die "needs root (ip netns add, veth, bridge)"
  command -v ip > /dev/null || die "iproute2 'ip' not found"
  [[ ${#PREFIX} -le 8 ]] || die "TFOS_NETNS_PREFIX must be at most 8 characters (interface names <= 15)"
  [[ "$SUBNET" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "TFOS_NETNS_SUBNET must look like 10.77.0"
  if [[ "$(cat /proc/sys/net/ipv4/ip_forward 2>/dev/null || echo 0)" != 0 && -z "${TFOS_NETNS_ALLOW_FORWARD:-}" ]]; then
    die "net.ipv4.ip_forward=1 on this machine: packets could be routed off the bridge; refusing (set TFOS_NETNS_ALLOW_FORWARD=1 to override)"
  fi
}

start_in_ns() {  # start_in_ns NS IP NAME LOGFILE CMD... -> records and prints the PID
  local ns=$1 ip=$2 name=$3 logfile=$4; shift 4
  # ip netns exec, env, nohup and spark-class all exec, so $! ends up being the JVM's PID.
  ip netns exec "$ns" env SPARK_LOCAL_IP="$ip" SPARK_LOCAL_HOSTNAME="$ip" \
    PYSPARK_PYTHON="${PYSPARK_PYTHON:-$PYTHON}" SPARK_HOME="$SPARK_HOME" \
    nohup "$@" > "$logfile" 2>&1 < /dev/null &
  local pid=$!
  record pid "$ns" "$pid" "$name"
  echo "$pid"
}

make_host() {  # make_host TAG NS IP
  local tag=$1 ns=$2 ip=$3 hv pv
  hv=$(host_veth "$tag"); pv=$(ns_veth "$tag")
  record ns "$ns"
  ip netns add "$ns"
  ip -n "$ns" link set lo up
  record veth "$hv"
  ip link add "$hv" type veth peer name "$pv" netns "$ns"
  ip link set "$hv" master "$BRIDGE"
  ip link set "$hv" up
  ip -n "$ns" addr add "$ip/24" dev "$pv"
  ip -n "$ns" link set "$pv" up
  record host "$tag" "$ns" "$ip" "$hv"
}

start_worker() {  # start_worker I: the Spark worker of host I (1 core, WORKER_MEMORY)
  local i=$1
  mkdir -p "$DIR/work/w$i"
  start_in_ns "$(worker_ns "$i")" "$(worker_ip "$i")" "worker$i" "$DIR/logs/worker$i.log" \
    "$SPARK_HOME/bin/spark-class" org.apache.spark.deploy.worker.Worker "$MASTER_URL" \
    --host "$(worker_ip "$i")" --cores 1 --memory "$WORKER_MEMORY" --work-dir "$DIR/work/w$i" > /dev/null
}

await_workers() {  # await_workers I...: until each worker logged its registration (or WAIT_S)
  local deadline=$((SECONDS + WAIT_S)) missing i
  while :; do
    missing=""
    for i in "$@"; do
      grep -q "Successfully registered with master" "$DIR/logs/worker$i.log" 2>/dev/null || missing+=" $i"
    done
    [[ -z "$missing" ]] && return 0
    if ((SECONDS > deadline)); then
      log "worker(s)$missing did not register within $WAIT_S s; see $DIR/logs/worker*.log"
      false
    fi
    sleep 0.5
  done
}

add_worker() {  # one more worker host on the running bed: host N+1 (N: hosts made so far, dead ones included)
  [[ -f "$STATE" ]] && grep -q '^master ' "$STATE" || die "not up (no master in $STATE); run '$0 up N' first"
  preflight
  local last=0 kind tag i
  while read -r kind tag _; do
    if [[ "$kind" == host && "$tag" == w* ]] && ((${tag#w} > last)); then last=${tag#w}; fi
  done < "$STATE"
  i=$((last + 1))
  ((i <= 200)) || die "at most 200 workers"
  [[ ! -e "/run/netns/$(worker_ns "$i")" ]] || die "namespace $(worker_ns "$i") exists but is not in $STATE"
  if ip link show "$(host_veth "w$i")" > /dev/null 2>&1; then die "link $(host_veth "w$i") exists but is not in $STATE"; fi
  SPARK_HOME="$(spark_home)"; export SPARK_HOME
  # Everything is recorded before it is made: on failure, 'down' removes the partial host.
  make_host "w$i" "$(worker_ns "$i")" "$(worker_ip "$i")"
  start_worker "$i"
  await_workers "$i"
  record added "$i"
  echo "worker $i $(worker_ns "$i") $(worker_ip "$i")"
}

up() {
  local n=${1:-}
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || die "usage: $0 up N   (N >= 1 workers)"
  ((n <= 200)) || die "at most 200 workers"
  preflight
  mkdir -p "$DIR"
  if [[ -s "$STATE" ]]; then
    die "a test bed is recorded in $STATE; run '$0 down' first"
  fi
  if ip link show "$BRIDGE" > /dev/null 2>&1; then die "bridge $BRIDGE exists but is not in $STATE; not touching it"; fi
  if ip -4 addr show | grep -q "inet $SUBNET\."; then die "addresses in $SUBNET.0/24 are already in use on this machine; set TFOS_NETNS_SUBNET"; fi
  local i
  for ((i = 1; i <= n; i++)); do
    if [[ -e "/run/netns/$(worker_ns "$i")" ]]; then die "namespace $(worker_ns "$i") exists but is not in $STATE"; fi
  done
  [[ ! -e "/run/netns/$MASTER_NS" ]] || die "namespace $MASTER_NS exists but is not in $STATE"
  local tag
  for tag in m $(seq -f 'w%g' 1 "$n"); do
    if ip link show "$(host_veth "$tag")" > /dev/null 2>&1; then die "link $(host_veth "$tag") exists but is not in $STATE; not touching it"; fi
  done

  SPARK_HOME="$(spark_home)"; export SPARK_HOME
  rm -rf "$DIR/logs" "$DIR/work"; mkdir -p "$DIR/logs"
  : > "$STATE"
  trap 'log "up failed; tearing down"; down > /dev/null 2>&1 || true' ERR

  record bridge "$BRIDGE"
  ip link add "$BRIDGE" type bridge
  ip addr add "$DRIVER_IP/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  record driver_ip "$DRIVER_IP"

  make_host m "$MASTER_NS" "$MASTER_IP"
  for ((i = 1; i <= n; i++)); do make_host "w$i" "$(worker_ns "$i")" "$(worker_ip "$i")"; done

  start_in_ns "$MASTER_NS" "$MASTER_IP" master "$DIR/logs/master.log" \
    "$SPARK_HOME/bin/spark-class" org.apache.spark.deploy.master.Master \
    --host "$MASTER_IP" --port "$MASTER_PORT" --webui-port 8080 > /dev/null
  if ! wait_for_port "$MASTER_IP" "$MASTER_PORT" "$WAIT_S"; then
    log "the master did not listen on $MASTER_IP:$MASTER_PORT within $WAIT_S s; see $DIR/logs/master.log"
    false
  fi
  record master "$MASTER_URL"
  for ((i = 1; i <= n; i++)); do start_worker "$i"; done
  await_workers $(seq 1 "$n")
  trap - ERR
  record up "$n"
  echo "master $MASTER_URL"
  echo "driver_ip $DRIVER_IP"
  for ((i = 1; i <= n; i++)); do echo "worker $i $(worker_ns "$i") $(worker_ip "$i")"; done
  echo "state $STATE"
}

stop_pids() {  # stop_pids SIGNAL_WAIT_S "ns pid"... : TERM, wait, then KILL (only PIDs still in their ns)
  local wait_s=$1; shift
  local entry ns pid end left
  for entry in "$@"; do
    read -r ns pid <<< "$entry"
    if pid_in_ns "$pid" "$ns"; then kill -TERM "$pid" 2>/dev/null || true; fi
  done
  end=$((SECONDS + wait_s))
  while ((SECONDS < end)); do
    left=0
    for entry in "$@"; do read -r ns pid <<< "$entry"; pid_in_ns "$pid" "$ns" && left=1; done
    ((left)) || return 0
    sleep 0.5
  done
  for entry in "$@"; do
    read -r ns pid <<< "$entry"
    if pid_in_ns "$pid" "$ns"; then log "pid $pid ($ns) did not stop in ${wait_s} s; SIGKILL"; kill -KILL "$pid" 2>/dev/null || true; fi
  done
}

ns_pids() {  # "ns pid" lines of every process in our namespace NS
  local ns=$1 pid
  [[ -e "/run/netns/$ns" ]] || return 0
  for pid in $(ip netns pids "$ns" 2>/dev/null); do echo "$ns $pid"; done
}

down() {
  if [[ ! -f "$STATE" ]]; then echo "nothing to take down (no $STATE)"; return 0; fi
  [[ $EUID -eq 0 ]] || die "needs root"
  local -a recorded=() workers=() masters=() rest=() namespaces=() veths=() bridges=()
  mapfile -t recorded < "$STATE"
  local line kind a b c
  for line in "${recorded[@]}"; do
    read -r kind a b c <<< "$line"
    case "$kind" in
      pid) if [[ "$c" == master ]]; then masters+=("$a $b"); else workers+=("$a $b"); fi ;;
      ns) namespaces+=("$a") ;;
      veth) veths+=("$a") ;;
      bridge) bridges+=("$a") ;;
    esac
  done
  # Workers first (they stop their executors), then the master, then whatever is left in
  # our namespaces (orphaned executors, Python workers, tfos node processes).
  ((${#workers[@]} == 0)) || stop_pids 20 "${workers[@]}"
  ((${#masters[@]} == 0)) || stop_pids 20 "${masters[@]}"
  local ns
  for ns in "${namespaces[@]}"; do mapfile -t -O "${#rest[@]}" rest < <(ns_pids "$ns"); done
  ((${#rest[@]} == 0)) || stop_pids 10 "${rest[@]}"
  local v
  for v in "${veths[@]}"; do ip link del "$v" 2>/dev/null || true; done
  for ns in "${namespaces[@]}"; do
    if [[ -e "/run/netns/$ns" ]]; then
      left=$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')
      [[ -z "$left" ]] || log "processes still in $ns after SIGKILL: $left"
      ip netns del "$ns" 2>/dev/null || log "could not delete namespace $ns"
    fi
  done
  for v in "${bridges[@]}"; do ip link del "$v" 2>/dev/null || true; done
  rm -f "$STATE"
  echo "down: stopped ${#workers[@]} worker(s), ${#masters[@]} master, ${#rest[@]} leftover process(es); deleted ${#namespaces[@]} namespace(s), ${#veths[@]} veth(s), ${#bridges[@]} bridge(s)"
}

host_field() {  # host_field I FIELD(ns|ip|veth): from the state file
  local want="w$1" tag ns ip hv
  [[ -f "$STATE" ]] || die "not up (no $STATE)"
  while read -r kind tag ns ip hv; do
    if [[ "$kind" == host && "$tag" == "$want" ]]; then
      case "$2" in ns) echo "$ns" ;; ip) echo "$ip" ;; veth) echo "$hv" ;; esac
      return 0
    fi
  done < "$STATE"
  die "no worker host $1 in $STATE"
}

cut() {
  local i=${1:?usage: $0 cut I}
  local hv; hv=$(host_field "$i" veth)
  ip link set "$hv" down
  echo "cut: worker host $i ($(host_field "$i" ip)) is off the bridge ($hv down)"
}

heal() {
  local i=${1:?usage: $0 heal I}
  local hv; hv=$(host_field "$i" veth)
  ip link set "$hv" up
  echo "heal: worker host $i ($(host_field "$i" ip)) is back on the bridge ($hv up)"
}

kill_worker() {  # SIGKILL every process of worker host I: its worker, executors, Python workers, tfos nodes
  local i=${1:?usage: $0 kill-worker I}
  local ns pid n=0; ns=$(host_field "$i" ns)
  for pid in $(ip netns pids "$ns" 2>/dev/null); do
    if pid_in_ns "$pid" "$ns"; then kill -KILL "$pid" 2>/dev/null && n=$((n + 1)); fi
  done
  echo "kill-worker: SIGKILLed $n process(es) of worker host $i ($(host_field "$i" ip))"
}

status() {
  if [[ ! -f "$STATE" ]]; then echo "not up"; return 1; fi
  local rc=0 kind a b c d
  while read -r kind a b c d; do
    case "$kind" in
      master) echo "master $a" ;;
      bridge) echo "bridge $a" ;;
      driver_ip) echo "driver_ip $a" ;;
      pid)
        if pid_in_ns "$b" "$a"; then echo "pid $b $c running in $a"; else echo "pid $b $c gone"; rc=1; fi ;;
      host)
        local state; state=$(cat "/sys/class/net/$d/operstate" 2>/dev/null || echo missing)
        local procs; procs=$(ip netns pids "$b" 2>/dev/null | wc -l)
        echo "host $a ns $b ip $c link $d $state, $procs process(es)"
        [[ -e "/run/netns/$b" ]] || rc=1 ;;
    esac
  done < "$STATE"
  return $rc
}

case "${1:-}" in
  up) up "${2:-}" ;;
  down) down ;;
  status) status ;;
  cut) cut "${2:-}" ;;
  heal) heal "${2:-}" ;;
  kill-worker) kill_worker "${2:-}" ;;
  add-worker) add_worker ;;
  *) echo "usage: $0 up N | down | status | cut I | heal I | kill-worker I | add-worker" >&2; exit 2 ;;
esac
