#!/usr/bin/env bash
# Start or stop a one-machine Spark standalone cluster (a master and one or more workers)
# for trying the examples with spark-submit. pip's PySpark has no sbin/ start scripts, so this
# runs the master and worker classes with bin/spark-class in the background and keeps
# their PIDs in a pid file; "stop" ends exactly those PIDs.
#
#   scripts/spark_standalone.sh start     # master spark://127.0.0.1:7077, UI http://127.0.0.1:8080
#   scripts/spark_standalone.sh status
#   scripts/spark_standalone.sh stop
#
# Authentication: "start" makes a new random secret and writes it, with spark.authenticate=true
# and spark.network.crypto.enabled=true, to $SPARK_STANDALONE_DIR/conf/spark-defaults.conf
# (directory 0700, file 0600); the master and workers read it there (SPARK_CONF_DIR), never
# from a command line. A standalone cluster has one secret for its master, its workers and
# every application, so submit with the same directory:
#   SPARK_CONF_DIR=/tmp/tfos-spark-standalone/conf spark-submit --master spark://127.0.0.1:7077 ...
# (the workers hand it to the executors in their environment). SPARK_STANDALONE_AUTH=0 starts
# a cluster without authentication (anyone who reaches its ports can run code on it).
#
# Settings (environment):
#   PYTHON              Python whose PySpark to use (default: the repo's .venv, else python3)
#   SPARK_WORKER_INSTANCES  how many workers (default 1; each is its own process, as
#                       separate machines would be)
#   SPARK_WORKER_CORES  cores each worker offers = max. executors with 1 core each (default 4)
#   SPARK_WORKER_MEMORY memory each worker offers (default 4g)
#   SPARK_MASTER_PORT   (default 7077)      SPARK_MASTER_WEBUI_PORT (default 8080)
#   SPARK_STANDALONE_DIR  pid file, logs, worker dir and conf/ (default /tmp/tfos-spark-standalone)
#   SPARK_STANDALONE_AUTH   1 (default): authentication and encryption on, see above; 0: off
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
STATE_DIR="${SPARK_STANDALONE_DIR:-/tmp/tfos-spark-standalone}"
PID_FILE="$STATE_DIR/pids"
HOST=127.0.0.1
MASTER_PORT="${SPARK_MASTER_PORT:-7077}"
WEBUI_PORT="${SPARK_MASTER_WEBUI_PORT:-8080}"
CORES="${SPARK_WORKER_CORES:-4}"
MEMORY="${SPARK_WORKER_MEMORY:-4g}"
WORKERS="${SPARK_WORKER_INSTANCES:-1}"
MASTER_URL="spark://$HOST:$MASTER_PORT"
AUTH="${SPARK_STANDALONE_AUTH:-1}"
CONF_DIR="$STATE_DIR/conf"

spark_home() {
  "$PYTHON" -c 'import os, pyspark; print(os.path.dirname(pyspark.__file__))'
}

alive() {  # alive PID -> true while that process runs
  kill -0 "$1" 2>/dev/null
}

