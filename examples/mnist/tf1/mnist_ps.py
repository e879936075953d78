"""MNIST with parameter servers, TF1 style: between-graph replication on tfos.

The classic TensorFlowOnSpark pattern, on TensorFlow 2.x through ``tf.compat.v1``:
every node runs ``main_fun(args, ctx)``; ps nodes start a TF server and
``server.join()``; workers build the same graph under
``tf.compat.v1.train.replica_device_setter`` (variables on the ps, compute on
the worker) and train asynchronously (or synchronously with
``SyncReplicasOptimizer``). Worker 0 is the chief: it initialises the
variables, writes checkpoints to ``--model_dir`` and, at the end, exports a
SavedModel to ``--export_dir``. The driver then loads that export and prints
the test accuracy.

Run it with plain Python (it starts its own ``local-cluster``) or with
``spark-submit``; see ``examples/mnist/tf1/README.md``::

    python examples/mnist/mnist_data_setup.py --output data/mnist --format both
    python examples/mnist/tf1/mnist_ps.py --images data/mnist/tfr/train \\
        --cluster_size 3 --num_ps 1 --steps 1000 --mode monitored

Options worth knowing:

* ``--mode monitored`` (default): ``MonitoredTrainingSession`` with a
  ``StopAtStepHook``; ``--mode supervisor``: the older ``tf.compat.v1.train.Supervisor``;
  ``--mode sync``: ``SyncReplicasOptimizer`` (one update per round of gradients
  from every worker) under ``MonitoredTrainingSession``.
* ``--input_mode tf`` (default): each worker reads its own shard of the
  TFRecord files; ``--input_mode spark``: the driver reads the files as an RDD
  and feeds the workers through ``TFNode.DataFeed``.
* ``--eval``: one more node, the 'evaluator', evaluates every checkpoint the
  chief writes on the test set and logs the accuracy.
* ``--driver_ps_nodes``: the ps runs as a process on the driver host, so only
  ``cluster_size - num_ps`` executors are needed.

Paths (``--images``, ``--model_dir``, ``--export_dir``) must be visible to the
driver and every executor: local paths on one machine, else a shared file
system (``hdfs://...``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any, Iterator, Optional, Sequence

logger = logging.getLogger("mnist_ps_tf1")

NUM_PIXELS = 784
NUM_CLASSES = 10
#: Name of the directory (under --model_dir) where every worker leaves its statistics.
STATS_DIR = "_stats"
#: File (under --model_dir) where the evaluator appends one JSON line per checkpoint.
EVAL_FILE = "eval/eval_results.jsonl"


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parses the command line (driver).

    Args:
        argv: Arguments without the program name; None reads ``sys.argv``.

    Returns:
        The options.
    """
    p = argparse.ArgumentParser(description="MNIST on tfos with parameter servers (TF1 between-graph).")
    p.add_argument("--cluster_size", type=int, default=3, help="number of nodes, ps (and evaluator) included")
    p.add_argument("--num_ps", type=int, default=1, help="number of parameter servers")
    p.add_argument("--epochs", type=int, default=10, help="passes over the training data (at most)")
    p.add_argument("--batch_size", type=int, default=100, help="examples per step and worker")
    p.add_argument("--steps", type=int, default=1000, help="global steps to train (all workers together)")
    p.add_argument("--model_dir", default="mnist_model_ps", help="checkpoint directory (shared)")
    p.add_argument("--export_dir", default="mnist_export_ps", help="SavedModel export directory (shared)")
    p.add_argument("--images", default="data/mnist/tfr/train", help="directory of TFRecord (or CSV) part files")
    p.add_argument("--test_images", default=None, help="test directory (default: 'test' next to --images)")
    p.add_argument("--mode", choices=("supervisor", "monitored", "sync"), default="monitored")
    p.add_argument("--input_mode", choices=("tf", "spark"), default="tf")
    p.add_argument("--tensorboard", action="store_true", help="run TensorBoard on the chief")
    p.add_argument("--master", default=None, help="Spark master (default: spark-submit's, else an own local-cluster)")
    p.add_argument("--eval", action="store_true", help="add an evaluator node that evaluates every checkpoint")
    p.add_argument("--driver_ps_nodes", action="store_true", help="run the ps nodes on the driver host")
    p.add_argument("--hidden_units", type=int, default=128, help="hidden layer width (0: softmax regression)")
    p.add_argument("--learning_rate", type=float, default=0.001, help="Adam learning rate")
    p.add_argument("--log_steps", type=int, default=100, help="local steps per logged window")
    p.add_argument("--checkpoint_steps", type=int, default=200, help="global steps between checkpoints")
    p.add_argument("--checkpoint_secs", type=int, default=5, help="seconds between checkpoints (supervisor mode)")
    p.add_argument("--eval_wait_secs", type=float, default=60.0,
                   help="with --eval: longest wait, in seconds, of the chief for the evaluator to score the last checkpoint")
    p.add_argument("--sync_timeout_s", type=float, default=120.0,
                   help="sync mode: longest wait, in seconds, for the other workers' gradients")
    p.add_argument("--keep", action="store_true", help="keep an existing --model_dir/--export_dir (resume)")
    args = p.parse_args(argv)
    if args.cluster_size - args.num_ps - (1 if args.eval else 0) < 1:
        p.error("cluster_size leaves no worker: it must exceed num_ps (+1 with --eval)")
    return args


