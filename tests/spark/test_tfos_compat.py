"""TFoS-style programs on a real Spark (shared ``local-cluster[2,1,1024]``), one per TFoS API
area: ctx attributes and path mapping, TFNode/DataFeed inference shapes, TF1 and Keras
export, TFParallel with ``map_fn=``, TFCluster attributes, TFSparkNode + reservation on
executors. Nodes write what they saw as JSON into ``tmp_path``; the tests assert it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from tfos import TFCluster, TFNode, TFParallel, TFSparkNode, reservation
from tfos.errors import ConfigurationError

pytestmark = [pytest.mark.spark, pytest.mark.tf, pytest.mark.timeout(420)]

SHUTDOWN_TIMEOUT_S = 240.0


def _dump(path: str, obj) -> None:
    import json
    import os

    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def _records(out: Path, prefix: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob(f"{prefix}*.json"))]


# ------------------------------------------------------- ctx, paths, TF1 + Keras export
def tfos_style_main(args, ctx):
    """A TFoS main_fun: reads ctx the TFoS way, maps a relative model_dir, exports."""
    import os
    import sys

    from tfos import TFNode

    model_dir = ctx.absolute_path(args["model_dir"])  # relative: same folder on every node
    local = model_dir[len("file://"):]
    os.makedirs(local, exist_ok=True)
    with open(os.path.join(local, f"from_{ctx.job_name}_{ctx.task_index}"), "w") as f:
        f.write(str(ctx.worker_num))
    rec = {
        "executor_id": ctx.executor_id, "worker_num": ctx.worker_num, "job_name": ctx.job_name,
        "task_index": ctx.task_index, "num_workers": ctx.num_workers, "cluster_spec": ctx.cluster_spec,
        "defaultFS": ctx.defaultFS, "working_dir": ctx.working_dir, "cwd": os.getcwd(),
        "model_dir": model_dir, "hdfs_path": TFNode.hdfs_path(ctx, args["model_dir"]),
        "tmp_socket_released": ctx.tmp_socket is None, "legacy_env": os.environ.get("TF_USE_LEGACY_KERAS"),
        "tf_preloaded": "tensorflow" in sys.modules,
    }
    import tensorflow as tf

    rec["tf_keras_module"] = type(tf.keras.layers.Dense(1)).__module__
    import keras

    rec["keras_version"] = keras.__version__
    if ctx.job_name == "chief":
        # TFoS's TF1 form: ctx.export_saved_model(sess, export_dir, tag_set, signatures)
        g = tf.Graph()
        with g.as_default():
            x = tf.compat.v1.placeholder(tf.float32, [None, 2], name="x")
            w = tf.compat.v1.get_variable("w", initializer=tf.constant([[2.0], [3.0]]))
            y = tf.matmul(x, w, name="y")
            with tf.compat.v1.Session(graph=g) as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                ctx.export_saved_model(sess, args["tf1_export"], "serve", {"serving_default": {"inputs": {"x": x}, "outputs": {"y": y}}})
    # the (model, export_dir, is_chief) form, every worker calling it
    model = tf.keras.Sequential([tf.keras.Input((2,)), tf.keras.layers.Dense(1, kernel_initializer="ones")])
    ctx.export_saved_model(model, args["keras_export"])
    _dump(os.path.join(args["out"], f"node_{ctx.executor_id}.json"), rec)


def test_tfos_program_ctx_paths_and_exports(sc, tmp_path, no_leftovers, monkeypatch):
    monkeypatch.delenv("TF_USE_LEGACY_KERAS", raising=False)
    monkeypatch.chdir(tmp_path)  # the driver's working directory: relative paths land here
    args = {"out": str(tmp_path), "model_dir": "rel/model", "tf1_export": str(tmp_path / "tf1"), "keras_export": str(tmp_path / "keras")}
    cluster = TFCluster.run(sc, tfos_style_main, args, 2, 0, False, TFCluster.InputMode.TENSORFLOW, master_node="chief", reservation_timeout=120)
    meta = cluster.cluster_meta
    assert meta["id"] == cluster.cluster_id and meta["working_dir"] == str(tmp_path) and meta["num_executors"] == 2
    assert meta["cluster_template"] == {"chief": [0], "worker": [1]} and len(meta["server_addr"]) == 2
    assert cluster.nodeRDD is not None and cluster.server is not None and TFCluster.tf_status == {}
    cluster.shutdown(timeout=SHUTDOWN_TIMEOUT_S)

    recs = {r["job_name"]: r for r in _records(tmp_path, "node_")}
    assert set(recs) == {"chief", "worker"}
    expected_dir = f"file://{tmp_path}/rel/model"
    for job, r in recs.items():
        assert r["worker_num"] == r["executor_id"] == {"chief": 0, "worker": 1}[job]
        assert r["num_workers"] == 2 and r["defaultFS"] == "file://" and r["tmp_socket_released"]
        assert r["working_dir"] == str(tmp_path)  # the driver's, as in TFoS
        assert r["model_dir"] == r["hdfs_path"] == expected_dir
        # Keras default: tf.keras is Keras 3 in the TF process, as `import keras` is
        # (TF_USE_LEGACY_KERAS=1 on the driver or the executors selects tf_keras)
        assert r["legacy_env"] is None and r["tf_keras_module"].startswith("keras") and not r["tf_preloaded"]
        assert int(r["keras_version"].split(".")[0]) >= 3
    # the executors' own working directories differ, the mapped folder is one
    assert recs["chief"]["cwd"] != recs["worker"]["cwd"]
    assert sorted(os.listdir(tmp_path / "rel" / "model")) == ["from_chief_0", "from_worker_0"]

    import tensorflow as tf

    tf1 = tf.saved_model.load(str(tmp_path / "tf1"), tags=["serve"])
    out = tf1.signatures["serving_default"](x=tf.constant([[1.0, 1.0], [2.0, 0.0]]))
    assert np.allclose(out["y"].numpy().ravel(), [5.0, 4.0])
    k = tf.saved_model.load(str(tmp_path / "keras"))
    res = list(k.signatures["serving_default"](tf.constant([[1.0, 2.0]])).values())[0]
    assert np.allclose(res.numpy(), [[3.0]])


# ------------------------------------------------------------------ batch_results
def square_inference_main(args, ctx):
    """TFoS's test_inputmode_spark main_fun: numpy results go back as numpy."""
    import tensorflow as tf

    from tfos import TFNode

    feed = TFNode.DataFeed(ctx.mgr, False)
    assert feed.mgr is ctx.mgr and feed.qname_in == "input"
    while not feed.should_stop():
        batch = feed.next_batch(batch_size=10)
        if not batch:
            continue
        squares = tf.math.square(batch).numpy()
        feed.batch_results(squares if args["shape"] == "2d" else squares.reshape(-1))


