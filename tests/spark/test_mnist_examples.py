"""Test-sized runs of the Keras MNIST examples (examples/mnist/keras), end to end.

Each script runs as a subprocess with its own ``--master local-cluster[2,1,1024]`` (only
one SparkContext may live in a process, and the pytest process may hold one), on 3,000
training and 1,000 test images written once per module by ``mnist_data_setup.py``.
The examples train with Keras 3; ``mnist_tf.py`` runs with ``--tf_keras`` (the legacy Keras 2
variant). The checks: the printed accuracy, the exports exist and load in this process
(SavedModel with ``tf.saved_model.load``, ``model.keras`` with Keras 3 or ``tf_keras``) and predict like the
printed accuracy says, every epoch trained on every row, one prediction per test row,
the TensorBoard URL answered, and no tfos process is left behind.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest

pytestmark = [pytest.mark.spark, pytest.mark.tf, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples", "mnist")
NUM_TRAIN = 3000
NUM_TEST = 1000
MASTER = "local-cluster[2,1,1024]"
#: Upper bound for one script run on a loaded 2-core machine (typically 30-120 s).
RUN_TIMEOUT_S = 420
MIN_ACCURACY = 0.8


def _env() -> dict:
    env = dict(os.environ)
    # The subprocess starts its own SparkContext: it must not attach to this process's gateway.
    for name in ("PYSPARK_GATEWAY_PORT", "PYSPARK_GATEWAY_SECRET"):
        env.pop(name, None)
    env.update(PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1",
               TFOS_PROGRESS="0", TF_CPP_MIN_LOG_LEVEL="2")
    return env


def _run(script: str, *args: str, cwd: str) -> tuple[str, float]:
    """Runs an example script; returns its output (stdout + stderr) and duration."""
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, script), *args],
        cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=RUN_TIMEOUT_S,
    )
    seconds = time.monotonic() - t0
    # The JVM's shutdown noise comes last: show the driver's own traceback, when there is one.
    tb = proc.stdout.rfind("Traceback (most recent call last)")
    assert proc.returncode == 0, (f"{script} exited with {proc.returncode}:\n{proc.stdout[tb:tb + 8000] if tb >= 0 else ''}"
                                  f"\n...\n{proc.stdout[-4000:]}")
    # The examples run Spark with spark.authenticate (tfos.authenticate_spark): no security WARNING.
    assert "tfos cluster key" not in proc.stdout, proc.stdout[-4000:]  # in each of tfos's key-transport WARNINGs
    return proc.stdout, seconds


def _number(pattern: str, text: str) -> float:
    found = re.findall(pattern, text, re.MULTILINE)
    assert found, f"no match for {pattern!r} in:\n{text[-4000:]}"
    return float(found[-1])


def _read_csv_dir(directory: str) -> tuple[np.ndarray, np.ndarray]:
    rows = np.concatenate([
        np.loadtxt(f, delimiter=",", dtype=np.float32, ndmin=2) for f in sorted(glob.glob(os.path.join(directory, "part-*")))
    ])
    return rows[:, 1:], rows[:, 0].astype(np.int64)


def _checkpoint(model_dir: str, epoch: int, tf_keras: bool = False) -> str:
    """The weights ModelCheckpoint writes after ``epoch`` (a TF checkpoint with tf_keras, an
    ``.weights.h5`` file with Keras 3)."""
    return os.path.join(model_dir, "checkpoints", f"epoch-{epoch:02d}" + (".index" if tf_keras else ".weights.h5"))


def _check_exports(model_dir: str, export_dir: str, test_csv: str, tf_keras: bool = False) -> float:
    """Loads both exports in this process (``model.keras`` with Keras 3, or with tf_keras);
    returns the SavedModel's test accuracy."""
    assert os.path.isfile(os.path.join(export_dir, "saved_model.pb")), os.listdir(model_dir)
    keras_file = os.path.join(model_dir, "model.keras")
    assert os.path.isfile(keras_file), os.listdir(model_dir)
    x, y = _read_csv_dir(test_csv)
    assert len(y) == NUM_TEST
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import tensorflow as tf

        if tf_keras:
            import tf_keras as keras
        else:
            import keras

        serve = tf.saved_model.load(export_dir).signatures["serving_default"]
        (output,) = serve(image=tf.constant(x)).values()  # one output: the probabilities
        probabilities = output.numpy()
        keras_probabilities = keras.models.load_model(keras_file).predict(x, verbose=0)
    assert probabilities.shape == (NUM_TEST, 10)
    np.testing.assert_allclose(keras_probabilities, probabilities, atol=1e-4)
    return float(np.mean(probabilities.argmax(-1) == y))


