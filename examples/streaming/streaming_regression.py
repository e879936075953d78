"""tfos streaming example: train Keras models on a stream of CSV files (no download).

A writer thread drops a CSV file of ``--rows`` synthetic rows ``x1,x2,y`` (y = 3 x1 - 2 x2 +
1 + noise) into ``--input_dir`` every ``--every`` seconds; Spark streams the directory to a
tfos cluster, and every node fits a linear Keras model on what it is fed, through
``DataFeed.as_dataset`` (the same tf.data path as a batch ``train()``).

Two APIs, same cluster code (``--api``):

* ``structured`` (default): ``cluster.train(spark.readStream.csv(...))`` starts a
  Structured Streaming query (checkpointed under ``--work_dir``); when every file was
  written the driver waits with ``query.processAllAvailable()`` and calls
  ``cluster.shutdown()``.
* ``dstream`` (TFoS style): ``cluster.train(ssc.textFileStream(...).map(parse))``,
  ``ssc.start()``, ``cluster.shutdown(ssc)``, which waits until someone asks the cluster
  to stop. The driver logs the stop endpoint; from another shell (same user and host)::

      python examples/streaming/stop_streaming.py HOST PORT

  (or ``python -m tfos.streaming stop HOST PORT``). With ``--auto_stop`` the driver asks
  itself once every file was fed.

Every node trains on its own share of the stream (no lock-step strategy: a stream gives
the workers unequal amounts of data, which MultiWorkerMirroredStrategy cannot train on; see
docs/streaming.md). Every node saves its model; the driver prints each node's steps and
the weights of the node that trained the most steps, which approach (3, -2) and 1.

Usage::

    python examples/streaming/streaming_regression.py [--api dstream --auto_stop] [--master local-cluster[2,1,1024]]
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import tempfile
import threading
import time


def main_fun(args, ctx):
    """Fits y ~ w . x + b on the rows fed to this node until the end of the feed (TF process)."""
    import json

    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    import tensorflow as tf
    import tf_keras as keras

    model = keras.Sequential([keras.layers.Dense(1, input_shape=(2,))])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    feed = ctx.get_data_feed()
    spec = (tf.TensorSpec((None,), tf.float32),) * 3
    ds = feed.as_dataset(32, spec).map(lambda x1, x2, y: (tf.stack([x1, x2], 1), y))
    # One pass over the whole stream: it ends at shutdown(). A step per batch rather than
    # model.fit(ds): Spark may give a node no row of the stream at all (every feed task ran
    # on the other executor), and fit() raises on an empty dataset; this loop just ends.
    for x, y in ds:
        model.train_on_batch(x, y)
    w, b = model.layers[0].get_weights()
    report = {"node": f"{ctx.job_name}:{ctx.task_index}", "steps": int(model.optimizer.iterations.numpy()),
              "w": [float(v) for v in w[:, 0]], "b": float(b[0])}
    with open(os.path.join(args["work_dir"], f"model-{ctx.job_name}-{ctx.task_index}.json"), "w") as f:
        json.dump(report, f)


def write_files(input_dir: str, staging: str, files: int, rows: int, every_s: float, done: threading.Event) -> None:
    """Drops ``files`` CSV files into ``input_dir``, one every ``every_s`` seconds (atomic renames)."""
    rng = random.Random(0)
    for i in range(files):
        time.sleep(every_s)
        lines = []
        for _ in range(rows):
            x1, x2 = rng.uniform(-1, 1), rng.uniform(-1, 1)
            lines.append(f"{x1:.6f},{x2:.6f},{3 * x1 - 2 * x2 + 1 + rng.gauss(0, 0.05):.6f}\n")
        tmp = os.path.join(staging, f"part-{i:04d}.csv")
        with open(tmp, "w") as f:
            f.writelines(lines)
        os.replace(tmp, os.path.join(input_dir, f"part-{i:04d}.csv"))
    done.set()


def parse(line: str) -> tuple:
    x1, x2, y = line.split(",")
    return (float(x1), float(x2), float(y))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--api", choices=["structured", "dstream"], default="structured")
    ap.add_argument("--master", default="local-cluster[2,1,1024]")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--every", type=float, default=2.0, help="seconds between two files")
    ap.add_argument("--work_dir", default=None)
    ap.add_argument("--auto_stop", action="store_true", help="dstream: ask the cluster to stop once every file was fed")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for name in ("tfos", "streaming_regression"):  # INFO from tfos (stop address...) and this program, not py4j
        logging.getLogger(name).setLevel(logging.INFO)
    work = args.work_dir or tempfile.mkdtemp(prefix="tfos-streaming-")
    input_dir, staging = os.path.join(work, "input"), os.path.join(work, "staging")
    os.makedirs(input_dir, exist_ok=True)
    os.makedirs(staging, exist_ok=True)

    from pyspark.sql import SparkSession

    from tfos import TFCluster, authenticate_spark, streaming

    authenticate_spark(args.master)  # spark.authenticate, its secret in a file only you can read (docs/deploy.md)
    spark = SparkSession.builder.master(args.master).appName("tfos-streaming-example").getOrCreate()
    sc = spark.sparkContext
    cluster = TFCluster.run(sc, main_fun, {"work_dir": work}, args.nodes, 0, input_mode=TFCluster.InputMode.SPARK,
                            master_node="chief")
    written = threading.Event()
    writer = threading.Thread(target=write_files, args=(input_dir, staging, args.files, args.rows, args.every, written), daemon=True)
    if args.api == "structured":
        sdf = spark.readStream.schema("x1 float, x2 float, y float").option("maxFilesPerTrigger", 2).csv(input_dir)
        query = cluster.train(sdf, checkpointLocation=os.path.join(work, "checkpoint"), queryName="tfos_regression")
        writer.start()
        written.wait()
        query.processAllAvailable()  # every file written is fed and committed
        cluster.shutdown()           # stops the query, ends the feed: model.fit() returns on every node
    else:
        from pyspark.streaming import StreamingContext

        ssc = StreamingContext(sc, 1)
        cluster.train(ssc.textFileStream(input_dir).map(parse))
        ssc.start()
        writer.start()
        if args.auto_stop:
            def stop_when_fed() -> None:
                written.wait()
                time.sleep(5.0)  # a few more micro-batches pick up the last files
                streaming.request_stop(cluster)
            threading.Thread(target=stop_when_fed, daemon=True).start()
        cluster.shutdown(ssc)        # waits for a stop request, stops ssc gracefully, then the nodes
    import glob
    import json

    models = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(work, "model-*.json")))]
    log = logging.getLogger("streaming_regression")
    log.info("steps per node: %s", ", ".join(f"{m['node']} {m['steps']}" for m in models))
    best = max(models, key=lambda m: m["steps"])  # a node the stream fed no row trained 0 steps
    log.info("model of %s after %d steps: w = (%.3f, %.3f), b = %.3f (data: w = (3, -2), b = 1)",
             best["node"], best["steps"], best["w"][0], best["w"][1], best["b"])
    spark.stop()


if __name__ == "__main__":
    main()