# ---------------------------------------------------------------------------
# Shared helpers (driver, evaluator and workers)
# ---------------------------------------------------------------------------


def data_test_dir(args: argparse.Namespace) -> str:
    """The test-set directory: ``--test_images`` or the 'test' sibling of ``--images``."""
    if args.test_images:
        return args.test_images
    return args.images.rstrip("/").rsplit("/", 1)[0] + "/test"


def data_files(directory: str) -> list[str]:
    """Sorted ``part-*`` files of a data directory (TFRecord or CSV), via ``tf.io.gfile``."""
    import tensorflow as tf

    files = sorted(f for f in tf.io.gfile.glob(directory.rstrip("/") + "/part-*") if not f.endswith(".crc"))
    if not files:
        raise FileNotFoundError(f"no part-* files in {directory}; run examples/mnist/mnist_data_setup.py first")
    return files


def is_tfrecord(files: Sequence[str]) -> bool:
    """True when the part files are TFRecords (``part-*.tfrecord``), False for CSV."""
    return all(f.endswith(".tfrecord") for f in files)


def read_tfrecord_file(path: str) -> Iterator[tuple[list, int]]:
    """Yields ``(784 floats, label)`` for each record of one TFRecord file (any process)."""
    import tensorflow as tf

    for record in tf.compat.v1.io.tf_record_iterator(path):
        example = tf.train.Example.FromString(record)
        feature = example.features.feature
        yield list(feature["image"].float_list.value), int(feature["label"].int64_list.value[0])


def parse_csv_line(line: str) -> tuple[list, int]:
    """``label,p0,...,p783`` -> ``(784 floats, label)``."""
    cells = line.split(",")
    return [float(c) for c in cells[1:]], int(cells[0])


def load_numpy(directory: str) -> tuple[Any, Any]:
    """Reads a whole (test) split into ``(float32[n, 784], int64[n])`` (any process)."""
    import numpy as np
    import tensorflow as tf

    files = data_files(directory)
    rows: list = []
    if is_tfrecord(files):
        for f in files:
            rows.extend(read_tfrecord_file(f))
    else:
        for f in files:
            with tf.io.gfile.GFile(f) as fh:
                rows.extend(parse_csv_line(line) for line in fh if line.strip())
    x = np.asarray([r[0] for r in rows], dtype=np.float32)
    y = np.asarray([r[1] for r in rows], dtype=np.int64)
    return x, y


