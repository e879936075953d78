#!/usr/bin/env bash
# The main job, end to end (the README's first command):
#   1. write the real MNIST digits as CSV and TFRecords to data/mnist/ (skipped when complete),
#   2. train a Keras 3 MLP on Spark with tfos, InputMode.SPARK, MultiWorkerMirroredStrategy
#      on local-cluster[2,1,1024] (two executor JVMs): output/mnist/export (SavedModel),
#      output/mnist/model.keras, output/mnist/checkpoints/, output/mnist/tensorboard/,
#   3. run cluster.inference over the 10,000 test images: output/mnist/predictions/
#      (label,prediction lines) and the test accuracy, which must be >= 0.97.
# Re-running replaces the outputs. Extra arguments go to the training script
# (e.g. --tensorboard, --epochs 5). MNIST_MIN_ACCURACY overrides the 0.97 check.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"

DATA="data/mnist"
OUT="output/mnist"
MIN_ACCURACY="${MNIST_MIN_ACCURACY:-0.97}"
mkdir -p "$OUT"
LOG="$OUT/run_mnist.log"
: > "$LOG"

export PYTHONUNBUFFERED=1  # the scripts' lines reach the terminal and the log as they are printed

started=$SECONDS
# step NAME COMMAND...: runs COMMAND, tees its output to the log, records its time. A step
# that prints nothing for 10 s (Spark starting, a Spark job writing files) gets a line
# saying it is still running and for how long.
step() {
  local name="$1" began=$SECONDS line part=""
  shift
  echo "=== [run_mnist] $name: $*" | tee -a "$LOG"
  "$@" 2>&1 | while true; do
      if IFS= read -r -t 10 line; then
        printf '%s\n' "$part$line"
        part=""
      elif (( $? > 128 )); then
        part+="$line"  # the start of a line whose end has not come yet: kept whole
        echo "=== [run_mnist] $name: still running, $((SECONDS - began)) s"
      else
        [ -z "$part$line" ] || printf '%s\n' "$part$line"
        break
      fi
    done | tee -a "$LOG"
  TIMES+=("$(printf '%-10s %4d s' "$name" $((SECONDS - began)))")
}
TIMES=()

step "data" python examples/mnist/mnist_data_setup.py --output "$DATA"
step "train" python examples/mnist/keras/mnist_spark.py --images "$DATA/csv/train" --epochs 5 \
  --model_dir "$OUT" --export_dir "$OUT/export" "$@"
step "inference" python examples/mnist/keras/mnist_inference.py --images "$DATA/csv/test" \
  --model_dir "$OUT" --export_dir "$OUT/export" --output "$OUT/predictions"

accuracy="$(sed -n 's/^test accuracy: \([0-9.]*\).*/\1/p' "$LOG" | tail -1)"
echo
echo "=== [run_mnist] summary"
printf '  %s\n' "${TIMES[@]}"
printf '  %-10s %4d s\n' "total" $((SECONDS - started))
echo "  data:        $ROOT/$DATA/{csv,tfr}/{train,test}"
echo "  SavedModel:  $ROOT/$OUT/export"
echo "  Keras file:  $ROOT/$OUT/model.keras"
echo "  predictions: $ROOT/$OUT/predictions/part-* ($(cat "$OUT"/predictions/part-* | wc -l) lines of label,prediction)"
echo "  full log:    $ROOT/$LOG"
echo "  test accuracy: ${accuracy:-?} (target >= $MIN_ACCURACY)"
if [ -z "$accuracy" ] || ! python -c "import sys; sys.exit(0 if float('$accuracy') >= float('$MIN_ACCURACY') else 1)"; then
  echo "[run_mnist] FAILED: test accuracy ${accuracy:-unknown} is below $MIN_ACCURACY" >&2
  exit 1
fi