@pytest.fixture(scope="module")
def mnist_data(tmp_path_factory) -> str:
    """3,000 training and 1,000 test images as CSV and TFRecords (written once)."""
    out = str(tmp_path_factory.mktemp("mnist") / "data")
    _run("mnist_data_setup.py", "--output", out, "--num_train", str(NUM_TRAIN), "--num_test", str(NUM_TEST),
         "--master", "local[2]", cwd=ROOT)
    for split in ("train", "test"):
        for fmt in ("csv", "tfr"):
            assert os.path.isfile(os.path.join(out, fmt, split, "_SUCCESS"))
    return out


def test_mnist_tf_trains_from_tfrecords_and_exports(mnist_data, tmp_path, no_leftovers):
    """mnist_tf.py --tf_keras (InputMode.TENSORFLOW, sharded TFRecords, MWMS, the legacy
    tf_keras): test accuracy >= 0.8, checkpoint, TensorBoard logs and URL, SavedModel and
    model.keras that load here."""
    model_dir = str(tmp_path / "model")
    export_dir = str(tmp_path / "export")
    out, seconds = _run(
        "keras/mnist_tf.py", "--master", MASTER, "--images", os.path.join(mnist_data, "tfr", "train"),
        "--epochs", "1", "--batch_size", "32", "--model_dir", model_dir, "--export_dir", export_dir,
        "--tensorboard", "--tf_keras", cwd=str(tmp_path),
    )
    print(f"mnist_tf.py: {seconds:.1f} s")
    assert _number(r"^test accuracy: ([0-9.]+)", out) >= MIN_ACCURACY, out[-4000:]
    # The chief's per-epoch line reached the driver's stderr with its node prefix.
    assert re.search(r"^\[chief:0\] \d+/\d+ - .*loss: [0-9.]+ - accuracy: [0-9.]+", out, re.MULTILINE), out[-4000:]
    # Each worker read its own half of the 10 files.
    assert re.search(r"chief:0 reads 5 training files: part-00000\.tfrecord, part-00002\.tfrecord", out), out[-4000:]
    assert re.search(r"TensorBoard: http://127\.0\.0\.1:\d+/ \(HTTP 200, TensorBoard page\)", out), out[-4000:]
    assert os.path.isfile(_checkpoint(model_dir, 1, tf_keras=True))
    assert glob.glob(os.path.join(model_dir, "tensorboard", "train", "events.out.tfevents.*"))
    assert _check_exports(model_dir, export_dir, os.path.join(mnist_data, "csv", "test"), tf_keras=True) >= MIN_ACCURACY


