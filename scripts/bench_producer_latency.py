#!/usr/bin/env python
"""Where a slow producer's rows wait before ``main_fun`` sees them.

One partition of ``--rows`` rows produced one every ``--every`` seconds (an upstream
decoder, a remote read). Each row carries the time it was produced; whoever reads it
notes how long after that it arrived (same host, one clock). Printed per reader: the
batches it saw (rows each), the lag of the partition's first row, the median lag over
its rows and the largest (a lag near the partition's duration means the rows were held
until the partition ended).

PySpark alone (no tfos; a Spark task's Python function reads the partition):

* ``rdd pipelined``: ``rdd.map(produce).mapPartitions(read)``: the reader runs in the
  producer's own Python worker (how tfos feeds a Python-pipelined RDD);
* ``rdd raw frames``: the same RDD read as the raw PySpark batches of its own worker's
  output (``tfos._data.spark_rawio.raw_records``; how tfos fed it before);
* ``df python udf, mapInArrow``: a DataFrame whose column comes from a slow Python UDF,
  read with ``mapInArrow`` (tfos's DataFrame feed), with Spark's defaults and with
  ``spark.sql.execution.arrow.maxRecordsPerBatch=4``;
* ``df jvm, mapInArrow``: a DataFrame whose rows the JVM produces slowly (``reflect`` of
  ``Thread.sleep``, as a slow JVM source would), read with ``mapInArrow``: defaults;
  ``maxRecordsPerBatch=4``; plus ``spark.sql.execution.pandas.udf.buffer.size=4096``; and
  ``maxRecordsPerBatch=1`` with a buffer of 8 bytes;
* ``df jvm, df.rdd raw frames``: the same DataFrame's ``df.rdd`` as raw batches.

Through tfos (``--tfos``, a 1-node InputMode.SPARK cluster whose ``main_fun`` reads with
``next_batch(1)``): the lag of the rows at ``main_fun`` for the slow RDD and for the
slow-UDF DataFrame.

Usage::

    .venv/bin/python scripts/bench_producer_latency.py --rows 40 --every 0.05 --tfos

Figures: docs/datafeed.md "Latency: the linger time".
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
import time

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("TFOS_PROGRESS", "0")


def _batches_seen(items, stamp):
    """[(rows, lag of the batch's first row, lag of its last row, every row's lag)] of one
    partition (task)."""
    out = []
    for item in items:
        now = time.time()
        stamps = stamp(item)
        out.append((len(stamps), now - stamps[0], now - stamps[-1], [now - t for t in stamps]))
    return out


def _report(name: str, seen: list, partition_s: float) -> None:
    import statistics

    first_lag = seen[0][1] if seen else float("nan")
    worst = max((b[1] for b in seen), default=float("nan"))
    lags = [x for b in seen for x in b[3]]
    median = statistics.median(lags) if lags else float("nan")
    sizes = [b[0] for b in seen]
    shown = " ".join(map(str, sizes[:12])) + (" ..." if len(sizes) > 12 else "")
    print(f"{name:<52} {len(seen):>7} {first_lag:>10.2f} {median:>10.2f} {worst:>9.2f}   rows per batch: {shown}  "
          f"(partition {partition_s:.1f} s)", flush=True)


def pyspark_readers(sc, rows: int, every: float) -> None:
    import pickle

    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from tfos._data.spark_rawio import raw_records

    partition_s = rows * every

    def produce(i):
        time.sleep(every)
        return (i, time.time())

    def rows_read(it):
        return [_batches_seen(([r] for r in it), lambda b: [b[0][1]])]

    _report("rdd pipelined (one row at a time)", sc.parallelize(range(rows), 1).map(produce).mapPartitions(rows_read).collect()[0],
            partition_s)
    raw = raw_records(sc.parallelize(range(rows), 1).map(produce))

    def frames_read(it):
        return [_batches_seen(it, lambda f: [r[1] for r in pickle.loads(f)])]

    _report("rdd raw frames", raw.rdd.mapPartitions(frames_read).collect()[0], partition_s)

    spark = SparkSession(sc)

    @F.udf(T.DoubleType())
    def slow_udf(x):
        time.sleep(every)
        return time.time()

    def arrow_read(col):
        def _read(batches):
            import pyarrow as pa

            seen = _batches_seen(batches, lambda b: b.column(col).to_pylist())
            yield pa.RecordBatch.from_pydict({"s": [repr(seen)]})

        return _read

    def run_arrow(name, df, col, confs):
        for k, v in confs.items():
            spark.conf.set(k, v)
        try:
            text = df.mapInArrow(arrow_read(col), "s string").collect()[0][0]
        finally:
            for k in confs:
                spark.conf.unset(k)
        _report(name, ast.literal_eval(text), partition_s)

    udf_df = spark.range(0, rows, 1, 1).withColumn("t", slow_udf("id"))
    run_arrow("df python udf, mapInArrow", udf_df, 1, {})
    run_arrow("df python udf, mapInArrow, maxRecordsPerBatch=4", udf_df, 1,
              {"spark.sql.execution.arrow.maxRecordsPerBatch": "4"})
    jvm_df = (spark.range(0, rows, 1, 1)
              .selectExpr("id", f"reflect('java.lang.Thread', 'sleep', cast({int(every * 1000)} as bigint)) as s")
              .selectExpr("id", "s", "cast(reflect('java.lang.System', 'currentTimeMillis') as double) / 1000 as t"))
    mr = "spark.sql.execution.arrow.maxRecordsPerBatch"
    buf = "spark.sql.execution.pandas.udf.buffer.size"
    run_arrow("df jvm, mapInArrow", jvm_df, 2, {})
    run_arrow("df jvm, mapInArrow, maxRecordsPerBatch=4", jvm_df, 2, {mr: "4"})
    run_arrow("df jvm, mapInArrow, 4 + buffer 4096", jvm_df, 2, {mr: "4", buf: "4096"})
    run_arrow("df jvm, mapInArrow, 1 + buffer 8", jvm_df, 2, {mr: "1", buf: "8"})
    raw = raw_records(jvm_df.rdd)

    def df_frames_read(it):
        return [_batches_seen(it, lambda f: [r[2] for r in pickle.loads(f)])]

    _report("df jvm, df.rdd raw frames", raw.rdd.mapPartitions(df_frames_read).collect()[0], partition_s)


def _tfos_main(args, ctx):
    import json
    import time as _time

    feed = ctx.get_data_feed(train_mode=True)
    lags = []
    while not feed.should_stop():  # to the end of the feed (shutdown()), so the partition is acknowledged
        for row in feed.next_batch(1):
            lags.append(_time.time() - row[1])
            if len(lags) == args["rows"]:
                with open(args["out"], "w") as f:
                    json.dump(lags, f)


def tfos_readers(sc, rows: int, every: float) -> None:
    import json
    import tempfile

    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    from tfos import TFCluster

    spark = SparkSession(sc)
    partition_s = rows * every

    def produce(i):
        time.sleep(every)
        return (i, time.time())

    @F.udf(T.DoubleType())
    def slow_udf(x):
        time.sleep(every)
        return time.time()

    with tempfile.TemporaryDirectory(prefix="tfos-bench-latency-") as tmp:
        for name, data in (("tfos train(rdd.map(produce))", lambda: sc.parallelize(range(rows), 1).map(produce)),
                           ("tfos train(df with a slow python udf)", lambda: spark.range(0, rows, 1, 1).withColumn("t", slow_udf("id")))):
            out = os.path.join(tmp, "lags.json")
            cluster = TFCluster.run(sc, _tfos_main, {"out": out, "rows": rows}, 1, 0, input_mode=TFCluster.InputMode.SPARK,
                                    reservation_timeout=300)
            try:
                cluster.train(data(), num_epochs=1)
            finally:
                cluster.shutdown()
            with open(out) as f:  # written by main_fun once it read every row
                lags = json.load(f)
            _report(name + ", at main_fun", [(1, x, x, [x]) for x in lags], partition_s)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=40, help="rows in the partition")
    ap.add_argument("--every", type=float, default=0.05, help="seconds between two rows")
    ap.add_argument("--tfos", action="store_true", help="also through a tfos cluster (1 node)")
    a = ap.parse_args()
    from pyspark import SparkConf, SparkContext

    conf = (SparkConf().setMaster("local-cluster[1,1,1024]").setAppName("tfos-bench-latency")
            .set("spark.ui.enabled", "false").set("spark.ui.showConsoleProgress", "false")
            .set("spark.driver.host", "127.0.0.1").set("spark.executor.memory", "768m"))
    sc = SparkContext(conf=conf)
    sc.setLogLevel("ERROR")
    try:
        print(f"one partition of {a.rows} rows, one every {a.every:g} s; load average {os.getloadavg()[0]:.1f}, "
              f"{os.cpu_count()} CPUs; lags in s (arrival - production)", flush=True)
        print(f"{'reader':<52} {'batches':>7} {'first lag':>10} {'median lag':>10} {'worst lag':>9}")
        pyspark_readers(sc, a.rows, a.every)
        if a.tfos:
            tfos_readers(sc, a.rows, a.every)
    finally:
        sc.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
