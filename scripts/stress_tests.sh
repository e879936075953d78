#!/usr/bin/env bash
# The README test command under CPU contention: starts N busy-loop processes (default 2,
# i.e. one per core on a 2-core machine), runs `bash scripts/run_tests.sh "$@"` beside them,
# and ends the busy loops by PID whatever happens. Exit status: the test command's.
#
#   bash scripts/stress_tests.sh                      # the whole suite, 2 busy loops
#   STRESS_PROCS=4 bash scripts/stress_tests.sh tests/spark -q
#   STRESS_CMD="python -m pytest" bash scripts/stress_tests.sh tests/spark/test_tf_mode.py
#       (STRESS_CMD replaces `bash scripts/run_tests.sh`, e.g. in an already set-up venv)
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
N="${STRESS_PROCS:-2}"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
  pids=()
}
trap cleanup EXIT
trap 'cleanup; exit 130' INT
trap 'cleanup; exit 143' TERM
for _ in $(seq "$N"); do
  ( trap - INT TERM; while :; do :; done ) &
  pids+=("$!")
done
echo "stress_tests.sh: $N busy-loop process(es): ${pids[*]}" >&2
cd "$ROOT"
if [[ -n "${STRESS_CMD:-}" ]]; then
  $STRESS_CMD "$@"
else
  bash "$ROOT/scripts/run_tests.sh" "$@"
fi
status=$?
cleanup
exit "$status"
