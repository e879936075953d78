"""Spark tests of InputMode.SPARK feeding: train() of RDDs and DataFrames, inference().

Keras trained from the feed under MultiWorkerMirroredStrategy: Keras 3 in
tests/spark/test_keras3_spark.py (against one process), tf_keras in
tests/spark/test_feed_tfdata.py and test_feed_cases.py.

Every test runs a real tfos cluster on the shared ``local-cluster[2,1,1024]`` context
(two executor JVMs, one node per executor). The main_funs write what they saw to
``tmp_path`` (one JSON file per node) and the tests assert exact counts and sums.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pyspark")

from tfos import TFCluster  # noqa: E402

pytestmark = pytest.mark.spark

INPUT = TFCluster.InputMode.SPARK


def _node_reports(out_dir: Path) -> dict[str, dict]:
    """``{file stem: report}`` of every node report written to ``out_dir``."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(out_dir.glob("*.json"))}


# --------------------------------------------------------------------------- main_funs
# Module-level functions ship by value (conftest registers this module with cloudpickle).


def count_fun(args, ctx):
    """Reads the feed until the end of feed; writes the row count and value sum."""
    import json as _json

    from tfos import TFNode

    feed = TFNode.DataFeed(ctx.mgr, train_mode=True)
    n = total = 0
    kinds = set()
    while not feed.should_stop():
        batch = feed.next_batch(64)
        n += len(batch)
        for x in batch:
            kinds.add(type(x).__name__)
            total += x
    with open(f"{args['out']}/{ctx.job_name}{ctx.task_index}.json", "w") as f:
        _json.dump({"rows": n, "sum": total, "kinds": sorted(kinds)}, f)


def mnist_fun(args, ctx):
    """Checks every MNIST-shaped row (float32[784] image, int label) and checksums them.

    Rows with labels < 1000 came from the RDD, the others from the DataFrame: both are
    counted separately.
    """
    import json as _json

    import numpy as _np

    from tfos import TFNode

    feed = TFNode.DataFeed(ctx.mgr, train_mode=True)
    stats = {src: {"rows": 0, "img_sum": 0.0, "label_sum": 0} for src in ("rdd", "df")}
    bad: list[str] = []
    while not feed.should_stop():
        for row in feed.next_batch(100):
            img, label = row
            if not (isinstance(img, _np.ndarray) and img.dtype == _np.float32 and img.shape == (784,)):
                bad.append(f"image {type(img).__name__} {getattr(img, 'dtype', '')} {getattr(img, 'shape', '')}")
            if not isinstance(label, int):
                bad.append(f"label {type(label).__name__}")
            s = stats["rdd" if label < 1000 else "df"]
            s["rows"] += 1
            s["img_sum"] += float(_np.asarray(img, dtype=_np.float64).sum())
            s["label_sum"] += int(label)
    with open(f"{args['out']}/{ctx.job_name}{ctx.task_index}.json", "w") as f:
        _json.dump({"stats": stats, "bad": bad[:10]}, f)


def square_fun(args, ctx):
    """Inference: answers every batch with x * x."""
    from tfos import TFNode

    feed = TFNode.DataFeed(ctx.mgr, train_mode=False)
    while not feed.should_stop():
        batch = feed.next_batch(args["batch_size"])
        if batch:
            feed.batch_results([x * x for x in batch])


def train_and_square_fun(args, ctx):
    """One main_fun for train() and inference() (docs/datafeed.md): ``feed.batch_mode``
    tells the batches apart; "trains" on (counts and sums) the train() rows, answers the
    inference() rows with x * x. Training rows are < 1000, inference rows >= 1000."""
    import json as _json

    feed = ctx.get_data_feed(train_mode=True)
    n = total = 0
    wrong = []
    while not feed.should_stop():
        batch = feed.next_batch(args["batch_size"])
        if not batch:
            continue
        if feed.batch_mode == "inference":
            feed.batch_results([x * x for x in batch])
            wrong += [x for x in batch if x < 1000]
        else:
            n += len(batch)
            total += sum(batch)
            wrong += [x for x in batch if x >= 1000 or feed.batch_mode != "train"]
    with open(f"{args['out']}/{ctx.job_name}{ctx.task_index}.json", "w") as f:
        _json.dump({"rows": n, "sum": total, "wrong": wrong[:10]}, f)


def _image(i: int) -> np.ndarray:
    """The deterministic float32[784] image of row ``i`` (also called in Spark closures)."""
    return ((np.arange(784, dtype=np.int64) + i) % 10).astype(np.float32) / np.float32(8.0)


# ------------------------------------------------------------------------------- tests


