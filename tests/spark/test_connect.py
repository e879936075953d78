"""TFCluster.run on a Spark Connect session (``SparkSession.builder.remote("local[2]")`` and
``remote("local-cluster[2,1,1024]")``).

``remote("local[...]")`` starts a Spark Connect server inside this test process's JVM
(one SparkContext per JVM), so the module first stops the classic ``sc`` fixture's context
and stops the Connect server (and its SparkContext) at the end; the next classic test
starts a fresh ``sc``. Nodes write what they saw as JSON into ``tmp_path``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import warnings
from pathlib import Path

import pytest

for _mod in ("grpc", "grpc_status", "google.rpc", "zstandard", "pyarrow", "pandas"):
    pytest.importorskip(_mod, reason="the Spark Connect client needs pip install tfos[connect]")

from tfos import TFCluster
from tfos.cluster_template import InputMode
from tfos.errors import ClusterFailedError, ConfigurationError, ReservationTimeoutError

from conftest import assert_no_tfos_processes

pytestmark = [pytest.mark.spark, pytest.mark.timeout(600)]

#: Longest wait, in seconds, for main_fun in shutdown(); a hang fails the test.
SHUTDOWN_TIMEOUT_S = 240.0


def _connect_host_processes() -> list:
    import psutil

    session = os.environ["TFOS_TEST_SESSION"]
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info.get("cmdline") or [])
        if "tfos._connect.control_host" in cmd:
            try:
                if p.environ().get("TFOS_TEST_SESSION") == session:
                    found.append((p.info["pid"], cmd))
            except psutil.Error:
                continue
    return found


def _assert_all_gone(timeout_s: float = 30.0) -> None:
    assert_no_tfos_processes(timeout_s)
    deadline = time.monotonic() + timeout_s
    while _connect_host_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _connect_host_processes(), f"control host left behind: {_connect_host_processes()}"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", params=["local[2]", "local-cluster[2,1,1024]"])
def spark(request, spark_manager):
    """A Spark Connect session on a local Connect server with 2 task slots: in the
    server's JVM (``local[2]``), or in 2 separate executor JVMs (``local-cluster``).

    The server listens on a free port, not Spark's default 15002, which another Connect
    server on this host may hold (``remote("local[...]")`` would then fail to start its
    own, or its client would reach the other one). The JVM is started fresh for the
    server and ended afterwards (also when the server fails to start), so no later
    classic context inherits the server's launch settings."""
    from pyspark.sql import SparkSession
    from pyspark.sql.connect.client import DefaultChannelBuilder

    spark_manager.discard_jvm()  # the Connect server below needs this JVM's only SparkContext
    port = _free_port()
    try:
        with warnings.catch_warnings(), pytest.MonkeyPatch.context() as mp:
            # Static confs are applied when the local server starts; the client then warns
            # that it cannot set them at run time.
            warnings.simplefilter("ignore", UserWarning)
            # remote("local[...]") connects its client to sc://localhost on the default port
            mp.setattr(DefaultChannelBuilder, "default_port", staticmethod(lambda: port))
            session = (
                SparkSession.builder.remote(request.param)
                .config("spark.connect.grpc.binding.port", str(port))
                .config("spark.executor.memory", "768m")
                .config("spark.ui.enabled", "false")
                .config("spark.ui.showConsoleProgress", "false")
                .config("spark.driver.host", "127.0.0.1")
                .getOrCreate()
            )
        assert type(session).__module__.startswith("pyspark.sql.connect")
        assert session.client._builder.endpoint == f"localhost:{port}"
    except BaseException:
        for name in ("SPARK_LOCAL_REMOTE", "SPARK_CONNECT_MODE_ENABLED"):
            os.environ.pop(name, None)
        spark_manager.discard_jvm()
        raise
    yield session
    session.stop()
    assert "SPARK_CONNECT_MODE_ENABLED" not in os.environ
    spark_manager.discard_jvm()


