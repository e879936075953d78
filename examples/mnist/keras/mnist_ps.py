"""MNIST with parameter servers, TF2 style: ``tf.distribute.ParameterServerStrategy`` on tfos.

Roles (``TFCluster.run(..., num_ps, master_node='chief')``):

* ``ps`` and ``worker`` nodes only run a standard TF server: ``ctx.run_server_and_wait()``
  serves until the driver stops the cluster (tfos does not wait for them at shutdown);
* the ``chief`` is the *coordinator*: it creates the Keras 3 model under
  ``strategy.scope()`` (so its variables live on the ps), and drives a custom training
  loop with ``tf.distribute.coordinator.ClusterCoordinator``: each
  ``coordinator.schedule(train_step, ...)`` runs one step on whichever worker is free,
  reading that worker's own ``tf.data`` pipeline over the TFRecord files
  (``coordinator.create_per_worker_dataset``). Training is asynchronous, as with TF1
  parameter servers. The chief checkpoints to ``--model_dir``, evaluates on the test
  set, and saves ``--export_dir/model.keras``; the driver loads it and prints the test
  accuracy;
* with ``--eval``, an ``evaluator`` node evaluates every checkpoint in ``--model_dir``.

Why a custom loop rather than ``model.fit``: with TF 2.21, Keras 3's ``fit`` fails under
ParameterServerStrategy ("To use this dataset, you need to pass this dataset to
ClusterCoordinator.create_per_worker_dataset"), while a custom loop with a Keras 3 model
and optimizer works. The legacy ``tf_keras`` ``fit(..., steps_per_epoch=N)`` also works
(see README_ps.md), but would tie the example to Keras 2.

Run it with plain Python (it starts its own ``local-cluster``) or ``spark-submit``::

    python examples/mnist/mnist_data_setup.py --output data/mnist --format tfr
    python examples/mnist/keras/mnist_ps.py --images data/mnist/tfr/train --cluster_size 4

``GRPC_FAIL_FAST=use_caller`` is set in every node before TensorFlow is imported, as
TensorFlow's ParameterServerStrategy guide asks.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any, Optional, Sequence

logger = logging.getLogger("mnist_ps_keras")

NUM_PIXELS = 784
NUM_CLASSES = 10
#: File (under --model_dir) with the chief's statistics.
STATS_FILE = "_stats/chief.json"
#: File (under --model_dir) where the evaluator appends one JSON line per checkpoint.
EVAL_FILE = "eval/eval_results.jsonl"


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parses the command line (driver)."""
    p = argparse.ArgumentParser(description="MNIST on tfos with TF2 ParameterServerStrategy.")
    p.add_argument("--cluster_size", type=int, default=4, help="number of nodes: ps + chief (+ evaluator) + workers")
    p.add_argument("--num_ps", type=int, default=1, help="number of parameter servers")
    p.add_argument("--batch_size", type=int, default=100, help="examples per step")
    p.add_argument("--steps", type=int, default=1000, help="training steps scheduled (all workers together)")
    p.add_argument("--log_steps", type=int, default=100, help="steps per logged window (the chief joins after each)")
    p.add_argument("--checkpoint_steps", type=int, default=200, help="steps between checkpoints (0: only at the end)")
    p.add_argument("--model_dir", default="mnist_model_pss", help="checkpoint directory (shared)")
    p.add_argument("--export_dir", default="mnist_export_pss", help="directory for model.keras (shared)")
    p.add_argument("--images", default="data/mnist/tfr/train", help="directory of TFRecord part files")
    p.add_argument("--test_images", default=None, help="test directory (default: 'test' next to --images)")
    p.add_argument("--hidden_units", type=int, default=128)
    p.add_argument("--learning_rate", type=float, default=0.001, help="Adam learning rate")
    p.add_argument("--tensorboard", action="store_true", help="run TensorBoard on the chief (scalars in --model_dir)")
    p.add_argument("--master", default=None, help="Spark master (default: spark-submit's, else an own local-cluster)")
    p.add_argument("--eval", action="store_true", help="add an evaluator node that evaluates every checkpoint")
    p.add_argument("--driver_ps_nodes", action="store_true", help="run the ps nodes on the driver host")
    p.add_argument("--eval_wait_secs", type=float, default=60.0,
                   help="with --eval: longest wait, in seconds, of the chief for the evaluator to score the last checkpoint")
    p.add_argument("--keep", action="store_true", help="keep an existing --model_dir/--export_dir")
    args = p.parse_args(argv)
    if args.cluster_size - args.num_ps - (1 if args.eval else 0) < 2:
        p.error("cluster_size must leave a chief and at least one worker besides the ps (and evaluator)")
    if args.num_ps < 1:
        p.error("ParameterServerStrategy needs --num_ps >= 1")
    return args


