"""A small tfos driver program run as a subprocess by test_fail_fast.py (not a test).

Usage: python failing_program.py

What a user writes from TensorFlow's multi-worker tutorial, with a bug: a local-cluster[2,1,1024]
SparkContext and a 2-node InputMode.TENSORFLOW cluster whose main_fun raises on one node
while the other computes (it never looks at a stop event). shutdown() raises the error; the
program prints ``error-at <time.time()>`` on stdout and returns, as a program that lets the
error end it would. The test measures how long the program takes to end after that line.
"""

from __future__ import annotations

import sys
import time


def main_fun(args, ctx):
    import time as _time

    if ctx.executor_id == 1:
        _time.sleep(2.0)
        raise ValueError("a bug in main_fun on one node")
    while True:  # a healthy node in a long computation
        _time.sleep(0.1)


def main() -> int:
    from pyspark import SparkConf, SparkContext

    from tfos import TFCluster
    from tfos.errors import ClusterFailedError

    conf = (
        SparkConf().setMaster("local-cluster[2,1,1024]").setAppName("tfos-failing-program")
        .set("spark.ui.enabled", "false").set("spark.ui.showConsoleProgress", "false")
        .set("spark.driver.host", "127.0.0.1").set("spark.executor.memory", "768m")
    )
    sc = SparkContext(conf=conf)
    sc.setLogLevel("ERROR")
    cluster = TFCluster.run(sc, main_fun, {}, 2, 0, input_mode=TFCluster.InputMode.TENSORFLOW, reservation_timeout=300)
    try:
        cluster.shutdown(timeout=300)
    except ClusterFailedError as exc:
        sys.stdout.write(f"error-at {time.time():.3f}\n{type(exc).__name__}: {str(exc).splitlines()[0]}\n")
        sys.stdout.flush()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