start() {
  if [[ -f "$PID_FILE" ]]; then
    local pid
    for pid in $(cat "$PID_FILE"); do
      if alive "$pid"; then
        echo "already running (pids $(tr '\n' ' ' < "$PID_FILE")); master $MASTER_URL" >&2
        return 0
      fi
    done
    rm -f "$PID_FILE"
  fi
  mkdir -p "$STATE_DIR/work"
  export SPARK_HOME; SPARK_HOME="$(spark_home)"
  export SPARK_LOCAL_IP="$HOST" PYSPARK_PYTHON="${PYSPARK_PYTHON:-$PYTHON}"
  echo "SPARK_HOME=$SPARK_HOME"
  write_conf
  export SPARK_CONF_DIR="$CONF_DIR"
  # spark.port.maxRetries=0: if the port is taken the master fails rather than moving to
  # the next port, where our worker would not find it (and might join another master).
  SPARK_MASTER_OPTS="${SPARK_MASTER_OPTS:-} -Dspark.port.maxRetries=0" \
  nohup "$SPARK_HOME/bin/spark-class" org.apache.spark.deploy.master.Master \
    --host "$HOST" --port "$MASTER_PORT" --webui-port "$WEBUI_PORT" \
    > "$STATE_DIR/master.log" 2>&1 < /dev/null &
  local master_pid=$!
  echo $master_pid > "$PID_FILE"
  local i ok=0
  for ((i = 0; i < 120; i++)); do
    if grep -q "Successfully started service 'sparkMaster' on port $MASTER_PORT\." "$STATE_DIR/master.log" 2>/dev/null; then
      ok=1; break
    fi
    if ! alive "$master_pid"; then break; fi
    sleep 0.5
  done
  if [[ $ok != 1 ]]; then
    echo "the master did not start on port $MASTER_PORT (it exited, or 60 s passed: is the port taken? set SPARK_MASTER_PORT); see $STATE_DIR/master.log" >&2
    stop
    return 1
  fi
  local w log
  for ((w = 1; w <= WORKERS; w++)); do
    log="$STATE_DIR/worker.log"; [[ $w == 1 ]] || log="$STATE_DIR/worker-$w.log"
    mkdir -p "$STATE_DIR/work/$w"
    nohup "$SPARK_HOME/bin/spark-class" org.apache.spark.deploy.worker.Worker "$MASTER_URL" \
      --host "$HOST" --cores "$CORES" --memory "$MEMORY" --work-dir "$STATE_DIR/work/$w" \
      > "$log" 2>&1 < /dev/null &
    echo $! >> "$PID_FILE"
  done
  for ((w = 1; w <= WORKERS; w++)); do
    log="$STATE_DIR/worker.log"; [[ $w == 1 ]] || log="$STATE_DIR/worker-$w.log"
    for ((i = 0; i < 120; i++)); do
      if grep -q "Successfully registered with master $MASTER_URL" "$log" 2>/dev/null; then break; fi
      sleep 0.5
    done
    if [[ $i == 120 ]]; then
      echo "worker $w did not register with $MASTER_URL within 60 s; see $log" >&2
      stop
      return 1
    fi
  done
  echo "master $MASTER_URL (UI http://$HOST:$WEBUI_PORT), $WORKERS worker(s) with $CORES cores and $MEMORY each"
  echo "pids $(tr '\n' ' ' < "$PID_FILE")(in $PID_FILE); logs in $STATE_DIR"
  if [[ $AUTH == 1 ]]; then
    echo "authentication on: submit with SPARK_CONF_DIR=$CONF_DIR (the cluster's secret, readable only by $(id -un))"
  else
    echo "authentication OFF (SPARK_STANDALONE_AUTH=0): submit with SPARK_CONF_DIR=$CONF_DIR"
  fi
  return 0
}

write_conf() {  # a fresh $CONF_DIR/spark-defaults.conf: the cluster's secret, or no authentication
  rm -rf "$CONF_DIR"
  (umask 077 && mkdir -p "$CONF_DIR")
  chmod 700 "$CONF_DIR"
  local spark_conf="$SPARK_HOME/conf" f
  if [[ -d $spark_conf ]]; then  # keep the installation's other settings (log4j2.properties, ...)
    for f in "$spark_conf"/*; do
      [[ -e $f && $(basename "$f") != spark-defaults.conf ]] && ln -s "$f" "$CONF_DIR/"
    done
  fi
  (
    umask 077  # the file is made by the redirection below, inside this subshell: mode 0600
    {
      [[ -f $spark_conf/spark-defaults.conf ]] && cat "$spark_conf/spark-defaults.conf"
      # No REST submission server (port 6066, unauthenticated; a second cluster on the host
      # could not bind it, and the master would stay in STANDBY and register no worker).
      echo "spark.master.rest.enabled false"
      if [[ $AUTH == 1 ]]; then
        echo "spark.authenticate true"
        echo "spark.authenticate.secret $("$PYTHON" -c 'import secrets; print(secrets.token_hex(32))')"
        echo "spark.network.crypto.enabled true"
      fi
    } > "$CONF_DIR/spark-defaults.conf"
  )
}

stop() {
  if [[ ! -f "$PID_FILE" ]]; then
    echo "not running (no $PID_FILE)"
    return 0
  fi
  local pids pid i
  pids=$(tac "$PID_FILE")  # worker first, then master
  for pid in $pids; do
    if alive "$pid"; then kill "$pid"; fi
  done
  for pid in $pids; do
    for ((i = 0; i < 40 && $(alive "$pid" && echo 1 || echo 0); i++)); do sleep 0.5; done
    if alive "$pid"; then
      echo "pid $pid did not stop in 20 s; killing it" >&2
      kill -9 "$pid" 2>/dev/null || true
    fi
  done
  rm -f "$PID_FILE"
  rm -rf "$CONF_DIR"
  echo "stopped (pids $(echo $pids | tr '\n' ' '))"
}

status() {
  if [[ ! -f "$PID_FILE" ]]; then echo "not running"; return 1; fi
  local pid state=0
  for pid in $(cat "$PID_FILE"); do
    if alive "$pid"; then echo "pid $pid running"; else echo "pid $pid gone"; state=1; fi
  done
  echo "master $MASTER_URL"
  return $state
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
