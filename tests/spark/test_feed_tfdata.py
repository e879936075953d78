"""The DataFeed -> tf.data fast path (``DataFeed.as_dataset(per_epoch=True)``,
tfos/_data/tfdata.py) on local-cluster[2,1,1024]: a tf_keras model under
MultiWorkerMirroredStrategy on 2 workers trains for 3 epochs (one ``fit`` per epoch on one
dataset, or one ``fit`` over all epochs with ``as_dataset(steps_per_epoch=S)``), from an
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
    steps = args.get("steps")
    losses = []
    if steps:  # one fit over all epochs: every epoch is `steps` batches on every worker
        ds = feed.as_dataset(args["batch"], sig, steps_per_epoch=steps)
        reader = ds.tfos_batches
        reader.track_sums = True
        dist = strategy.distribute_datasets_from_function(lambda _ctx: ds)
        losses += model.fit(dist, epochs=args["epochs"], steps_per_epoch=steps, verbose=0).history["loss"]
    else:
        ds = feed.as_dataset(args["batch"], sig, per_epoch=True)
        reader = ds.tfos_batches
        reader.track_sums = True
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
            "steps_run": int(model.optimizer.iterations.numpy()),
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


def test_steps_per_epoch_one_fit_mwms_uneven_partitions(sc, tmp_path):
    """as_dataset(steps_per_epoch=S): one fit(epochs=3, steps_per_epoch=S) under MWMS on
    partitions of unequal sizes (the workers get different rows per epoch): Keras runs
    exactly 3 x S steps on each worker and every epoch hands TensorFlow exactly the fed rows."""
    from tfos.datafeed import DataFeed

    n, epochs, batch = 2000, 3, 40
    sizes = [700, 100, 500, 300, 400]  # 5 partitions, unequal

    def part(index, _it):
        start = sum(sizes[:index])
        return [_row(i) for i in range(start, start + sizes[index])]

    rdd = sc.parallelize(range(5), 5).mapPartitionsWithIndex(part)
    steps = DataFeed.steps_per_epoch(n, batch, 2)
    args = {"out": str(tmp_path), "batch": batch, "epochs": epochs, "steps": steps}
    cluster = TFCluster.run(sc, per_epoch_fit, args, 2, 0, input_mode=INPUT)
    cluster.train(rdd, num_epochs=epochs, end_of_feed=True, feed_timeout=300)
    cluster.shutdown(timeout=300)
    _check(tmp_path, n, epochs, *_expected(n))
    for r in (json.loads(p.read_text()) for p in tmp_path.glob("*.json")):
        assert r["steps_run"] == epochs * steps, r


def read_epochs(args, ctx):
    """Reads the feed with as_dataset(per_epoch=True or steps_per_epoch=S), without a model;
    writes the rows, sums and batches of every epoch and how often a later epoch was held."""
    import os as _os

    _os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    import tensorflow as tf

    feed = ctx.get_data_feed()
    sig = (tf.TensorSpec((None, K), tf.float32), tf.TensorSpec((None,), tf.int64))
    if args["steps"]:
        ds = feed.as_dataset(args["batch"], sig, steps_per_epoch=args["steps"])
    else:
        ds = feed.as_dataset(args["batch"], sig, per_epoch=True)
    reader = ds.tfos_batches
    reader.track_sums = True
    while not reader.ended:
        for _ in reader:
            pass
    with open(f"{args['out']}/{ctx.job_name}{ctx.task_index}.json", "w") as f:
        json.dump({"rows": {str(e): n for e, n in reader.rows.items()},
                   "sums": {str(e): s for e, s in reader.sums.items()},
                   "batches": reader.batches_out, "waits": reader.order.waits, "epochs_run": 2,
                   "spec": {"x": ["float32[None, 8]"], "y": ["int64[None]"]}}, f)


@pytest.mark.parametrize("steps", [0, 4])
def test_epochs_stay_whole_when_spark_runs_a_later_epoch_first(sc, tmp_path, steps):
    """One node, two executors: the feed task of partition 1 of epoch 0 (job index 1)
    produces its rows only after partition 0 of epoch 1 (job index 4) was produced, so the
    other executor feeds partitions 0, 2, 3 and then epoch 1's partition 0 to the node
    first. The node holds epoch 1 back until the driver says every partition of epoch 0
    was handed over and it read its own to the end: both epochs hold exactly the 4 x 150
    rows of one pass (the first chunk of epoch 1 used to end epoch 0 early, and partition
    1's rows then counted in epoch 1)."""
    n, parts, epochs = 600, 4, 2
    marker = str(tmp_path / "epoch1-part0-produced")

    def part(index, _it):
        import os as _os
        import time as _time

        from pyspark import TaskContext

        job_index = TaskContext.get().partitionId()
        if job_index == 1:  # epoch 0, partition 1: after epoch 1's partition 0 (at most 120 s)
            end = _time.monotonic() + 120
            while not _os.path.exists(marker) and _time.monotonic() < end:
                _time.sleep(0.05)
            _time.sleep(2.0)  # its chunk reaches the node first
        yield from (_row(i) for i in range(index * 150, index * 150 + 150))
        if job_index == 4:
            open(marker, "w").close()

    rdd = sc.parallelize(range(parts), parts).mapPartitionsWithIndex(part)
    args = {"out": str(tmp_path / "out"), "batch": 40, "steps": steps}
    (tmp_path / "out").mkdir()
    cluster = TFCluster.run(sc, read_epochs, args, 1, 0, input_mode=INPUT)
    cluster.train(rdd, num_epochs=epochs, end_of_feed=True, feed_timeout=300)
    cluster.shutdown(timeout=300)
    (report,) = [json.loads(p.read_text()) for p in (tmp_path / "out").glob("*.json")]
    sx, sy = _expected(n)
    for e in range(epochs):
        assert report["rows"][str(e)] == n, report
        assert report["sums"][str(e)][0] == pytest.approx(sx, rel=1e-12) and report["sums"][str(e)][1] == sy, report
    assert report["waits"] >= 1, report  # the node did see epoch 1 first
    if steps:
        assert report["batches"] == epochs * steps, report


def read_epochs_or_terminate(args, ctx):
    """worker:1 terminates its feed at once (C11); worker:0 reads every epoch with
    as_dataset(per_epoch=True) and writes what each epoch held."""
    if ctx.task_index == 1:
        ctx.get_data_feed().terminate()
        open(f"{args['out']}/worker1-terminated", "w").close()  # the test feeds after this
        return
    read_epochs(dict(args, steps=0), ctx)


def test_epoch_order_does_not_wait_for_partitions_a_terminated_node_skipped(sc, tmp_path):
    """C11 with the epoch-aware reader: worker:1 calls terminate() before reading, so the
    feed tasks on its executor skip their partitions and report them skipped to the driver
    (``partition_skipped``, counted by ``epoch_handover``); worker:0 still reads every epoch
    of its own partitions, and nothing waits for the 120 s bound (feed_timeout/2, far above
    what the feed takes on a loaded machine). (The end
    of the feed also ends a hold, so the time bound alone does not show the reports: the
    driver's record is checked directly.)"""
    import time as _time

    n, parts, epochs = 1200, 8, 3
    rdd = sc.parallelize(range(n), parts).map(_row)
    out = tmp_path / "out"
    out.mkdir()
    cluster = TFCluster.run(sc, read_epochs_or_terminate, {"out": str(out), "batch": 50}, 2, 0, input_mode=INPUT)
    # Feed only once worker:1 has terminated: a feed task that reached it earlier would hand
    # it a partition (run() returns when the nodes registered, before main_fun runs).
    end = _time.monotonic() + 120
    while not (out / "worker1-terminated").exists() and _time.monotonic() < end:
        _time.sleep(0.1)
    assert (out / "worker1-terminated").exists(), "worker:1 never called terminate()"
    t0 = _time.monotonic()
    cluster.train(rdd, num_epochs=epochs, end_of_feed=True, feed_timeout=240)
    claimed, skipped = cluster._ctl.backend.host.read(
        lambda core: ({k: dict(v) for k, v in core.ledger.claimed.items()}, {k: set(v) for k, v in core.ledger.skipped.items()}))
    cluster.shutdown(timeout=120)
    elapsed = _time.monotonic() - t0
    (report,) = [json.loads(p.read_text()) for p in out.glob("*.json")]
    assert elapsed < 100, (elapsed, report)  # no boundary waited for the 120 s bound
    assert report["rows"] and set(report["rows"]) <= {"0", "1", "2"}, report
    assert sum(report["rows"].values()) % 150 == 0 and 0 < sum(report["rows"].values()) <= epochs * n, report
    # every job partition was either handed to worker:0 or reported skipped, none both
    (feed_id,) = claimed
    mine = set(claimed[feed_id])
    assert all(node.startswith("worker:0 ") for node in claimed[feed_id].values()), claimed
    assert mine | skipped.get(feed_id, set()) == set(range(parts * epochs)), (mine, skipped)
    assert not mine & skipped.get(feed_id, set()) and skipped.get(feed_id), (mine, skipped)
    assert sum(report["rows"].values()) == 150 * len(mine), (report, mine)


@pytest.mark.parametrize("steps", [0, 3])
def test_epochs_continue_across_train_calls(sc, tmp_path, steps):
    """train(a, 2) then train(b, 1) on one cluster of 2 nodes, read with one epoch-aware
    dataset per node: the dataset has 3 epochs, epochs 0 and 1 hold exactly the rows of
    a and epoch 2 exactly those of b (the second call's epoch 0 used to be merged into the
    dataset's epoch 0 or 1, found by a new user)."""
    n = 600
    a = sc.parallelize(range(n), 4).map(_row)
    b = sc.parallelize(range(n, 2 * n), 4).map(_row)
    out = tmp_path / "out"
    out.mkdir()
    cluster = TFCluster.run(sc, read_epochs, {"out": str(out), "batch": 40, "steps": steps}, 2, 0, input_mode=INPUT)
    cluster.train(a, num_epochs=2)
    cluster.train(b, num_epochs=1, end_of_feed=True)
    cluster.shutdown(timeout=300)
    reports = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    assert len(reports) == 2, reports
    sums_a = _expected(n)
    sums_b = (float(sum(_row(i)[0].astype(np.float64).sum() for i in range(n, 2 * n))), sum(_row(i)[1] for i in range(n, 2 * n)))
    for e, (sx, sy) in enumerate((sums_a, sums_a, sums_b)):
        assert sum(r["rows"].get(str(e), 0) for r in reports) == n, (e, reports)
        assert sum(r["sums"].get(str(e), [0, 0])[0] for r in reports) == pytest.approx(sx, rel=1e-12), (e, reports)
        assert sum(r["sums"].get(str(e), [0, 0])[1] for r in reports) == sy, (e, reports)
    assert all(set(r["rows"]) <= {"0", "1", "2"} for r in reports), reports
    if steps:
        assert [r["batches"] for r in reports] == [3 * steps, 3 * steps], reports


def direct_fit_counting(args, ctx):
    """model.fit(ds) with the dataset as is (Keras distributes it under MWMS); the model's
    train_step counts the rows and sums the ids it trained on (metrics: summed over replicas)."""
    import os as _os

    _os.environ["TF_USE_LEGACY_KERAS"] = "1"
    _os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    import tensorflow as tf
    import tf_keras as keras

    strategy = tf.distribute.MultiWorkerMirroredStrategy()

    class Counting(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1)
            self.rows = keras.metrics.Sum(name="rows")
            self.ids = keras.metrics.Sum(name="ids")

        def call(self, x):
            return self.dense(x)

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((self(x)[:, 0] - y) ** 2)
            self.optimizer.apply_gradients(zip(tape.gradient(loss, self.trainable_variables), self.trainable_variables))
            self.rows.update_state(tf.cast(tf.shape(x)[0], tf.float64))
            self.ids.update_state(tf.reduce_sum(tf.cast(x[:, 0], tf.float64)))
            return {"rows": self.rows.result(), "ids": self.ids.result()}

        @property
        def metrics(self):
            return [self.rows, self.ids]

    with strategy.scope():
        model = Counting()
        model.compile(optimizer=keras.optimizers.SGD(0.0))
    ds = ctx.get_data_feed().as_dataset(args["batch"], (tf.TensorSpec((None,), tf.float32),) * 2)
    hist = model.fit(ds.map(lambda a, b: (tf.stack([a, a], 1), b)), epochs=1, verbose=0).history
    with open(f"{args['out']}/{ctx.job_name}{ctx.task_index}.json", "w") as f:
        json.dump({"rows": hist["rows"][-1], "ids": hist["ids"][-1]}, f)


def test_dataset_given_to_fit_as_is_under_mwms_trains_every_row_once(sc, tmp_path):
    """The quick start's form: as_dataset(64) handed to model.fit as is under
    MultiWorkerMirroredStrategy (Keras splits each batch over the replicas of all workers):
    the 2 workers together train on each of the 4,000 fed rows exactly once (row count and
    id sum, summed over the replicas by the metrics)."""
    n = 4000
    out = tmp_path / "out"
    out.mkdir()
    rdd = sc.parallelize([(float(i), float(i)) for i in range(n)], 4)
    cluster = TFCluster.run(sc, direct_fit_counting, {"out": str(out), "batch": 64}, 2, 0, input_mode=INPUT, master_node="chief")
    cluster.train(rdd, 1, end_of_feed=True)
    cluster.shutdown(timeout=300)
    reports = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    assert [(r["rows"], r["ids"]) for r in reports] == [(n, float(sum(range(n))))] * 2, reports
