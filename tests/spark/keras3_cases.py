"""Keras 3 programs run by tests/spark/test_keras3_loopback.py, in processes of their own.

    python keras3_cases.py OUT_JSON worker   (TF_CONFIG set: a MultiWorkerMirroredStrategy worker)
    python keras3_cases.py OUT_JSON reference (one process, two logical CPU devices)
    python keras3_cases.py OUT_JSON single    (no TF_CONFIG: a MultiWorkerMirroredStrategy of one
                                              worker, as on a one-node tfos cluster; SINGLE_CASES)

A worker installs tfos's Keras 3 fix the way a tfos TF process does before ``main_fun``
(``tfos._node.keras3_fix.install()``; ``TFOS_KERAS3_FIX=0`` turns it off) and runs every
case under ``MultiWorkerMirroredStrategy``. The reference runs the same cases on the same
global batches in one process, without the fix: with one replica (the default strategy), and,
where each replica's share of the batch changes the result (Dropout masks, BatchNormalization
batch statistics, low-precision sums), also with two replicas
(``MirroredStrategy`` over two logical CPUs: what Keras does on one machine with two devices).
Every case writes weights, history, evaluate/predict results and file lists to OUT_JSON.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import traceback

OUT, ROLE = sys.argv[1], sys.argv[2]
faulthandler.enable()
faulthandler.register(signal.SIGUSR1)  # the test dumps every thread's stack before killing a stuck run
if ROLE in ("worker", "single"):
    from tfos._node import keras3_fix

    keras3_fix.install()  # what the TF process does before main_fun

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

if ROLE == "reference":
    _cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402

TASK = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {}).get("index", 0)
FILES = os.path.join(os.path.dirname(OUT), "files")  # shared by both workers, as on shared storage
EPOCHS = 2
GLOBAL_BATCH = 32
rng = np.random.default_rng(0)
X = rng.normal(size=(256, 4)).astype("float32")
Y = (X.sum(axis=1) > 0).astype("float32")
X_PREDICT = rng.normal(size=(251, 4)).astype("float32")  # a last batch of 27 rows: 14 + 13 per worker


def strategies() -> dict:
    """``{name: strategy}`` this process runs every case under."""
    if ROLE == "worker":
        return {"workers": tf.distribute.MultiWorkerMirroredStrategy()}
    if ROLE == "single":
        return {"single_worker": tf.distribute.MultiWorkerMirroredStrategy()}
    return {"one_replica": tf.distribute.get_strategy(), "two_replicas": tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])}


def dataset(*tensors, batch: int = GLOBAL_BATCH):
    """Global batches of ``tensors``, in order; each worker gets its half of every batch."""
    ds = tf.data.Dataset.from_tensor_slices(tensors if len(tensors) > 1 else tensors[0]).batch(batch)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return ds.with_options(options)


def mlp(*middle) -> keras.Model:
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), *middle,
                             keras.layers.Dense(1, activation="sigmoid")])


def compiled(strategy, build=mlp, optimizer=lambda: keras.optimizers.SGD(0.1), **compile_kwargs) -> keras.Model:
    keras.utils.set_random_seed(1)  # the same initial weights in every process
    with strategy.scope():
        model = build()
        model.compile(optimizer=optimizer(), loss="binary_crossentropy", metrics=["accuracy"], **compile_kwargs)
    return model


def record(model, history=None, **more) -> dict:
    out = {"weights": [w.tolist() for w in model.get_weights()]}
    if history is not None:
        out["history"] = history.history
        out["epochs"] = list(history.epoch)
    out.update(more)
    return out


def fit_evaluate_predict(strategy) -> dict:
    """fit with two metrics and validation_data, then evaluate and predict (dataset and numpy)."""
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = mlp()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="binary_crossentropy",
                      metrics=["accuracy", keras.metrics.AUC(name="auc")])
    history = model.fit(dataset(X, Y), epochs=EPOCHS, verbose=0, validation_data=dataset(X[:64], Y[:64]))
    return record(model, history,
                  evaluate=model.evaluate(dataset(X, Y), verbose=0, return_dict=True),
                  predict=model.predict(dataset(X_PREDICT), verbose=0)[:, 0].tolist(),
                  predict_numpy=model.predict(X_PREDICT, batch_size=GLOBAL_BATCH, verbose=0)[:, 0].tolist())


def one_shot_source(strategy, unbuilt: bool = False) -> dict:
    """fit, then evaluate, on datasets that cannot be rewound: a new iteration goes on where
    the last one stopped, each batch handed out once, as a tfos feed (``as_dataset``) does.
    Every batch must be trained on (evaluated) once, even when Keras builds the model
    (``unbuilt``: a model without ``keras.Input``, built by ``fit``)."""
    handed: list = []

    def source(x, y):
        starts = iter(range(0, len(x), GLOBAL_BATCH))  # shared by every iteration of the dataset
        count = len(handed)
        handed.append(0)

        def batches():
            for start in starts:
                handed[count] += 1
                yield x[start:start + GLOBAL_BATCH], y[start:start + GLOBAL_BATCH]

        ds = tf.data.Dataset.from_generator(batches, output_signature=(tf.TensorSpec((None, 4), tf.float32), tf.TensorSpec((None,), tf.float32)))
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
        return ds.with_options(options).prefetch(2)

    build = (lambda: keras.Sequential([keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1, activation="sigmoid")])) if unbuilt else mlp
    model = compiled(strategy, build)
    history = model.fit(source(X, Y), epochs=1, verbose=0)
    return record(model, history, evaluate=model.evaluate(source(X[:128], Y[:128]), verbose=0, return_dict=True), handed=handed)


def steps_per_execution(strategy) -> dict:
    model = compiled(strategy, optimizer=lambda: keras.optimizers.Adam(0.01), steps_per_execution=3)
    history = model.fit(dataset(X, Y), epochs=EPOCHS, verbose=0)  # 8 steps per epoch: 3 + 3 + 2
    return record(model, history, evaluate=model.evaluate(dataset(X, Y), verbose=0, return_dict=True),
                  predict=model.predict(dataset(X_PREDICT), verbose=0)[:, 0].tolist())


def dict_inputs(strategy) -> dict:
    def build():
        a, b = keras.Input((2,), name="a"), keras.Input((2,), name="b")
        hidden = keras.layers.Dense(8, activation="relu")(keras.layers.Concatenate()([a, b]))
        return keras.Model({"a": a, "b": b}, keras.layers.Dense(1, activation="sigmoid")(hidden))

    model = compiled(strategy, build)
    inputs = {"a": X[:, :2], "b": X[:, 2:]}
    history = model.fit(dataset(inputs, Y), epochs=EPOCHS, verbose=0)
    return record(model, history, evaluate=model.evaluate(dataset(inputs, Y), verbose=0, return_dict=True),
                  predict=model.predict(dataset({"a": X_PREDICT[:, :2], "b": X_PREDICT[:, 2:]}), verbose=0)[:, 0].tolist())


def dropout_batchnorm(synchronized: bool):
    def case(strategy) -> dict:
        model = compiled(strategy, lambda: mlp(keras.layers.Dropout(0.3, seed=5), keras.layers.BatchNormalization(synchronized=synchronized)))
        history = model.fit(dataset(X, Y), epochs=EPOCHS, verbose=0)
        # Each replica's own copy of every variable (BatchNormalization's moving statistics
        # are updated from each replica's rows).
        replicas = [[np.asarray(t).tolist() for t in strategy.experimental_local_results(v.value)] for v in model.weights]
        return record(model, history, evaluate=model.evaluate(dataset(X, Y), verbose=0, return_dict=True),
                      replica_weights=[list(r) for r in zip(*replicas)],
                      trainable=[i for i, v in enumerate(model.weights) if v.trainable])

    return case


def batchnorm_synchronized(strategy) -> dict:
    model = compiled(strategy, lambda: mlp(keras.layers.BatchNormalization(synchronized=True)))
    history = model.fit(dataset(X, Y), epochs=EPOCHS, verbose=0)
    return record(model, history, evaluate=model.evaluate(dataset(X, Y), verbose=0, return_dict=True))


def mixed_precision(policy: str):
    def case(strategy) -> dict:
        keras.mixed_precision.set_global_policy(policy)
        try:
            model = compiled(strategy)
            history = model.fit(dataset(X, Y), epochs=EPOCHS, verbose=0)
            return record(model, history, evaluate=model.evaluate(dataset(X, Y), verbose=0, return_dict=True),
                          optimizer=type(model.optimizer).__name__, compute_dtype=model.layers[0].compute_dtype)
        finally:
            keras.mixed_precision.set_global_policy("float32")

    return case


class CrashAfterEpoch(keras.callbacks.Callback):
    """Raises at the end of epoch ``epoch`` (0-based), after the callbacks listed before it."""

    def __init__(self, epoch: int) -> None:
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError(f"injected failure after epoch {epoch + 1}")


def barrier(strategy) -> float:
    """Returns once every replica reached it (an all-reduce across the workers): what one
    worker does before it is done on the others, e.g. the chief's deletion of the backup
    at the end of ``fit``. Returns the number of replicas."""

    @tf.function
    def step():
        return strategy.run(lambda: tf.distribute.get_replica_context().all_reduce("SUM", tf.constant(1.0)))

    return float(strategy.experimental_local_results(step())[0])


def callbacks_and_restart(name: str):
    """The failed attempt trains 2 of 5 epochs, saved by BackupAndRestore, and fails; the
    next attempt (a fresh model, as in a restarted TF process) resumes with
    ModelCheckpoint, EarlyStopping and TensorBoard. Both workers share every path."""

    def case(strategy) -> dict:
        root = os.path.join(FILES, name)
        backup = os.path.join(root, "backup")
        model = compiled(strategy, optimizer=lambda: keras.optimizers.Adam(0.01))
        try:
            model.fit(dataset(X, Y), epochs=5, verbose=0, callbacks=[keras.callbacks.BackupAndRestore(backup), CrashAfterEpoch(1)])
            failed = ""
        except RuntimeError as exc:
            failed = str(exc)
        model = compiled(strategy, optimizer=lambda: keras.optimizers.Adam(0.01))
        history = model.fit(dataset(X, Y), epochs=5, verbose=0, callbacks=[
            keras.callbacks.BackupAndRestore(backup),  # delete_checkpoint=True: removed at the end
            keras.callbacks.ModelCheckpoint(os.path.join(root, "ckpt", "epoch-{epoch:02d}.weights.h5"), save_weights_only=True),
            keras.callbacks.ModelCheckpoint(os.path.join(root, "ckpt", "best.keras"), monitor="loss", save_best_only=True),
            keras.callbacks.EarlyStopping(monitor="loss", min_delta=0.1, patience=0),
            keras.callbacks.TensorBoard(os.path.join(root, "tensorboard")),
        ])
        barrier(strategy)  # the chief's files are all written (and the backup deleted) before any worker lists them
        files = sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)
        out = record(model, history, failed=failed, files=files)
        if strategy.extended.should_checkpoint:  # the chief reads back what it wrote
            last = keras.models.clone_model(model)
            last.load_weights(os.path.join(root, "ckpt", f"epoch-{history.epoch[-1] + 1:02d}.weights.h5"))
            out["last_checkpoint"] = [w.tolist() for w in last.get_weights()]
            out["best_loss"] = float(keras.models.load_model(os.path.join(root, "ckpt", "best.keras")).evaluate(
                X, Y, batch_size=GLOBAL_BATCH, verbose=0, return_dict=True)["loss"])
        return out

    return case


def save_and_load(name: str):
    """Saves ``model.keras`` and exports a SavedModel as TensorFlow's multi-worker tutorial
    does: under MultiWorkerMirroredStrategy saving reads the metrics' variables across the
    workers (collectives), so every worker saves, the chief to the real path and the others
    to a temporary one. The chief loads both back for inference."""

    def case(strategy) -> dict:
        import shutil
        import tempfile

        model = compiled(strategy)
        history = model.fit(dataset(X, Y), epochs=EPOCHS, verbose=0)
        expected = model.predict(X_PREDICT, verbose=0)[:, 0]  # on every worker: it runs collectives
        out = record(model, history, predict=expected.tolist())
        chief = strategy.extended.should_checkpoint
        target = FILES if chief else tempfile.mkdtemp()
        os.makedirs(target, exist_ok=True)
        path = os.path.join(target, name)
        model.save(path + ".keras")
        model.export(path + "-savedmodel", verbose=False)
        if chief:
            loaded = keras.models.load_model(path + ".keras").predict(X_PREDICT, verbose=0)[:, 0]
            savedmodel = tf.saved_model.load(path + "-savedmodel")  # kept: its functions need its variables
            served = savedmodel.serve(tf.constant(X_PREDICT)).numpy()[:, 0]
            out["loaded_diff"] = float(np.abs(loaded - expected).max())
            out["served_diff"] = float(np.abs(served - expected).max())
        else:
            shutil.rmtree(target)
        return out

    return case


#: Cases whose result depends on each replica's share of the batch: compared with two replicas in one process.
def _local_variable(value):
    """A plain variable of this process (never a distributed one, even in a strategy's scope)."""
    from tensorflow.python.ops import resource_variable_ops

    with tf.init_scope():
        return resource_variable_ops.ResourceVariable(value, trainable=False)


class RowRecorder(keras.Model):
    """Two inputs ``a`` and ``b`` (a dict, as from numpy); ``row`` (each row's index) is not a
    feature: train_step adds 1 to ``seen[row]`` for every row of its local batch."""

    def __init__(self, rows: int):
        super().__init__()
        self.da, self.db = keras.layers.Dense(4, activation="relu"), keras.layers.Dense(4, activation="relu")
        self.out = keras.layers.Dense(1, activation="sigmoid")
        self.seen = _local_variable(tf.zeros((rows,), tf.int32))

    def call(self, inputs):
        return self.out(keras.ops.concatenate([self.da(inputs["a"]), self.db(inputs["b"])], axis=1))

    def train_step(self, data):
        x, y = data
        self.seen.scatter_add(tf.IndexedSlices(tf.ones_like(x["row"][:, 0], tf.int32), x["row"][:, 0]))
        return super().train_step(data)


def numpy_inputs(rows: np.ndarray) -> dict:
    return {"a": X[rows, :2], "b": X[rows, 2:], "row": rows.reshape(-1, 1).astype("int64")}


def common_orders(epochs: int) -> list:
    """The global orders the workers' fit(numpy) trains in, drawn as tfos draws them (the
    first shuffled array dataset of the process, TFOS_ARRAY_SHUFFLE_SEED set by the test)."""
    from keras.src.trainers.data_adapters.array_data_adapter import ArrayDataAdapter
    from tfos._node.keras3_arrays import common_order_dataset, dataset_seed

    adapter = ArrayDataAdapter(numpy_inputs(np.arange(len(X))), Y, batch_size=GLOBAL_BATCH, shuffle=True)
    ds = common_order_dataset(adapter, dataset_seed(0))
    orders = []
    for _ in range(epochs):
        orders.append(np.concatenate([batch[0]["row"].numpy()[:, 0] for batch in ds]))
        iter(ds)  # Keras's epoch iterator makes one at the end of an epoch and another at the next start
    return orders


def numpy_default_shuffle(strategy) -> dict:
    """fit(numpy) with Keras's default shuffle=True and no seed of the program's own, a
    subclassed two-input model with a custom train_step; validation_split, evaluate and
    predict on numpy. The reference trains one process on the workers' common orders."""
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = RowRecorder(len(X))
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="binary_crossentropy", metrics=["accuracy"])
        model({k: v[:2] for k, v in numpy_inputs(np.arange(2)).items()})  # the seeded initial weights
    tf.random.set_seed(None)  # from here no seed, as most programs: Keras's own shuffle draws per worker
    per_epoch = []
    record_rows = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: (per_epoch.append(model.seen.numpy().tolist()), model.seen.assign(tf.zeros_like(model.seen))))
    if ROLE == "worker":
        history = model.fit(numpy_inputs(np.arange(len(X))), Y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, verbose=0,
                            callbacks=[record_rows])
    else:  # one process, unshuffled, on the workers' orders
        history = keras.callbacks.History()
        history.set_model(model)
        history.history, history.epoch = {}, []
        for epoch, order in enumerate(common_orders(EPOCHS)):
            h = model.fit(numpy_inputs(order), Y[order], batch_size=GLOBAL_BATCH, epochs=epoch + 1, initial_epoch=epoch,
                          shuffle=False, verbose=0, callbacks=[record_rows])
            for k, v in h.history.items():
                history.history.setdefault(k, []).extend(v)
            history.epoch.extend(h.epoch)
    split = model.fit(numpy_inputs(np.arange(len(X))), Y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0, shuffle=False,
                      validation_split=0.25)
    x_predict = {"a": X_PREDICT[:, :2], "b": X_PREDICT[:, 2:], "row": np.zeros((len(X_PREDICT), 1), "int64")}
    return record(model, history, per_epoch=per_epoch, split=split.history,
                  evaluate=model.evaluate(numpy_inputs(np.arange(len(X))), Y, batch_size=GLOBAL_BATCH, verbose=0, return_dict=True),
                  predict=model.predict(x_predict, batch_size=GLOBAL_BATCH, verbose=0)[:, 0].tolist())


