"""What a tfos cluster does under spark.executor.pyspark.memory (docs/api.md "Memory limits").

Starts local-cluster[2,1,<executor MiB>] with spark.executor.pyspark.memory=<value>, runs a
2-node MultiWorkerMirroredStrategy ``fit`` (tf_keras, as TFoS programs use) on random data,
and prints how it ended: the ClusterFailedError naming RLIMIT_AS, or "trained".

    python scripts/pyspark_memory_demo.py 2g          # SIGABRT (pthread_create() failed), named
    python scripts/pyspark_memory_demo.py 1g          # ImportError (failed to map segment), named
    python scripts/pyspark_memory_demo.py 6g --executor-mib 1024
"""

from __future__ import annotations

import argparse
import os


def mwms_fit(args, ctx):
    import numpy as np
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((784,)), tf.keras.layers.Dense(128, activation="relu"), tf.keras.layers.Dense(10)])
        model.compile("adam", tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.rand(2048, 784).astype("float32")
    y = np.random.randint(0, 10, 2048)
    model.fit(x, y, batch_size=64, epochs=1, verbose=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pyspark_memory", help="spark.executor.pyspark.memory, e.g. 2g")
    ap.add_argument("--executor-mib", type=int, default=1024)
    args = ap.parse_args()
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    from pyspark import SparkConf, SparkContext

    from tfos import TFCluster
    from tfos.errors import ClusterFailedError

    conf = (SparkConf().setMaster(f"local-cluster[2,1,{args.executor_mib}]").setAppName("tfos-pyspark-memory")
            .set("spark.ui.enabled", "false").set("spark.driver.host", "127.0.0.1")
            .set("spark.executor.memory", f"{args.executor_mib * 3 // 4}m")
            .set("spark.executor.pyspark.memory", args.pyspark_memory))
    sc = SparkContext(conf=conf)
    sc.setLogLevel("ERROR")
    try:
        cluster = TFCluster.run(sc, mwms_fit, {}, 2, 0, executor_wait_s=300, reservation_timeout=300)
        cluster.shutdown(timeout=1200)
        print(f"spark.executor.pyspark.memory={args.pyspark_memory}: trained")
    except ClusterFailedError as exc:
        print(f"spark.executor.pyspark.memory={args.pyspark_memory}: {exc.failures[0].kind} {exc.failures[0].error_type}: "
              f"{exc.failures[0].message}")
    finally:
        sc.stop()


if __name__ == "__main__":
    main()
