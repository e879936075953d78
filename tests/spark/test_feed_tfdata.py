"""The DataFeed -> tf.data fast path (``DataFeed.as_dataset(per_epoch=True)``,
tfos/_data/tfdata.py) on local-cluster[2,1,1024]: a tf_keras model under
MultiWorkerMirroredStrategy on 2 workers trains for 3 epochs (one ``fit`` per epoch on one
dataset), from an
RDD (pickled batches) and from a DataFrame (Arrow chunks); every epoch hands TensorFlow
exactly the fed rows (counts and checksums), with the declared shapes and dtypes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pyspark")

from tfos import TFCluster  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.tf]

INPUT = TFCluster.InputMode.SPARK
K = 8


def _row(i: int) -> tuple:
    """Row ``i``: ``(float32[8] x, int label)``; also called in Spark closures."""
    return np.arange(K, dtype=np.float32) + np.float32(i % 97), i % 10


def per_epoch_fit(args, ctx):
    """One fit() over all epochs of the feed; writes what the dataset handed TensorFlow."""
    import os as _os

    _os.environ["TF_USE_LEGACY_KERAS"] = "1"
    _os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    import tensorflow as tf
    import tf_keras as keras

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.layers.Dense(10, activation="softmax", input_shape=(K,))])
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    feed = ctx.get_data_feed()
    sig = (tf.TensorSpec((None, K), tf.float32), tf.TensorSpec((None,), tf.int64))
    ds = feed.as_dataset(args["batch"], sig, per_epoch=True)
    reader = ds.tfos_batches
    reader.track_sums = True
    losses = []
    for epoch in range(args["epochs"]):  # one fit per epoch, one dataset for all
        losses += model.fit(ds, initial_epoch=epoch, epochs=epoch + 1, verbose=0).history["loss"]
    while not reader.ended:
        for _ in reader:
            pass
    spec = ds.element_spec
    seen = {"x": [f"{spec[0].dtype.name}{spec[0].shape.as_list()}"], "y": [f"{spec[1].dtype.name}{spec[1].shape.as_list()}"]}
    with open(f"{args['out']}/{ctx.job_name}{ctx.task_index}.json", "w") as f:
        json.dump({
            "rows": {str(e): n for e, n in reader.rows.items()},
            "sums": {str(e): s for e, s in reader.sums.items()},
            "epochs_run": len(losses),
            "spec": seen,
            "batches": reader.batches_out,
        }, f)


def _check(out: Path, n: int, epochs: int, ids_sum_x: float, ids_sum_y: int) -> None:
    reports = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json"))}
    assert set(reports) == {"worker0", "worker1"}, reports
    for r in reports.values():
        assert r["epochs_run"] == epochs
        assert r["spec"] == {"x": ["float32[None, 8]"], "y": ["int64[None]"]}
    for e in range(epochs):
        rows = sum(r["rows"].get(str(e), 0) for r in reports.values())
        assert rows == n, (e, reports)
        sx = sum(r["sums"].get(str(e), [0, 0])[0] for r in reports.values())
        sy = sum(r["sums"].get(str(e), [0, 0])[1] for r in reports.values())
        assert sx == pytest.approx(ids_sum_x, rel=1e-12) and sy == ids_sum_y, (e, sx, sy)


def _expected(n: int) -> tuple[float, int]:
    return float(sum(_row(i)[0].astype(np.float64).sum() for i in range(n))), sum(_row(i)[1] for i in range(n))


def test_per_epoch_dataset_mwms_from_rdd(sc, tmp_path):
    n, epochs = 2400, 3
    rdd = sc.parallelize(range(n), 4).map(_row)
    cluster = TFCluster.run(sc, per_epoch_fit, {"out": str(tmp_path), "batch": 64, "epochs": epochs}, 2, 0, input_mode=INPUT)
    cluster.train(rdd, num_epochs=epochs, end_of_feed=True, feed_timeout=300)
    cluster.shutdown(timeout=300)
    _check(tmp_path, n, epochs, *_expected(n))


def test_per_epoch_dataset_mwms_from_dataframe(sc, tmp_path):
    from pyspark.sql import SparkSession

    n, epochs = 1800, 2
    spark = SparkSession.builder.getOrCreate()
    df = spark.createDataFrame(sc.parallelize(range(n), 3).map(lambda i: (_row(i)[0].tolist(), _row(i)[1])),
                               "x array<float>, y long")
    cluster = TFCluster.run(sc, per_epoch_fit, {"out": str(tmp_path), "batch": 50, "epochs": epochs}, 2, 0, input_mode=INPUT)
    cluster.train(df, num_epochs=epochs, end_of_feed=True, feed_timeout=300)
    cluster.shutdown(timeout=300)
    _check(tmp_path, n, epochs, *_expected(n))