# ------------------------------------------------------------------ main_funs
def _write_json(path: str, obj) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def tf_mode_fun(args, ctx):
    """InputMode.TENSORFLOW: records the node's view (its start task's TaskContext and a
    file shipped with spark.addArtifacts(..., file=True) included) and returns."""
    from pyspark import SparkFiles, TaskContext

    tc = TaskContext.get()
    with open(SparkFiles.get(args["file"])) as f:
        shipped = f.read()
    with open(os.path.join(SparkFiles.get(args["archive"]), "inside.txt")) as f:
        shipped += " + " + f.read()
    shipped += " + " + __import__(args["module"]).WORD
    _write_json(os.path.join(args["out"], f"{ctx.job_name}{ctx.task_index}.json"), {
        "job": ctx.job_name, "index": ctx.task_index, "executor_id": ctx.executor_id,
        "tf_config": json.loads(os.environ["TF_CONFIG"]), "pid": os.getpid(), "file": shipped,
        "task": [tc.partitionId(), tc.stageId() >= 0, tc.attemptNumber(), sorted(tc.resources())],
    })


def spark_mode_fun(args, ctx):
    """InputMode.SPARK: trains on queue 'input' (count and checksum), serves inference on
    queue 'infer' from a thread, until shutdown() ends the feed."""
    import threading

    from tfos.datafeed import DataFeed

    def serve() -> None:
        feed = DataFeed(ctx.mgr, train_mode=False, qname_in="infer")
        while not feed.should_stop():
            rows = feed.next_batch(37)
            if rows:
                feed.batch_results([(int(r[0]), int(r[0]) * int(r[0])) for r in rows])

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    feed = DataFeed(ctx.mgr, train_mode=True)
    count = total = check = 0
    while not feed.should_stop():
        for r in feed.next_batch(64):
            count += 1
            total += int(r[0])
            check += int(r[1])
    t.join(60)
    _write_json(os.path.join(args["out"], f"{ctx.job_name}{ctx.task_index}.json"), {"count": count, "sum": total, "check": check})


def failing_fun(args, ctx):
    """worker:1 raises at once; worker:0 would run for minutes if nothing stopped it."""
    import time

    if ctx.task_index == 1:
        raise ValueError("boom on purpose in worker 1")
    time.sleep(300)


def failing_feed_fun(args, ctx):
    """InputMode.SPARK: raises after its first batch."""
    from tfos.datafeed import DataFeed

    feed = DataFeed(ctx.mgr, train_mode=True)
    feed.next_batch(10)
    raise RuntimeError(f"bad batch on purpose in {ctx.job_name}:{ctx.task_index}")


def read_ten_and_return_fun(args, ctx):
    """InputMode.SPARK: reads 10 rows and returns without DataFeed.terminate() (C02)."""
    from tfos.datafeed import DataFeed

    rows = DataFeed(ctx.mgr, train_mode=True).next_batch(10)
    _write_json(os.path.join(args["out"], f"{ctx.job_name}{ctx.task_index}.json"), {"rows": len(rows)})


def rows_to_pickle_fun(args, ctx):
    """InputMode.SPARK: pickles every row it reads to ``<out>/<node>.pkl``."""
    import pickle

    from tfos.datafeed import DataFeed

    feed = DataFeed(ctx.mgr, train_mode=True)
    rows: list = []
    while not feed.should_stop():
        rows.extend(feed.next_batch(5))
    with open(os.path.join(args["out"], f"{ctx.job_name}{ctx.task_index}.pkl"), "wb") as f:
        pickle.dump(rows, f)


