#!/usr/bin/env python
"""The outputs of docs/status.md: a slow producer, a slow step, a stuck worker (local-cluster).

One cluster of 2 nodes (chief:0, worker:0, InputMode.SPARK, ``stall_timeout=20``) is fed
three times by one ``main_fun``; each row says what to do with its batch of 10:

(a) ``producer``: the RDD's ``map`` sleeps 30 ms per row;
(b) ``compute``: rows come at once, main_fun sleeps 0.1 s per batch;
(c) stuck: two epochs; worker:0 blocks on a ``threading.Event`` at its first batch of the
    second epoch, until the script releases it 45 s later.

A second cluster (skipped with ``--no-keras``) runs Keras 3 ``fit`` under
``MultiWorkerMirroredStrategy`` on two workers fed by ``as_dataset``: (d) worker:1 blocks
in a callback at the end of its first epoch, and worker:0 waits for it in the next
all-reduce; the stall WARNING names worker:1 as stuck and worker:0 as waiting inside
TensorFlow.

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


def keras_main(args, ctx):
    import os
    import threading
    import time

    import keras
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
        model.compile("adam", "mse")
    feed = ctx.get_data_feed()
    steps = feed.steps_per_epoch(args["rows"], 16, 2)
    ds = feed.as_dataset(16, (tf.TensorSpec((None, 4), tf.float32), tf.TensorSpec((None,), tf.float32)), steps_per_epoch=steps)
    blocker = threading.Event()

    def watch():
        while not os.path.exists(args["release"]):
            time.sleep(0.2)
        blocker.set()

    threading.Thread(target=watch, name="release-watch", daemon=True).start()

    class Block(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if ctx.task_index == 1 and epoch == 0:
                blocker.wait()  # stuck in a callback; worker:0 waits in the next all-reduce

    dist = strategy.distribute_datasets_from_function(lambda _: ds)
    model.fit(dist, epochs=3, steps_per_epoch=steps, verbose=0, shuffle=False, callbacks=[Block()])


def _keras_case(sc, TFCluster, tmp: str, hold_s: float) -> None:
    print("\n=== (d) Keras 3 fit under MultiWorkerMirroredStrategy, worker:1 blocked in a callback: the driver's log")
    args = {"release": os.path.join(tmp, "release-keras"), "rows": 2000}
    rows = [([float(i % 7), 1.0, 2.0, 3.0], float(i % 3)) for i in range(args["rows"])]
    cluster = TFCluster.run(sc, keras_main, args, 2, 0, input_mode=TFCluster.InputMode.SPARK, stall_timeout=20, progress=False)
    try:
        t = threading.Thread(target=cluster.train, args=(sc.parallelize(rows, 4), 3),
                             kwargs={"feed_timeout": 300, "end_of_feed": True}, daemon=True)
        t.start()
        deadline = time.monotonic() + 300
        while not cluster.status()["last_stall"] and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(max(0.0, hold_s - 30))
        open(args["release"], "w").close()
        t.join()
        cluster.shutdown(timeout=300)
    finally:
        open(args["release"], "w").close()
    print(json.dumps([{k: n[k] for k in ("node", "rows", "steps", "feed_wait_share")} for n in cluster.summary()["nodes"]]))


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
    ap.add_argument("--no-keras", action="store_true", help="skip (d), the Keras 3 cluster")
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
        rdd = sc.parallelize([(i, -1.0) for i in range(400)], 8)  # 8 partitions an epoch: worker:0 gets some of the second
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
    if not opts.no_keras:
        _keras_case(sc, TFCluster, tmp, opts.hold_s)
    sc.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
