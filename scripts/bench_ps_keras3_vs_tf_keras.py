"""Keras 3 ``model.fit`` under ParameterServerStrategy (tfos's fix) vs tf_keras, same program.

Starts 1 ps + 2 workers on loopback (TensorFlow servers, as the PS tutorial writes them), then
runs the coordinator ``--runs`` times with Keras 3 (tfos's fix installed as a tfos TF process
does) and ``--runs`` times with tf_keras (``TF_USE_LEGACY_KERAS=1``, ``DatasetCreator``),
alternating, on the same servers: the same model (an embedding split over the ps by a
``variable_partitioner``), the same data (a fixed seed), the same steps
(``--epochs`` x ``--steps``, ``steps_per_execution=2``). Training is asynchronous, so every run
differs (which worker runs which step, and when its gradient reaches the ps); the script
prints each run's final training loss (the last epoch's, from the metrics on the ps), the
held-out loss and accuracy (computed on the coordinator the same way for both), and the
mean, standard deviation, min and max per flavour.

Usage: ``python scripts/bench_ps_keras3_vs_tf_keras.py [--runs 4] [--epochs 2] [--steps 20]``
(about a minute per run on a loaded 2-core machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB, ROWS, TRAIN, BATCH = 100, 4096, 3072, 64


def data():
    import numpy as np

    rng = np.random.default_rng(0)
    klass = rng.integers(0, 2, VOCAB)
    ids = rng.integers(0, VOCAB, (ROWS, 2)).astype("int32")
    return ids, (klass[ids[:, 0]] ^ klass[ids[:, 1]]).astype("float32")[:, None]


def serve() -> None:
    import tensorflow as tf

    r = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    tf.distribute.Server(r.cluster_spec(), job_name=r.task_type, task_index=r.task_id, protocol="grpc", start=True).join()


def coordinate(flavour: str, out: str, epochs: int, steps: int, seed: int) -> None:
    if flavour == "keras3":
        sys.path.insert(0, REPO)
        from tfos._node import keras3_fix

        keras3_fix.install()
    import numpy as np
    import tensorflow as tf

    keras = tf.keras  # Keras 3, or tf_keras under TF_USE_LEGACY_KERAS=1
    keras.utils.set_random_seed(seed)
    ids, labels = data()
    strategy = tf.distribute.ParameterServerStrategy(
        tf.distribute.cluster_resolver.TFConfigClusterResolver(),
        variable_partitioner=tf.distribute.experimental.partitioners.MinSizePartitioner(min_shard_bytes=1024, max_shards=2))
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((2,), dtype="int32"), keras.layers.Embedding(VOCAB, 16), keras.layers.Flatten(),
            keras.layers.Dense(32, activation="relu"), keras.layers.Dense(1, activation="sigmoid")])
        model.compile(optimizer=keras.optimizers.Adam(0.02), loss="binary_crossentropy", metrics=["accuracy"],
                      steps_per_execution=2)

    def dataset_fn(input_context):
        return tf.data.Dataset.from_tensor_slices((ids[:TRAIN], labels[:TRAIN])).shuffle(TRAIN, seed=seed).batch(BATCH).repeat()

    x = dataset_fn if flavour == "keras3" else keras.utils.experimental.DatasetCreator(dataset_fn)
    started = time.monotonic()
    history = model.fit(x, epochs=epochs, steps_per_epoch=steps, verbose=0)
    seconds = time.monotonic() - started
    p = np.clip(np.asarray(model(ids[TRAIN:], training=False)), 1e-7, 1 - 1e-7)
    y = labels[TRAIN:]
    from importlib.metadata import version

    result = {"flavour": flavour, "keras": version("keras" if flavour == "keras3" else "tf-keras"), "train_loss": float(history.history["loss"][-1]),
              "test_loss": float(np.mean(-(y * np.log(p) + (1 - y) * np.log(1 - p)))),
              "test_accuracy": float(np.mean((p > 0.5) == (y > 0.5))), "fit_s": seconds,
              "iterations": int(np.asarray(model.optimizer.iterations))}
    with open(out, "w") as f:
        json.dump(result, f)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    sys.path.insert(0, REPO)
    from tfos._node.tf_process import reserve_port

    held = [reserve_port("127.0.0.1") for _ in range(4)]
    addr = [f"127.0.0.1:{s.getsockname()[1]}" for s in held]
    cluster = {"ps": addr[:1], "worker": addr[1:3], "chief": addr[3:]}
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", GRPC_FAIL_FAST="use_caller")
    env.pop("TF_USE_LEGACY_KERAS", None)
    work = tempfile.mkdtemp(prefix="tfos-ps-bench-")

    def tf_config(task: str, index: int) -> str:
        return json.dumps({"cluster": cluster, "task": {"type": task, "index": index}})

    servers = [subprocess.Popen([sys.executable, __file__, "serve"], env=dict(env, TF_CONFIG=tf_config(t, i)),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
               for t, i in (("ps", 0), ("worker", 0), ("worker", 1))]
    results: dict = {"keras3": [], "tf_keras": []}
    try:
        for run in range(args.runs):
            for flavour in ("keras3", "tf_keras"):
                out = os.path.join(work, f"{flavour}-{run}.json")
                cenv = dict(env, TF_CONFIG=tf_config("chief", 0))
                if flavour == "tf_keras":
                    cenv["TF_USE_LEGACY_KERAS"] = "1"
                proc = subprocess.run([sys.executable, __file__, "coordinate", flavour, out, str(args.epochs), str(args.steps), str(run)],
                                      env=cenv, capture_output=True, text=True, timeout=900)
                if proc.returncode != 0:
                    print(f"{flavour} run {run} failed:\n{proc.stderr[-4000:]}", file=sys.stderr)
                    return 1
                with open(out) as f:
                    r = json.load(f)
                results[flavour].append(r)
                print(f"run {run} {flavour:8s} (Keras {r['keras']}): train loss {r['train_loss']:.4g}, held-out loss "
                      f"{r['test_loss']:.4g}, accuracy {r['test_accuracy']:.4f}, {r['iterations']} steps, fit {r['fit_s']:.1f} s",
                      flush=True)
    finally:
        for s in servers:
            s.kill()
            s.wait()
        for sock in held:
            sock.close()
    for flavour, runs in results.items():
        for key in ("train_loss", "test_loss", "test_accuracy"):
            values = [r[key] for r in runs]
            spread = statistics.stdev(values) if len(values) > 1 else 0.0
            print(f"{flavour:8s} {key:13s} mean {statistics.mean(values):.4g}  std {spread:.2g}  "
                  f"min {min(values):.4g}  max {max(values):.4g}  (n={len(values)})")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        serve()
    elif len(sys.argv) > 1 and sys.argv[1] == "coordinate":
        coordinate(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
    else:
        sys.exit(main())