def data_test_dir(args: argparse.Namespace) -> str:
    """The test-set directory: ``--test_images`` or the 'test' sibling of ``--images``."""
    if args.test_images:
        return args.test_images
    return args.images.rstrip("/").rsplit("/", 1)[0] + "/test"


def tfrecord_files(directory: str) -> list[str]:
    """Sorted ``part-*.tfrecord`` files of a directory (any process)."""
    import tensorflow as tf

    files = sorted(tf.io.gfile.glob(directory.rstrip("/") + "/part-*.tfrecord"))
    if not files:
        raise FileNotFoundError(f"no part-*.tfrecord files in {directory}; run "
                                "examples/mnist/mnist_data_setup.py --format tfr first")
    return files


def parse_record(record: Any) -> tuple[Any, Any]:
    """A serialized ``tf.train.Example`` -> ``(float32[784], int64 label)`` (graph function)."""
    import tensorflow as tf

    ex = tf.io.parse_single_example(record, {
        "image": tf.io.FixedLenFeature([NUM_PIXELS], tf.float32),
        "label": tf.io.FixedLenFeature([], tf.int64),
    })
    return ex["image"], ex["label"]


def load_numpy(directory: str) -> tuple[Any, Any]:
    """A whole split as ``(float32[n, 784], int64[n])`` (eager; chief, evaluator, driver)."""
    import numpy as np
    import tensorflow as tf

    ds = tf.data.TFRecordDataset(tfrecord_files(directory)).map(
        tf.autograph.experimental.do_not_convert(parse_record)).batch(4096)
    xs, ys = zip(*[(x.numpy(), y.numpy()) for x, y in ds])
    return np.concatenate(xs), np.concatenate(ys)


def build_model(hidden_units: int) -> Any:
    """The Keras 3 model: 784 -> ReLU(hidden_units) -> 10 logits."""
    import keras

    layers = [keras.Input((NUM_PIXELS,))]
    if hidden_units > 0:
        layers.append(keras.layers.Dense(hidden_units, activation="relu", name="hidden"))
    layers.append(keras.layers.Dense(NUM_CLASSES, name="logits"))
    return keras.Sequential(layers, name="mnist_mlp")


def accuracy_of(model: Any, x: Any, y: Any, batch: int = 2000) -> float:
    """Top-1 accuracy of ``model`` on numpy arrays (eager)."""
    import numpy as np

    pred = np.concatenate([np.argmax(np.asarray(model(x[i:i + batch], training=False)), 1)
                           for i in range(0, len(x), batch)])
    return float(np.mean(pred == y))


def wait_for_final_eval(args: argparse.Namespace, ctx: Any, final_step: int) -> bool:
    """Chief, with --eval: waits until the evaluator has scored the final checkpoint.

    The driver stops the evaluator as soon as the chief/workers are done, so the chief
    holds on (at most ``--eval_wait_secs``) until the evaluator's results file shows
    ``final_step``. Polls the shared results file; needs no other coordination.

    Returns:
        True if the evaluator scored ``final_step`` in time.
    """
    import tensorflow as tf

    path = f"{args.model_dir}/{EVAL_FILE}"
    deadline = time.monotonic() + args.eval_wait_secs
    while time.monotonic() < deadline:
        if tf.io.gfile.exists(path):
            with tf.io.gfile.GFile(path) as fh:
                if any(json.loads(line).get('step') == final_step for line in fh if line.strip()):
                    return True
        time.sleep(0.5)
    _say(ctx, f"the evaluator did not score step {final_step} within {args.eval_wait_secs:g} s; not waiting longer")
    return False


def _say(ctx: Any, text: str) -> None:
    """Prints a line of this node: in its executor's log, and on the driver's stderr with
    tfos's node prefix (``[worker:1] ...``) for the nodes ``forward_logs`` selects."""
    del ctx
    print(text, flush=True)


