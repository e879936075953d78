"""InputMode.TENSORFLOW cluster lifecycle on a real Spark (shared ``local-cluster[2,1,1024]``).

Every node writes what it saw (TF_CONFIG, losses, ports, pids) as JSON into a pytest
``tmp_path`` (the executors run on this machine), and the tests assert those values.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import os
import time
import urllib.request
from pathlib import Path

import pytest

from tfos import TFCluster
from tfos.errors import ClusterFailedError

pytestmark = [pytest.mark.spark, pytest.mark.tf, pytest.mark.timeout(420)]

#: Longest wait, in seconds, for the workers' main_fun in shutdown(); a hang fails the test.
SHUTDOWN_TIMEOUT_S = 240.0


# --------------------------------------------------------------------------
# Helpers shipped by value to the node processes
# --------------------------------------------------------------------------


def _write_json(path: str, obj) -> None:
    """Writes ``obj`` as JSON atomically (TF process)."""
    import json
    import os

    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def _run_bounded(fn, seconds: float, what: str):
    """Runs ``fn()`` in a daemon thread; raises TimeoutError if it takes longer than
    ``seconds`` (the TF process exits without joining the stuck thread)."""
    import threading

    box: dict = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc

    t = threading.Thread(target=target, name="bounded", daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        raise TimeoutError(f"{what} did not finish within {seconds:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("result")


def _node_file(out_dir: str, ctx, suffix: str = "") -> str:
    import os

    return os.path.join(out_dir, f"{ctx.job_name}_{ctx.task_index}{suffix}.json")


def _read_nodes(out_dir: Path, suffix: str = "") -> dict:
    """``{"chief:0": record, ...}`` from the JSON files the nodes wrote (driver)."""
    found = {}
    for p in sorted(out_dir.glob(f"*{suffix}.json")):
        stem = p.name[: -len(f"{suffix}.json")]
        if suffix == "" and not stem.rsplit("_", 1)[-1].isdigit():
            continue
        job, idx = stem.rsplit("_", 1)
        found[f"{job}:{idx}"] = json.loads(p.read_text())
    return found


# --------------------------------------------------------------------------
# main_funs
# --------------------------------------------------------------------------


def mwms_regression_main(args, ctx):
    """Trains y = 3x + 1 with MultiWorkerMirroredStrategy and Keras ``model.fit``.

    ``args["legacy_keras"]`` selects tf_keras (TF_USE_LEGACY_KERAS=1, set before
    TensorFlow is imported) or Keras 3.
    """
    import json
    import os
    import sys

    tf_preloaded = "tensorflow" in sys.modules
    if args["legacy_keras"]:
        os.environ["TF_USE_LEGACY_KERAS"] = "1"
    _write_json(
        _node_file(args["out"], ctx, "_tfconfig"),
        {"tf_config": json.loads(os.environ["TF_CONFIG"]), "tf_preloaded": tf_preloaded,
         "cluster_spec": ctx.cluster_spec, "num_workers": ctx.num_workers},
    )
    import numpy as np
    import tensorflow as tf

    def train():
        comm = tf.distribute.experimental.CommunicationOptions(timeout_seconds=args["collective_timeout_s"])
        strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=comm)
        if args["legacy_keras"]:
            keras = tf.keras  # tf_keras, thanks to TF_USE_LEGACY_KERAS=1
        else:
            import keras
        rng = np.random.default_rng(7)
        x = rng.uniform(-1.0, 1.0, size=(256, 1)).astype("float32")
        y = 3.0 * x + 1.0
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
        opts = tf.data.Options()
        opts.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
        ds = ds.with_options(opts)
        with strategy.scope():
            model = keras.Sequential([keras.layers.Input(shape=(1,)), keras.layers.Dense(1)])
            model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.2), loss="mse")
        hist = model.fit(ds, epochs=args["epochs"], verbose=0)
        w, b = (float(np.ravel(v)[0]) for v in model.get_weights())
        return {
            "losses": [float(v) for v in hist.history["loss"]],
            "replicas": int(strategy.num_replicas_in_sync),
            "keras_module": keras.__name__,
            "keras_version": getattr(keras, "__version__", "?"),
            "weights": [w, b],
        }

    result = _run_bounded(train, args["fit_timeout_s"], "MultiWorkerMirroredStrategy model.fit")
    _write_json(_node_file(args["out"], ctx), result)


def tfos_style_main(args, ctx):
    """A classic TensorFlowOnSpark InputMode.TENSORFLOW main_fun; only the import changed."""
    import json
    import os
    import socket

    import tensorflow as tf
    from tfos import TFNode

    job_name = ctx.job_name
    task_index = ctx.task_index
    cluster_spec = ctx.cluster_spec
    num_workers = ctx.num_workers
    model_dir = ctx.absolute_path(args.model_dir)
    print(f"{job_name}:{task_index} of {num_workers} workers, cluster {cluster_spec}, model_dir {model_dir}")

    # each worker computes its share of sum(range(100)), TF style
    total = int(tf.reduce_sum(tf.range(task_index, 100, num_workers)).numpy())
    tf.io.gfile.makedirs(model_dir)
    with tf.io.gfile.GFile(f"{model_dir}/{job_name}_{task_index}.json", "w") as f:
        f.write(json.dumps({
            "job_name": job_name, "task_index": task_index, "cluster_spec": cluster_spec,
            "num_workers": num_workers, "model_dir": model_dir, "hdfs_path": TFNode.hdfs_path(ctx, args.model_dir),
            "partial_sum": total, "batch_size": args.batch_size, "epochs": args.epochs,
            "hostname": socket.gethostname(), "pid": os.getpid(),
        }))


def ps_worker_main(args, ctx):
    """The ps blocks forever (like ``server.join()``); the worker writes a file and returns."""
    import os
    import threading

    _write_json(_node_file(args["out"], ctx), {"pid": os.getpid(), "ppid": os.getppid()})
    if ctx.job_name == "ps":
        threading.Event().wait()
    _wait_for_ps_record(args["out"])


def _wait_for_ps_record(out_dir: str) -> None:
    """Returns once the ps wrote its record (at most 120 s; TF process). A worker ends
    only after that (see driver_ps_main): under CPU contention shutdown() once stopped
    the ps before its main_fun wrote its file."""
    import os
    import time

    ps_file = os.path.join(out_dir, "ps_0.json")
    end = time.monotonic() + 120
    while not os.path.exists(ps_file) and time.monotonic() < end:
        time.sleep(0.05)


def atexit_main(args, ctx):
    """Each node registers an atexit handler and has autograph convert a function (one
    generated module in the temp dir); the ps then blocks forever, the worker returns."""
    import atexit
    import os
    import threading

    import tensorflow as tf

    def branchy(x):
        if x > 0:
            return x + 1
        return x - 1

    generated = tf.autograph.to_graph(branchy).__code__.co_filename
    name = f"{ctx.job_name}_{ctx.task_index}"
    atexit.register(_write_json, os.path.join(args["out"], f"{name}_atexit.json"), {"pid": os.getpid()})
    _write_json(_node_file(args["out"], ctx), {"pid": os.getpid(), "generated": generated, "existed": os.path.exists(generated)})
    if ctx.job_name == "ps":
        threading.Event().wait()
    _wait_for_ps_record(args["out"])


def _ancestor_pids() -> list:
    import psutil

    return [p.pid for p in psutil.Process().parents()]


def driver_ps_main(args, ctx):
    """ps (on the driver host) blocks forever; each worker records its process ancestry."""
    import os
    import threading

    _write_json(_node_file(args["out"], ctx), {"pid": os.getpid(), "ancestors": _ancestor_pids(), "spec": ctx.cluster_spec})
    if ctx.job_name == "ps":
        threading.Event().wait()
    # Workers end only once the ps recorded itself: under CPU contention the ps's main_fun
    # may start after both workers returned, and shutdown() stops the ps as soon as the
    # workers are done (as in TFoS), which once stopped it 33 ms into its main_fun.
    _wait_for_ps_record(args["out"])


def tf_server_main(args, ctx):
    """Starts a real TF server on the node's port; the chief runs an op on the worker's
    server through a TF1 session, then tells the worker (via a file) it may exit."""
    import os
    import socket
    import time

    import tensorflow as tf

    try:
        from tfos.tf_server import start_cluster_server

        cluster, server = start_cluster_server(ctx)
        how = "tfos.tf_server"
    except ImportError:
        ctx.release_port()
        cluster = tf.train.ClusterSpec(ctx.cluster_spec)
        server = tf.distribute.Server(cluster, job_name=ctx.job_name, task_index=ctx.task_index, start=True)
        how = "tf.distribute.Server"
    with socket.create_connection(("127.0.0.1", ctx.port), timeout=10.0):
        listening = True
    done_flag = os.path.join(args["out"], "chief_done")
    record = {"port": ctx.port, "target": server.target, "listening": listening, "how": how, "spec": ctx.cluster_spec}
    if ctx.job_name == "chief":
        g = tf.Graph()
        with g.as_default():
            with tf.device("/job:worker/task:0"):
                answer = tf.constant(20) + tf.constant(22)
        config = tf.compat.v1.ConfigProto(operation_timeout_in_ms=60000)
        with tf.compat.v1.Session(server.target, graph=g, config=config) as sess:
            record["remote_answer"] = int(sess.run(answer))
        _write_json(_node_file(args["out"], ctx), record)
        open(done_flag, "w").close()
    else:
        _write_json(_node_file(args["out"], ctx), record)
        deadline = time.monotonic() + 180.0
        while not os.path.exists(done_flag):  # keep serving until the chief is done
            if time.monotonic() > deadline:
                raise TimeoutError("the chief never finished")
            time.sleep(0.2)


def boom_main(args, ctx):
    """The worker fails; the chief returns."""
    if ctx.job_name == "worker":
        raise ValueError("boom")


def tensorboard_main(args, ctx):
    """Writes one scalar summary on the chief, then returns (TensorBoard stays up until shutdown)."""
    import os

    if ctx.job_name == "chief":
        import tensorflow as tf

        w = tf.summary.create_file_writer(args["log_dir"])
        with w.as_default():
            tf.summary.scalar("loss", 0.5, step=1)
        w.flush()
        _write_json(_node_file(args["out"], ctx), {"pythonpath": os.environ.get("PYTHONPATH")})


def trivial_main(args, ctx):
    import json
    import os

    _write_json(_node_file(args["out"], ctx), {"pid": os.getpid(), "tf_config": json.loads(os.environ["TF_CONFIG"])})


# --------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------


def _mwms_args(tmp_path: Path, legacy: bool) -> dict:
    return {"out": str(tmp_path), "legacy_keras": legacy, "epochs": 8, "collective_timeout_s": 90, "fit_timeout_s": 150}


def _check_tf_configs(tmp_path: Path, cluster_spec: dict) -> None:
    seen = _read_nodes(tmp_path, "_tfconfig")
    assert set(seen) == {"chief:0", "worker:0"}
    assert len(cluster_spec["chief"]) == 1 and len(cluster_spec["worker"]) == 1
    assert cluster_spec["chief"] != cluster_spec["worker"]
    for name, rec in seen.items():
        job, idx = name.split(":")
        tfc = rec["tf_config"]
        assert tfc["task"] == {"type": job, "index": int(idx)}
        assert tfc["cluster"] == cluster_spec
        assert rec["cluster_spec"] == cluster_spec
        assert rec["num_workers"] == 2
        assert not rec["tf_preloaded"], "tfos imported TensorFlow before main_fun (TF_USE_LEGACY_KERAS would be ignored)"


def _check_regression(tmp_path: Path, cluster_spec: dict, legacy: bool) -> None:
    _check_tf_configs(tmp_path, cluster_spec)
    results = _read_nodes(tmp_path)
    assert set(results) == {"chief:0", "worker:0"}
    for name, r in results.items():
        losses = r["losses"]
        assert len(losses) == 8, name
        assert losses[-1] < 0.5 * losses[0], f"{name}: loss did not go down: {losses}"
        assert losses[-1] < 0.5, f"{name}: {losses}"
        assert r["replicas"] == 2, name
        assert ("tf_keras" in r["keras_module"]) == legacy, r["keras_module"]
    # synchronous training: both workers end with the same weights, near w=3, b=1
    (w0, b0), (w1, b1) = (results[n]["weights"] for n in ("chief:0", "worker:0"))
    assert w0 == pytest.approx(w1, abs=1e-5) and b0 == pytest.approx(b1, abs=1e-5)
    assert b0 == pytest.approx(1.0, abs=0.3) and w0 == pytest.approx(3.0, abs=1.0)


def test_mwms_tf_keras_two_nodes(sc, tmp_path, no_leftovers):
    cluster = TFCluster.run(sc, mwms_regression_main, _mwms_args(tmp_path, True), 2, 0, False,
                            TFCluster.InputMode.TENSORFLOW, master_node="chief", reservation_timeout=120)
    spec = cluster.cluster_spec
    cluster.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
    _check_regression(tmp_path, spec, legacy=True)


def test_mwms_keras3_two_nodes(sc, tmp_path, no_leftovers):
    cluster = TFCluster.run(sc, mwms_regression_main, _mwms_args(tmp_path, False), 2, 0, False,
                            TFCluster.InputMode.TENSORFLOW, master_node="chief", reservation_timeout=120)
    spec = cluster.cluster_spec
    cluster.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
    _check_regression(tmp_path, spec, legacy=False)


def test_tfos_style_program_unchanged(sc, tmp_path, no_leftovers):
    # --- a TensorFlowOnSpark driver program, unchanged apart from the import ---
    from tfos import TFCluster

    parser = argparse.ArgumentParser()
    parser.add_argument("--batch_size", help="number of records per batch", type=int, default=64)
    parser.add_argument("--cluster_size", help="number of nodes in the cluster", type=int, default=2)
    parser.add_argument("--epochs", help="number of epochs", type=int, default=3)
    parser.add_argument("--model_dir", help="path to save model/checkpoint", default="mnist_model")
    parser.add_argument("--tensorboard", help="launch tensorboard process", action="store_true")
    args = parser.parse_args(["--model_dir", str(tmp_path / "mnist_model"), "--epochs", "2"])
    num_ps = 0

    cluster = TFCluster.run(sc, tfos_style_main, args, args.cluster_size, num_ps, args.tensorboard,
                            TFCluster.InputMode.TENSORFLOW, master_node='chief')
    cluster.shutdown()
    # ---------------------------------------------------------------------------
    assert isinstance(cluster.cluster_spec, dict)
    found = _read_nodes(tmp_path / "mnist_model")
    assert set(found) == {"chief:0", "worker:0"}
    expected_dir = f"file://{tmp_path / 'mnist_model'}"
    for name, r in found.items():
        assert f"{r['job_name']}:{r['task_index']}" == name
        assert r["cluster_spec"] == cluster.cluster_spec
        assert set(r["cluster_spec"]) == {"chief", "worker"}
        assert r["num_workers"] == 2
        assert r["model_dir"] == expected_dir and r["hdfs_path"] == expected_dir
        assert (r["batch_size"], r["epochs"]) == (64, 2)
    assert found["chief:0"]["pid"] != found["worker:0"]["pid"]
    # chief has task 0 of 2 workers (even numbers), worker task 0 as well: each summed its share
    assert found["chief:0"]["partial_sum"] == sum(range(0, 100, 2))
    assert found["worker:0"]["partial_sum"] == sum(range(0, 100, 2))


def test_ps_blocking_forever_is_stopped_by_shutdown(sc, tmp_path, caplog, no_leftovers):
    caplog.set_level(logging.INFO, logger="tfos._driver")
    cluster = TFCluster.run(sc, ps_worker_main, {"out": str(tmp_path)}, 2, 1, False,
                            TFCluster.InputMode.TENSORFLOW, reservation_timeout=120)
    assert cluster.cluster_template == {"ps": [0], "worker": [1]}
    assert any("1 ps [0], 1 worker [1]" in r.getMessage() for r in caplog.records if r.name.startswith("tfos._driver.")), caplog.text
    t0 = time.monotonic()
    cluster.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
    assert time.monotonic() - t0 < 120
    found = _read_nodes(tmp_path)
    assert set(found) == {"ps:0", "worker:0"}
    import psutil

    assert not psutil.pid_exists(found["ps:0"]["pid"]) or psutil.Process(found["ps:0"]["pid"]).status() == psutil.STATUS_ZOMBIE


def test_node_exit_runs_atexit_handlers_and_removes_autograph_modules(sc, tmp_path, no_leftovers):
    """The TF process ends with os._exit (skipping atexit); tfos runs the atexit handlers
    first, so autograph's generated modules do not pile up in the executors' temp dir and
    main_fun's own handlers run: on a worker that returns and on a ps stopped by shutdown()."""
    cluster = TFCluster.run(sc, atexit_main, {"out": str(tmp_path)}, 2, 1, False,
                            TFCluster.InputMode.TENSORFLOW, reservation_timeout=120)
    cluster.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
    found = _read_nodes(tmp_path)
    assert set(found) == {"ps:0", "worker:0"}
    for name, r in found.items():
        assert r["existed"], (name, r)
        assert not os.path.exists(r["generated"]), f"{name}: autograph module {r['generated']} left behind"
        marker = tmp_path / f"{name.replace(':', '_')}_atexit.json"
        assert marker.exists(), f"{name}: main_fun's atexit handler did not run"
        assert json.loads(marker.read_text())["pid"] == r["pid"]


