"""MNIST with Keras on tfos, InputMode.SPARK: the driver feeds Spark data to the nodes.

The driver reads the training images with Spark — the CSV files as an RDD of
``(float32[784] image, label)`` rows (default), or the TFRecords as a DataFrame via
``tfos.dfutil.loadTFRecords`` (``--format tfr``) — starts a tfos cluster of
``--cluster_size`` nodes (one chief, the rest workers) and calls
``cluster.train(data, epochs, end_of_feed=True)``. Each node runs :func:`main_fun`: it
joins a ``MultiWorkerMirroredStrategy`` and trains the same MLP as ``mnist_tf.py`` with
Keras 3 ``model.fit`` (``--tf_keras``: tf_keras) on the rows Spark feeds it, one ``fit`` call over all epochs,
then saves it (same outputs as ``mnist_tf.py``).

Epochs. ``cluster.train(data, n)`` feeds every partition ``n`` times, and every fed row
carries its epoch number. The node reads the feed with
``DataFeed.as_dataset(steps_per_epoch=S)`` (:func:`feed_dataset`): a background thread
turns every received chunk into numpy batches and cuts every epoch into exactly ``S``
batches, ``S`` computed alike on every node from the image count the driver passes in
the args. So one ``fit(epochs=n, steps_per_epoch=S)`` trains every epoch on one
iterator, Keras prints each epoch's loss and accuracy, and the next epoch is already
buffered. The last epoch ends at the end of the feed: ``end_of_feed=True`` ends
every node's feed as soon as all partitions were handed over (tfos's answer to uneven
data in lock-step training, C12). Without it, a node that has received all its data
could only learn that no more is coming from ``cluster.shutdown()``, which the driver
cannot call while the other node, waiting for this one in the
MultiWorkerMirroredStrategy collectives, still has rows to consume.

Restarts. ``--max_restarts N`` passes ``max_restarts=N`` to ``TFCluster.run``: after a
node failure a fresh cluster starts, ``BackupAndRestore`` makes ``fit`` resume after the
last saved epoch ``c``, and ``ctx.checkpoint_callback()`` (listed after it) has reported
``c`` to the driver, so the restarted ``train()`` feeds exactly epochs ``c..n-1``: although
the reader had read ahead of the checkpoint, ``fit``'s remaining ``(n - c) * S`` steps
match the resumed feed (see ``docs/reliability.md``, "Recovery").

Feeding once. ``--feed_once`` makes Spark read the data once: the driver calls
``cluster.train(data, 1)``, every node caches its ``S`` batches with
``ds.take(S).cache().repeat()`` (tf.data, in memory: the node's share of the data) and
replays them, in the same order, for every later epoch. Each epoch read from Spark costs
CPU that training does not get (``docs/performance.md``); use it when the node's share fits
in memory. The node reports checkpoint 0 (``ctx.report_checkpoint(0)``): a restarted
attempt is fed the whole epoch again to rebuild its cache, and ``BackupAndRestore`` still
resumes ``fit`` after the last saved epoch.

Run it with plain Python (it starts its own ``local-cluster[2,1,1024]``) or with
``spark-submit`` (see ``examples/mnist/README.md``)::

    python examples/mnist/mnist_data_setup.py --output data/mnist
    python examples/mnist/keras/mnist_spark.py --images data/mnist/csv/train --epochs 3
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mnist_common as common  # noqa: E402

logger = common.logger


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parses the command line (driver)."""
    p = common.common_parser("MNIST with Keras 3 and MultiWorkerMirroredStrategy, fed by Spark (InputMode.SPARK).")
    p.add_argument("--format", choices=("csv", "tfr"), default="csv",
                   help="csv: an RDD parsed from the CSV files; tfr: a DataFrame from the TFRecords (dfutil)")
    p.add_argument("--images", default=None, help="directory of training part files (default: data/mnist/FORMAT/train)")
    p.add_argument("--learning_rate", type=float, default=1e-3, help="Adam learning rate")
    p.add_argument("--shuffle_buffer", type=int, default=10000,
                   help="row-level shuffle window of each node, in rows (0: train in the fed order)")
    p.add_argument("--feed_once", action="store_true",
                   help="Spark feeds the data once (cluster.train(data, 1)); every node caches its fed epoch "
                        "with tf.data (in memory: its share of the data) and replays it for the later epochs")
    p.add_argument("--max_restarts", type=int, default=0,
                   help="restart the cluster after a node failure at most this many times; training and the feed "
                        "resume at the last checkpointed epoch (TFCluster.run(..., max_restarts=N))")
    args = p.parse_args(argv)
    if args.images is None:
        args.images = f"data/mnist/{args.format}/train"
    return args


# ---------------------------------------------------------------------------
# TF process
# ---------------------------------------------------------------------------