def _write_json(path: str, obj: dict) -> None:
    import tensorflow as tf

    tf.io.gfile.makedirs(path.rsplit("/", 1)[0])
    with tf.io.gfile.GFile(path, "w") as fh:
        fh.write(json.dumps(obj))


# ---------------------------------------------------------------------------
# Node side
# ---------------------------------------------------------------------------


def main_fun(args: argparse.Namespace, ctx: Any) -> None:
    """Runs on every node (TF process): ps/worker serve, the chief coordinates."""
    # Must be set before TensorFlow is imported, in every process of the cluster.
    os.environ["GRPC_FAIL_FAST"] = "use_caller"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if ctx.job_name in ("ps", "worker"):
        _say(ctx, "serving for the ParameterServerStrategy coordinator")
        ctx.run_server_and_wait()  # returns when the driver stops the cluster
        return
    if ctx.job_name == "evaluator":
        run_evaluator(args, ctx)
        return
    run_chief(args, ctx)


def run_chief(args: argparse.Namespace, ctx: Any) -> None:
    """The coordinator: trains with a custom loop, evaluates, saves (chief's TF process)."""
    import keras
    import tensorflow as tf

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    num_workers = len(ctx.cluster_spec.get("worker", []))
    _say(ctx, f"coordinator for {num_workers} worker(s) and {len(ctx.cluster_spec['ps'])} ps")

    with strategy.scope():
        model = build_model(args.hidden_units)
        optimizer = keras.optimizers.Adam(args.learning_rate)
        # Create the optimizer's variables now, on the ps: a scheduled function cannot.
        optimizer.build(model.trainable_variables)
        train_acc = keras.metrics.SparseCategoricalAccuracy()
        train_loss = keras.metrics.Mean()
    devices = sorted({v.value.device for v in model.trainable_variables})
    _say(ctx, f"model variables on {devices}")

    files = tfrecord_files(args.images)
    batch_size = args.batch_size

    def dataset_fn(input_context: Any) -> Any:
        # Runs on each worker: every worker reads all files in its own random order.
        return (
            tf.data.Dataset.from_tensor_slices(files)
            .shuffle(len(files))
            .interleave(tf.data.TFRecordDataset, cycle_length=len(files))
            .map(tf.autograph.experimental.do_not_convert(parse_record))
            .shuffle(5000)
            .repeat()
            .batch(batch_size)
            .prefetch(2)
        )

    # autograph=False: nothing to convert, and functions shipped by value have no source.
    @tf.function(autograph=False)
    def per_worker_dataset_fn() -> Any:
        return strategy.distribute_datasets_from_function(dataset_fn)

    per_worker_iter = iter(coordinator.create_per_worker_dataset(per_worker_dataset_fn))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    @tf.function(autograph=False)
    def train_step(iterator: Any) -> Any:
        @tf.autograph.experimental.do_not_convert
        def replica_fn(x: Any, y: Any) -> Any:
            with tf.GradientTape() as tape:
                logits = model(x, training=True)
                loss = tf.nn.compute_average_loss(loss_fn(y, logits), global_batch_size=batch_size)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            train_acc.update_state(y, logits)
            train_loss.update_state(loss)
            return loss

        x, y = next(iterator)
        return strategy.run(replica_fn, args=(x, y))

    ckpt = tf.train.Checkpoint(model=model, optimizer=optimizer)
    manager = tf.train.CheckpointManager(ckpt, args.model_dir, max_to_keep=20)
    writer = tf.summary.create_file_writer(args.model_dir) if args.tensorboard else None
    stats: dict = {"variable_devices": devices, "num_workers": num_workers, "windows": []}
    t_start = time.monotonic()
    done = 0
    while done < args.steps:
        n = min(args.log_steps, args.steps - done)
        t0 = time.monotonic()
        for _ in range(n):
            coordinator.schedule(train_step, args=(per_worker_iter,))
        coordinator.join()  # wait for this window's steps (on all workers)
        done += n
        secs = time.monotonic() - t0
        window = {"step": done, "loss": float(train_loss.result()), "accuracy": float(train_acc.result()),
                  "steps_per_sec": n / secs, "steps_per_sec_per_worker": n / secs / max(num_workers, 1)}
        stats["windows"].append(window)
        _say(ctx, f"step {done:5d}  loss {window['loss']:.4f}  accuracy {window['accuracy']:.3f}  "
                  f"{window['steps_per_sec']:.1f} steps/s ({window['steps_per_sec_per_worker']:.1f} per worker)")
        if writer is not None:
            with writer.as_default():
                tf.summary.scalar("loss", window["loss"], step=done)
                tf.summary.scalar("accuracy", window["accuracy"], step=done)
        train_loss.reset_state()
        train_acc.reset_state()
        if args.checkpoint_steps and (done % args.checkpoint_steps < n or done == args.steps):
            manager.save(checkpoint_number=done)
    total = time.monotonic() - t_start
    if not manager.latest_checkpoint or not manager.latest_checkpoint.endswith(f"-{done}"):
        manager.save(checkpoint_number=done)

    test_x, test_y = load_numpy(data_test_dir(args))
    test_acc = accuracy_of(model, test_x, test_y)
    tf.io.gfile.makedirs(args.export_dir)
    path = args.export_dir.rstrip("/") + "/model.keras"
    model.save(path)
    stats.update(steps=done, seconds=total, steps_per_sec=done / total,
                 steps_per_sec_per_worker=done / total / max(num_workers, 1),
                 chief_test_accuracy=test_acc, num_test=int(len(test_y)), model_path=path)
    _say(ctx, f"trained {done} steps in {total:.1f} s ({stats['steps_per_sec']:.1f} steps/s); "
              f"test accuracy {test_acc:.4f} on {len(test_y)} images; saved {path}")
    if args.eval:
        stats["final_checkpoint_evaluated"] = wait_for_final_eval(args, ctx, done)
    _write_json(f"{args.model_dir}/{STATS_FILE}", stats)


