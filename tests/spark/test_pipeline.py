"""Spark ML pipeline API (``TFEstimator``/``TFModel``) and ``TFParallel.run`` on a real Spark
(shared ``local-cluster[2,1,1024]``).

Node functions write what they saw as JSON into a pytest ``tmp_path`` (the executors run on
this machine) and the tests assert those values.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest
from feed_gate import after_started, mark_started, started_at

from tfos import TFParallel
from tfos.errors import ClusterFailedError
from tfos.pipeline import TFEstimator, TFModel

pytestmark = [pytest.mark.spark, pytest.mark.tf, pytest.mark.timeout(300)]

#: True weights and bias of the synthetic regression ``label = features @ W + B``.
W = [1.0, -2.0, 0.5, 3.0]
B = -0.5


# --------------------------------------------------------------------------
# Functions shipped by value to the node processes
# --------------------------------------------------------------------------


def _write_json(path: str, obj) -> None:
    """Writes ``obj`` as JSON atomically (TF process)."""
    import json as _json
    import os as _os

    tmp = f"{path}.tmp{_os.getpid()}"
    with open(tmp, "w") as f:
        _json.dump(obj, f)
    _os.replace(tmp, path)


def regression_train_fn(args, ctx):
    """Reads every fed row, then trains ``Dense(1)`` under MultiWorkerMirroredStrategy and
    exports a SavedModel with signature ``serving_default: features -> prediction``.

    All rows are read *before* training: the two workers run in lock-step (collectives),
    and a worker whose feed ended first would otherwise block the other one's feed (see
    test_feed_cases C12). Both then run the same fixed number of steps.
    """
    import os as _os

    _os.environ["TF_USE_LEGACY_KERAS"] = "1"
    import numpy as _np
    import tensorflow as tf
    import tf_keras as keras

    from tfos import TFNode, compat

    feed = TFNode.DataFeed(ctx.mgr, input_mapping=args.input_mapping)
    xs, ys, first_keys = [], [], None
    while not feed.should_stop():
        batch = feed.next_batch(args.batch_size)
        if first_keys is None and batch["features"]:
            first_keys = sorted(batch)
        xs.extend(batch["features"])
        ys.extend(batch["label"])
    rows = len(xs)
    if rows:
        x = _np.asarray(xs, _np.float32).reshape(rows, 4)
        y = _np.asarray(ys, _np.float32)
        w = _np.ones(rows, _np.float32)
    else:  # no partition reached this node: zero-weight padding keeps the collectives in step
        x, y, w = _np.zeros((1, 4), _np.float32), _np.zeros(1, _np.float32), _np.zeros(1, _np.float32)

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.layers.Dense(1, input_shape=(4,))])
        model.compile(optimizer=keras.optimizers.SGD(args.lr), loss="mse")
    opts = tf.data.Options()
    opts.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    ds = tf.data.Dataset.from_tensor_slices((x, y, w)).repeat().shuffle(256, seed=ctx.task_index).batch(args.batch_size)
    hist = model.fit(ds.with_options(opts), epochs=3, steps_per_epoch=args.train_steps // 3, verbose=0)
    kernel, bias = model.get_weights()

    class Serving(tf.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net

        @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32, name="features")])
        def serve(self, features):
            return {"prediction": tf.squeeze(self.net(features), axis=-1)}

    compat.export_saved_model(Serving(model), args.export_dir, is_chief=ctx.job_name == "chief")
    _write_json(
        _os.path.join(args.out, f"{ctx.job_name}_{ctx.task_index}.json"),
        {
            "rows": rows, "keys": first_keys, "loss": hist.history["loss"][-1],
            "weights": [float(v) for v in kernel.ravel()] + [float(bias[0])],
            "epochs": args.epochs, "cluster_size": args.cluster_size, "feed_timeout": args.feed_timeout,
        },
    )


def stop_consuming_train_fn(args, ctx):
    """Never reads the feed: sleeps until the driver stops the node."""
    mark_started(args.out, ctx)
    ctx.stop_event.wait(300)


def parallel_map_fun(args, ctx):
    """TFParallel instance: records its identity, environment and file shard."""
    import os as _os

    from tfos import TFNode

    if ctx.task_index in args.get("fail", ()):
        raise RuntimeError(f"boom from instance {ctx.task_index}")
    _write_json(
        _os.path.join(args["out"], f"instance_{ctx.task_index}.json"),
        {
            "executor_id": ctx.executor_id, "task_index": ctx.task_index, "job_name": ctx.job_name,
            "pid": _os.getpid(), "tf_config": "TF_CONFIG" in _os.environ,
            "shard": TFNode.shard_files(ctx, args["pattern"]),
        },
    )


# --------------------------------------------------------------------------
# Helpers (driver)
# --------------------------------------------------------------------------


def _regression_schema_data(rows: int):
    """Rows and schema ``features: array<float>[4], label: float`` with ``label = features @ W + B``."""
    from pyspark.sql.types import ArrayType, FloatType, StructField, StructType

    x = np.random.default_rng(7).normal(size=(rows, 4)).astype(np.float32)
    y = x @ np.asarray(W, np.float32) + np.float32(B)
    schema = StructType([StructField("features", ArrayType(FloatType(), False)), StructField("label", FloatType())])
    return [([float(v) for v in x[i]], float(y[i])) for i in range(rows)], schema


def _read(out_dir: Path, prefix: str) -> dict:
    return {p.stem: json.loads(p.read_text()) for p in sorted(out_dir.glob(f"{prefix}*.json"))}


# --------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------


def test_estimator_fit_then_model_transform(sc, tmp_path, no_leftovers):
    """TFEstimator trains a linear regression on 2 nodes (3 epochs fed from a DataFrame),
    the chief exports a SavedModel, and TFModel.transform predicts every row accurately."""
    from pyspark.sql import SparkSession

    spark = SparkSession(sc)
    rows, parts, epochs = 256, 4, 3
    df = spark.createDataFrame(*_regression_schema_data(rows)).repartition(parts).cache()
    export_dir = str(tmp_path / "export")
    out = tmp_path / "out"
    out.mkdir()
    est = (
        TFEstimator(regression_train_fn, {"lr": 0.1, "train_steps": 60, "out": str(out)})
        .setInputMapping({"features": "features", "label": "label"})
        .setClusterSize(2)
        .setEpochs(epochs)
        .setBatchSize(32)
        .setExportDir(export_dir)
        .setGraceSecs(0)
    )
    t0 = time.monotonic()
    model = est.fit(df)
    fit_s = time.monotonic() - t0
    assert isinstance(model, TFModel)
    assert model.getExportDir() == export_dir
    assert model.getBatchSize() == 32
    reports = _read(out, "")
    assert sorted(reports) == ["chief_0", "worker_0"], reports
    # Every row of every epoch reached exactly one node, as {tensor: [values]} batches.
    assert sum(r["rows"] for r in reports.values()) == rows * epochs, reports
    for r in reports.values():
        assert r["keys"] in (None, ["features", "label"]), r
        assert (r["epochs"], r["cluster_size"], r["feed_timeout"]) == (epochs, 2, 600.0), r
        assert r["loss"] < 0.01, r
        np.testing.assert_allclose(r["weights"], W + [B], atol=0.05)
    # MultiWorkerMirroredStrategy kept the two replicas identical.
    assert reports["chief_0"]["weights"] == reports["worker_0"]["weights"]
    assert (Path(export_dir) / "saved_model.pb").exists()
    assert fit_s < 240, fit_s

    preds = model.setInputMapping({"features": "features"}).setOutputMapping({"prediction": "pred"}).transform(df)
    assert preds.schema.simpleString() == "struct<pred:double>"  # from the signature's output spec
    got = np.asarray([r.pred for r in preds.collect()], np.float64)
    expected = np.asarray([r.label for r in df.select("label").collect()], np.float64)
    assert got.shape == (rows,)
    mse = float(np.mean((got - expected) ** 2))
    assert mse < 0.01, mse
    # An empty input gives an empty DataFrame of the same schema (no rows to infer it from).
    empty = model.transform(df.limit(0))
    assert empty.schema == preds.schema and empty.count() == 0


def test_pipeline_model_save_load_same_predictions(sc, tmp_path, no_leftovers):
    """``Pipeline([SQLTransformer, TFEstimator]).fit(df)`` trains on 2 nodes; the fitted
    ``PipelineModel`` (Java stage + TFModel) is saved, loaded with ``PipelineModel.load`` and
    gives exactly the same predictions; every param (set or default), uid and args of both
    the fitted TFModel and the unfitted estimator survive, also when loaded alone."""
    from pyspark.ml import Pipeline, PipelineModel
    from pyspark.ml.feature import SQLTransformer
    from pyspark.sql import SparkSession

    spark = SparkSession(sc)
    rows, parts = 128, 4
    data, schema = _regression_schema_data(rows)
    df = spark.createDataFrame(data, schema).selectExpr("features", "label", "label * 2 AS unused").repartition(parts).cache()
    out = tmp_path / "out"
    out.mkdir()
    export_dir = str(tmp_path / "export")
    prep = SQLTransformer(statement="SELECT features, label FROM __THIS__")
    est = (
        TFEstimator(regression_train_fn, {"lr": 0.1, "train_steps": 30, "out": str(out)})
        .setInputMapping({"features": "features", "label": "label"}).setClusterSize(2).setBatchSize(32)
        .setExportDir(export_dir).setGraceSecs(0).setFeedTimeout(300)
    )
    pipeline = Pipeline(stages=[prep, est])
    # The unfitted pipeline round-trips (the estimator's train_fn is cloudpickled).
    pipeline.write().overwrite().save(str(tmp_path / "pipeline"))
    est_back = Pipeline.load(str(tmp_path / "pipeline")).getStages()[1]
    assert type(est_back) is TFEstimator and est_back.uid == est.uid
    assert _param_values(est_back) == _param_values(est)
    assert vars(est_back.args) == vars(est.args)
    assert est_back.train_fn.__name__ == "regression_train_fn"

    fitted = pipeline.fit(df)
    model = fitted.stages[1]
    assert isinstance(model, TFModel) and model.getExportDir() == export_dir
    model.setInputMapping({"features": "features"}).setOutputMapping({"prediction": "pred"}).setSignatureDefKey("serving_default")
    before = [r.pred for r in fitted.transform(df).collect()]
    assert len(before) == rows and all(isinstance(v, float) for v in before)

    path = str(tmp_path / "pipeline_model")
    fitted.write().overwrite().save(path)
    loaded = PipelineModel.load(path)
    assert [type(s).__name__ for s in loaded.stages] == ["SQLTransformer", "TFModel"]
    model_back = loaded.stages[1]
    assert model_back.uid == model.uid and _param_values(model_back) == _param_values(model)
    assert vars(model_back.args) == vars(model.args)
    after = [r.pred for r in loaded.transform(df).collect()]
    assert after == before  # same SavedModel, same rows: bit-identical

    # Each stage loads alone too; a TFModel with JSON args has no pickled code.
    stage_dirs = sorted((Path(path) / "stages").iterdir())
    alone = TFModel.load(str(stage_dirs[1]))
    assert alone.uid == model.uid and _param_values(alone) == _param_values(model)
    assert not (stage_dirs[1] / "code").exists()
    assert [r.pred for r in alone.transform(df).collect()] == before
    est_dir = sorted((tmp_path / "pipeline" / "stages").iterdir())[1]
    assert (est_dir / "code").exists()
    assert _param_values(TFEstimator.load(str(est_dir))) == _param_values(est)


def _param_values(stage) -> dict:
    """``{param name: (is set, value)}`` of every param of ``stage``."""
    return {p.name: (stage.isSet(p), stage.getOrDefault(p) if stage.isDefined(p) else None) for p in stage.params}


def test_c17_estimator_feed_timeout_names_node_and_partition(sc, tmp_path, no_leftovers):
    """C17: a train_fn that stops consuming, with setFeedTimeout(3): fit() fails within a
    minute of train_fn's start with the FeedTimeoutError text (node, partition, "accepted
    no data") inside the ClusterFailedError, and every node process is gone. The rows go
    out once train_fn runs (tests/spark/feed_gate.py): before, on a loaded machine the
    3 s ran out while the node was still importing the estimator's modules."""
    from pyspark.sql import SparkSession

    spark = SparkSession(sc)
    out = str(tmp_path)
    # 2 partitions of 40 x 1 MiB rows: far more than the node's queue plus the socket
    # buffers hold, so the feed task blocks sending.
    rows = sc.parallelize(range(2), 2).flatMap(
        lambda p: after_started(out, 1, (("x" * 1048576, float(40 * p + i)) for i in range(40))))
    df = spark.createDataFrame(rows, "blob string, label float")
    est = TFEstimator(stop_consuming_train_fn, {"out": out}).setInputMapping({"blob": "blob", "label": "label"}).setFeedTimeout(3)
    assert est.getFeedTimeout() == 3.0
    with pytest.raises(ClusterFailedError) as info:
        est.fit(df)
    elapsed = time.time() - started_at(out)
    assert elapsed < 60, elapsed
    text = str(info.value)
    assert "during train()" in text, text
    assert re.search(
        r"chief:0 \(executor 0, host [^)]+\) accepted no data for 3 s while feeding partition [01] \(epoch 0\) "
        r"-> chief:0 \(executor 0, host [^)]+\): main_fun is not reading queue 'input'",
        text,
    ), text
    assert info.value.failures[0].kind == "feed", info.value.failures
    # The stack starts at the user's train_fn: the estimator's own frames are tfos's.
    assert re.search(r"innermost call last:\n"
                     r'  File "[^"]*test_pipeline\.py", line \d+, in stop_consuming_train_fn\n'
                     r"    ctx\.stop_event\.wait\(300\)\n", text), text