class VariableResult(keras.metrics.Metric):
    """As in Keras's ``Metric`` docstring: ``result()`` returns the metric's own variable."""

    def __init__(self, name="positives", **kwargs):
        super().__init__(name=name, **kwargs)
        self.positives = self.add_variable(shape=(), initializer="zeros", name="positives")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.positives.assign_add(keras.ops.sum(keras.ops.cast(y_pred > 0.5, "float32")))

    def result(self):
        return self.positives


class CustomSteps(keras.Sequential):
    """train_step/test_step returning dicts with a Python number, a variable and an int tensor."""

    def train_step(self, data):
        logs = super().train_step(data)
        return {**logs, "scale": 0.5, "iterations": self.optimizer.iterations, "seven": tf.constant(7)}

    def test_step(self, data):
        return {**super().test_step(data), "scale": 2.0, "seven": tf.constant(7)}


def custom_metric_and_steps(strategy) -> dict:
    """A metric whose result() is its variable; custom steps returning non-replica values."""
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = CustomSteps([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1, activation="sigmoid")])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="binary_crossentropy", metrics=["accuracy", VariableResult()])
    history = model.fit(dataset(X, Y), epochs=EPOCHS, verbose=0)
    return record(model, history, evaluate=model.evaluate(dataset(X, Y), verbose=0, return_dict=True))