# ---------------------------------------------------------------------- tests
def test_tensorflow_mode(spark, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="tfos")
    import zipfile

    tag = time.monotonic_ns()
    shipped, archive = tmp_path / f"shipped-{tag}.txt", tmp_path / f"archive-{tag}.zip"
    shipped.write_text("shipped with addArtifacts")
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("inside.txt", "unpacked")
    module = tmp_path / f"tfos_shipped_module_{tag}.py"
    module.write_text('WORD = "imported"\n')
    spark.addArtifacts(str(shipped), file=True)
    spark.addArtifacts(str(archive), archive=True)
    spark.addArtifacts(str(module), pyfile=True)
    cluster = TFCluster.run(spark, tf_mode_fun, {"out": str(tmp_path), "file": shipped.name, "archive": archive.name,
                                                 "module": module.stem}, 2, 0,
                            input_mode=InputMode.TENSORFLOW, master_node="chief", reservation_timeout=180)
    assert cluster.sc is None
    spec = cluster.cluster_spec
    assert sorted(spec) == ["chief", "worker"] and len(spec["chief"]) == 1 and len(spec["worker"]) == 1
    cluster.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
    seen = {p.name: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    assert sorted(seen) == ["chief0.json", "worker0.json"]
    for name, node in seen.items():
        assert node["tf_config"]["cluster"] == spec
        assert node["tf_config"]["task"] == {"type": node["job"], "index": node["index"]}
    assert {n["executor_id"] for n in seen.values()} == {0, 1}
    # main_fun reads its start task's TaskContext and the session's files (docs/connect.md)
    assert sorted(n["task"][0] for n in seen.values()) == [0, 1]
    assert all(n["task"][1:] == [True, 0, []] and n["file"] == "shipped with addArtifacts + unpacked + imported" for n in seen.values()), seen
    # The server's Spark runs without spark.authenticate: the closures carrying the key can
    # be fetched from its block managers, and the client says so (once per application).
    keys = [r.getMessage() for r in caplog.records if "spark.authenticate is off" in r.getMessage()]
    assert len(keys) == 1 and "spark.authenticate=true" in keys[0], [r.getMessage() for r in caplog.records]
    _assert_all_gone()


def test_spark_mode_train_and_inference(spark, tmp_path):
    n = 1000
    df = spark.range(0, n, 1, 4).selectExpr("id", "id * 7 + 1 as y")
    with TFCluster.run(spark, spark_mode_fun, {"out": str(tmp_path)}, 2, 0, input_mode=InputMode.SPARK,
                       queues=["input", "infer"], reservation_timeout=180) as cluster:
        with pytest.raises(ConfigurationError, match="DataFrames only"):
            cluster.train([(1, 2)])
        with pytest.raises(ConfigurationError, match="a streaming DataFrame cannot be fed under Spark Connect"):
            cluster.train(spark.readStream.format("rate").load())
        cluster.train(df, num_epochs=2)
        infer_in = spark.range(0, 500, 1, 3).selectExpr("id as x")
        out = cluster.inference(infer_in, qname="infer", schema="x long, sq long")
        rows = out.collect()
        cluster.train(df, end_of_feed=True)  # a third epoch, then the end of every queue of the nodes
        with pytest.raises(ConfigurationError, match=r"inference\(\): the feed already ended"):
            cluster.inference(infer_in, qname="infer", schema="x long, sq long")
    # Inference: exactly one result per input row, in input order.
    assert [r["x"] for r in rows] == list(range(500))
    assert all(r["sq"] == r["x"] * r["x"] for r in rows)
    # Training: every row of both epochs reached exactly one node.
    seen = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("*.json"))]
    assert len(seen) == 2
    assert sum(s["count"] for s in seen) == 3 * n
    assert sum(s["sum"] for s in seen) == 3 * sum(range(n))
    assert sum(s["check"] for s in seen) == 3 * sum(7 * i + 1 for i in range(n))
    _assert_all_gone()


def test_failure_reaches_the_client_fast(spark, tmp_path):
    t0 = time.monotonic()
    with pytest.raises(ClusterFailedError) as ei:
        cluster = TFCluster.run(spark, failing_fun, {}, 2, 0, input_mode=InputMode.TENSORFLOW, reservation_timeout=180)
        cluster.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
    elapsed = time.monotonic() - t0
    text = str(ei.value)
    assert "worker:1" in text and "ValueError: boom on purpose in worker 1" in text
    assert "in failing_fun" in text  # the remote traceback
    # with the file name and the source line, shipped with main_fun as on the classic path
    assert f'File "{__file__}", line ' in text and 'raise ValueError("boom on purpose in worker 1")' in text
    assert [f.error_type for f in ei.value.failures if f.kind == "exception"] == ["ValueError"]
    # worker:0 sleeps 300 s: only failing fast ends this well before.
    assert elapsed < 200, f"the failure took {elapsed:.0f} s to reach the client"
    _assert_all_gone()