def test_tfparallel_runs_independent_instances(sc, tmp_path, no_leftovers):
    """TFParallel.run: 2 instances in different processes, executors 0 and 1, without
    TF_CONFIG, and shard_files splits the input files disjointly and completely."""
    data = tmp_path / "data"
    data.mkdir()
    files = sorted(str(data / f"part-{i:05d}.txt") for i in range(5))
    for f in files:
        Path(f).write_text("x\n")
    out = tmp_path / "out"
    out.mkdir()
    t0 = time.monotonic()
    assert TFParallel.run(sc, parallel_map_fun, {"out": str(out), "pattern": str(data / "*.txt")}, 2) is None
    elapsed = time.monotonic() - t0
    recs = _read(out, "instance_")
    assert sorted(recs) == ["instance_0", "instance_1"], recs
    a, b = recs["instance_0"], recs["instance_1"]
    assert (a["executor_id"], a["task_index"], a["job_name"]) == (0, 0, "worker")
    assert (b["executor_id"], b["task_index"], b["job_name"]) == (1, 1, "worker")
    assert a["pid"] != b["pid"] and os.getpid() not in (a["pid"], b["pid"])
    assert a["tf_config"] is False and b["tf_config"] is False
    assert a["shard"] == files[0::2] and b["shard"] == files[1::2]
    assert not set(a["shard"]) & set(b["shard"])
    assert sorted(a["shard"] + b["shard"]) == files
    assert elapsed < 120, elapsed