def build_model(x: Any, hidden_units: int) -> Any:
    """The model: ``x`` -> logits, a ReLU hidden layer (or none) then softmax regression.

    Plain ``tf.compat.v1`` variables (no Keras, no deprecated ``tf.compat.v1.layers``), so the
    graph and the checkpoint names are the same on the workers, the evaluator and at export.
    Runs in graph mode.
    """
    import tensorflow as tf

    v1 = tf.compat.v1
    init = v1.glorot_uniform_initializer(seed=42)
    h, width = x, NUM_PIXELS
    if hidden_units > 0:
        hid_w = v1.get_variable("hid_w", [NUM_PIXELS, hidden_units], initializer=init)
        hid_b = v1.get_variable("hid_b", [hidden_units], initializer=v1.zeros_initializer())
        h, width = tf.nn.relu(tf.matmul(x, hid_w) + hid_b), hidden_units
    sm_w = v1.get_variable("sm_w", [width, NUM_CLASSES], initializer=init)
    sm_b = v1.get_variable("sm_b", [NUM_CLASSES], initializer=v1.zeros_initializer())
    return tf.matmul(h, sm_w) + sm_b


def _write_json(path: str, obj: dict) -> None:
    import tensorflow as tf

    tf.io.gfile.makedirs(path.rsplit("/", 1)[0])
    with tf.io.gfile.GFile(path, "w") as fh:
        fh.write(json.dumps(obj))


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
                if any(json.loads(line).get('global_step') == final_step for line in fh if line.strip()):
                    return True
        time.sleep(0.5)
    _say(ctx, f"the evaluator did not score step {final_step} within {args.eval_wait_secs:g} s; not waiting longer")
    return False


def _say(ctx: Any, text: str) -> None:
    """Prints a line of this node: in its executor's log, and on the driver's stderr with
    tfos's node prefix (``[worker:1] ...``) for the nodes ``forward_logs`` selects."""
    del ctx
    print(text, flush=True)


# ---------------------------------------------------------------------------
# Node side
# ---------------------------------------------------------------------------