def test_feed_failure_names_the_node(spark, tmp_path):
    df = spark.range(0, 2000, 1, 4).selectExpr("id", "id as y")
    cluster = TFCluster.run(spark, failing_feed_fun, {}, 2, 0, input_mode=InputMode.SPARK, reservation_timeout=180)
    with pytest.raises(ClusterFailedError) as ei:
        cluster.train(df)
    text = str(ei.value)
    assert "RuntimeError: bad batch on purpose in worker:" in text
    assert any(f.kind == "exception" and f.error_type == "RuntimeError" for f in ei.value.failures)
    # TFoS's module-level status records it under Connect too (it stayed {}: break helper)
    assert TFCluster.tf_status["error"].startswith("ClusterFailedError: ") and "bad batch on purpose" in TFCluster.tf_status["error"]
    cluster.shutdown()  # already torn down: a no-op
    _assert_all_gone()


def test_results_that_do_not_fit_the_schema_are_the_error_shown(spark):
    """Results that do not fit schema=: the task's own error is the cause the client shows.
    On local-cluster Spark retried the task, tfos refused the retry, and only the refusal
    ("Spark retried the feed task") was listed (found by the new-user helper)."""
    df = spark.range(0, 100, 1, 2)
    with TFCluster.run(spark, echo_third_column_fun, {}, 2, 0, input_mode=InputMode.SPARK, reservation_timeout=180) as cluster:
        with pytest.raises(ClusterFailedError) as ei:
            cluster.inference(df.selectExpr("id", "id", "'text'"), schema="id long, fx double").collect()
    causes = [f for f in ei.value.failures if f.kind == "spark"]
    assert len(causes) >= 1, ei.value.failures
    f = causes[0]
    assert f.error_type == "TFOSError" and f.message.startswith("inference results do not fit the result schema"), f
    assert "in the Spark task of partition " in f.message and "results_to_batch" in f.traceback, f
    assert "inference results do not fit the result schema" in str(ei.value)
    _assert_all_gone()


def test_main_fun_returning_early_is_named_in_the_warning(spark, tmp_path, caplog):
    """main_fun reading 10 rows and returning, on Connect: train() ends, and its WARNING
    (the one of the classic path: TFCluster logs it for both) says how many partitions
    were skipped and names the nodes."""
    caplog.set_level(logging.INFO, logger="tfos._driver")
    df = spark.range(0, 1000, 1, 4).selectExpr("id", "id as y")
    with TFCluster.run(spark, read_ten_and_return_fun, {"out": str(tmp_path)}, 2, 0, input_mode=InputMode.SPARK,
                       reservation_timeout=180) as cluster:
        cluster.train(df)
    # 10 rows per node fed (Spark may run every feed task on one executor: the other then reads none)
    rows = {p.stem: json.loads(p.read_text())["rows"] for p in tmp_path.glob("*.json")}
    assert set(rows) == {"worker0", "worker1"} and set(rows.values()) <= {0, 10} and 10 in rows.values(), rows
    warned = [r.getMessage() for r in caplog.records if r.name.startswith("tfos._driver.") and r.levelno == logging.WARNING
              and "not consumed to their end" in r.getMessage()]
    node = r"worker:[01] \(executor [01], host [^)]+\)"
    assert len(warned) == 1 and re.fullmatch(
        r"train\(\): 4 of 4 partitions were not consumed to their end because main_fun on their node had "
        r"returned \(it stopped reading without DataFeed\.terminate\(\)\); their unread rows were not trained on"
        rf"\. main_fun returned without terminate\(\) on {node}(, {node})?", warned[0]), warned
    _assert_all_gone()


