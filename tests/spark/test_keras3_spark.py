"""Keras 3 programs on Spark (shared ``local-cluster[2,1,1024]``), unchanged, against one process.

``tutorial_main`` is written the way TensorFlow's multi-worker Keras tutorial writes it: no
tfos call, no environment variable; TF_CONFIG comes from tfos. The same program runs in one
process (default strategy, the same global batches) for the reference.

``fed_main`` trains from the feed (InputMode.SPARK, ``as_dataset(steps_per_epoch=S)``, one
``fit`` over the epochs of ``train(rdd, 2, end_of_feed=True)``), as docs/datafeed.md
recommends; each node records the rows of every step, and ``fed_reference`` replays the
global batches in one process (see its docstring for how MWMS combines the replicas).
Run with ``TFOS_KERAS3_FIX=0`` (driver) to see both tests fail without tfos's Keras 3 fix.
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


# ------------------------------------------------------------------ the fed path (InputMode.SPARK)
#: Rows of the fed RDD, in 3 partitions whose sizes no split over 2 nodes makes even: in
#: every epoch the nodes get different numbers of rows, so their local batches differ in size.
FED_PARTITIONS = (140, 100, 60)
FED_ROWS = sum(FED_PARTITIONS)
FED_EPOCHS = 2
FED_BATCH = 16  # per node (per replica) and step; S = ceil(300 / (16 x 2)) = 10 steps per epoch
FED_SIGNATURE = (("int64", (None,)), ("float32", (None, 4)), ("float32", (None,)))  # id, x, y


def fed_data() -> tuple:
    """``(x float32[FED_ROWS, 4], y float32[FED_ROWS])``: row ``i`` of the fed RDD is ``(i, x[i], y[i])``."""
    rng = np.random.default_rng(7)
    x = rng.normal(size=(FED_ROWS, 4)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5, 1.0], np.float32) + 0.3 > 0).astype(np.float32)
    return x, y


def fed_model(keras, metrics):
    """The model of the fed test (seeded: the same initial weights on every node), compiled."""
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(1, activation="sigmoid")])
    model.compile(optimizer=keras.optimizers.SGD(0.2), loss="binary_crossentropy", metrics=metrics)
    return model


def fed_main(args, ctx):
    """Keras 3 under MultiWorkerMirroredStrategy, fed by ``as_dataset(steps_per_epoch=S)`` (the
    form of docs/datafeed.md); writes, per step, the ids of its local batch in the order
    TensorFlow received them, the history and the weights."""
    import json
    import os
    import sys

    import numpy as np
    import tensorflow as tf
    import keras

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = fed_model(keras, ["accuracy"])
    initial = [w.tolist() for w in model.get_weights()]
    feed = ctx.get_data_feed()
    steps = feed.steps_per_epoch(args["rows_per_epoch"], args["batch_size"], strategy.num_replicas_in_sync)
    signature = tuple(tf.TensorSpec(shape, dtype) for dtype, shape in FED_SIGNATURE)
    ds = feed.as_dataset(args["batch_size"], signature, steps_per_epoch=steps)
    batches: list = []

    def note(ids, x):  # tf.data runs the map in order, one batch at a time
        batches.append(ids.tolist())
        return x

    def features(ids, x, y):
        x = tf.numpy_function(note, [ids, x], tf.float32, stateful=True)
        x.set_shape([None, 4])
        return x, y

    dist = strategy.distribute_datasets_from_function(lambda _: ds.map(features))
    history = model.fit(dist, epochs=args["epochs"], steps_per_epoch=steps, verbose=0)
    reader = ds.tfos_batches
    while not reader.ended:  # end_of_feed=True: the dataset ends right after the last epoch
        for _ in reader:
            pass
    trainer = sys.modules.get("keras.src.backend.tensorflow.trainer")
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    out = os.path.join(args["out"], f"{task['type']}{task['index']}.json")
    with open(out + ".tmp", "w") as f:
        json.dump({"task": task, "keras": keras.__version__, "fix_applied": bool(getattr(trainer, "_tfos_keras3_fix", False)),
                   "steps_per_epoch": steps, "batches": batches, "iterations": int(model.optimizer.iterations.numpy()),
                   "batches_out": reader.batches_out, "rows": {str(e): n for e, n in sorted(reader.rows.items())},
                   "history": history.history, "initial": initial,
                   "final": [np.asarray(w).tolist() for w in model.get_weights()]}, f)
    os.replace(out + ".tmp", out)


def fed_reference(out_dir: str, nodes: int = 2, timeout_s: float = 540.0) -> None:
    """One process, one replica, on the nodes' global batches (run as a subprocess; waits for
    the nodes' files, importing TensorFlow meanwhile); writes ``reference.json``.

    How Keras 3 combines the replicas under MultiWorkerMirroredStrategy: each replica's loss
    is the mean over its local batch, divided by the number of replicas R
    (``scale_loss_for_distribution``), and the gradients are summed across replicas
    (``_all_reduce_sum_gradients``): a step's gradient is the mean of the replicas' mean
    gradients, which equals one replica on the concatenated batch only when every local batch
    has the same size. A feed does not promise that (here it never does), so the global batch
    (the local batches concatenated in replica order) gets per-row sample weights
    ``N / (R x n_r)`` (``N`` rows in the step, ``n_r`` in replica r's part): with
    ``sum_over_batch_size`` the weighted loss is then exactly that mean of means. The loss
    Keras reports for an epoch is its tracker's total over its count, both summed across the
    replicas (each replica adds ``n_r x`` its mean and ``n_r``): the unweighted mean over the
    epoch's rows, which the reference reads from an unweighted ``BinaryCrossentropy`` metric
    (its own reported loss is the weighted one). ``accuracy`` is unweighted on both sides
    (``metrics``, not ``weighted_metrics``).
    """
    import glob
    import json
    import os
    import time

    import tensorflow as tf
    import keras

    deadline = time.monotonic() + timeout_s
    while len(glob.glob(os.path.join(out_dir, "worker*.json"))) < nodes:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no node files in {out_dir} after {timeout_s} s")
        time.sleep(0.5)
    runs = sorted((json.load(open(p)) for p in glob.glob(os.path.join(out_dir, "worker*.json"))), key=lambda r: r["task"]["index"])
    steps, total = runs[0]["steps_per_epoch"], len(runs[0]["batches"])
    x, y = fed_data()

    def global_batches():
        for step in range(total):
            parts = [r["batches"][step] for r in runs]
            ids = np.array([i for part in parts for i in part], np.int64)
            weights = np.concatenate([np.full(len(p), len(ids) / (len(runs) * len(p)), np.float32) for p in parts if p])
            yield x[ids], y[ids, None], weights  # y as (rows, 1): the metric does not reshape it as the loss does

    ds = tf.data.Dataset.from_generator(global_batches, output_signature=(
        tf.TensorSpec((None, 4), tf.float32), tf.TensorSpec((None, 1), tf.float32), tf.TensorSpec((None,), tf.float32)))
    model = fed_model(keras, ["accuracy", keras.metrics.BinaryCrossentropy(name="row_loss")])
    model.set_weights([np.asarray(w, np.float32) for w in runs[0]["initial"]])
    history = model.fit(ds, epochs=total // steps, steps_per_epoch=steps, verbose=0)
    with open(os.path.join(out_dir, "reference.json"), "w") as f:
        json.dump({"history": history.history, "iterations": int(model.optimizer.iterations.numpy()),
                   "final": [w.tolist() for w in model.get_weights()]}, f)


def test_fed_fit_on_two_nodes_equals_one_process(sc, tmp_path, no_leftovers, monkeypatch):
    """InputMode.SPARK: ``train(rdd, 2, end_of_feed=True)`` into Keras 3 ``fit`` under
    MultiWorkerMirroredStrategy (as_dataset(steps_per_epoch=S), distribute_datasets_from_function)
    on partitions no split makes even: every row is trained once per epoch, both nodes end
    equal, each dataset ends with the feed, and weights, losses and accuracy equal one
    process's on the same global batches within 1e-5."""
    monkeypatch.delenv("TF_USE_LEGACY_KERAS", raising=False)
    out = tmp_path / "out"
    out.mkdir()
    x, y = fed_data()
    starts = np.cumsum((0,) + FED_PARTITIONS)
    parts = [[(i, x[i], float(y[i])) for i in range(starts[p], starts[p + 1])] for p in range(len(FED_PARTITIONS))]
    rdd = sc.parallelize(range(len(parts)), len(parts)).flatMap(lambda p: parts[p])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, ROOT]), TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    reference = subprocess.Popen([sys.executable, "-c", f"from test_keras3_spark import fed_reference; fed_reference({str(out)!r})"],
                                 env=env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        args = {"out": str(out), "rows_per_epoch": FED_ROWS, "batch_size": FED_BATCH, "epochs": FED_EPOCHS}
        # tensorboard=True: the driver also writes the nodes' figures as scalars under <log_dir>/tfos
        cluster = TFCluster.run(sc, fed_main, args, 2, 0, True, TFCluster.InputMode.SPARK, log_dir=str(tmp_path / "tb"),
                                reservation_timeout=120)
        cluster.train(rdd, num_epochs=FED_EPOCHS, end_of_feed=True, feed_timeout=300)
        cluster.shutdown(timeout=300)
        ref_out, _ = reference.communicate(timeout=300)
    finally:
        if reference.poll() is None:
            reference.kill()
            reference.communicate()
    assert reference.returncode == 0, ref_out[-4000:]
    nodes = [json.loads((out / f"worker{i}.json").read_text()) for i in range(2)]
    one = json.loads((out / "reference.json").read_text())
    steps = -(-FED_ROWS // (FED_BATCH * 2))
    for r in nodes:
        assert r["keras"].startswith("3.") and r["fix_applied"], (r["keras"], r["fix_applied"])
        assert r["steps_per_epoch"] == steps
        # Keras trained every batch the dataset gave, and the dataset ended with the feed.
        assert r["iterations"] == len(r["batches"]) == r["batches_out"] == FED_EPOCHS * steps, r
        per_epoch = {str(e): sum(map(len, r["batches"][e * steps:(e + 1) * steps])) for e in range(FED_EPOCHS)}
        assert {e: n for e, n in r["rows"].items() if n} == {e: n for e, n in per_epoch.items() if n}, (r["rows"], per_epoch)
        assert set(r["history"]) == {"loss", "accuracy"} and len(r["history"]["loss"]) == FED_EPOCHS
    assert nodes[0]["initial"] == nodes[1]["initial"]
    assert nodes[0]["final"] == nodes[1]["final"] and nodes[0]["history"] == nodes[1]["history"]
    for epoch in range(FED_EPOCHS):
        ids = [i for r in nodes for b in r["batches"][epoch * steps:(epoch + 1) * steps] for i in b]
        assert sorted(ids) == list(range(FED_ROWS)), epoch  # every row once per epoch
    sizes = [[len(b) for b in r["batches"]] for r in nodes]
    assert sizes[0] != sizes[1], sizes  # the replicas' local batches differ in size
    assert one["iterations"] == FED_EPOCHS * steps
    assert _relative(nodes[0]["final"], one["final"]) <= 1e-5
    assert _relative([nodes[0]["history"]["loss"]], [one["history"]["row_loss"]]) <= 1e-5, (nodes[0]["history"], one["history"])
    assert _relative([nodes[0]["history"]["accuracy"]], [one["history"]["accuracy"]]) <= 1e-5, (nodes[0]["history"], one["history"])
    assert one["history"]["row_loss"][-1] < one["history"]["row_loss"][0]
    # the driver's figures: Keras's steps per node (docs/status.md), as TensorBoard reads them
    summary = cluster.summary()
    assert [(n["node"], n["rows"], n["steps"]) for n in summary["nodes"]] == [
        (f"worker:{i}", sum(r["rows"].values()), FED_EPOCHS * steps) for i, r in enumerate(nodes)], summary
    assert sum(n["rows"] for n in summary["nodes"]) == FED_ROWS * FED_EPOCHS
    read = ("import json, sys; from tensorboard.backend.event_processing.event_accumulator import EventAccumulator as A\n"
            "out = {}\nfor run in ('worker_0', 'worker_1'):\n a = A(sys.argv[1] + '/' + run); a.Reload()\n"
            " out[run] = {t: [(e.step, e.value) for e in a.Scalars(t)] for t in a.Tags()['scalars']}\nprint(json.dumps(out))")
    got = subprocess.run([sys.executable, "-c", read, str(tmp_path / "tb" / "tfos")], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert got.returncode == 0, got.stderr[-3000:]
    scalars = json.loads(got.stdout.strip().splitlines()[-1])
    for run in ("worker_0", "worker_1"):
        assert {"tfos/rows_per_s", "tfos/feed_wait_pct", "tfos/steps_per_s", "tfos/cpu_pct", "tfos/rss_mib"} <= set(scalars[run]), scalars
        assert all(0 <= v <= 100 for _, v in scalars[run]["tfos/feed_wait_pct"]) and scalars[run]["tfos/rss_mib"][-1][1] > 10


# ------------------------------------------------------------- the coordination service's leader
def lingering_worker_main(args, ctx):
    """MWMS on two workers; worker 1 is still busy (``linger_s``) when worker 0, the leader of
    TensorFlow's coordination service, returns."""
    import os
    import time

    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"  # TensorFlow's errors are printed
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        v = tf.Variable(1.0)
    total = strategy.experimental_local_results(strategy.run(lambda: tf.distribute.get_replica_context().all_reduce("SUM", v)))[0]
    if ctx.task_index == args.get("late", 1):
        time.sleep(args["linger_s"])  # longer than the workers' coordination heartbeat interval
    print(f"{ctx.job_name}:{ctx.task_index} summed {float(total)}", flush=True)


def test_a_worker_that_ends_after_the_leader_logs_no_coordination_error(sc, capfd, no_leftovers):
    # The leader's process stays up until the cluster stops: the other worker's heartbeats
    # to the coordination service keep reaching it. Before, worker:1 printed "StartAbort
    # UNAVAILABLE: Failed to send RPC to coordination service" in a run that went well.
    capfd.readouterr()
    cluster = TFCluster.run(sc, lingering_worker_main, {"linger_s": 8.0}, 2, 0, False, TFCluster.InputMode.TENSORFLOW,
                            reservation_timeout=120)
    cluster.shutdown(timeout=120)
    captured = capfd.readouterr()
    text = captured.out + captured.err
    assert "worker:0 summed 2.0" in text and "worker:1 summed 2.0" in text, text[-3000:]
    assert "coordination service" not in text and "StartAbort" not in text, text[-3000:]
    # The other way round: the leader (worker 0) is still busy 15 s after worker 1 returned.
    # worker 1's process keeps heartbeating until the cluster stops; before, it exited and
    # the leader printed "StartAbort UNAVAILABLE ... The following tasks are unhealthy
    # (stopped sending heartbeats): /job:worker/replica:0/task:1 The tasks have crashed"
    # about 10 s later, in a run that went well.
    cluster = TFCluster.run(sc, lingering_worker_main, {"linger_s": 15.0, "late": 0}, 2, 0, False,
                            TFCluster.InputMode.TENSORFLOW, reservation_timeout=120)
    cluster.shutdown(timeout=120)
    captured = capfd.readouterr()
    text = captured.out + captured.err
    assert "worker:0 summed 2.0" in text and "worker:1 summed 2.0" in text, text[-3000:]
    assert "unhealthy" not in text and "StartAbort" not in text and "have crashed" not in text, text[-3000:]
