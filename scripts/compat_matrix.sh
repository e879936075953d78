#!/usr/bin/env bash
# PySpark 3.5 compatibility run (setup.py allows pyspark>=3.5).
#
# Makes a second venv (default .venv-spark35, gitignored) holding only the newest PySpark
# 3.5.x and its py4j, and lets it use every other package of the main venv (TensorFlow,
# numpy, pyarrow, pytest, ...) through a .pth file placed after its own site-packages, so
# nothing but PySpark is downloaded. tfos itself comes from this checkout (PYTHONPATH).
# Then runs, under Java 17 (which Spark 3.5 supports):
#   1. the unit tests (tests/unit) except tests/unit/test_packaging.py (it installs tfos's
#      wheel with pip, which this venv does not have; packaging is checked in the main venv)
#      and tests/unit/test_typing.py (mypy against PySpark 4's annotations, see below);
#   2. a Spark smoke subset on local-cluster: PySpark's raw frame formats that tfos reads
#      (tfos/_data/spark_rawio.py relies on PySpark internals), InputMode.SPARK feeding from an
#      RDD and a DataFrame (Arrow), inference, InputMode.TENSORFLOW with MWMS, and one
#      failure in each input mode, and saving and loading a TFModel (PySpark's
#      DefaultParamsWriter/Reader differ between 3.5 and 4).
# Extra arguments go to both pytest runs (e.g. -x). Exits non-zero when a test fails.
#
# Needs PyPI once (to install PySpark 3.5.x; set TFOS_SPARK35_VERSION to skip the version
# look-up), then runs offline. Prints the time each step took.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
MAIN_VENV="${TFOS_VENV:-$ROOT/.venv}"
if [ ! -x "$MAIN_VENV/bin/python" ]; then
  source "$ROOT/scripts/setup_env.sh"   # the main venv (Java 17, tfos's dependencies)
fi
MAIN_PY="$MAIN_VENV/bin/python"
export SPARK_LOCAL_IP="${SPARK_LOCAL_IP:-127.0.0.1}"
VENV="${TFOS_SPARK35_VENV:-$ROOT/.venv-spark35}"
T0=$(date +%s)

VERSION="${TFOS_SPARK35_VERSION:-}"
if [ -z "$VERSION" ]; then
  VERSION="$("$MAIN_PY" -m pip index versions pyspark 2>/dev/null \
    | sed -n 's/^Available versions: //p' | tr ',' '\n' | tr -d ' ' | grep -E '^3\.5\.[0-9]+$' \
    | sort -t. -k3,3n | tail -1)"
fi
[ -n "$VERSION" ] || { echo "[compat] could not find a PySpark 3.5.x release (set TFOS_SPARK35_VERSION)" >&2; exit 1; }

if [ ! -x "$VENV/bin/python" ]; then
  echo "[compat] creating $VENV"
  "$MAIN_PY" -m venv --without-pip "$VENV"
fi
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
MAIN_SITE="$("$MAIN_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if [ "$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("pyspark"))' 2>/dev/null || true)" != "$VERSION" ]; then
  echo "[compat] installing pyspark==$VERSION into $VENV"
  "$MAIN_PY" -m pip --python "$VENV/bin/python" install -q "pyspark==$VERSION"
fi
# Everything else from the main venv, after this venv's own packages (so PySpark 3.5 wins).
echo "$MAIN_SITE" > "$SITE/zz_tfos_main_venv.pth"
T1=$(date +%s)

export PYTHONPATH="$ROOT"
export PYSPARK_PYTHON="$VENV/bin/python" PYSPARK_DRIVER_PYTHON="$VENV/bin/python"
unset SPARK_HOME
"$VENV/bin/python" - <<'EOF'
import pyspark, tfos
assert pyspark.__version__.startswith("3.5."), pyspark.__version__
print(f"[compat] PySpark {pyspark.__version__} ({pyspark.__file__}), tfos from {tfos.__file__}")
EOF

echo "[compat] unit tests"
# tests/unit/test_packaging.py builds and installs tfos's wheel with pip, which this venv
# (--without-pip, PySpark only) does not have: packaging is checked in the main venv.
# tests/unit/test_typing.py runs mypy against the installed PySpark's annotations; tfos is
# typed against PySpark 4's (3.5 lacks VariantVal and types saveMetadata's argument as a
# SparkContext): typing is checked in the main venv.
"$VENV/bin/python" -m pytest tests/unit -q --ignore tests/unit/test_packaging.py --ignore tests/unit/test_typing.py "$@"
T2=$(date +%s)
echo "[compat] Spark smoke subset"
"$VENV/bin/python" -m pytest -q "$@" \
  tests/spark/test_spark_rawio.py \
  "tests/spark/test_feed.py::test_train_counts_rows_over_epochs" \
  "tests/spark/test_feed.py::test_train_mnist_rows_from_rdd_and_dataframe" \
  "tests/spark/test_feed.py::test_inference_one_result_per_row_in_order" \
  "tests/spark/test_tf_mode.py::test_mwms_tf_keras_two_nodes" \
  "tests/spark/test_tf_mode.py::test_worker_exception_fails_shutdown" \
  "tests/spark/test_failures.py::test_exception_while_feeding_carries_remote_traceback" \
  "tests/spark/test_pipeline.py::test_pipeline_model_save_load_same_predictions"
T3=$(date +%s)
echo "[compat] PySpark $VERSION passed: set-up $((T1 - T0)) s, unit tests $((T2 - T1)) s, Spark smoke $((T3 - T2)) s, total $((T3 - T0)) s"