def test_udt_and_binary_columns_arrive_as_collect_gives_them(spark, tmp_path):
    """C24 on Connect: the client puts the Spark schema into the Arrow chunks for UDT and
    binary columns, so nodes get ``DenseVector``/``SparseVector`` (not the vector's struct),
    ``Row`` for structs and binary as the session's ``collect()`` gives it (``bytes`` unless
    ``spark.sql.execution.pyspark.binaryAsBytes`` is false), at every depth."""
    import pickle

    from pyspark.ml.linalg import DenseVector, SparseVector, VectorUDT
    from pyspark.sql.types import ArrayType, BinaryType, LongType, StructField, StructType

    schema = StructType([
        StructField("id", LongType(), False), StructField("v", VectorUDT(), True),
        StructField("vs", ArrayType(VectorUDT(), True), True), StructField("b", BinaryType(), True),
        StructField("s", StructType([StructField("x", BinaryType(), True), StructField("v", VectorUDT(), True)]), True),
    ])
    data = []
    for i in range(12):
        vec = DenseVector([float(i), 0.5]) if i % 2 else SparseVector(3, [i % 3], [float(i)])
        data.append((i, None if i == 5 else vec, [vec, None] if i % 4 else [], None if i == 3 else bytes([i, 0, 255]),
                     (bytes([i]), SparseVector(2, [], [])) if i % 3 else None))
    df = spark.createDataFrame(data, schema).repartition(3)
    want = {r["id"]: r for r in df.collect()}
    assert type(want[1]["v"]) is DenseVector and type(want[0]["v"]) is SparseVector
    with TFCluster.run(spark, rows_to_pickle_fun, {"out": str(tmp_path)}, 2, 0, input_mode=InputMode.SPARK,
                       reservation_timeout=180) as cluster:
        cluster.train(df, num_epochs=1)
    got = [row for p in sorted(tmp_path.glob("*.pkl")) for row in pickle.loads(p.read_bytes())]
    assert sorted(r[0] for r in got) == list(range(12))

    def same(g, w, where):
        assert type(g) is type(w), f"{where}: {g!r} != {w!r}"
        if isinstance(w, SparseVector):
            assert (g.size, g.indices.tolist(), g.values.tolist()) == (w.size, w.indices.tolist(), w.values.tolist()), where
        elif isinstance(w, DenseVector):
            assert g.toArray().tolist() == w.toArray().tolist(), where
        elif isinstance(w, (list, tuple)):
            assert len(g) == len(w) and getattr(g, "__fields__", None) == getattr(w, "__fields__", None), where
            for k, (gi, wi) in enumerate(zip(g, w)):
                same(gi, wi, f"{where}[{k}]")
        else:
            assert g == w, f"{where}: {g!r} != {w!r}"

    for row in got:
        same(tuple(row), tuple(want[row[0]]), f"row {row[0]}")
    _assert_all_gone()


def echo_timestamps_fun(args, ctx):
    """InputMode.SPARK inference: answers each row (id, ts) with (id, ts, [ts, None], {a: ts})."""
    from tfos.datafeed import DataFeed

    feed = DataFeed(ctx.mgr, train_mode=False)
    while not feed.should_stop():
        rows = feed.next_batch(7)
        if rows:
            feed.batch_results([(r[0], r[1], [r[1], None], {"a": r[1]}) for r in rows])