TWO_REPLICA_CASES = ("dropout_batchnorm", "mixed_bfloat16", "mixed_float16")
#: Cases the one-worker process runs.
SINGLE_CASES = ("one_shot_source", "one_shot_unbuilt")

CASES = {
    "fit_evaluate_predict": fit_evaluate_predict,
    "one_shot_source": one_shot_source,
    "one_shot_unbuilt": lambda strategy: one_shot_source(strategy, unbuilt=True),
    "steps_per_execution": steps_per_execution,
    "dict_inputs": dict_inputs,
    "batchnorm_synchronized": batchnorm_synchronized,
    "dropout_batchnorm": dropout_batchnorm(False),
    "mixed_bfloat16": mixed_precision("mixed_bfloat16"),
    "mixed_float16": mixed_precision("mixed_float16"),
    "callbacks_and_restart": None,  # named per process below
    "save_and_load": None,
    "numpy_default_shuffle": numpy_default_shuffle,
    "custom_metric_and_steps": custom_metric_and_steps,
}


def main() -> None:
    trainer = sys.modules.get("keras.src.backend.tensorflow.trainer")
    results: dict = {"keras": keras.__version__, "fix_applied": bool(getattr(trainer, "_tfos_keras3_fix", False))}
    with open(OUT, "w") as f:
        json.dump(results, f)  # also when KERAS3_CASES selects no case of this process
    for strategy_name, strategy in strategies().items():
        tag = "workers" if ROLE == "worker" else strategy_name
        cases = dict(CASES, callbacks_and_restart=callbacks_and_restart(f"callbacks-{tag}"), save_and_load=save_and_load(f"model-{tag}"))
        for name, case in cases.items():
            if os.environ.get("KERAS3_CASES") and name not in os.environ["KERAS3_CASES"].split(","):
                continue
            print(f"case {name} under {strategy_name}", file=sys.stderr, flush=True)
            if ROLE == "reference":
                if (strategy_name != "one_replica") if name in SINGLE_CASES else \
                        ((name in TWO_REPLICA_CASES) != (strategy_name == "two_replicas")):
                    continue
            elif (ROLE == "single") != (name in SINGLE_CASES):
                continue  # the one-shot cases run on one worker alone (and in the reference)
            try:
                results.setdefault(strategy_name, {})[name] = case(strategy)
            except Exception:  # noqa: BLE001 - every case reports
                results.setdefault(strategy_name, {})[name] = {"error": traceback.format_exc()[-6000:]}
            with open(OUT + ".tmp", "w") as f:
                json.dump(results, f)
            os.replace(OUT + ".tmp", OUT)
            if "error" in results[strategy_name][name] and ROLE == "worker":
                return  # the workers' collectives no longer pair up


if __name__ == "__main__":
    main()