def test_run_shutdown_run_again_with_tf_servers(sc, tmp_path, no_leftovers):
    specs, records = [], []
    for i in range(2):
        out = tmp_path / f"run{i}"
        out.mkdir()
        cluster = TFCluster.run(sc, tf_server_main, {"out": str(out)}, 2, 0, False,
                                TFCluster.InputMode.TENSORFLOW, master_node="chief",
                                reservation_timeout=120, release_port=False)
        specs.append(cluster.cluster_spec)
        cluster.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
        found = _read_nodes(out)
        assert set(found) == {"chief:0", "worker:0"}, f"run {i}"
        records.append(found)
        for name, r in found.items():
            job, idx = name.split(":")
            assert r["listening"] and r["how"] == "tfos.tf_server"
            assert r["target"].startswith("grpc://") and r["target"].endswith(f":{r['port']}")
            assert r["spec"] == specs[-1]
            assert specs[-1][job][int(idx)].endswith(f":{r['port']}")
        assert found["chief:0"]["remote_answer"] == 42
    ports = [{r["port"] for r in found.values()} for found in records]
    assert ports[0] != ports[1], f"both runs used the same TF ports {ports}"
    assert specs[0] != specs[1]


def tf1_worker_returns_at_once_main(args, ctx):
    """TF1 between-graph as users write it: the worker starts its server and returns; the
    chief, 3 s later, runs an op on the worker's server in a session (TF's CreateSession
    waits without end for every task of the cluster spec)."""
    import time as _time

    import tensorflow as tf

    from tfos import TFNode

    cluster, server = TFNode.start_cluster_server(ctx)
    if ctx.job_name == "chief":
        _time.sleep(3)
        g = tf.Graph()
        with g.as_default():
            with tf.device("/job:worker/task:0"):
                answer = tf.constant(20) + tf.constant(22)
        with tf.compat.v1.Session(server.target, graph=g) as sess:
            _write_json(_node_file(args["out"], ctx), {"remote_answer": int(sess.run(answer))})


