"""MNIST with Keras on tfos, InputMode.TENSORFLOW: every worker reads its own TFRecords.

The driver starts a tfos cluster of ``--cluster_size`` nodes (one chief, the rest
workers) and waits. Each node runs :func:`main_fun` in its own TF process: it joins a
``MultiWorkerMirroredStrategy`` (synchronous data parallelism), reads its share of the
TFRecord files (``TFNode.shard_files``: files ``[rank::num_workers]``), trains the
MLP with Keras 3 ``model.fit`` (``--tf_keras``: tf_keras), evaluates it on its share of the test files, and saves
it. The chief's files are kept:

* ``--export_dir``: SavedModel (signature ``serving_default(image) -> probabilities``);
* ``--model_dir/model.keras``: the Keras model file;
* ``--model_dir/checkpoints/epoch-NN``: weights after every epoch;
* ``--model_dir/tensorboard``: TensorBoard logs (served with ``--tensorboard``);
* ``--model_dir/train_summary.json``: per-epoch loss/accuracy and the test accuracy.

Run it with plain Python (it starts its own ``local-cluster[2,1,1024]``) or with
``spark-submit`` (see ``examples/mnist/README.md``)::

    python examples/mnist/mnist_data_setup.py --output data/mnist
    python examples/mnist/keras/mnist_tf.py --images data/mnist/tfr/train --epochs 3

Paths must be visible to the driver and every executor (one machine, or a shared
file system).
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
    p = common.common_parser("MNIST with Keras 3 and MultiWorkerMirroredStrategy; the nodes read TFRecords.")
    p.add_argument("--images", default="data/mnist/tfr/train", help="directory of training TFRecord part files")
    p.add_argument("--test_images", default=None,
                   help="directory of test TFRecord part files (default: 'test' next to --images; 'none' to skip)")
    p.add_argument("--learning_rate", type=float, default=1e-3, help="Adam learning rate")
    p.add_argument("--shuffle_buffer", type=int, default=10000,
                   help="examples in each worker's shuffle buffer (0: read the files in order)")
    p.add_argument("--max_restarts", type=int, default=0,
                   help="restart the cluster up to N times after a node failure; training resumes from "
                        "--model_dir/backup (BackupAndRestore)")
    args = p.parse_args(argv)
    if args.test_images is None:
        args.test_images = os.path.join(os.path.dirname(args.images.rstrip("/")), "test")
    elif args.test_images.lower() == "none":
        args.test_images = None
    return args


# ---------------------------------------------------------------------------
# TF process
# ---------------------------------------------------------------------------


def tfrecord_dataset(tf: Any, files: Sequence[str], global_batch: int, shuffle_buffer: int = 0) -> Any:
    """``(image float32[n, 784], label int64[n])`` batches from TFRecord files (TF process).

    Auto-sharding is OFF: the files are already this worker's share.
    """
    features = {
        "image": tf.io.FixedLenFeature([common.NUM_PIXELS], tf.float32),
        "label": tf.io.FixedLenFeature([], tf.int64),
    }

    @tf.autograph.experimental.do_not_convert  # shipped by value: AutoGraph finds no source
    def parse(serialized: Any) -> tuple[Any, Any]:
        parsed = tf.io.parse_example(serialized, features)
        return parsed["image"], parsed["label"]

    ds = tf.data.TFRecordDataset(list(files), num_parallel_reads=min(4, len(files)))
    if shuffle_buffer:
        ds = ds.shuffle(shuffle_buffer, reshuffle_each_iteration=True)
    ds = ds.batch(global_batch).map(parse, num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return ds.with_options(options)


def main_fun(args: argparse.Namespace, ctx: Any) -> None:
    """Trains, evaluates and saves the model on one node (TF process, every node)."""
    tf, keras = common.import_keras(args.tf_keras)
    from tfos import TFNode

    chief = common.is_chief(ctx)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    num_workers = strategy.num_replicas_in_sync  # one CPU replica per node
    # Every replica processes --batch_size examples per step: MWMS splits each batch of
    # the dataset over all replicas, so the per-worker dataset is batched globally.
    global_batch = args.batch_size * num_workers
    print(f"{ctx.job_name}:{ctx.task_index}: {num_workers} workers, batch {args.batch_size} per worker "
          f"({global_batch} per step)", flush=True)

    train_files = TFNode.shard_files(ctx, os.path.join(args.images, "part-*"))
    print(f"{ctx.job_name}:{ctx.task_index} reads {len(train_files)} training files: "
          f"{', '.join(os.path.basename(f) for f in train_files)}", flush=True)
    train_ds = tfrecord_dataset(tf, train_files, global_batch, args.shuffle_buffer)

    with strategy.scope():
        model = common.build_model(keras, args.learning_rate)
    callbacks = common.keras_callbacks(keras, ctx, args)
    began = time.monotonic()
    history = model.fit(train_ds, epochs=args.epochs, shuffle=False, verbose=2 if chief else 0, callbacks=callbacks)  # shuffled in tf.data
    train_seconds = time.monotonic() - began

    test = None
    if args.test_images:
        test_files = TFNode.shard_files(ctx, os.path.join(args.test_images, "part-*"))
        # Distributed evaluation: every worker evaluates its share; the metrics are
        # aggregated over all workers.
        loss, accuracy = model.evaluate(tfrecord_dataset(tf, test_files, global_batch), verbose=0)
        test = {"loss": float(loss), "accuracy": float(accuracy)}
        print(f"test: loss {loss:.4f}, accuracy {accuracy:.4f}", flush=True)

    common.save_model(ctx, model, args)
    if chief:
        common.write_json(tf, os.path.join(common.node_path(ctx, args.model_dir), common.SUMMARY_FILE), {
            "mode": "tensorflow",
            "history": {k: [float(v) for v in vals] for k, vals in history.history.items()},
            "test": test,
            "train_seconds": train_seconds,
            "workers": num_workers,
            "batch_size_per_worker": args.batch_size,
        })


# ---------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------


def run(sc: Any, args: argparse.Namespace) -> Optional[dict]:
    """Trains on the cluster and prints the report (driver).

    Returns:
        The chief's run summary, or None when it is missing.
    """
    from tfos import TFCluster

    common.ship_by_value(common)
    args = common.resolve_paths(args, sc, ("images", "test_images", "model_dir", "export_dir"))
    if common.is_local(args.images):
        common.part_files(args.images)  # fail early, with the command that writes the data
    common.remove_outputs([
        args.export_dir,
        os.path.join(args.model_dir, common.KERAS_FILE),
        os.path.join(args.model_dir, common.CHECKPOINT_DIR),
        os.path.join(args.model_dir, common.BACKUP_DIR),  # a fresh run must not restore an old backup
        os.path.join(args.model_dir, common.TENSORBOARD_DIR),
        os.path.join(args.model_dir, common.SUMMARY_FILE),
    ])
    began = time.monotonic()
    with TFCluster.run(
        sc, main_fun, args, args.cluster_size, num_ps=0, tensorboard=args.tensorboard,
        input_mode=TFCluster.InputMode.TENSORFLOW, master_node="chief",
        log_dir=os.path.join(args.model_dir, common.TENSORBOARD_DIR), progress=args.progress,
        max_restarts=args.max_restarts,
    ) as cluster:
        if args.tensorboard:
            common.check_tensorboard(cluster.tensorboard_url())
        cluster.shutdown()
    return common.print_training_report(args, time.monotonic() - began)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Script entry point (driver)."""
    args = parse_args(argv)
    common.setup_logging()
    sc, created = common.spark_context(args, "mnist_keras_tf")
    try:
        run(sc, args)
    finally:
        if created:
            sc.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
