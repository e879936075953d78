#!/usr/bin/env bash
# Runs TensorFlowOnSpark's own test suite against tfos, with only the imports renamed.
#
#   bash scripts/run_tfos_suite.sh /path/to/TensorFlowOnSpark [unittest args...]
#
# Fetches nothing: give it a TFoS checkout (e.g. tag v2.2.5). Its tests/ are copied to a
# temporary directory, every "tensorflowonspark" becomes "tfos" (imports and mock.patch
# targets), and `python -m unittest discover` runs there, on local-cluster[2,1,1024] unless
# MASTER is set. Nothing is written to the checkout or to this repository.
set -euo pipefail
SRC="${1:?usage: run_tfos_suite.sh /path/to/TensorFlowOnSpark [unittest args...]}"
shift || true
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ -d "$SRC/tests" ] || { echo "no tests/ in $SRC" >&2; exit 2; }
WORK="$(mktemp -d /tmp/tfos_suite.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
cp -r "$SRC/tests" "$WORK/tests"
grep -rl tensorflowonspark "$WORK/tests" | xargs -r sed -i 's/tensorflowonspark/tfos/g'
# TFoS's test.py asserts SPARK_CLASSPATH (for spark.jars): TFoS's own tensorflow-hadoop jar
# (lib/ of the checkout); tfos reads and writes TFRecords without it, so if it is missing any
# jar already on Spark's class path will do.
PYSPARK_JARS="$(python -c 'import os, pyspark; print(os.path.join(os.path.dirname(pyspark.__file__), "jars"))')"
TFOS_HADOOP_JAR="$(ls "$SRC"/lib/tensorflow-hadoop-*.jar 2>/dev/null | head -1 || true)"
export SPARK_CLASSPATH="${SPARK_CLASSPATH:-${TFOS_HADOOP_JAR:-$(ls "$PYSPARK_JARS"/spark-core_*.jar | head -1)}}"
export MASTER="${MASTER:-local-cluster[2,1,1024]}"
export SPARK_WORKER_INSTANCES="${SPARK_WORKER_INSTANCES:-2}"
export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}"
# Keras (docs/migration.md): TFoS's tests build tf.keras objects on the driver and ship them
# to the nodes, so the driver uses tf_keras too; the TF processes inherit the driver's value.
export TF_USE_LEGACY_KERAS="${TF_USE_LEGACY_KERAS:-1}"
cd "$WORK/tests"
python -m unittest "${@:-discover}" -v