def test_mnist_spark_then_inference(mnist_data, tmp_path, no_leftovers):
    """mnist_spark.py (InputMode.SPARK, MWMS, 2 epochs) trains on every row of every epoch;
    mnist_inference.py labels every test image with the export: accuracy >= 0.8 and one
    label,prediction line per test row, in input order."""
    model_dir = str(tmp_path / "model")
    export_dir = str(tmp_path / "export")
    out, seconds = _run(
        "keras/mnist_spark.py", "--master", MASTER, "--images", os.path.join(mnist_data, "csv", "train"),
        "--epochs", "2", "--batch_size", "32", "--model_dir", model_dir, "--export_dir", export_dir, cwd=str(tmp_path),
    )
    print(f"mnist_spark.py: {seconds:.1f} s")
    assert f"rows trained per epoch (all nodes): [{NUM_TRAIN}, {NUM_TRAIN}], {NUM_TRAIN} images" in out, out[-4000:]
    assert re.search(r"^\[chief:0\] Epoch 2/2 - \d+ steps - .*accuracy: [0-9.]+", out, re.MULTILINE), out[-4000:]
    assert _number(r"^final train accuracy: ([0-9.]+)", out) >= MIN_ACCURACY
    assert os.path.isfile(_checkpoint(model_dir, 2))
    saved_model_accuracy = _check_exports(model_dir, export_dir, os.path.join(mnist_data, "csv", "test"))
    assert saved_model_accuracy >= MIN_ACCURACY

    predictions = str(tmp_path / "predictions")
    out, seconds = _run(
        "keras/mnist_inference.py", "--master", MASTER, "--images", os.path.join(mnist_data, "csv", "test"),
        "--model_dir", model_dir, "--export_dir", export_dir, "--output", predictions, cwd=str(tmp_path),
    )
    print(f"mnist_inference.py: {seconds:.1f} s")
    accuracy = _number(r"^test accuracy: ([0-9.]+)", out)
    assert accuracy == pytest.approx(saved_model_accuracy, abs=1e-3)
    assert f"{NUM_TEST} predictions for {NUM_TEST} test images" in out
    lines = [line for f in sorted(glob.glob(os.path.join(predictions, "part-*"))) for line in open(f).read().splitlines()]
    assert os.path.isfile(os.path.join(predictions, "_SUCCESS"))
    assert len(lines) == NUM_TEST
    pairs = np.array([[int(v) for v in line.split(",")] for line in lines])
    _, labels = _read_csv_dir(os.path.join(mnist_data, "csv", "test"))
    np.testing.assert_array_equal(pairs[:, 0], labels)  # one line per row, in input order
    assert float(np.mean(pairs[:, 0] == pairs[:, 1])) == pytest.approx(accuracy, abs=1e-4)


def test_mnist_spark_feed_once_replays_the_cached_epoch(mnist_data, tmp_path, no_leftovers):
    """mnist_spark.py --feed_once: Spark feeds one epoch (cluster.train(data, 1)); every node
    caches its batches with tf.data and trains 3 epochs on them: each epoch has every row
    once on the nodes together, the chief's lines show all 3 epochs, and the model learns."""
    model_dir = str(tmp_path / "model")
    export_dir = str(tmp_path / "export")
    out, seconds = _run(
        "keras/mnist_spark.py", "--master", MASTER, "--images", os.path.join(mnist_data, "csv", "train"),
        "--epochs", "3", "--batch_size", "32", "--feed_once", "--model_dir", model_dir, "--export_dir", export_dir,
        cwd=str(tmp_path),
    )
    print(f"mnist_spark.py --feed_once: {seconds:.1f} s")
    assert "feeding 1 epoch(s) (the nodes replay it for every epoch)" in out, out[-4000:]
    assert f"rows trained per epoch (all nodes): [{NUM_TRAIN}, {NUM_TRAIN}, {NUM_TRAIN}], {NUM_TRAIN} images" in out, out[-4000:]
    # Each node's three epochs are the same rows: the share Spark fed it once.
    shares = re.findall(r"^\[(?:chief|worker):0\] (?:chief|worker):0 trained on (\d+) rows \((\d+), (\d+), (\d+) per epoch\)",
                        out, re.MULTILINE)
    assert len(shares) == 2, out[-4000:]
    assert all(int(a) == int(b) == int(c) and int(total) == 3 * int(a) for total, a, b, c in shares), shares
    assert sum(int(a) for _, a, _, _ in shares) == NUM_TRAIN, shares
    assert re.search(r"^\[chief:0\] Epoch 3/3 - \d+ steps - .*accuracy: [0-9.]+", out, re.MULTILINE), out[-4000:]
    assert _number(r"^final train accuracy: ([0-9.]+)", out) >= MIN_ACCURACY
    assert _check_exports(model_dir, export_dir, os.path.join(mnist_data, "csv", "test")) >= MIN_ACCURACY


