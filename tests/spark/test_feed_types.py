"""C24 on local-cluster[2,1,1024]: ``cluster.train(df)`` (Arrow chunks) delivers the values of
``df.rdd`` for an ``array<array<float>>`` image column, a ``VectorAssembler`` output (dense
and sparse vectors), a struct column, a map column and a ``list<long>`` column holding 2^60+1
and a null; ``as_dataset`` gives the image column as a (batch, 2, 3) float32 tensor and the
vector column (dense and sparse) as a (batch, 3) float64 tensor."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pyspark")

from tfos import TFCluster  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.tf]

INPUT = TFCluster.InputMode.SPARK
N = 24
BIG = 2**60 + 1


def rows_and_images_fun(args, ctx):
    """Reads queue 'input' row by row (a thread) and queue 'images' through as_dataset;
    pickles what it got to ``<out>/<node>.pkl``."""
    import os as _os
    import pickle as _pickle
    import threading

    _os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    import tensorflow as tf

    from tfos import TFNode

    rows: list = []
    errors: list = []

    def read_rows() -> None:
        try:
            feed = TFNode.DataFeed(ctx.mgr, train_mode=True, qname_in="input")
            while not feed.should_stop():
                rows.extend(feed.next_batch(5))
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            errors.append(repr(exc))

    reader = threading.Thread(target=read_rows)
    reader.start()
    feed = TFNode.DataFeed(ctx.mgr, train_mode=True, qname_in="images")
    sig = (tf.TensorSpec((None, 2, 3), tf.float32), tf.TensorSpec((None, 3), tf.float64), tf.TensorSpec((None,), tf.int64))
    batches = [(x.numpy(), v.numpy(), y.numpy()) for x, v, y in feed.as_dataset(4, sig)]
    reader.join(300)
    with open(f"{args['out']}/{ctx.job_name}{ctx.task_index}.pkl", "wb") as f:
        _pickle.dump({"rows": rows, "batches": batches, "errors": errors}, f)


def _same(got, want, where: str) -> None:
    """Equal values and equal types, recursively (Rows field by field)."""
    assert type(got) is type(want), f"{where}: {type(got).__name__} {got!r} != {type(want).__name__} {want!r}"
    if isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where}: {got!r} != {want!r}"
        if hasattr(want, "__fields__"):
            assert got.__fields__ == want.__fields__, where
        for i, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"{where}[{i}]")
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for k in want:
            _same(got[k], want[k], f"{where}[{k!r}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def test_c24_rows_carry_df_rdd_values_and_as_dataset_gives_images(sc, tmp_path: Path, no_leftovers):
    from pyspark.ml.feature import VectorAssembler
    from pyspark.ml.linalg import DenseVector, SparseVector
    from pyspark.sql import SparkSession

    spark = SparkSession.builder.getOrCreate()

    def make(i: int) -> tuple:
        img = [[float(i), 0.5, 0.0], [1.0, 1.0, float(-i)]]
        # rows 0, 3, 6...: three zeros -> VectorAssembler emits a SparseVector; others dense
        xs = (0.0, 0.0, 0.0) if i % 3 == 0 else (float(i), 2.0, 3.0)
        longs = [BIG, None] if i % 2 == 0 else [i, BIG + i]
        return (i, img, *xs, (float(i), float(i) / 4), {"k": i, "j": None} if i % 4 else None, longs)

    schema = ("id long, img array<array<float>>, x1 double, x2 double, x3 double, "
              "st struct<a:double,b:double>, m map<string,long>, longs array<long>")
    raw = spark.createDataFrame(sc.parallelize(range(N), 3).map(make), schema)
    df = VectorAssembler(inputCols=["x1", "x2", "x3"], outputCol="features").transform(raw).select(
        "id", "img", "features", "st", "m", "longs")
    expected = {r.id: r for r in df.rdd.collect()}
    assert len(expected) == N
    assert {type(r.features) for r in expected.values()} == {DenseVector, SparseVector}

    cluster = TFCluster.run(sc, rows_and_images_fun, {"out": str(tmp_path)}, 2, 0, input_mode=INPUT,
                            queues=["input", "images"])
    cluster.train(df, num_epochs=1, feed_timeout=300, qname="input")
    cluster.train(df.select("img", "features", "id"), num_epochs=1, feed_timeout=300, qname="images")
    cluster.shutdown(timeout=300)

    reports = {p.stem: pickle.loads(p.read_bytes()) for p in sorted(tmp_path.glob("*.pkl"))}
    assert set(reports) == {"worker0", "worker1"}
    assert all(r["errors"] == [] for r in reports.values()), reports
    rows = [row for r in reports.values() for row in r["rows"]]
    assert sorted(row[0] for row in rows) == list(range(N))
    for row in rows:
        want = expected[row[0]]
        assert len(row) == len(want)
        # the image column: a (2, 3) float32 numpy array holding df.rdd's numbers
        assert isinstance(row[1], np.ndarray) and row[1].dtype == np.float32 and row[1].shape == (2, 3)
        assert row[1].tolist() == want.img
        for i, name in ((0, "id"), (2, "features"), (3, "st"), (4, "m"), (5, "longs")):
            _same(row[i], want[i], f"row {row[0]} {name}")
    got_longs = [row[5] for row in rows if row[0] == 0]
    assert got_longs == [[1152921504606846977, None]]

    batches = [b for r in reports.values() for b in r["batches"]]
    assert batches and all(x.shape[1:] == (2, 3) and x.dtype == np.float32 for x, _, _ in batches)
    assert all(v.shape[1:] == (3,) and v.dtype == np.float64 for _, v, _ in batches)
    assert all(x.shape[0] == v.shape[0] == y.shape[0] <= 4 for x, v, y in batches)
    by_id = {int(i): (x, v) for xb, vb, yb in batches for x, v, i in zip(xb, vb, yb)}
    assert sorted(by_id) == list(range(N))
    for i, (x, v) in by_id.items():
        assert x.tolist() == expected[i].img
        # ML vectors on the column path: dense ones as they are, sparse ones densified
        assert v.tolist() == expected[i].features.toArray().tolist()