def test_tf1_worker_server_outlives_its_main_fun_until_shutdown(sc, tmp_path, no_leftovers):
    """A node's TF server started with start_cluster_server keeps serving after main_fun
    returns, until shutdown() stops the cluster (new-user trial, session 17: the chief's
    session waited for the exited worker until shutdown()'s timeout; TFoS's reused Python
    worker kept the server up)."""
    cluster = TFCluster.run(sc, tf1_worker_returns_at_once_main, {"out": str(tmp_path)}, 2, 0, False,
                            TFCluster.InputMode.TENSORFLOW, master_node="chief", reservation_timeout=120)
    t0 = time.monotonic()
    cluster.shutdown(timeout=90)
    assert _read_nodes(tmp_path) == {"chief:0": {"remote_answer": 42}}
    assert time.monotonic() - t0 < 90


def test_worker_exception_fails_shutdown(sc, tmp_path, no_leftovers):
    t0 = time.monotonic()
    with pytest.raises(ClusterFailedError) as info:
        # worker:0 raises at once: under load its report can reach the driver before run()
        # returns, and then run() itself raises; otherwise shutdown() does.
        cluster = TFCluster.run(sc, boom_main, {"out": str(tmp_path)}, 2, 0, False,
                                TFCluster.InputMode.TENSORFLOW, master_node="chief", reservation_timeout=120)
        cluster.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
    assert time.monotonic() - t0 < 120
    err = info.value
    text = str(err)
    assert "worker:0" in text and "boom" in text, text
    # the remote traceback; cloudpickle ships test-module functions by value with
    # co_filename "<dynamic-code>", so it has line numbers but no source lines
    lines, first = inspect.getsourcelines(boom_main)
    raise_line = first + next(i for i, ln in enumerate(lines) if 'raise ValueError("boom")' in ln)
    assert "Traceback (most recent call last)" in text and "in run_node" in text, text
    assert f'line {raise_line}, in boom_main' in text and "ValueError: boom" in text, text
    worker_failures = [f for f in err.failures if f.job_name == "worker" and f.task_index == 0]
    assert worker_failures and worker_failures[0].error_type == "ValueError" and worker_failures[0].message == "boom"
    assert worker_failures[0].kind == "exception"
    assert not any(f.error_type == "ValueError" for f in err.failures if f.job_name == "chief")