def feed_dataset(tf: Any, feed: Any, batch_size: int, steps_per_epoch: int, shuffle_buffer: int = 0) -> Any:
    """The node's fed rows as one ``tf.data.Dataset`` over all epochs, ``steps_per_epoch``
    batches per epoch (TF process).

    ``DataFeed.as_dataset(steps_per_epoch=S)`` reads the feed ahead in a background
    thread, turns every received chunk into numpy columns at once and hands TensorFlow
    whole batches: exactly ``S`` per epoch of ``cluster.train(data, n)`` on every node,
    whatever share of the partitions Spark gave the node in that epoch (the last batches
    of an epoch share its remaining rows), so one ``model.fit(epochs=n,
    steps_per_epoch=S)`` runs all epochs on one iterator, with no pause between epochs.
    The dataset keeps the reader as ``ds.tfos_batches`` (rows handed to TensorFlow per
    epoch).

    Args:
        tf: The tensorflow module.
        feed: The node's ``DataFeed`` (train mode).
        batch_size: Rows per step on this node.
        steps_per_epoch: Batches per epoch, the same on every node
            (``DataFeed.steps_per_epoch(rows, batch_size, nodes)``).
        shuffle_buffer: Rows in the row-level shuffle window (0: keep the fed order).
            Spark feeds the partitions in the same order every epoch; the reader thread
            draws every batch at random from a pool of at least this many rows of the
            epoch, mixing rows of all the chunks and partitions that arrived
            (``as_dataset(shuffle_rows=...)``): every epoch keeps its ``S`` batches and
            every row is trained on once per epoch.
    """
    signature = (
        tf.TensorSpec((None, common.NUM_PIXELS), tf.float32),
        tf.TensorSpec((None,), tf.int64),
    )
    return feed.as_dataset(batch_size, signature, steps_per_epoch=steps_per_epoch, shuffle_rows=shuffle_buffer)


def main_fun(args: argparse.Namespace, ctx: Any) -> None:
    """Trains on the fed rows and saves the model (TF process, every node)."""
    tf, keras = common.import_keras(args.tf_keras)

    chief = common.is_chief(ctx)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    num_workers = ctx.num_workers  # fed nodes (chief + workers); not num_replicas_in_sync, which counts devices
    # MWMS splits every batch of the dataset over all replicas: batch globally so that
    # each worker processes --batch_size rows per step.
    feed = ctx.get_data_feed(train_mode=True)
    # Every node computes the same steps per epoch from the rows the driver counted.
    steps = feed.steps_per_epoch(args.rows_per_epoch, args.batch_size, num_workers)
    ds = feed_dataset(tf, feed, args.batch_size, steps, args.shuffle_buffer)
    reader = ds.tfos_batches
    if args.feed_once:
        # --feed_once: the driver feeds one epoch. tf.data caches this node's `steps`
        # batches of it in memory while the first epoch trains, then replays them in the
        # same order for every later epoch: Spark reads the data once, not once per epoch.
        # The cache dies with the node, so a restarted attempt must be fed the whole epoch
        # again: report "nothing checkpointed" (0) instead of the epochs BackupAndRestore
        # saved (which still makes fit resume after the last saved epoch).
        ds = ds.take(steps).cache().repeat()
        ctx.report_checkpoint(0)
    # Each node's batches are its own steps (--batch_size rows per worker), not split again.
    dist_ds = strategy.distribute_datasets_from_function(lambda _input_context: ds)

    with strategy.scope():
        model = common.build_model(keras, args.learning_rate)
    # Restarts: BackupAndRestore (first in keras_callbacks) saves every epoch end and, on a
    # restarted attempt, makes fit start after the last saved epoch c. The checkpoint
    # callback, listed after it, then reports c to the driver (ctx.report_checkpoint), so a
    # restarted train() feeds exactly epochs c..n-1 although the reader had read ahead:
    # fit's (n - c) * steps batches match the resumed feed.
    reports = [] if args.feed_once else [ctx.checkpoint_callback(keras)]
    callbacks = common.keras_callbacks(keras, ctx, args) + reports + [common.epoch_logger(keras, args.epochs)]
    began = time.monotonic()
    # One fit over all epochs on one iterator: every node's dataset has exactly `steps`
    # batches per epoch (see feed_dataset), so the epochs of Keras and of the feed agree
    # on every node. The epoch logger prints each epoch's line (steps, seconds, the gap
    # since the previous epoch).
    result = model.fit(dist_ds, epochs=args.epochs, steps_per_epoch=steps, shuffle=False, verbose=0, callbacks=callbacks)
    history = {key: [float(v) for v in values] for key, values in result.history.items()}
    first_epoch = args.epochs - len(history.get("loss", []))  # > 0 after a restart (restored)
    train_seconds = time.monotonic() - began
    # Read anything left up to the end of the feed (normally nothing: the last epoch ended
    # there), so that every feed task ends normally.
    marker_rows = 0
    while not reader.ended:
        marker_rows += sum(len(batch[1]) for batch in reader)
    # Rows handed to TensorFlow per epoch (--feed_once: the fed epoch, replayed by every later one).
    rows = ([reader.rows[0] if e >= first_epoch else 0 for e in range(args.epochs)] if args.feed_once
            else [reader.rows[e] for e in range(args.epochs)])
    if ctx.attempt:
        print(f"{ctx.job_name}:{ctx.task_index}: attempt {ctx.attempt} resumed at epoch {first_epoch + 1}; "
              f"the feed resumed at epoch {min([e for e in range(args.epochs) if rows[e]] or [args.epochs]) + 1}", flush=True)
    print(f"{ctx.job_name}:{ctx.task_index} trained on {sum(rows)} rows "
          f"({', '.join(str(r) for r in rows)} per epoch); "
          f"{marker_rows} rows left unread at the end of the feed; waited {reader.wait_s:.1f} s for data", flush=True)

    model_dir = common.node_path(ctx, args.model_dir)
    common.write_json(tf, os.path.join(model_dir, common.STATS_DIR, f"{ctx.job_name}-{ctx.task_index}.json"), {
        "job": ctx.job_name, "task": ctx.task_index,
        "rows_per_epoch": rows,
    })
    common.save_model(ctx, model, args)
    if chief:
        common.write_json(tf, os.path.join(model_dir, common.SUMMARY_FILE), {
            "mode": "spark",
            "history": history,
            "first_epoch": first_epoch,
            "attempt": ctx.attempt,
            "test": None,
            "train_seconds": train_seconds,
            "workers": num_workers,
            "batch_size_per_worker": args.batch_size,
        })