def test_train_counts_rows_over_epochs(sc, tmp_path):
    """1,000 ints in 10 partitions, 3 epochs, 2 nodes: exactly 3,000 rows arrive, sum 3x."""
    rows, epochs = 1000, 3
    rdd = sc.parallelize(range(rows), 10)
    t0 = time.monotonic()
    cluster = TFCluster.run(sc, count_fun, {"out": str(tmp_path)}, 2, 0, input_mode=INPUT)
    cluster.train(rdd, num_epochs=epochs)
    cluster.shutdown(timeout=120)
    reports = _node_reports(tmp_path)
    assert set(reports) == {"worker0", "worker1"}, reports
    assert sum(r["rows"] for r in reports.values()) == rows * epochs
    assert sum(r["sum"] for r in reports.values()) == epochs * sum(range(rows))
    assert all(r["kinds"] in ([], ["int"]) for r in reports.values()), reports
    assert time.monotonic() - t0 < 180


def test_train_mnist_rows_from_rdd_and_dataframe(sc, tmp_path):
    """MNIST-shaped rows keep shape and dtype, from an RDD (pickled batches) and from a
    DataFrame (Arrow record batches through mapInArrow); counts and checksums are exact."""
    from pyspark.sql import SparkSession

    n_rdd, n_df, df_epochs = 400, 300, 2
    rdd = sc.parallelize(range(n_rdd), 4).map(lambda i: (_image(i), i % 10))
    spark = SparkSession.builder.getOrCreate()
    df = spark.createDataFrame(
        sc.parallelize(range(n_df), 3).map(lambda i: (_image(i).tolist(), 1000 + i)),
        "image array<float>, label long",
    )
    assert df.rdd.getNumPartitions() == 3
    cluster = TFCluster.run(sc, mnist_fun, {"out": str(tmp_path)}, 2, 0, input_mode=INPUT)
    cluster.train(rdd, num_epochs=1)
    cluster.train(df, num_epochs=df_epochs)
    cluster.shutdown(timeout=120)

    reports = _node_reports(tmp_path)
    assert set(reports) == {"worker0", "worker1"}
    assert all(r["bad"] == [] for r in reports.values()), reports
    got = {src: {k: sum(r["stats"][src][k] for r in reports.values()) for k in ("rows", "img_sum", "label_sum")} for src in ("rdd", "df")}
    img_sum = lambda ids: float(sum(_image(i).astype(np.float64).sum() for i in ids))  # noqa: E731
    assert got["rdd"]["rows"] == n_rdd
    assert got["rdd"]["label_sum"] == sum(i % 10 for i in range(n_rdd))
    assert got["rdd"]["img_sum"] == pytest.approx(img_sum(range(n_rdd)), rel=1e-9)
    assert got["df"]["rows"] == n_df * df_epochs
    assert got["df"]["label_sum"] == df_epochs * sum(1000 + i for i in range(n_df))
    assert got["df"]["img_sum"] == pytest.approx(df_epochs * img_sum(range(n_df)), rel=1e-9)


def test_inference_one_result_per_row_in_order(sc):
    """x -> x*x over 1,000 rows in 10 partitions: one result per row, in input order."""
    rows = 1000
    rdd = sc.parallelize(range(rows), 10)
    with TFCluster.run(sc, square_fun, {"batch_size": 64}, 2, 0, input_mode=INPUT) as cluster:
        out = cluster.inference(rdd)
        results = out.collect()
    assert len(results) == rows
    assert sum(results) == sum(x * x for x in range(rows))
    assert results == [x * x for x in range(rows)]


def test_one_cluster_trains_then_infers(sc, tmp_path):
    """The flow at the top of docs/datafeed.md on one cluster with one main_fun (TFoS's
    default train_mode=True, ``feed.batch_mode`` to tell the batches apart): train() 2 epochs of 300 rows,
    inference() of 500 rows (exact, in order), then a last train(..., end_of_feed=True),
    after which inference() is refused up front."""
    from tfos.errors import ConfigurationError

    train_rdd = sc.parallelize(range(300), 4)
    infer_rdd = sc.parallelize(range(1000, 1500), 5)
    with TFCluster.run(sc, train_and_square_fun, {"out": str(tmp_path), "batch_size": 64}, 2, 0, input_mode=INPUT) as cluster:
        cluster.train(train_rdd, num_epochs=2)
        results = cluster.inference(infer_rdd).collect()
        assert results == [x * x for x in range(1000, 1500)]
        cluster.train(train_rdd, num_epochs=1, end_of_feed=True)
        with pytest.raises(ConfigurationError, match=r"inference\(\): the feed already ended \(an earlier train\(\.\.\., end_of_feed=True\)"):
            cluster.inference(infer_rdd)
    reports = _node_reports(tmp_path)
    assert set(reports) == {"worker0", "worker1"}, reports
    assert all(r["wrong"] == [] for r in reports.values()), reports
    assert sum(r["rows"] for r in reports.values()) == 3 * 300
    assert sum(r["sum"] for r in reports.values()) == 3 * sum(range(300))