def test_tensorboard_without_pythonpath(sc, tmp_path, monkeypatch, no_leftovers):
    monkeypatch.delenv("PYTHONPATH", raising=False)
    log_dir = tmp_path / "tb"
    cluster = TFCluster.run(sc, tensorboard_main, {"out": str(tmp_path), "log_dir": str(log_dir)}, 2, 0, True,
                            TFCluster.InputMode.TENSORFLOW, log_dir=str(log_dir), master_node="chief",
                            reservation_timeout=120)
    try:
        url = cluster.tensorboard_url(timeout_s=150.0)
        assert url is not None and url.startswith("http://"), url
        with urllib.request.urlopen(url, timeout=30) as resp:
            status = resp.status
            body = resp.read().decode("utf-8", "replace")
        assert status == 200
        assert "TensorBoard" in body
    finally:
        cluster.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
    assert _read_nodes(tmp_path).keys() == {"chief:0"}
    assert list(log_dir.glob("events.out.tfevents.*"))


def test_driver_ps_nodes(sc, tmp_path, no_leftovers):
    cluster = TFCluster.run(sc, driver_ps_main, {"out": str(tmp_path)}, 3, 1, False,
                            TFCluster.InputMode.TENSORFLOW, driver_ps_nodes=True, reservation_timeout=120)
    assert cluster.cluster_template == {"ps": [0], "worker": [1, 2]}
    info = {f"{n['job_name']}:{n['task_index']}": n for n in cluster.cluster_info}
    cluster.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
    found = _read_nodes(tmp_path)
    assert set(found) == {"ps:0", "worker:0", "worker:1"}
    # TF process -> supervisor -> its launcher: the driver itself for the ps, a PySpark
    # worker of an executor for the workers
    driver_pid = os.getpid()
    assert found["ps:0"]["ancestors"][1] == driver_pid, "the ps does not run on the driver"
    for w in ("worker:0", "worker:1"):
        assert found[w]["ancestors"][1] != driver_pid, f"{w} runs on the driver, not on an executor"
        assert found[w]["spec"] == found["ps:0"]["spec"]
    assert "driver" in info["ps:0"]["executor_key"]
    assert info["worker:0"]["executor_key"] != info["worker:1"]["executor_key"]
    # the driver-hosted ps supervisor exited cleanly (it used to abort at interpreter exit)
    assert [p.returncode for p in cluster._ctl.backend.runtime.local_nodes] == [0]


def test_tensorboard_relative_log_dir_is_ctx_absolute_path(sc, tmp_path, monkeypatch, no_leftovers):
    """A relative log_dir resolves as ctx.absolute_path does (the driver's working
    directory), so TensorBoard reads where main_fun writes ctx.absolute_path(log_dir); it
    used to resolve against the executor's directory and showed nothing."""
    import json as _json

    monkeypatch.chdir(tmp_path)
    cluster = TFCluster.run(sc, tensorboard_main, {"out": str(tmp_path), "log_dir": str(tmp_path / "tb_rel")}, 2, 0, True,
                            TFCluster.InputMode.TENSORFLOW, log_dir="tb_rel", master_node="chief", reservation_timeout=120)
    try:
        url = cluster.tensorboard_url(timeout_s=150.0)
        assert url is not None, "TensorBoard did not start"
        with urllib.request.urlopen(url.rstrip("/") + "/data/environment", timeout=30) as resp:
            env = _json.loads(resp.read().decode("utf-8"))
        assert env["data_location"] == str(tmp_path / "tb_rel"), env
    finally:
        cluster.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
