"""MNIST inference on tfos: every node loads the exported model and labels the test images.

The driver reads the test images with Spark (CSV as an RDD, default, or TFRecords
through ``tfos.dfutil.loadTFRecords`` with ``--format tfr``), starts a tfos cluster of
``--cluster_size`` nodes in InputMode.SPARK and calls ``cluster.inference(rdd)``. Each
node runs :func:`main_fun`: it loads the model — the SavedModel in ``--export_dir``
(default, through ``tf.saved_model.load``: no Keras needed) or the Keras file
``--model_dir/model.keras`` (``--model_format keras``) — and answers every batch of
rows with one ``"label,prediction"`` string per row. The driver writes those rows to
``--output`` (``saveAsTextFile``: ``part-*`` files) and prints the test accuracy.

Run it with plain Python (it starts its own ``local-cluster[2,1,1024]``) or with
``spark-submit`` (see ``examples/mnist/README.md``)::

    python examples/mnist/keras/mnist_inference.py --images data/mnist/csv/test \\
        --export_dir output/mnist/export --output output/mnist/predictions
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
    p = common.common_parser("MNIST inference with an exported model on tfos (InputMode.SPARK); "
                             "--epochs is accepted for a uniform command line and ignored.", epochs=1)
    p.set_defaults(batch_size=1000)
    p.add_argument("--format", choices=("csv", "tfr"), default="csv",
                   help="csv: an RDD parsed from the CSV files; tfr: the TFRecords read with dfutil")
    p.add_argument("--images", default=None, help="directory of test part files (default: data/mnist/FORMAT/test)")
    p.add_argument("--model_format", choices=("savedmodel", "keras"), default="savedmodel",
                   help="savedmodel: load EXPORT_DIR with tf.saved_model.load; keras: MODEL_DIR/model.keras with Keras 3 (with tf_keras when --tf_keras)")
    p.add_argument("--output", default="output/mnist/predictions",
                   help="directory for the label,prediction lines (replaced if present)")
    args = p.parse_args(argv)
    if args.images is None:
        args.images = f"data/mnist/{args.format}/test"
    return args


# ---------------------------------------------------------------------------
# TF process
# ---------------------------------------------------------------------------


def load_predictor(args: argparse.Namespace, ctx: Any) -> Any:
    """Loads the model; returns ``predict(float32[n, 784]) -> int[n]`` (TF process)."""
    import numpy as np

    if args.model_format == "keras":
        tf, keras = common.import_keras(args.tf_keras)
        model = keras.models.load_model(os.path.join(common.node_path(ctx, args.model_dir), common.KERAS_FILE))
        return lambda images: np.argmax(model.predict_on_batch(images), axis=-1)

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    loaded = tf.saved_model.load(common.node_path(ctx, args.export_dir))
    serve = loaded.signatures["serving_default"]
    (input_name,) = serve.structured_input_signature[1].keys()  # "image"
    (output_name,) = serve.structured_outputs.keys()  # "probabilities"
    return lambda images: np.argmax(serve(**{input_name: tf.constant(images)})[output_name].numpy(), axis=-1)


def main_fun(args: argparse.Namespace, ctx: Any) -> None:
    """Answers every fed batch with ``"label,prediction"`` strings (TF process, every node)."""
    import numpy as np

    predict = load_predictor(args, ctx)
    feed = ctx.get_data_feed(train_mode=False)
    rows_done = 0
    while not feed.should_stop():
        rows = feed.next_batch(args.batch_size)
        if not rows:
            continue
        images = np.stack([np.asarray(row[0], dtype=np.float32) for row in rows])
        predictions = predict(images)
        feed.batch_results([f"{int(row[1])},{int(p)}" for row, p in zip(rows, predictions)])
        rows_done += len(rows)
    print(f"{ctx.job_name}:{ctx.task_index} labelled {rows_done} images", flush=True)


# ---------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------


def spark_uri(path: str) -> str:
    """A path for Spark's Hadoop writers: local paths as ``file://`` URIs."""
    return "file://" + path if common.is_local(path) else path


def run(sc: Any, args: argparse.Namespace) -> dict:
    """Runs inference over the test images and writes the predictions (driver).

    Returns:
        ``{"images", "predictions", "correct", "accuracy", "seconds", "output"}``.
    """
    from tfos import TFCluster

    common.ship_by_value(common)
    args = common.resolve_paths(args, sc, ("images", "model_dir", "export_dir", "output"))
    model_path = args.export_dir if args.model_format == "savedmodel" else os.path.join(args.model_dir, common.KERAS_FILE)
    if common.is_local(model_path) and not os.path.exists(model_path):
        raise FileNotFoundError(f"no model at {model_path}; train one first (mnist_spark.py or mnist_tf.py)")
    common.remove_outputs([args.output])
    data = common.load_images(sc, args.images, args.format)
    rdd = data if args.format == "csv" else data.rdd
    images = rdd.count()
    logger.info("%d test images in %d partitions (%s); model %s", images, rdd.getNumPartitions(), args.images, model_path)

    began = time.monotonic()
    with TFCluster.run(
        sc, main_fun, args, args.cluster_size, num_ps=0, tensorboard=args.tensorboard,
        input_mode=TFCluster.InputMode.SPARK, master_node="chief",
        log_dir=os.path.join(args.model_dir, common.TENSORBOARD_DIR), progress=args.progress,
    ) as cluster:
        if args.tensorboard:
            common.check_tensorboard(cluster.tensorboard_url())
        results = cluster.inference(rdd)  # one "label,prediction" per row, persisted
        results.saveAsTextFile(spark_uri(args.output))
        pairs = results.map(lambda line: tuple(int(v) for v in line.split(",")))
        predictions, correct = pairs.map(lambda p: (1, int(p[0] == p[1]))).reduce(lambda a, b: (a[0] + b[0], a[1] + b[1]))
        cluster.shutdown()
    seconds = time.monotonic() - began
    accuracy = correct / predictions if predictions else 0.0
    print(f"\nInference finished in {seconds:.1f} s on {args.cluster_size} nodes")
    print(f"{predictions} predictions for {images} test images written to {args.output}")
    print(f"test accuracy: {accuracy:.4f} ({correct}/{predictions} correct)")
    return {"images": images, "predictions": predictions, "correct": correct, "accuracy": accuracy,
            "seconds": seconds, "output": args.output}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Script entry point (driver)."""
    args = parse_args(argv)
    common.setup_logging()
    sc, created = common.spark_context(args, "mnist_keras_inference")
    try:
        run(sc, args)
    finally:
        if created:
            sc.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
