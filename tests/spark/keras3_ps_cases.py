"""Keras 3 ``model.fit`` under ParameterServerStrategy: the programs ``test_keras3_ps_loopback.py`` runs.

``python keras3_ps_cases.py server`` serves a ps or worker task (TF_CONFIG), as TensorFlow's
parameter-server tutorial writes it. ``python keras3_ps_cases.py coordinator OUT.json`` is the
chief: it installs tfos's Keras fix as a tfos TF process does (unless ``TFOS_KERAS3_FIX=0``),
trains a model with a ``variable_partitioner``-sharded embedding on a synthetic task and writes
what the test asserts to OUT.json. ``KILL_WORKER_PID`` names a worker process the coordinator
kills in the middle of its second ``fit``.
"""

from __future__ import annotations

import json
import os
import signal
import sys

os.environ["GRPC_FAIL_FAST"] = "use_caller"  # TensorFlow's PS tutorial: report a lost worker fast

VOCAB = 100  # ids; the label is whether an id's hidden class is 1
ROWS = 4096
BATCH = 64
STEPS = 40  # steps per epoch
EPOCHS = 3


def serve() -> None:
    import tensorflow as tf

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    server = tf.distribute.Server(resolver.cluster_spec(), job_name=resolver.task_type, task_index=resolver.task_id,
                                  protocol="grpc", start=True)
    print("serving", flush=True)
    server.join()


def data(seed: int = 0):
    """ids (ROWS, 2) int32 and labels (ROWS, 1): label = class[id0] xor class[id1] is not
    learnable by a linear model of the ids, only through the embedding."""
    import numpy as np

    rng = np.random.default_rng(seed)
    klass = rng.integers(0, 2, VOCAB)
    ids = rng.integers(0, VOCAB, (ROWS, 2)).astype("int32")
    labels = (klass[ids[:, 0]] ^ klass[ids[:, 1]]).astype("float32")[:, None]
    return ids, labels


def coordinate(out: str) -> None:
    if os.environ.get("TFOS_KERAS3_FIX", "1") != "0":
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        from tfos._node import keras3_fix

        keras3_fix.install()
    import keras
    import numpy as np
    import tensorflow as tf

    result: dict = {}
    ids, labels = data()
    train_ids, train_labels, test_ids, test_labels = ids[:3072], labels[:3072], ids[3072:], labels[3072:]
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(min_shard_bytes=1024, max_shards=2)
    strategy = tf.distribute.ParameterServerStrategy(resolver, variable_partitioner=partitioner)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((2,), dtype="int32"), keras.layers.Embedding(VOCAB, 16), keras.layers.Flatten(),
            keras.layers.Dense(32, activation="relu"), keras.layers.Dense(1, activation="sigmoid")])
        model.compile(optimizer=keras.optimizers.Adam(0.02), loss="binary_crossentropy", metrics=["accuracy"],
                      steps_per_execution=2)

    def dataset_fn(input_context):
        return tf.data.Dataset.from_tensor_slices((train_ids, train_labels)).shuffle(3072).batch(BATCH).repeat()

    work = os.path.dirname(out)
    callbacks = [
        keras.callbacks.ModelCheckpoint(os.path.join(work, "ckpt", "epoch-{epoch}.keras")),
        keras.callbacks.BackupAndRestore(os.path.join(work, "backup")),
        keras.callbacks.TensorBoard(os.path.join(work, "tb")),
        keras.callbacks.EarlyStopping(monitor="loss", patience=5),
    ]
    try:
        history = model.fit(dataset_fn, epochs=EPOCHS, steps_per_epoch=STEPS, callbacks=callbacks, verbose=2,
                            validation_data=(test_ids, test_labels))
    except Exception as exc:  # noqa: BLE001 - the fix-off run records Keras's own errors
        result["fit_error"] = f"{type(exc).__name__}: {exc}"
        try:
            model.fit(tf.data.Dataset.from_tensor_slices((train_ids, train_labels)).batch(BATCH), epochs=1, verbose=0)
        except Exception as exc:  # noqa: BLE001
            result["fit_dataset_error"] = f"{type(exc).__name__}: {exc}"
        with open(out, "w") as f:
            json.dump(result, f)
        return
    from tfos._node import keras3_ps

    result["history"] = history.history
    result["iterations_after_fit"] = int(model.optimizer.iterations.numpy())
    result["steps_by_worker"] = keras3_ps.steps_by_worker()
    result["devices"] = {v.path: [s.device for s in getattr(v.value, "variables", [v.value])] for v in model.variables}
    result["evaluate"] = model.evaluate(test_ids, test_labels, verbose=0, return_dict=True)

    # A worker killed in the middle of an epoch: its closures run again on the other worker.
    class KillMidEpoch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            pid = int(os.environ.get("KILL_WORKER_PID", "0"))
            if batch >= 6 and pid and "killed_at_step" not in result:
                os.kill(pid, signal.SIGKILL)
                result["killed_at_step"] = batch

    before = keras3_ps.steps_by_worker()
    history = model.fit(dataset_fn, epochs=1, steps_per_epoch=STEPS, callbacks=[KillMidEpoch()], verbose=0)
    result["after_kill"] = {"history": history.history, "iterations": int(model.optimizer.iterations.numpy()),
                            "steps_by_worker": {k: v - before.get(k, 0) for k, v in keras3_ps.steps_by_worker().items()}}
    # A finite tf.data.Dataset without steps_per_epoch: one epoch is its batches.
    start = int(model.optimizer.iterations.numpy())
    model.fit(tf.data.Dataset.from_tensor_slices((train_ids, train_labels)).batch(64), epochs=1, verbose=0)
    result["dataset_epoch_steps"] = int(model.optimizer.iterations.numpy()) - start
    result["metric_counts"] = {v.path: float(v.numpy()) for m in model.metrics for v in m.variables if "count" in v.path}
    result["evaluate_final"] = model.evaluate(test_ids, test_labels, verbose=0, return_dict=True)
    predictions = model.predict(test_ids, verbose=0)
    path = os.path.join(work, "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)  # no strategy: as cluster.inference() loads it
    result["saved_vs_live"] = float(np.max(np.abs(loaded.predict(test_ids, verbose=0) - predictions)))
    result["saved_accuracy"] = float(np.mean((loaded.predict(test_ids, verbose=0) > 0.5) == (test_labels > 0.5)))
    # The sidecar form: another process (here: a model without strategy) evaluates the
    # checkpoints ModelCheckpoint wrote on the coordinator.
    sidecar = keras.models.load_model(os.path.join(work, "ckpt", f"epoch-{EPOCHS}.keras"))
    result["sidecar_evaluate"] = sidecar.evaluate(test_ids, test_labels, verbose=0, return_dict=True)
    result["files"] = sorted(os.listdir(os.path.join(work, "ckpt"))) + [
        "tb" if any(files for _, _, files in os.walk(os.path.join(work, "tb"))) else "no-tb",
        "backup" if os.path.exists(os.path.join(work, "backup")) else "no-backup"]
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    if sys.argv[1] == "server":
        serve()
    else:
        coordinate(sys.argv[2])