def test_timestamp_results_keep_their_instants(spark):
    """A TimestampType result column (top level, in an array, in a struct): the nodes get
    naive local datetimes, as df.rdd gives them, and returning them gives the same instants.
    (PySpark's to_arrow_schema refused TimestampType without a zone: every inference task
    failed with an AssertionError.)"""
    n = 200
    df = spark.range(0, n, 1, 3).selectExpr("id", "timestamp_seconds(1698537600 + id * 97) + make_interval(0, 0, 0, 0, 0, 0, id / 1000) AS ts")
    df = df.selectExpr("id", "CASE WHEN id % 50 = 7 THEN NULL ELSE ts END AS ts")
    with TFCluster.run(spark, echo_timestamps_fun, {}, 2, 0, input_mode=InputMode.SPARK, reservation_timeout=180) as cluster:
        out = cluster.inference(df, schema="id long, ts timestamp, tss array<timestamp>, s struct<a: timestamp>")
        joined = out.alias("o").join(df.alias("i"), "id").selectExpr(
            "id", "o.ts <=> i.ts AS top", "o.tss[0] <=> i.ts AS arr", "o.tss[1] IS NULL AS arr_null", "o.s.a <=> i.ts AS st",
            "unix_micros(o.ts) AS us").collect()
    assert len(joined) == n and sorted(r["id"] for r in joined) == list(range(n))
    bad = [r for r in joined if not (r["top"] and r["arr"] and r["arr_null"] and r["st"])]
    assert bad == []
    got_us = {r["id"]: r["us"] for r in joined}
    assert got_us[7] is None and got_us[1] == (1698537600 + 97) * 1_000_000 + 1000
    _assert_all_gone()


def echo_third_column_fun(args, ctx):
    """InputMode.SPARK inference: answers each row with (row[0], row[2])."""
    from tfos.datafeed import DataFeed

    feed = DataFeed(ctx.mgr, train_mode=False)
    while not feed.should_stop():
        rows = feed.next_batch(11)
        if rows:
            feed.batch_results([(r[0], r[2]) for r in rows])


def test_dotted_backticked_and_repeated_column_names(spark, tmp_path):
    """mapInArrow resolves its input columns by name: a join's repeated 'id', 'feature.x' and
    'a`b' failed Spark's analysis in train() and inference(); the client renames the columns
    by position and the tasks put the names back."""
    import pickle

    df = spark.range(0, 30, 1, 3).selectExpr("id", "id", "id * 3", "id * 10").toDF("id", "ID", "feature.x", "a`b")
    with TFCluster.run(spark, rows_to_pickle_fun, {"out": str(tmp_path)}, 2, 0, input_mode=InputMode.SPARK,
                       reservation_timeout=180) as cluster:
        cluster.train(df, num_epochs=1)
    got = sorted(tuple(r) for p in tmp_path.glob("*.pkl") for r in pickle.loads(p.read_bytes()))
    assert got == [(i, i, 3 * i, 10 * i) for i in range(30)]
    with TFCluster.run(spark, echo_third_column_fun, {}, 2, 0, input_mode=InputMode.SPARK, reservation_timeout=180) as cluster:
        rows = cluster.inference(df, schema="id long, fx long").collect()
    assert sorted((r["id"], r["fx"]) for r in rows) == [(i, 3 * i) for i in range(30)]
    _assert_all_gone()


def parallel_fun(args, ctx):
    """TFParallel instance: records what an independent instance sees."""
    _write_json(os.path.join(args["out"], f"instance{ctx.executor_id}.json"), {
        "job": ctx.job_name, "num_workers": ctx.num_workers, "tf_config": os.environ.get("TF_CONFIG"),
        "sum": sum(args["values"]),
    })


def test_tfparallel_runs_independent_instances(spark, tmp_path):
    """TFParallel.run takes a Connect session as it takes a SparkContext (docs/connect.md)."""
    from tfos import TFParallel

    TFParallel.run(spark, parallel_fun, {"out": str(tmp_path), "values": [1, 2, 3]}, 2, reservation_timeout=180,
                   timeout=SHUTDOWN_TIMEOUT_S)
    seen = {p.name: json.loads(p.read_text()) for p in tmp_path.glob("instance*.json")}
    assert sorted(seen) == ["instance0.json", "instance1.json"]
    for node in seen.values():
        assert node == {"job": "worker", "num_workers": 2, "tf_config": None, "sum": 6}
    _assert_all_gone()


