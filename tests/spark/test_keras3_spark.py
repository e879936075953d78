"""Keras 3 programs on Spark (shared ``local-cluster[2,1,1024]``), unchanged, against one process.

``tutorial_main`` is written the way TensorFlow's multi-worker Keras tutorial writes it: no
tfos call, no environment variable; TF_CONFIG comes from tfos. The same program runs in one
process (default strategy, the same global batches) for the reference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tfos import TFCluster

pytestmark = [pytest.mark.spark, pytest.mark.tf, pytest.mark.timeout(600)]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def tutorial_main(args, ctx):
    """TensorFlow's multi-worker Keras tutorial (mnist_setup.py + main.py), on generated digits,
    with seeded initial weights and shuffle so that one process can replay it."""
    import json
    import os

    import numpy as np
    import tensorflow as tf

    def mnist_dataset(batch_size):
        rng = np.random.default_rng(0)
        x_train = rng.uniform(0, 255, size=(1024, 28, 28)).astype("float32")
        y_train = (x_train[:, :14].mean(axis=(1, 2)) > x_train[:, 14:].mean(axis=(1, 2))).astype(np.int64)
        x_train = x_train / np.float32(255)
        return tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(1024, seed=1).repeat().batch(batch_size)

    def build_and_compile_cnn_model():
        model = tf.keras.Sequential([
            tf.keras.layers.InputLayer(shape=(28, 28)),
            tf.keras.layers.Reshape(target_shape=(28, 28, 1)),
            tf.keras.layers.Conv2D(8, 3, activation="relu"),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(32, activation="relu"),
            tf.keras.layers.Dense(2),
        ])
        model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      optimizer=tf.keras.optimizers.SGD(learning_rate=0.05), metrics=["accuracy"])
        return model

    tf.keras.utils.set_random_seed(1)  # not in the tutorial: the same initial weights as the reference
    per_worker_batch_size = 32
    tf_config = json.loads(os.environ.get("TF_CONFIG", "{}"))
    num_workers = len(tf_config.get("cluster", {}).get("worker", [])) or args["num_workers"]
    strategy = tf.distribute.MultiWorkerMirroredStrategy() if tf_config else tf.distribute.get_strategy()
    global_batch_size = per_worker_batch_size * num_workers
    multi_worker_dataset = mnist_dataset(global_batch_size)
    with strategy.scope():
        multi_worker_model = build_and_compile_cnn_model()
    history = multi_worker_model.fit(multi_worker_dataset, epochs=3, steps_per_epoch=6, verbose=0)
    evaluation = multi_worker_model.evaluate(mnist_dataset(global_batch_size).take(4), verbose=0, return_dict=True)

    task = tf_config.get("task", {"type": "single", "index": 0})
    with open(os.path.join(args["out"], f"{task['type']}-{task['index']}.json"), "w") as f:
        json.dump({"history": history.history, "evaluate": evaluation, "keras": tf.keras.__name__,
                   "weights": [w.tolist() for w in multi_worker_model.get_weights()]}, f)


def _relative(got, want) -> float:
    a = np.concatenate([np.ravel(np.asarray(v, dtype=np.float64)) for v in got])
    b = np.concatenate([np.ravel(np.asarray(v, dtype=np.float64)) for v in want])
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_tutorial_program_unchanged_on_two_nodes_equals_one_process(sc, tmp_path, no_leftovers, monkeypatch):
    monkeypatch.delenv("TF_USE_LEGACY_KERAS", raising=False)
    args = {"out": str(tmp_path), "num_workers": 2}
    # The reference: the same program in one process, meanwhile.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, ROOT]), TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    reference = subprocess.Popen([sys.executable, "-c", f"from test_keras3_spark import tutorial_main; tutorial_main({args!r}, None)"],
                                 env=env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        cluster = TFCluster.run(sc, tutorial_main, args, 2, 0, False, TFCluster.InputMode.TENSORFLOW, reservation_timeout=120)
        cluster.shutdown(timeout=300)
    finally:
        out, _ = reference.communicate(timeout=300)
    assert reference.returncode == 0, out[-4000:]
    results = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in ("worker-0", "worker-1", "single-0")}
    one = results.pop("single-0")
    assert one["keras"].startswith("keras."), one["keras"]  # Keras 3's tf.keras (keras._tf_keras.keras), not tf_keras
    for name, r in results.items():
        assert r["keras"] == one["keras"], name  # tf.keras is Keras 3 on the nodes too
        assert r["weights"] == results["worker-0"]["weights"], name
        assert set(r["history"]) == {"loss", "accuracy"}
        for key in ("loss", "accuracy"):
            assert _relative([r["history"][key]], [one["history"][key]]) <= 1e-5, (name, key, r["history"], one["history"])
        assert _relative([list(r["evaluate"].values())], [list(one["evaluate"].values())]) <= 1e-5, (r["evaluate"], one["evaluate"])
        assert _relative(r["weights"], one["weights"]) <= 1e-5, name
    assert one["history"]["loss"][-1] < one["history"]["loss"][0]