def main_fun(args: argparse.Namespace, ctx: Any) -> None:
    """Runs on every node (TF process): ps serve, workers train, the evaluator evaluates."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    from tfos import TFNode

    tf.compat.v1.disable_eager_execution()
    if ctx.job_name == "evaluator":
        run_evaluator(args, ctx)
        return
    cluster, server = TFNode.start_cluster_server(ctx)
    if ctx.job_name == "ps":
        _say(ctx, f"parameter server up at {server.target}; joining")
        server.join()  # never returns: the driver stops the process at shutdown
        return
    run_worker(args, ctx, cluster, server)


def _is_chief(ctx: Any) -> bool:
    if ctx.job_name in ("chief", "master"):
        return True
    return ctx.job_name == "worker" and ctx.task_index == 0 and not ({"chief", "master"} & set(ctx.cluster_spec))


def _input_tensors(args: argparse.Namespace, ctx: Any) -> tuple[Any, Any, Any]:
    """``(x, y, feed)``: tensors of the next batch, and the DataFeed in InputMode.SPARK."""
    import tensorflow as tf

    from tfos import TFNode

    v1 = tf.compat.v1
    if args.input_mode == "spark":
        x = v1.placeholder(tf.float32, [None, NUM_PIXELS], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        return x, y, TFNode.DataFeed(ctx.mgr)
    files = TFNode.shard_files(ctx, args.images.rstrip("/") + "/part-*")
    spec = {
        "image": tf.io.FixedLenFeature([NUM_PIXELS], tf.float32),
        "label": tf.io.FixedLenFeature([], tf.int64),
    }

    @tf.autograph.experimental.do_not_convert  # shipped by value: no source for AutoGraph
    def parse(record: Any) -> tuple[Any, Any]:
        ex = tf.io.parse_single_example(record, spec)
        return ex["image"], ex["label"]

    # Synchronous training needs every worker until the last step: a worker that ran out
    # of data would leave the others waiting for its gradients, so sync mode repeats forever.
    epochs = None if args.mode == "sync" else args.epochs
    ds = (
        tf.data.TFRecordDataset(files)
        .map(parse)
        .shuffle(2000, seed=ctx.task_index)
        .repeat(epochs)
        .batch(args.batch_size)
        .prefetch(2)
    )
    x, y = v1.data.make_one_shot_iterator(ds).get_next()
    return x, y, None


def _feed_dict(args: argparse.Namespace, feed: Any, x: Any, y: Any) -> Optional[dict]:
    """Next batch from the DataFeed as a feed_dict; None when the feed has ended."""
    import numpy as np

    if feed is None:
        return {}
    if feed.should_stop():
        return None
    rows = feed.next_batch(args.batch_size)
    if not rows:
        return None
    return {
        x: np.asarray([r[0] for r in rows], dtype=np.float32),
        y: np.asarray([r[1] for r in rows], dtype=np.int64),
    }


def _wait_for_chief_init(target: str, config: Any, timeout_s: float = 300.0) -> None:
    """Blocks a non-chief worker until the chief has initialised the variables on the ps.

    ``MonitoredTrainingSession`` on a non-chief polls readiness only every 30 s (fixed in
    ``WorkerSessionCreator``); polling here first makes the worker start within ~0.5 s.
    """
    import tensorflow as tf

    v1 = tf.compat.v1
    uninitialized = v1.report_uninitialized_variables(v1.global_variables())
    deadline = time.monotonic() + timeout_s
    with v1.Session(target, config=config) as sess:
        while len(sess.run(uninitialized)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the chief did not initialise the variables within {timeout_s:g} s")
            time.sleep(0.5)


def run_worker(args: argparse.Namespace, ctx: Any, cluster: Any, server: Any) -> None:
    """Trains on a worker (TF process, graph mode)."""
    import tensorflow as tf

    v1 = tf.compat.v1
    is_chief = _is_chief(ctx)
    num_workers = ctx.num_workers
    model_dir = args.model_dir
    device = f"/job:{ctx.job_name}/task:{ctx.task_index}"
    with v1.device(v1.train.replica_device_setter(worker_device=device, cluster=cluster)):
        global_step = v1.train.get_or_create_global_step()
        x, y, feed = _input_tensors(args, ctx)
        logits = build_model(x, args.hidden_units)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        accuracy = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, 1), y), tf.float32))
        v1.summary.scalar("loss", loss)
        v1.summary.scalar("accuracy", accuracy)
        opt = v1.train.AdamOptimizer(args.learning_rate)
        if args.mode == "sync":
            opt = v1.train.SyncReplicasOptimizer(opt, replicas_to_aggregate=num_workers, total_num_replicas=num_workers)
        train_op = opt.minimize(loss, global_step=global_step)
    # Only the ps and this worker: other workers may come and go without stalling our session.
    config = v1.ConfigProto(device_filters=["/job:ps", device], inter_op_parallelism_threads=2, intra_op_parallelism_threads=2)
    if args.mode == "sync":
        # A step waits for every worker's gradients: if one worker dies or runs dry, fail
        # (DeadlineExceededError, reported by tfos) instead of waiting forever.
        config.operation_timeout_in_ms = int(args.sync_timeout_s * 1000)
    # Where replica_device_setter put things: variables on the ps, the input on this worker.
    placement = {"global_step": global_step.device, "x": x.device,
                 "variables": {v.op.name: v.device for v in v1.trainable_variables()}}
    _say(ctx, f"{'chief ' if is_chief else ''}worker of {num_workers}, mode {args.mode}, input {args.input_mode}; "
              f"global_step on {global_step.device}")

    stats = {"job": ctx.job_name, "task": ctx.task_index, "is_chief": is_chief, "devices": placement,
             "mode": args.mode, "input_mode": args.input_mode, "windows": []}
    window = {"t0": time.monotonic(), "n": 0, "loss": 0.0, "acc": 0.0}
    local_steps, last_gstep = 0, 0
    t_start = time.monotonic()

    def record(gstep: int, loss_v: float, acc_v: float) -> None:
        nonlocal local_steps, last_gstep
        local_steps += 1
        last_gstep = int(gstep)
        window["n"] += 1
        window["loss"] += float(loss_v)
        window["acc"] += float(acc_v)
        if window["n"] >= args.log_steps:
            flush_window()

    def flush_window() -> None:
        n = window["n"]
        if not n:
            return
        secs = time.monotonic() - window["t0"]
        w = {"global_step": last_gstep, "local_steps": local_steps, "loss": window["loss"] / n,
             "accuracy": window["acc"] / n, "steps_per_sec": n / max(secs, 1e-9)}
        stats["windows"].append(w)
        _say(ctx, f"global step {w['global_step']:5d}  local step {local_steps:5d}  loss {w['loss']:.4f}  "
                  f"accuracy {w['accuracy']:.3f}  {w['steps_per_sec']:.1f} steps/s")
        window.update(t0=time.monotonic(), n=0, loss=0.0, acc=0.0)

    fetches = [train_op, global_step, loss, accuracy]
    stopped_early = False
    if args.mode == "supervisor":
        saver = v1.train.Saver(max_to_keep=20)
        summary_op = v1.summary.merge_all() if args.tensorboard else None
        sv = v1.train.Supervisor(
            is_chief=is_chief, logdir=model_dir, global_step=global_step, init_op=v1.global_variables_initializer(),
            saver=saver, save_model_secs=args.checkpoint_secs, summary_op=None, recovery_wait_secs=1,
        )
        sess = sv.prepare_or_wait_for_session(server.target, config=config)
        step = 0
        try:
            while not sv.should_stop() and step < args.steps:
                fd = _feed_dict(args, feed, x, y)
                if fd is None:
                    break
                if summary_op is not None and is_chief and local_steps % args.log_steps == 0:
                    _, step, l, a, summ = sess.run(fetches + [summary_op], feed_dict=fd)
                    sv.summary_computed(sess, summ, global_step=step)
                else:
                    _, step, l, a = sess.run(fetches, feed_dict=fd)
                record(step, l, a)
        except tf.errors.OutOfRangeError:
            pass  # this worker's input is exhausted (--epochs)
        if is_chief:
            sv.saver.save(sess, sv.save_path, global_step=sess.run(global_step))
        stopped_early = step >= args.steps
        sv.stop()
    else:
        hooks = [v1.train.StopAtStepHook(last_step=args.steps)]
        if args.mode == "sync":
            hooks.append(opt.make_session_run_hook(is_chief))
        if not is_chief:
            _wait_for_chief_init(server.target, config)
        with v1.train.MonitoredTrainingSession(
            master=server.target, is_chief=is_chief, checkpoint_dir=model_dir, hooks=hooks,
            save_checkpoint_steps=args.checkpoint_steps, save_checkpoint_secs=None,
            save_summaries_steps=args.log_steps if args.tensorboard else None, save_summaries_secs=None,
            log_step_count_steps=0, config=config, stop_grace_period_secs=3,
        ) as sess:
            while not sess.should_stop():
                fd = _feed_dict(args, feed, x, y)
                if fd is None:
                    break
                _, step, l, a = sess.run(fetches, feed_dict=fd)
                record(step, l, a)
            stopped_early = sess.should_stop()
    flush_window()
    if feed is not None and stopped_early:
        feed.terminate()  # skip the rest of the feed: the step budget is used up
    total_s = time.monotonic() - t_start
    stats.update(local_steps=local_steps, last_global_step=last_gstep, seconds=total_s,
                 steps_per_sec=local_steps / max(total_s, 1e-9))
    _say(ctx, f"done: {local_steps} local steps in {total_s:.1f} s ({stats['steps_per_sec']:.1f} steps/s), "
              f"last global step {last_gstep}")
    if is_chief:
        stats["export_dir"] = export(args, ctx)
        if args.eval:
            final_step = int(tf.train.latest_checkpoint(model_dir).rsplit("-", 1)[1])
            stats["final_checkpoint_evaluated"] = wait_for_final_eval(args, ctx, final_step)
    _write_json(f"{model_dir}/{STATS_DIR}/{ctx.job_name}_{ctx.task_index}.json", stats)


def export(args: argparse.Namespace, ctx: Any) -> str:
    """Chief: restores the latest checkpoint into a fresh local graph and exports a SavedModel.

    A fresh graph has no ps/worker device placements, so the export loads anywhere.

    Returns:
        The export directory.
    """
    import tensorflow as tf

    from tfos import TFNode

    v1 = tf.compat.v1
    ckpt = tf.train.latest_checkpoint(args.model_dir)
    if ckpt is None:
        raise FileNotFoundError(f"no checkpoint in {args.model_dir} to export")
    with tf.Graph().as_default():
        x = v1.placeholder(tf.float32, [None, NUM_PIXELS], name="image")
        logits = build_model(x, args.hidden_units)
        prediction = tf.argmax(logits, 1, name="prediction")
        with v1.Session() as sess:
            v1.train.Saver().restore(sess, ckpt)
            if tf.io.gfile.exists(args.export_dir):
                tf.io.gfile.rmtree(args.export_dir)
            TFNode.export_saved_model(
                sess, args.export_dir, "serve",
                {"serving_default": {"inputs": {"image": x}, "outputs": {"logits": logits, "prediction": prediction}}},
            )
    _say(ctx, f"exported {ckpt} to {args.export_dir}")
    return args.export_dir


def run_evaluator(args: argparse.Namespace, ctx: Any) -> None:
    """Evaluator node: evaluates each new checkpoint in --model_dir on the test set (TF process).

    Loops until the driver stops the cluster (which ends this process at shutdown; the
    ``timeout_fn`` also ends the loop once ``ctx.stop_event`` is set). One JSON line per
    checkpoint is appended to ``--model_dir/eval/eval_results.jsonl``.
    """
    import tensorflow as tf

    v1 = tf.compat.v1
    test_x, test_y = load_numpy(data_test_dir(args))
    _say(ctx, f"evaluator: {len(test_y)} test images; watching {args.model_dir}")
    results_path = f"{args.model_dir}/{EVAL_FILE}"
    tf.io.gfile.makedirs(results_path.rsplit("/", 1)[0])
    with tf.Graph().as_default():
        x = v1.placeholder(tf.float32, [None, NUM_PIXELS])
        y = v1.placeholder(tf.int64, [None])
        logits = build_model(x, args.hidden_units)
        accuracy = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, 1), y), tf.float32))
        global_step = v1.train.get_or_create_global_step()
        saver = v1.train.Saver()
        with v1.Session() as sess:
            for ckpt in tf.train.checkpoints_iterator(args.model_dir, min_interval_secs=1, timeout=2,
                                                      timeout_fn=ctx.stop_event.is_set):
                try:
                    saver.restore(sess, ckpt)
                except (tf.errors.NotFoundError, tf.errors.DataLossError) as exc:
                    _say(ctx, f"skipping {ckpt}: {type(exc).__name__}")  # removed by the saver meanwhile
                    continue
                acc, step = sess.run([accuracy, global_step], {x: test_x, y: test_y})
                record = {"checkpoint": ckpt, "global_step": int(step), "accuracy": float(acc), "time": time.time()}
                _say(ctx, f"checkpoint {os.path.basename(ckpt)} (global step {step}): test accuracy {acc:.4f}")
                with tf.io.gfile.GFile(results_path, "a") as fh:
                    fh.write(json.dumps(record) + "\n")


# ---------------------------------------------------------------------------
# Driver side
# ---------------------------------------------------------------------------


def resolve_paths(args: argparse.Namespace, sc: Any) -> argparse.Namespace:
    """Makes the data/model paths absolute on the driver (relative local paths would
    otherwise resolve in each executor's own working directory)."""
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


def spark_input_rdd(sc: Any, images: str) -> Any:
    """The training data as an RDD of ``(784 floats, label)`` (driver; read by executors)."""
    files = data_files(images)
    if is_tfrecord(files):
        return sc.parallelize(files, len(files)).flatMap(read_tfrecord_file)
    return sc.textFile(",".join(files)).filter(lambda line: bool(line.strip())).map(parse_csv_line)


def export_accuracy(args: argparse.Namespace) -> tuple[float, int]:
    """Test accuracy of the exported SavedModel, computed on the driver.

    Returns:
        ``(accuracy, number of test images)``.
    """
    import numpy as np
    import tensorflow as tf

    x, y = load_numpy(data_test_dir(args))
    model = tf.saved_model.load(args.export_dir)
    predict = model.signatures["serving_default"]
    pred = np.concatenate([predict(image=tf.constant(x[i:i + 2000]))["prediction"].numpy() for i in range(0, len(x), 2000)])
    return float(np.mean(pred == y)), int(len(y))


def read_stats(args: argparse.Namespace) -> dict:
    """``{"worker:0": stats, ...}``: what every worker left in --model_dir/_stats (driver)."""
    import tensorflow as tf

    out = {}
    for path in sorted(tf.io.gfile.glob(f"{args.model_dir}/{STATS_DIR}/*.json")):
        with tf.io.gfile.GFile(path) as fh:
            s = json.load(fh)
        out[f"{s['job']}:{s['task']}"] = s
    return out


def read_eval_results(args: argparse.Namespace) -> list:
    """The evaluator's per-checkpoint records (driver); empty without --eval."""
    import tensorflow as tf

    path = f"{args.model_dir}/{EVAL_FILE}"
    if not tf.io.gfile.exists(path):
        return []
    with tf.io.gfile.GFile(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def run(sc: Any, args: argparse.Namespace) -> dict:
    """Trains on the cluster and evaluates the export (driver).

    Args:
        sc: The SparkContext.
        args: Options from :func:`parse_args`.

    Returns:
        A summary: ``test_accuracy``, ``num_test``, ``workers`` (per-worker statistics),
        ``eval`` (evaluator records), ``seconds``, ``args``.
    """
    import tensorflow as tf

    from tfos import TFCluster

    args = resolve_paths(args, sc)
    if not args.keep:
        for d in (args.model_dir, args.export_dir):
            if tf.io.gfile.exists(d):
                tf.io.gfile.rmtree(d)
    input_mode = TFCluster.InputMode.SPARK if args.input_mode == "spark" else TFCluster.InputMode.TENSORFLOW
    started = time.monotonic()
    # As a context manager, the cluster is torn down (every node stopped) on any error.
    with TFCluster.run(
        sc, main_fun, args, args.cluster_size, args.num_ps, args.tensorboard, input_mode,
        log_dir=args.model_dir, driver_ps_nodes=args.driver_ps_nodes, eval_node=args.eval,
        release_port=False,  # start_cluster_server hands the reserved port to TF without a gap
    ) as cluster:
        if args.tensorboard:
            logger.info("TensorBoard: %s", cluster.tensorboard_url())
        if input_mode == TFCluster.InputMode.SPARK:
            cluster.train(spark_input_rdd(sc, args.images), args.epochs)
        # Waits for the workers, then stops the ps (and evaluator) nodes. With --eval the
        # chief has already waited for the evaluator to score the final checkpoint.
        cluster.shutdown()
    seconds = time.monotonic() - started
    acc, n = export_accuracy(args)
    workers = read_stats(args)
    return {"test_accuracy": acc, "num_test": n, "workers": workers, "eval": read_eval_results(args),
            "seconds": seconds, "args": vars(args)}


def print_summary(summary: dict) -> None:
    """Prints the result table (driver)."""
    args = summary["args"]
    print(f"\nmode {args['mode']}, input {args['input_mode']}, {args['cluster_size']} nodes "
          f"({args['num_ps']} ps{', driver ps' if args['driver_ps_nodes'] else ''}{', evaluator' if args['eval'] else ''}), "
          f"{summary['seconds']:.1f} s")
    for name, s in summary["workers"].items():
        last = s["windows"][-1] if s["windows"] else {}
        print(f"  {name:9s} {s['local_steps']:5d} local steps, {s['steps_per_sec']:7.1f} steps/s, "
              f"last window loss {last.get('loss', float('nan')):.4f} acc {last.get('accuracy', float('nan')):.3f}; "
              f"global_step on {s['devices']['global_step']}")
    for e in summary["eval"]:
        print(f"  evaluator: global step {e['global_step']:5d}: test accuracy {e['accuracy']:.4f}")
    print(f"test accuracy of {args['export_dir']}: {summary['test_accuracy']:.4f} on {summary['num_test']} images")


def spark_context(args: argparse.Namespace) -> tuple[Any, bool]:
    """The SparkContext: spark-submit's, or an own ``local-cluster`` (driver).

    Returns:
        ``(sc, created)``.
    """
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark import SparkConf, SparkContext

    from tfos import authenticate_spark

    active = SparkContext._active_spark_context
    if active is not None:
        return active, False
    conf = SparkConf().setAppName("mnist_ps_tf1")
    if "PYSPARK_GATEWAY_PORT" in os.environ:  # spark-submit
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