def _executor_jvm_hosting_a_node(root_pid: int):
    """An executor JVM started (indirectly) by process ``root_pid`` that hosts a tfos TF
    process, or None. Only descendants of our own subprocess are considered."""
    import psutil

    try:
        procs = psutil.Process(root_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return None
    for p in procs:
        try:
            if "tfos._node.tf_process" not in " ".join(p.cmdline()):
                continue
            for parent in p.parents():
                if parent.name().startswith("java") and "CoarseGrainedExecutorBackend" in " ".join(parent.cmdline()):
                    return parent
        except psutil.NoSuchProcess:
            continue
    return None


@pytest.mark.chaos  # the example under an executor kill; tests/spark/test_restarts.py covers the mechanism
def test_mnist_spark_restart_resumes_at_the_checkpointed_epoch(mnist_data, tmp_path, no_leftovers):
    """mnist_spark.py --max_restarts 1: an executor JVM hosting a node is SIGKILLed once
    epoch 2 of 6 is saved; the feed resumes at the checkpoint the nodes reported, or at the
    first epoch not fully consumed when that is earlier (also when
    the failure is noticed only by shutdown(), after the whole feed was read ahead), every
    epoch from there is fed in full again, the restarted fit starts there (or after a newer
    save the dying node made without reporting it), and the model is as good."""
    import signal

    model_dir = str(tmp_path / "model")
    export_dir = str(tmp_path / "export")
    cmd = [sys.executable, os.path.join(EXAMPLES, "keras", "mnist_spark.py"), "--master", MASTER,
           "--images", os.path.join(mnist_data, "csv", "train"), "--epochs", "6", "--batch_size", "32",
           "--model_dir", model_dir, "--export_dir", export_dir, "--max_restarts", "1"]
    log_path = tmp_path / "out.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=str(tmp_path), env=_env(), stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            end = time.monotonic() + RUN_TIMEOUT_S
            killed = None
            while proc.poll() is None and time.monotonic() < end and killed is None:
                if os.path.isfile(_checkpoint(model_dir, 2)):
                    jvm = _executor_jvm_hosting_a_node(proc.pid)
                    if jvm is not None:
                        jvm.send_signal(signal.SIGKILL)
                        killed = jvm.pid
                time.sleep(0.1)
            assert killed, f"no executor killed:\n{log_path.read_text()[-4000:]}"
            proc.wait(max(1.0, end - time.monotonic()) + 2 * RUN_TIMEOUT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
    out = log_path.read_text()
    assert proc.returncode == 0, out[-6000:]
    m = re.search(r"attempt 1 resumes the feed at epoch (\d+) of 6 \(epochs numbered from 0; every row of (\d+) epoch\(s\) "
                  r"consumed; checkpoint reported after (\d+) epoch\(s\)\)", out)
    assert m, out[-6000:]
    resumed, consumed, checkpointed = int(m.group(1)), int(m.group(2)), int(m.group(3))
    # The documented rule (reliability.md): min(epochs fully consumed, checkpoint reported).
    # Under load the nodes can report the checkpoint of epoch 3 while the last partition of
    # epoch 2 is still unacknowledged (S steps per epoch, read-ahead): the feed resumes at 2.
    assert resumed == min(consumed, checkpointed) and checkpointed >= 2 and resumed >= 2, m.group(0)
    # The feed resumed at the reported checkpoint; fit restored it, or a newer save of a node
    # that died before its report arrived (1-based in the print).
    starts = re.findall(r"(\w+:\d+): attempt 1 resumed at epoch (\d+); the feed resumed at epoch (\d+)", out)
    assert len(starts) == 2 and all(int(a) >= int(b) == resumed + 1 for _, a, b in starts), (starts, out[-4000:])
    print("restart:", m.group(0), starts)
    # Attempt 1 was fed every row of every epoch from the resumed one (late rows of an epoch,
    # when Spark runs its feed tasks out of order, count with the next one: the total is exact).
    per_epoch = [int(v) for v in re.findall(r"^rows trained per epoch \(all nodes\): \[([0-9, ]+)\]", out, re.MULTILINE)[-1].split(",")]
    assert per_epoch[:resumed] == [0] * resumed and sum(per_epoch) == NUM_TRAIN * (6 - resumed), per_epoch
    assert _number(r"^final train accuracy: ([0-9.]+)", out) >= MIN_ACCURACY
    assert _check_exports(model_dir, export_dir, os.path.join(mnist_data, "csv", "test")) >= MIN_ACCURACY
