#!/usr/bin/env python
"""Skip benchmark: how long ``train()`` takes to skip the partitions a node no longer wants.

On ``local-cluster[2,1,1024]`` (two executor JVMs), a 2-node InputMode.SPARK cluster is fed
one epoch of a cached RDD of ``--rows`` integers in ``--partitions`` partitions, in turns:

* ``feed``: main_fun reads every row (the reference);
* ``terminate``: main_fun reads 10 rows, calls ``DataFeed.terminate()`` and returns, so
  the feed tasks of (almost) every partition skip it (docs/datafeed.md "Ending early").

Each turn starts a new cluster and times ``train()`` alone. The script prints, per mode, the
seconds of every repeat (min / median / max) and the ratio terminate / feed per repeat,
with its median. Row counts are checked: ``feed`` must consume every row, ``terminate``
exactly 10 per node.

Usage::

    python scripts/bench_skip.py [--rows 60000] [--partitions 60] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def consume(args, ctx):
    import json as _json

    from tfos import TFNode

    feed = TFNode.DataFeed(ctx.mgr)
    n = 0
    while not feed.should_stop():
        n += len(feed.next_batch(100))
    with open(f"{args['out']}/{ctx.job_name}{ctx.task_index}.json", "w") as f:
        _json.dump({"rows": n}, f)


def read_ten_then_terminate(args, ctx):
    import json as _json

    from tfos import TFNode

    feed = TFNode.DataFeed(ctx.mgr)
    n = len(feed.next_batch(10))
    feed.terminate()
    with open(f"{args['out']}/{ctx.job_name}{ctx.task_index}.json", "w") as f:
        _json.dump({"rows": n}, f)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=60000)
    ap.add_argument("--partitions", type=int, default=60)
    ap.add_argument("--repeat", type=int, default=3)
    opts = ap.parse_args()

    from pyspark.sql import SparkSession

    from tfos import TFCluster

    spark = (SparkSession.builder.master("local-cluster[2,1,1024]").config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false").config("spark.driver.host", "127.0.0.1").getOrCreate())
    sc = spark.sparkContext
    sc.setLogLevel("ERROR")
    print(f"load average at start: {os.getloadavg()[0]:.2f}", flush=True)
    rdd = sc.parallelize(range(opts.rows), opts.partitions).cache()
    assert rdd.count() == opts.rows
    times: dict[str, list[float]] = {"feed": [], "terminate": []}
    ok = True
    for rep in range(opts.repeat):
        for mode, fn in (("feed", consume), ("terminate", read_ten_then_terminate)):
            with tempfile.TemporaryDirectory() as out:
                cluster = TFCluster.run(sc, fn, {"out": out}, 2, 0, input_mode=TFCluster.InputMode.SPARK)
                t0 = time.monotonic()
                cluster.train(rdd, num_epochs=1, feed_timeout=120)
                dt = time.monotonic() - t0
                cluster.shutdown(timeout=120)
                rows = sum(json.load(open(os.path.join(out, p)))["rows"] for p in os.listdir(out))
            want = opts.rows if mode == "feed" else 20
            if rows != want:
                print(f"ROW COUNT WRONG: {mode} repeat {rep + 1}: {rows} rows, want {want}", flush=True)
                ok = False
            times[mode].append(dt)
            print(f"repeat {rep + 1} {mode:<9} train() {dt:6.2f} s  rows {rows}", flush=True)
    for mode, ts in times.items():
        print(f"{mode:<9} s: min {min(ts):.2f} median {statistics.median(ts):.2f} max {max(ts):.2f}")
    ratios = [t / f for t, f in zip(times["terminate"], times["feed"])]
    print(f"terminate / feed per repeat: {' '.join(f'{r:.2f}' for r in ratios)} (median {statistics.median(ratios):.2f})")
    spark.stop()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