# ---------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------


def run(sc: Any, args: argparse.Namespace) -> Optional[dict]:
    """Reads the data, trains on the cluster and prints the report (driver).

    Returns:
        The chief's run summary plus ``rows_per_epoch`` (all nodes) and ``images``.
    """
    from pyspark import StorageLevel

    from tfos import TFCluster

    common.ship_by_value(common)
    args = common.resolve_paths(args, sc, ("images", "model_dir", "export_dir"))
    common.remove_outputs([
        args.export_dir,
        os.path.join(args.model_dir, common.KERAS_FILE),
        os.path.join(args.model_dir, common.CHECKPOINT_DIR),
        os.path.join(args.model_dir, common.BACKUP_DIR),  # a fresh run must not restore an old backup
        os.path.join(args.model_dir, common.TENSORBOARD_DIR),
        os.path.join(args.model_dir, common.SUMMARY_FILE),
        os.path.join(args.model_dir, common.STATS_DIR),
    ])
    data = common.load_images(sc, args.images, args.format)
    rdd = data if args.format == "csv" else data.rdd
    if rdd.getNumPartitions() < args.cluster_size:
        # Every node must get a partition of every epoch (see the module docstring).
        data = data.repartition(args.cluster_size)
    # Parsed once (here, by count()), then read from the cache by every epoch.
    data = data.persist(StorageLevel.MEMORY_AND_DISK)
    images = data.count()
    partitions = (data if args.format == "csv" else data.rdd).getNumPartitions()
    logger.info("%d training images in %d partitions (%s)", images, partitions, args.images)
    args.rows_per_epoch = images  # the nodes derive their steps per epoch from it

    began = time.monotonic()
    with TFCluster.run(
        sc, main_fun, args, args.cluster_size, num_ps=0, tensorboard=args.tensorboard,
        input_mode=TFCluster.InputMode.SPARK, master_node="chief",
        log_dir=os.path.join(args.model_dir, common.TENSORBOARD_DIR), progress=args.progress,
        max_restarts=args.max_restarts,
    ) as cluster:
        if args.tensorboard:
            common.check_tensorboard(cluster.tensorboard_url())
        # end_of_feed: every node's feed ends right after its last row, which ends the last
        # epoch on every node while the others may still train (uneven data, C12).
        feed_epochs = 1 if args.feed_once else args.epochs
        logger.info("feeding %d epoch(s)%s", feed_epochs, " (the nodes replay it for every epoch)" if args.feed_once else "")
        cluster.train(data, feed_epochs, end_of_feed=True)
        cluster.shutdown()
    seconds = time.monotonic() - began
    data.unpersist()

    summary = common.print_training_report(args, seconds)
    stats = common.read_node_stats(args.model_dir) if common.is_local(args.model_dir) else {}
    if stats:
        per_epoch = [sum(s["rows_per_epoch"][e] for s in stats.values()) for e in range(args.epochs)]
        print(f"rows trained per epoch (all nodes): {per_epoch}, {images} images; per node: "
              + ", ".join(f"{name} {s['rows_per_epoch']}" for name, s in stats.items()))
        if summary is not None:
            summary["rows_per_epoch"] = per_epoch
    if summary is not None:
        summary["images"] = images
    return summary


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Script entry point (driver)."""
    args = parse_args(argv)
    common.setup_logging()
    sc, created = common.spark_context(args, "mnist_keras_spark")
    try:
        run(sc, args)
    finally:
        if created:
            sc.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
