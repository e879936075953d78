"""Shared pieces of the Keras MNIST examples (``mnist_tf.py``, ``mnist_spark.py``,
``mnist_inference.py``).

Some functions run on the Spark *driver* (argument parsing, the SparkContext, path
handling, reading the summaries), some in Spark tasks (CSV parsing) and some in the
TF process that tfos starts on every node (the model, the exports). The scripts ship
this module *by value* to executors and nodes (:func:`ship_by_value`), so nothing has
to be installed on the executors and ``spark-submit`` needs no ``--py-files``.

Keras flavour: the nodes use Keras 3 (``import keras``), TensorFlow's default; tfos makes
its ``model.fit`` correct under ``MultiWorkerMirroredStrategy`` (docs/keras.md). ``--tf_keras``
selects the legacy ``tf_keras`` (Keras 2) instead, with ``TF_USE_LEGACY_KERAS=1`` set before
TensorFlow is imported (:func:`import_keras`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Optional, Sequence

import numpy as np

logger = logging.getLogger("mnist_keras")

NUM_PIXELS = 784
NUM_CLASSES = 10
#: Name of the model's input (the SavedModel signature's argument).
INPUT_NAME = "image"
#: Name of the model's output layer (the SavedModel signature's result key).
OUTPUT_NAME = "probabilities"
#: Files and directories a training run writes under ``--model_dir``.
KERAS_FILE = "model.keras"
CHECKPOINT_DIR = "checkpoints"
#: Training state for restarts (``TFCluster.run(..., max_restarts=N)``): model, optimizer and
#: epoch, written at the end of every epoch by ``BackupAndRestore``.
BACKUP_DIR = "backup"
TENSORBOARD_DIR = "tensorboard"
SUMMARY_FILE = "train_summary.json"
STATS_DIR = "stats"


# ---------------------------------------------------------------------------
# Driver: command line, SparkContext, paths
# ---------------------------------------------------------------------------


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def common_parser(description: str, epochs: int = 5) -> argparse.ArgumentParser:
    """The options every Keras MNIST script takes (driver).

    Args:
        description: The script's ``--help`` text.
        epochs: Default for ``--epochs``.

    Returns:
        A parser with ``--cluster_size``, ``--epochs``, ``--batch_size``, ``--model_dir``,
        ``--export_dir``, ``--tensorboard``, ``--tf_keras``, ``--master``.
    """
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--cluster_size", type=positive_int, default=2,
                   help="number of TF nodes = Spark executors used (one chief, the rest workers)")
    p.add_argument("--epochs", type=positive_int, default=epochs, help="passes over the training data")
    p.add_argument("--batch_size", type=positive_int, default=128, help="examples per step on each worker")
    p.add_argument("--model_dir", default="output/mnist",
                   help="directory for checkpoints/, tensorboard/, model.keras and the run summary")
    p.add_argument("--export_dir", default="output/mnist/export", help="SavedModel directory")
    p.add_argument("--tensorboard", action="store_true",
                   help="run TensorBoard on the chief (over MODEL_DIR/tensorboard) and print its URL")
    p.add_argument("--tf_keras", action="store_true",
                   help="train with the legacy tf_keras (Keras 2, TF_USE_LEGACY_KERAS=1) instead of Keras 3")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="tfos' feed progress bar on stderr (on a terminal log lines clear and redraw it; on a pipe or "
                        "file it is a line every 10 s); --no-progress: none")
    p.add_argument("--master", default=None,
                   help="Spark master; default: spark-submit's, or an own local-cluster[CLUSTER_SIZE,1,1024] "
                   "when started with python")
    return p


#: TensorFlow's C++ start-up lines that every TF process prints (TF 2.21 prints them
#: whatever TF_CPP_MIN_LOG_LEVEL says); the driver does not repeat them.
_TF_STARTUP_NOISE = (
    "WARNING: All log messages before absl::InitializeLog() is called",
    "oneDNN custom operations are on",
    "Could not find cuda drivers on your machine",
    "failed call to cuInit",
)


class _DropTFStartupNoise(logging.Filter):
    """Drops the chief's forwarded TensorFlow start-up lines (driver)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(noise in message for noise in _TF_STARTUP_NOISE)