def test_tfparallel_failing_instance_raises(sc, tmp_path, no_leftovers):
    """A failing TFParallel instance makes run() raise ClusterFailedError naming it, with
    its remote traceback (the other instance is stopped, as a failed barrier stage would be)."""
    data = tmp_path / "data"
    data.mkdir()
    for i in range(2):
        (data / f"f{i}.txt").write_text("x\n")
    out = tmp_path / "out"
    out.mkdir()
    t0 = time.monotonic()
    with pytest.raises(ClusterFailedError) as info:
        TFParallel.run(sc, parallel_map_fun, {"out": str(out), "pattern": str(data / "*.txt"), "fail": [1]}, 2)
    elapsed = time.monotonic() - t0
    text = str(info.value)
    assert "worker:1 (executor 1" in text, text
    assert "RuntimeError: boom from instance 1" in text, text
    assert "Traceback" in text and "parallel_map_fun" in text, text
    # the instance's traceback names this file and shows the failing line; the error says
    # what the caller called
    assert f'File "{__file__}", line' in text and 'raise RuntimeError(f"boom from instance {ctx.task_index}")' in text, text
    assert re.match(r"tfos cluster \S+ failed during TFParallel\.run\(\): 1 node\(s\)", text), text
    assert [(f.executor_id, f.kind, f.error_type) for f in info.value.failures] == [(1, "exception", "RuntimeError")], info.value.failures
    assert "instance_1" not in _read(out, "instance_")
    assert elapsed < 120, elapsed