@pytest.mark.parametrize("shape", ["2d", "1d"])
def test_batch_results_keep_numpy_rows_and_scalars(sc, shape, no_leftovers):
    rdd = sc.parallelize([[x] for x in range(100)], 4)
    cluster = TFCluster.run(sc, square_inference_main, {"shape": shape}, 2, 0, input_mode=TFCluster.InputMode.SPARK)
    out = cluster.inference(rdd).collect()
    assert rdd.map(lambda r: r).count() == 100
    cluster.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
    if shape == "2d":
        assert all(isinstance(r, np.ndarray) and r.shape == (1,) for r in out)
        assert [int(r[0]) for r in out] == [x * x for x in range(100)]
        assert int(sum(out)[0]) == sum(x * x for x in range(100))  # TFoS's rdd_out.sum()
    else:
        assert all(isinstance(r, np.integer) for r in out)
        assert [int(r) for r in out] == [x * x for x in range(100)]


# -------------------------------------------------------------------- TFParallel
def parallel_main(args, ctx):
    import os

    _dump(os.path.join(args["out"], f"par_{ctx.worker_num}.json"), {"worker_num": ctx.worker_num, "executor_id": ctx.executor_id, "num_workers": ctx.num_workers, "tf_config": os.environ.get("TF_CONFIG")})


def test_tfparallel_map_fn_keyword(sc, tmp_path, no_leftovers):
    assert TFParallel.run(sc, map_fn=parallel_main, tf_args={"out": str(tmp_path)}, num_executors=2) is None
    recs = _records(tmp_path, "par_")
    assert [(r["worker_num"], r["executor_id"], r["num_workers"], r["tf_config"]) for r in recs] == [(0, 0, 2, None), (1, 1, 2, None)]


def test_tfcluster_tf_status_records_a_failed_run(sc):
    with pytest.raises(ConfigurationError):
        TFCluster.run(sc, parallel_main, {}, 2, 0, queues="input")
    assert "ConfigurationError" in TFCluster.tf_status["error"]


# -------------------------------------------------- TFSparkNode + reservation on executors
def sparknode_main(args, ctx):
    import json
    import os

    _dump(os.path.join(args["out"], f"sn_{ctx.executor_id}.json"), {
        "job": ctx.job_name, "index": ctx.task_index, "spec": ctx.cluster_spec,
        "tf_config": json.loads(os.environ["TF_CONFIG"]), "mgr_state": str(ctx.mgr.get("state")),
    })


def test_tfsparknode_run_with_reservation_server(sc, tmp_path):
    server = reservation.Server(2)
    addr = server.start()
    meta = {"id": 1234, "cluster_template": {"chief": [0], "worker": [1]}, "num_executors": 2, "default_fs": "file://",
            "working_dir": str(tmp_path), "server_addr": addr, "release_port": True}
    try:
        sc.parallelize(range(2), 2).barrier().mapPartitions(
            lambda it: TFSparkNode.run(sparknode_main, {"out": str(tmp_path)}, meta, False, None, ["input"], False)(it) or []
        ).collect()
        assert len(server.await_reservations(timeout=5)) == 2
    finally:
        server.stop()
    recs = _records(tmp_path, "sn_")
    assert [(r["job"], r["index"]) for r in recs] == [("chief", 0), ("worker", 0)]
    assert recs[0]["spec"] == recs[1]["spec"] and set(recs[0]["spec"]) == {"chief", "worker"}
    assert recs[1]["tf_config"]["task"] == {"type": "worker", "index": 0}
    assert all(r["mgr_state"] == "'running'" for r in recs)