def setup_logging() -> None:
    """INFO logging on the driver, so the chief's forwarded lines ('tfos.node') show."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout)
    logging.getLogger("py4j").setLevel(logging.WARNING)
    logging.getLogger("tfos.node").addFilter(_DropTFStartupNoise())


def spark_context(args: argparse.Namespace, app_name: str) -> tuple[Any, bool]:
    """Returns spark-submit's SparkContext, or starts an embedded local cluster (driver).

    Without spark-submit (no ``PYSPARK_GATEWAY_PORT``) the master is ``--master`` or
    ``local-cluster[<cluster_size>,1,1024]`` (separate executor JVMs), bound to
    127.0.0.1, without UI and progress bars; ``PYSPARK_PYTHON`` defaults to this
    interpreter and ``SPARK_LOCAL_IP`` to 127.0.0.1. ``spark.locality.wait`` defaults to 0
    (unless set, e.g. with ``spark-submit --conf``).

    Args:
        args: The options (``master``, ``cluster_size``).
        app_name: The Spark application name.

    Returns:
        ``(sc, created)``; stop the context when ``created``.
    """
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark import SparkConf, SparkContext

    from tfos import authenticate_spark

    active = SparkContext._active_spark_context
    if active is not None:
        return active, False
    conf = SparkConf().setAppName(app_name)
    if "PYSPARK_GATEWAY_PORT" in os.environ:  # launched by spark-submit
        if args.master:
            conf.setMaster(args.master)
    else:
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        conf.setMaster(args.master or f"local-cluster[{args.cluster_size},1,1024]")
        # spark.authenticate with a secret only this user can read, never on a command line
        # (docs/deploy.md, "Spark authentication"); spark-submit gets the settings from its user.
        authenticate_spark(conf.get("spark.master"))
        conf.set("spark.driver.host", "127.0.0.1")
        conf.set("spark.ui.enabled", "false")
        conf.set("spark.ui.showConsoleProgress", "false")
    # A feed task feeds the node on its own executor: an executor idling up to 3 s (Spark's
    # default delay scheduling) for a cached partition's executor starves its node, and
    # the whole MultiWorkerMirroredStrategy waits (docs/performance.md).
    conf.setIfMissing("spark.locality.wait", "0")
    sc = SparkContext(conf=conf)
    sc.setLogLevel("WARN")
    return sc, True


def ship_by_value(*modules: Any) -> None:
    """Pickles ``modules``' functions by value, for Spark tasks and tfos nodes (driver).

    Spark tasks are pickled with PySpark's bundled cloudpickle and tfos's ``main_fun``
    with the ``cloudpickle`` package: both are told.
    """
    import cloudpickle
    from pyspark import cloudpickle as spark_cloudpickle

    for module in modules:
        cloudpickle.register_pickle_by_value(module)
        spark_cloudpickle.register_pickle_by_value(module)


def default_fs(sc: Any) -> str:
    """Spark's ``fs.defaultFS`` (``file://`` when unknown)."""
    try:
        return sc._jsc.hadoopConfiguration().get("fs.defaultFS") or "file://"
    except Exception:  # noqa: BLE001 - no Hadoop configuration: local files
        return "file://"


def resolve_paths(args: argparse.Namespace, sc: Any, names: Sequence[str]) -> argparse.Namespace:
    """Makes the path options absolute on the driver (driver).

    A relative path would otherwise resolve in each executor's working directory.
    Local paths come back without ``file://``; paths on other file systems
    (``hdfs://...``) keep their URI.

    Args:
        args: The options.
        sc: The SparkContext.
        names: The attributes of ``args`` that hold paths (None values are skipped).

    Returns:
        A copy of ``args`` with absolute paths.
    """
    from tfos.node_context import absolute_path

    fs = default_fs(sc)
    resolved = argparse.Namespace(**vars(args))
    for name in names:
        value = getattr(args, name, None)
        if value:
            setattr(resolved, name, strip_file_scheme(absolute_path(value, fs, os.getcwd())))
    return resolved


def strip_file_scheme(path: str) -> str:
    """``file:///a/b`` -> ``/a/b``; other paths unchanged."""
    return path[len("file://"):] if path.startswith("file://") else path


def is_local(path: str) -> bool:
    """True for a local path (no URI scheme)."""
    return "://" not in path


def remove_outputs(paths: Sequence[str]) -> None:
    """Deletes earlier outputs so that a re-run starts clean (driver; local paths only).

    Args:
        paths: Files or directories to remove; missing ones and URIs are skipped (a
            remote output is overwritten by the writer instead).
    """
    for path in paths:
        if not is_local(path):
            logger.info("not removing %s (not a local path)", path)
        elif os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)