def test_model_transform_reshapes_flat_spark_arrays_to_the_signature_shape(sc, tmp_path):
    """Spark columns hold flat arrays: TFModel reshapes a row of 4 values to a
    ``(None, 2, 2, 1)`` signature input, as TFoS did (new-user trial, session 17: TFoS's
    keras/mnist_pipeline.py crashed the Python worker in a Conv2D). A row of another length
    gets an error naming the column, the input and both shapes."""
    import tensorflow as tf
    from pyspark.sql import SparkSession

    class Weighted(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec((None, 2, 2, 1), tf.float32, name="image")])
        def serve(self, image):
            w = tf.constant([[[1.0], [10.0]], [[100.0], [1000.0]]])
            return {"score": tf.reduce_sum(image * w, axis=[1, 2, 3])}

    module = Weighted()
    export_dir = str(tmp_path / "export")
    tf.saved_model.save(module, export_dir, signatures={"serving_default": module.serve})
    spark = SparkSession(sc)
    rows = [([float(i), float(i + 1), float(i + 2), float(i + 3)],) for i in range(50)]
    df = spark.createDataFrame(rows, "pixels array<float>").repartition(3)
    model = TFModel().setExportDir(export_dir).setInputMapping({"pixels": "image"}).setOutputMapping({"score": "score"}).setBatchSize(7)
    got = sorted(r.score for r in model.transform(df).collect())
    assert got == sorted(i + 10 * (i + 1) + 100 * (i + 2) + 1000 * (i + 3) for i in range(50))

    bad = spark.createDataFrame([([1.0, 2.0, 3.0],)], "pixels array<float>")
    with pytest.raises(Exception) as info:
        model.transform(bad).collect()
    assert ("TFModel: column 'pixels' holds rows of shape (3,) (3 values), but signature input 'image' "
            "takes rows of shape (2, 2, 1)") in str(info.value), str(info.value)[-3000:]
