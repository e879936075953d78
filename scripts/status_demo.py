#!/usr/bin/env python
"""The outputs of docs/status.md: a slow producer, a slow step, a stuck worker (local-cluster).

One cluster of 2 nodes (chief:0, worker:0, InputMode.SPARK, ``stall_timeout=20``) is fed
three times by one ``main_fun``; each row says what to do with its batch of 10:

(a) ``producer``: the RDD's ``map`` sleeps 30 ms per row;
(b) ``compute``: rows come at once, main_fun sleeps 0.1 s per batch;
(c) stuck: two epochs; worker:0 blocks on a ``threading.Event`` at its first batch of the
    second epoch, until the script releases it 45 s later.

It prints ``cluster.status()`` (verdict, verdict text, per-node figures) once the verdict
of (a) and (b) shows while rows flow, the stall WARNING of (c) as the driver logs it,
``cluster.stacks()`` of worker:0, and ``cluster.summary()`` with its log line after
``shutdown()``.

Usage::

    /work/bin/spark-slot nice .venv/bin/python scripts/status_demo.py [--master local-cluster[2,1,1024]]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def demo_main(args, ctx):
    import os
    import threading
    import time

    feed = ctx.get_data_feed(train_mode=True)
    blocker = threading.Event()

    def watch():
        while not os.path.exists(args["release"]):
            time.sleep(0.2)
        blocker.set()

    threading.Thread(target=watch, name="release-watch", daemon=True).start()
    while not feed.should_stop():
        batch = feed.next_batch(10)
        if not batch:
            continue
        mode = batch[-1][1]
        if mode > 0:
            time.sleep(mode)  # the "training step"
        elif mode < 0 and ctx.job_name == "worker" and feed.last_origins[-1][2] >= 1 and not blocker.is_set():
            blocker.wait()  # stuck: waits for an event that does not come


def _slow(i):
    import time as _time

    _time.sleep(0.03)
    return (i, 0.0)


def _show(s: dict) -> None:
    keep = ("node", "state", "rows", "rows_per_s", "feed_wait_share", "queue_fill", "cpu_share", "rss_bytes",
            "heartbeat_age_s", "idle_s", "class")
    print(json.dumps({"verdict": s["verdict"], "verdict_nodes": s["verdict_nodes"], "verdict_text": s["verdict_text"],
                      "nodes": [{k: n[k] for k in keep} for n in s["nodes"]]}, indent=1))


def _until(cluster, verdict: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = cluster.status()
        if s["verdict"] == verdict and all(n["rows_per_s"] for n in s["nodes"] if n["node"] in s["verdict_nodes"]):
            _show(s)
            return
        time.sleep(1.0)
    print(f"no {verdict} verdict within {timeout_s} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--master", default="local-cluster[2,1,1024]")
    ap.add_argument("--hold-s", type=float, default=45.0, help="seconds worker:0 stays blocked in (c)")
    opts = ap.parse_args()
    from pyspark import SparkConf, SparkContext

    from tfos import TFCluster, authenticate_spark

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("tfos._driver.cluster").setLevel(logging.INFO)  # the summary line
    authenticate_spark(opts.master)  # no security WARNING in the outputs
    conf = SparkConf().setMaster(opts.master).setAppName("tfos-status-demo").set("spark.ui.enabled", "false")
    conf.set("spark.executor.memory", "1024m").set("spark.driver.host", "127.0.0.1").set("spark.ui.showConsoleProgress", "false")
    sc = SparkContext(conf=conf)
    tmp = tempfile.mkdtemp(prefix="tfos-status-demo-")
    args = {"release": os.path.join(tmp, "release")}
    cluster = TFCluster.run(sc, demo_main, args, 2, 0, input_mode=TFCluster.InputMode.SPARK, master_node="chief",
                            stall_timeout=20, progress=False)
    try:
        for title, rdd, verdict, epochs in (
            ("(a) a map sleeping 30 ms per row", sc.parallelize(range(600), 4).map(_slow), "producer", 1),
            ("(b) main_fun sleeping 0.1 s per batch of 10", sc.parallelize([(i, 0.1) for i in range(4000)], 4), "compute", 1),
        ):
            print(f"\n=== {title}: cluster.status()")
            t = threading.Thread(target=cluster.train, args=(rdd, epochs), kwargs={"feed_timeout": 120}, daemon=True)
            t.start()
            _until(cluster, verdict)
            t.join()
        print("\n=== (c) worker:0 blocked at the second epoch (stall_timeout=20): the driver's log")
        rdd = sc.parallelize([(i, -1.0) for i in range(400)], 4)
        t = threading.Thread(target=cluster.train, args=(rdd, 2), kwargs={"feed_timeout": 180}, daemon=True)
        t.start()
        deadline = time.monotonic() + 120
        while not cluster.status()["last_stall"] and time.monotonic() < deadline:
            time.sleep(0.5)
        print("\n=== (c) cluster.stacks()['worker:0']")
        print(cluster.stacks()["worker:0"])
        time.sleep(max(0.0, opts.hold_s - 30))
        open(args["release"], "w").close()
        t.join()
        print("\n=== shutdown(): the summary line")
        cluster.shutdown(timeout=120)
    finally:
        open(args["release"], "w").close()
    print("\n=== cluster.summary()")
    print(json.dumps(cluster.summary(), indent=1))
    sc.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