def part_files(directory: str) -> list[str]:
    """Sorted ``part-*`` data files of a local directory (driver).

    Raises:
        FileNotFoundError: No such files (with the command that writes them).
    """
    import glob

    files = sorted(f for f in glob.glob(os.path.join(directory, "part-*")) if not f.endswith(".crc"))
    if not files:
        raise FileNotFoundError(
            f"no part-* files in {directory}; write the data first: "
            "python examples/mnist/mnist_data_setup.py --output data/mnist"
        )
    return files


def read_json(path: str) -> Optional[dict]:
    """A JSON file written by a node, or None if it is missing/unreadable (driver)."""
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None


def read_node_stats(model_dir: str) -> dict[str, dict]:
    """``{"chief:0": stats, "worker:0": ...}`` written by every training node (driver)."""
    out = {}
    directory = os.path.join(model_dir, STATS_DIR)
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else ():
        stats = read_json(os.path.join(directory, name))
        if stats:
            out[f"{stats['job']}:{stats['task']}"] = stats
    return out


def print_training_report(args: argparse.Namespace, seconds: float) -> Optional[dict]:
    """Prints what the chief reported and where the model went (driver).

    Returns:
        The chief's summary (``history``, ``test``, ...) or None when it is missing.
    """
    summary = read_json(os.path.join(args.model_dir, SUMMARY_FILE)) if is_local(args.model_dir) else None
    print(f"\nTraining finished in {seconds:.1f} s on {args.cluster_size} nodes")
    if summary is None:
        print(f"  (no run summary in {args.model_dir}; see the chief's log)")
        return None
    first = int(summary.get("first_epoch", 0))  # > 0 when the last attempt restored a backup
    if first:
        print(f"  attempt {summary.get('attempt', 0)} restored the backup of epochs 1-{first} and trained the rest:")
    for i, (loss, acc) in enumerate(zip(summary["history"]["loss"], summary["history"]["accuracy"]), start=first):
        print(f"  epoch {i + 1}: loss {loss:.4f}, train accuracy {acc:.4f}")
    print(f"final train accuracy: {summary['history']['accuracy'][-1]:.4f}")
    if summary.get("test"):
        print(f"test accuracy: {summary['test']['accuracy']:.4f} (test loss {summary['test']['loss']:.4f})")
    print(f"SavedModel: {args.export_dir}")
    print(f"Keras file: {os.path.join(args.model_dir, KERAS_FILE)}")
    print(f"checkpoints: {os.path.join(args.model_dir, CHECKPOINT_DIR)}")
    print(f"TensorBoard logs: {os.path.join(args.model_dir, TENSORBOARD_DIR)}")
    return summary


def check_tensorboard(url: Optional[str]) -> None:
    """Logs the TensorBoard URL and whether it answers (driver)."""
    if not url:
        logger.warning("TensorBoard did not start")
        return
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            status = response.status
            page = response.read(4096).decode("utf-8", "replace")
        logger.info("TensorBoard: %s (HTTP %d%s)", url, status, ", TensorBoard page" if "TensorBoard" in page or "tf-tensorboard" in page else "")
    except OSError as exc:
        logger.warning("TensorBoard: %s does not answer yet: %s", url, exc)


# ---------------------------------------------------------------------------
# Spark tasks: parsing
# ---------------------------------------------------------------------------


def parse_csv_line(line: str) -> tuple[np.ndarray, int]:
    """``"label,p0,...,p783"`` -> ``(float32[784] pixels, label)`` (Spark task)."""
    label, _, pixels = line.partition(",")
    return np.array(pixels.split(","), dtype=np.float32), int(label)


def load_images(sc: Any, path: str, fmt: str) -> Any:
    """The images under ``path`` (training or test) as Spark data of ``(image, label)`` rows (driver).

    Args:
        sc: The SparkContext.
        path: A directory of ``part-*`` files written by ``mnist_data_setup.py``.
        fmt: ``"csv"``: an RDD of ``(float32[784] ndarray, int)`` tuples, one partition
            per file; ``"tfr"``: a DataFrame ``(image array<float>, label bigint)`` read
            with ``tfos.dfutil.loadTFRecords`` (fed to the nodes as Arrow batches).

    Returns:
        The RDD or DataFrame.
    """
    if fmt == "csv":
        files = part_files(path)
        return sc.textFile(",".join(files), minPartitions=len(files)).filter(lambda line: bool(line.strip())).map(parse_csv_line)
    from tfos import dfutil

    part_files(path)  # a clear error when the directory is empty
    return dfutil.loadTFRecords(sc, path).select("image", "label")


# ---------------------------------------------------------------------------
# TF process: Keras, the model, paths, exports
# ---------------------------------------------------------------------------