def run_evaluator(args: argparse.Namespace, ctx: Any) -> None:
    """Evaluator node: evaluates each new checkpoint on the test set until stopped (eager)."""
    import tensorflow as tf

    test_x, test_y = load_numpy(data_test_dir(args))
    model = build_model(args.hidden_units)
    ckpt = tf.train.Checkpoint(model=model)
    results = f"{args.model_dir}/{EVAL_FILE}"
    tf.io.gfile.makedirs(results.rsplit("/", 1)[0])
    _say(ctx, f"evaluator: {len(test_y)} test images; watching {args.model_dir}")
    for path in tf.train.checkpoints_iterator(args.model_dir, min_interval_secs=1, timeout=2,
                                              timeout_fn=ctx.stop_event.is_set):
        try:
            ckpt.restore(path).expect_partial()
        except (tf.errors.NotFoundError, tf.errors.DataLossError) as exc:
            _say(ctx, f"skipping {path}: {type(exc).__name__}")
            continue
        step = int(path.rsplit("-", 1)[1])
        acc = accuracy_of(model, test_x, test_y)
        _say(ctx, f"checkpoint {os.path.basename(path)}: test accuracy {acc:.4f}")
        with tf.io.gfile.GFile(results, "a") as fh:
            fh.write(json.dumps({"checkpoint": path, "step": step, "accuracy": acc, "time": time.time()}) + "\n")


# ---------------------------------------------------------------------------
# Driver side
# ---------------------------------------------------------------------------


def resolve_paths(args: argparse.Namespace, sc: Any) -> argparse.Namespace:
    """Makes the paths absolute on the driver (see the TF1 example)."""
    from tfos.node_context import absolute_path

    try:
        default_fs = sc._jsc.hadoopConfiguration().get("fs.defaultFS") or "file://"
    except Exception:  # noqa: BLE001 - no Hadoop configuration: local files
        default_fs = "file://"
    resolved = argparse.Namespace(**vars(args))
    for name in ("images", "test_images", "model_dir", "export_dir"):
        value = getattr(args, name)
        if value:
            path = absolute_path(value, default_fs, os.getcwd())
            setattr(resolved, name, path[len("file://"):] if path.startswith("file://") else path)
    resolved.test_images = data_test_dir(resolved)
    return resolved


def read_json(path: str) -> Optional[dict]:
    import tensorflow as tf

    if not tf.io.gfile.exists(path):
        return None
    with tf.io.gfile.GFile(path) as fh:
        return json.load(fh)