def _sleep_in_task(batches, marker):
    import time

    for b in batches:
        open(marker, "w").close()  # the task holds its slot from here
        time.sleep(120)
        yield b


def test_too_few_task_slots(spark, tmp_path):
    """Both local masters have 2 task slots: 3 nodes are refused before anything runs. With
    one of the 2 slots held by another job, the start stage of 2 nodes cannot be
    scheduled: run() interrupts it after reservation_timeout (Spark itself would retry the
    barrier stage for about 10 minutes)."""
    import threading

    marker = str(tmp_path / "blocker.running")
    t0 = time.monotonic()
    with pytest.raises(ConfigurationError, match=r"has 2 task slot\(s\) but the cluster needs 3"):
        TFCluster.run(spark, tf_mode_fun, {"out": str(tmp_path)}, 3, 0)
    assert time.monotonic() - t0 < 30

    def hold_a_slot() -> None:
        spark.addTag("tfos-test-blocker")
        try:
            spark.range(0, 1, 1, 1).mapInArrow(lambda batches: _sleep_in_task(batches, marker), "id long").collect()
        except Exception:  # interrupted below
            pass

    blocker = threading.Thread(target=hold_a_slot, daemon=True)
    blocker.start()
    try:
        end = time.monotonic() + 120
        while not os.path.exists(marker) and time.monotonic() < end:
            time.sleep(0.1)
        assert os.path.exists(marker), "the blocking task did not start"
        t0 = time.monotonic()
        with pytest.raises(ReservationTimeoutError, match=r"did not finish within reservation_timeout=8 s, so it was interrupted"):
            TFCluster.run(spark, tf_mode_fun, {"out": str(tmp_path)}, 2, 0, reservation_timeout=8)
        assert time.monotonic() - t0 < 60  # 8 s, and at most 30 s for the interrupted job to end
    finally:
        spark.interruptTag("tfos-test-blocker")
        blocker.join(60)
    assert not list(tmp_path.glob("*.json"))  # no node ran main_fun
    _assert_all_gone()


@pytest.mark.chaos  # about 75 s, most of it the feed tasks' and the teardown's reconnect deadlines
def test_lost_control_host_is_named(spark, tmp_path):
    """The control host process dies between two calls: the next train() raises a
    ClusterFailedError whose first cause says the control host cannot be reached, and the
    nodes end themselves (heartbeat_timeout)."""
    import psutil

    if str(spark.conf.get("spark.master")).startswith("local-cluster"):
        pytest.skip("the same path as on local[2], but Spark retries every failed task there (spark.task.maxFailures=4): "
                    "minutes more for the suite")
    df = spark.range(0, 400, 1, 2).selectExpr("id", "id as y")
    cluster = TFCluster.run(spark, spark_mode_fun, {"out": str(tmp_path)}, 2, 0, input_mode=InputMode.SPARK,
                            queues=["input", "infer"], reservation_timeout=180, heartbeat_timeout=4)
    cluster.train(df)
    (host_pid, _), = _connect_host_processes()
    psutil.Process(host_pid).kill()
    with pytest.raises(ClusterFailedError) as ei:
        cluster.train(df)
    first = ei.value.failures[0]
    assert (first.kind, first.error_type) == ("lost", "ControlHostLost"), str(ei.value)
    assert "the tfos control host at " in first.message and "cannot be reached" in first.message
    cluster.shutdown()  # already torn down: a no-op
    _assert_all_gone()


def raises_on_attempt_0_fun(args, ctx):
    """worker:1 raises on attempt 0; on later attempts every node records its attempt."""
    if ctx.attempt == 0 and ctx.task_index == 1:
        raise ValueError("bad shard on the first attempt")
    _write_json(os.path.join(args["out"], f"{ctx.job_name}{ctx.task_index}-{ctx.attempt}.json"), {"attempt": ctx.attempt})