def import_keras(tf_keras: bool = False) -> tuple[Any, Any]:
    """Imports TensorFlow and Keras 3, or the legacy Keras 2 (``tf_keras``) (TF process).

    For ``tf_keras``, ``TF_USE_LEGACY_KERAS=1`` must be set before TensorFlow is first
    imported; the TF process started by tfos has not imported it yet when ``main_fun`` begins.

    Args:
        tf_keras: Use ``tf_keras`` (``--tf_keras``) instead of Keras 3.

    Returns:
        ``(tensorflow, keras)``: the ``keras`` (3) or ``tf_keras`` module.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if not tf_keras:
        import keras
        import tensorflow as tf

        return tf, keras
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    if "tensorflow" in sys.modules and "tf_keras" not in sys.modules:
        logger.warning("tensorflow was imported before TF_USE_LEGACY_KERAS=1 was set; using tf_keras directly")
    import tensorflow as tf
    import tf_keras

    return tf, tf_keras


def import_tf_keras() -> tuple[Any, Any]:
    """``import_keras(tf_keras=True)``: TensorFlow and ``tf_keras`` (scripts/bench_train.py's flavour)."""
    return import_keras(tf_keras=True)


def build_model(keras: Any, learning_rate: float = 1e-3) -> Any:
    """The MLP 784-256-128-10 (softmax), compiled with Adam (TF process, in the strategy scope).

    Args:
        keras: The ``keras`` or ``tf_keras`` module.
        learning_rate: Adam's learning rate.

    Returns:
        A compiled functional model with input ``image`` and output ``probabilities``.
    """
    inputs = keras.Input(shape=(NUM_PIXELS,), name=INPUT_NAME)
    x = keras.layers.Dense(256, activation="relu")(inputs)
    x = keras.layers.Dense(128, activation="relu")(x)
    outputs = keras.layers.Dense(NUM_CLASSES, activation="softmax", name=OUTPUT_NAME)(x)
    model = keras.Model(inputs, outputs, name="mnist_mlp")
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model


def is_tf_keras(keras: Any) -> bool:
    """True for the legacy ``tf_keras`` module (Keras 2), False for Keras 3."""
    return keras.__name__.split(".")[0] == "tf_keras"


def is_chief(ctx: Any) -> bool:
    """True on the node whose outputs are kept (the chief, else worker 0)."""
    jobs = set(ctx.cluster_spec)
    return ctx.job_name in ("chief", "master") or (ctx.job_name == "worker" and ctx.task_index == 0 and not jobs & {"chief", "master"})


def node_path(ctx: Any, path: str) -> str:
    """``path`` resolved with ``ctx.absolute_path``; local paths without ``file://`` (TF process).

    Keras' file writers take plain local paths; other URIs (``hdfs://``) are kept.
    """
    return strip_file_scheme(ctx.absolute_path(path))


def keras_callbacks(keras: Any, ctx: Any, args: argparse.Namespace) -> list:
    """Backup, checkpoint (every epoch) and TensorBoard callbacks under ``--model_dir`` (TF process).

    ``BackupAndRestore`` makes a restarted cluster (``TFCluster.run(..., max_restarts=N)``;
    ``ctx.attempt > 0``) resume where the failed attempt's last finished epoch left off: at
    the end of every epoch it saves the model, the optimizer and the epoch number in
    ``--model_dir/backup``, and at the start of ``fit`` it restores them when a backup is
    there (then ``fit`` starts at the next epoch). The backup is kept after training
    (``delete_checkpoint=False``: an attempt restarted after ``fit`` returned finds the
    finished training), so the driver removes it before a fresh run. In InputMode.SPARK
    ``mnist_spark.py`` lists ``ctx.checkpoint_callback()`` after these callbacks so the
    driver learns each saved epoch and a restarted feed resumes there. ``--model_dir`` must be on storage every executor
    reaches: a restart may run on other executors.

    Under MultiWorkerMirroredStrategy every worker runs these callbacks (saving involves
    collectives) and only the chief's files are kept: the other workers write to temporary
    directories (tf_keras does so itself, tfos's Keras 3 fix does it for Keras 3).
    """
    model_dir = node_path(ctx, args.model_dir)
    if getattr(ctx, "attempt", 0):
        print(f"{ctx.job_name}:{ctx.task_index}: attempt {ctx.attempt}: restoring the training state from "
              f"{os.path.join(model_dir, BACKUP_DIR)}", flush=True)
    return [
        keras.callbacks.BackupAndRestore(os.path.join(model_dir, BACKUP_DIR), delete_checkpoint=False),
        keras.callbacks.ModelCheckpoint(  # Keras 3 names weights files *.weights.h5
            os.path.join(model_dir, CHECKPOINT_DIR, "epoch-{epoch:02d}" + ("" if is_tf_keras(keras) else ".weights.h5")),
            save_weights_only=True,
        ),
        keras.callbacks.TensorBoard(log_dir=os.path.join(model_dir, TENSORBOARD_DIR), update_freq="epoch", profile_batch=0),
    ]


def save_model(ctx: Any, model: Any, args: argparse.Namespace) -> None:
    """Saves the trained model as a SavedModel and as a ``.keras`` file, on every node (TF process).

    Saving under MultiWorkerMirroredStrategy runs collectives, so *every* worker must
    save: the chief writes ``--export_dir`` and ``--model_dir/model.keras``; the others
    write the same to a temporary directory that is then deleted.

    The SavedModel (via ``ctx.export_saved_model``: Keras 3's ``model.export``, or tf_keras'
    ``save_format="tf"``) has the signature ``serving_default(image: float32[None, 784])``
    with one float32[None, 10] output of probabilities, and loads with
    ``tf.saved_model.load`` (no Keras needed). ``model.keras`` loads with
    ``keras.models.load_model`` (a ``--tf_keras`` run's with ``tf_keras.models.load_model``:
    the two formats differ).
    """
    chief = is_chief(ctx)
    ctx.export_saved_model(model, node_path(ctx, args.export_dir), is_chief=chief)
    if chief:
        path = os.path.join(node_path(ctx, args.model_dir), KERAS_FILE)
        model.save(path)
        print(f"saved the model to {node_path(ctx, args.export_dir)} (SavedModel) and {path}", flush=True)
    else:
        temp_dir = tempfile.mkdtemp(prefix="mnist_keras_worker_")
        try:
            model.save(os.path.join(temp_dir, KERAS_FILE))
        finally:
            shutil.rmtree(temp_dir, ignore_errors=True)


def write_json(tf: Any, path: str, obj: dict) -> None:
    """Writes ``obj`` as JSON through ``tf.io.gfile`` (any TF file system; TF process)."""
    tf.io.gfile.makedirs(os.path.dirname(path))
    with tf.io.gfile.GFile(path, "w") as handle:
        handle.write(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def epoch_logger(keras: Any, epochs: int) -> Any:
    """A Keras callback printing ``Epoch i/n - steps - seconds - loss - accuracy`` (TF process).

    Also prints the gap between epochs: the seconds from the last step of the previous
    epoch to the first step of this one, and how much of it the end-of-epoch callbacks
    listed before this one took (checkpoints, TensorBoard, checkpoint reports); list this
    callback last. A wait for the next epoch's first batch is not in the gap: Keras
    takes the batch inside the first step. The metrics are those of the whole
    cluster: under MultiWorkerMirroredStrategy Keras aggregates them over all workers.

    Args:
        keras: The ``keras`` or ``tf_keras`` module.
        epochs: The total number of epochs (for the ``i/n`` display).
    """
    class EpochLogger(keras.callbacks.Callback):
        _last_step_end: Optional[float] = None
        _callbacks_s: Optional[float] = None

        def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
            self._began = time.monotonic()
            self._steps = 0
            self._gap: Optional[float] = None

        def on_train_batch_begin(self, batch: int, logs: Optional[dict] = None) -> None:
            if self._steps == 0 and self._last_step_end is not None:
                # From the previous epoch's last step to this epoch's first: the pause
                # between epochs (callbacks, end-of-epoch sync, waiting for data).
                self._gap = time.monotonic() - self._last_step_end

        def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
            self._steps += 1
            self._last_step_end = time.monotonic()

        def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
            callbacks_s = self._callbacks_s
            # The callbacks listed before this one have run their on_epoch_end by now.
            self._callbacks_s = None if self._last_step_end is None else time.monotonic() - self._last_step_end
            metrics = " - ".join(f"{name}: {value:.4f}" for name, value in (logs or {}).items())
            gap = ""
            if self._gap is not None:
                gap = f" - {self._gap:.2f}s since the previous epoch's last step"
                if callbacks_s is not None:
                    gap += f" ({callbacks_s:.2f}s of it in its epoch-end callbacks)"
            print(f"Epoch {epoch + 1}/{epochs} - {self._steps} steps - {time.monotonic() - self._began:.1f}s{gap} - {metrics}",
                  flush=True)

    return EpochLogger()