def read_eval_results(args: argparse.Namespace) -> list:
    import tensorflow as tf

    path = f"{args.model_dir}/{EVAL_FILE}"
    if not tf.io.gfile.exists(path):
        return []
    with tf.io.gfile.GFile(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def run(sc: Any, args: argparse.Namespace) -> dict:
    """Trains on the cluster, then loads ``model.keras`` on the driver and scores it.

    Returns:
        ``test_accuracy``, ``num_test``, ``chief`` (the chief's statistics), ``eval``,
        ``seconds``, ``args``.
    """
    os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")
    import keras
    import tensorflow as tf

    from tfos import TFCluster

    args = resolve_paths(args, sc)
    if not args.keep:
        for d in (args.model_dir, args.export_dir):
            if tf.io.gfile.exists(d):
                tf.io.gfile.rmtree(d)
    started = time.monotonic()
    with TFCluster.run(
        sc, main_fun, args, args.cluster_size, args.num_ps, args.tensorboard, TFCluster.InputMode.TENSORFLOW,
        log_dir=args.model_dir, driver_ps_nodes=args.driver_ps_nodes, master_node="chief", eval_node=args.eval,
        release_port=False,  # run_server_and_wait hands the reserved port to TF without a gap
    ) as cluster:
        if args.tensorboard:
            logger.info("TensorBoard: %s", cluster.tensorboard_url())
        # shutdown() waits for the chief only: ps/worker nodes told tfos they just serve.
        # With --eval the chief has already waited for the evaluator's last score.
        cluster.shutdown()
    seconds = time.monotonic() - started
    chief = read_json(f"{args.model_dir}/{STATS_FILE}") or {}
    model = keras.saving.load_model(chief.get("model_path", args.export_dir.rstrip("/") + "/model.keras"))
    x, y = load_numpy(data_test_dir(args))
    return {"test_accuracy": accuracy_of(model, x, y), "num_test": int(len(y)), "chief": chief,
            "eval": read_eval_results(args), "seconds": seconds, "args": vars(args)}


def print_summary(summary: dict) -> None:
    """Prints the results (driver)."""
    args, chief = summary["args"], summary["chief"]
    print(f"\nParameterServerStrategy: {args['cluster_size']} nodes ({args['num_ps']} ps"
          f"{' on the driver' if args['driver_ps_nodes'] else ''}, chief, {chief.get('num_workers', '?')} worker(s)"
          f"{', evaluator' if args['eval'] else ''}), {summary['seconds']:.1f} s")
    for w in chief.get("windows", []):
        print(f"  step {w['step']:5d}: loss {w['loss']:.4f}, accuracy {w['accuracy']:.3f}, "
              f"{w['steps_per_sec']:.1f} steps/s ({w['steps_per_sec_per_worker']:.1f} per worker)")
    if chief:
        print(f"  {chief['steps']} steps in {chief['seconds']:.1f} s: {chief['steps_per_sec']:.1f} steps/s, "
              f"{chief['steps_per_sec_per_worker']:.1f} per worker; variables on {chief['variable_devices']}")
    for e in summary["eval"]:
        print(f"  evaluator: step {e['step']:5d}: test accuracy {e['accuracy']:.4f}")
    print(f"test accuracy of {chief.get('model_path')}: {summary['test_accuracy']:.4f} on {summary['num_test']} images")


def spark_context(args: argparse.Namespace) -> tuple[Any, bool]:
    """spark-submit's SparkContext, or an own ``local-cluster`` (driver)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark import SparkConf, SparkContext

    from tfos import authenticate_spark

    active = SparkContext._active_spark_context
    if active is not None:
        return active, False
    conf = SparkConf().setAppName("mnist_ps_keras")
    if "PYSPARK_GATEWAY_PORT" in os.environ:
        if args.master:
            conf.setMaster(args.master)
    else:
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        executors = args.cluster_size - (args.num_ps if args.driver_ps_nodes else 0)
        conf.setMaster(args.master or f"local-cluster[{executors},1,1024]")
        authenticate_spark(conf.get("spark.master"))  # a secret only this user can read (docs/deploy.md)
        conf.set("spark.driver.host", "127.0.0.1").set("spark.ui.enabled", "false")
        conf.set("spark.ui.showConsoleProgress", "false")
    return SparkContext(conf=conf), True


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Script entry point (driver)."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sc, created = spark_context(args)
    try:
        sc.setLogLevel("WARN")
        print_summary(run(sc, args))
    finally:
        if created:
            sc.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