def counts_then_fails_once_fun(args, ctx):
    """InputMode.SPARK: records the rows it read per epoch in ``<out>/rows-<attempt>-<task>.json``;
    worker:1 of attempt 0 raises once it read 300 rows."""
    from tfos.datafeed import DataFeed

    feed = DataFeed(ctx.mgr, train_mode=True)
    seen: dict = {}
    path = os.path.join(args["out"], f"rows-{ctx.attempt}-{ctx.task_index}.json")
    while not feed.should_stop():
        batch = feed.next_batch(50)
        origins = feed.last_origins + [(len(batch), -1, -1, 0)]
        for (start, _part, epoch, _first), (end, *_rest) in zip(origins, origins[1:]):
            seen.setdefault(str(epoch), []).extend(int(r[0]) for r in batch[start:end])
        _write_json(path, seen)
        if ctx.attempt == 0 and ctx.task_index == 1 and sum(len(v) for v in seen.values()) >= 300:
            raise RuntimeError("worker 1 fails once, mid-feed")


def test_max_restarts_recovers_a_node_failure(spark, tmp_path, caplog):
    """TFCluster.run(spark_connect_session, ..., max_restarts=1): worker:1's main_fun raises
    on attempt 0; the client tears the cluster down, starts attempt 1 (a new start stage,
    control host and cluster id; ctx.attempt == 1), and shutdown() returns once it
    finished, as on the classic path."""
    if str(spark.conf.get("spark.master")).startswith("local-cluster"):
        pytest.skip("the restart path is the client's, the same on both masters: local[2] covers it")
    caplog.set_level(logging.WARNING, logger="tfos")
    cluster = TFCluster.run(spark, raises_on_attempt_0_fun, {"out": str(tmp_path)}, 2, 0, input_mode=InputMode.TENSORFLOW,
                            reservation_timeout=180, max_restarts=1)
    cluster.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
    assert (cluster.attempt, cluster.state, cluster.cluster_id.endswith("-r1")) == (1, TFCluster.Lifecycle.CLOSED, True)
    names = {p.name for p in tmp_path.glob("*.json")}
    assert {"worker0-1.json", "worker1-1.json"} <= names and "worker1-0.json" not in names, names
    text = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "attempt 0 failed during" in text and "ValueError: bad shard on the first attempt" in text, text
    assert "starting attempt 1 (restart 1 of 1)" in text and "attempt 1 running" in text, text
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith("tfos")] == []
    _assert_all_gone()


def test_max_restarts_resumes_the_feed(spark, tmp_path, caplog):
    """InputMode.SPARK under Spark Connect: worker:1 fails mid-feed on attempt 0; train()
    restarts the cluster and feeds again from the first epoch not acknowledged in full (the
    failed attempt's acknowledgements come back in the teardown's answer): every row of
    every epoch from there on reaches attempt 1's main_fun."""
    if str(spark.conf.get("spark.master")).startswith("local-cluster"):
        pytest.skip("the restart path is the client's, the same on both masters: local[2] covers it")
    caplog.set_level(logging.WARNING, logger="tfos")
    n, epochs = 800, 2
    df = spark.range(0, n, 1, 4).selectExpr("id", "0 as e")
    with TFCluster.run(spark, counts_then_fails_once_fun, {"out": str(tmp_path)}, 2, 0, input_mode=InputMode.SPARK,
                       reservation_timeout=180, max_restarts=1) as cluster:
        cluster.train(df, num_epochs=epochs, feed_timeout=120)
        assert cluster.attempt == 1
    text = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    resumed = re.search(r"train\(\): attempt 1 resumes the feed at epoch (\d) of 2", text)
    assert resumed, text
    second: dict = {}  # attempt 1: epoch -> rows its nodes read
    for p in tmp_path.glob("rows-1-*.json"):
        for epoch, rows in json.loads(p.read_text()).items():
            second.setdefault(int(epoch), []).extend(rows)
    # every row of every epoch from the resume epoch on reached attempt 1's main_fun, once
    for epoch in range(int(resumed.group(1)), epochs):
        assert sorted(second.get(epoch, [])) == list(range(n)), (epoch, len(second.get(epoch, [])))
    _assert_all_gone()

