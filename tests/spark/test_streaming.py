"""Spark tests of streaming feeds (issue 16): DStreams (``ssc.queueStream``) and a
Structured Streaming file source, a node failure during a stream, and shutdown during a
stream.

Every test runs a real tfos cluster on the shared ``local-cluster[2,1,1024]`` context. The
main_funs write what they read (row count, value sum, whether ``should_stop()`` was ever
true before the end) to ``tmp_path``; the tests assert exact counts and checksums. Only one
StreamingContext may be active per JVM: every test stops its own (never the SparkContext).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("pyspark")

from tfos import TFCluster  # noqa: E402
from tfos import streaming as tfos_streaming  # noqa: E402
from tfos.errors import ClusterFailedError  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.filterwarnings("ignore:DStream is deprecated:FutureWarning")]

INPUT = TFCluster.InputMode.SPARK
ROWS_PER_RDD = 300


def _reports(out_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out_dir.glob("*.json"))]


def stream_count_fun(args, ctx):
    """Reads the feed until the end of feed; writes rows, value sum, and the number of
    batches read (should_stop() must stay False between micro-batches)."""
    import json as _json

    from tfos import TFNode

    feed = TFNode.DataFeed(ctx.mgr, train_mode=True)
    n = total = 0
    fail_after = args.get("fail_after")
    while not feed.should_stop():
        batch = feed.next_batch(50)
        for x in batch:
            v = x[0] if isinstance(x, (tuple, list)) else x
            n += 1
            total += int(v)
        if fail_after is not None and n >= fail_after:
            raise RuntimeError(f"streaming main_fun failed on purpose after {n} rows")
    with open(f"{args['out']}/{ctx.job_name}{ctx.task_index}.json", "w") as f:
        _json.dump({"rows": n, "sum": total}, f)


def _queue(sc, count: int, rows: int = ROWS_PER_RDD):
    """``count`` RDDs of ``rows`` distinct integers each (3 partitions), and their values."""
    rdds, values = [], []
    for k in range(count):
        vals = list(range(k * 100000, k * 100000 + rows))
        rdds.append(sc.parallelize(vals, 3))
        values.append(vals)
    return rdds, values


def _wait_batches(cluster, n: int, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while tfos_streaming.stream_stats(cluster)["batches"] < n:
        stats = tfos_streaming.stream_stats(cluster)
        assert stats["error"] is None, stats["error"]
        assert time.monotonic() < deadline, f"only {stats['batches']} of {n} micro-batches fed in {timeout_s} s"
        time.sleep(0.2)


def _close(cluster) -> None:
    """Tears the cluster down when a test failed before its shutdown()."""
    cluster._ctl.abort("the test failed before its shutdown()")


def _no_active_ssc() -> bool:
    from pyspark.streaming import StreamingContext

    return StreamingContext.getActive() is None


@pytest.fixture
def key_dir(tmp_path, monkeypatch):
    d = tmp_path / "keys"
    monkeypatch.setenv("TFOS_KEY_DIR", str(d))
    return d


def test_dstream_queue_every_row_once_and_stop_from_outside(sc, tmp_path, key_dir, no_leftovers):
    from pyspark.streaming import StreamingContext

    out = tmp_path / "out"
    out.mkdir()
    rdds, values = _queue(sc, 3)
    cluster = TFCluster.run(sc, stream_count_fun, {"out": str(out)}, 2, 0, input_mode=INPUT)
    ssc = StreamingContext(sc, 1)
    try:
        stream = ssc.queueStream(rdds)
        cluster.train(stream, 1)
        ssc.start()
        _wait_batches(cluster, 3)
        # As TFoS's stop_streaming.py: another process asks the cluster to stop, knowing only
        # (host, port); the key comes from the driver user's key file (0600).
        host, port = tfos_streaming.stop_address(cluster)
        key_files = list(key_dir.glob("*.key"))
        assert len(key_files) == 1 and (key_files[0].stat().st_mode & 0o077) == 0
        subprocess.run([sys.executable, "-m", "tfos.streaming", "stop", host, str(port)], check=True, timeout=120,
                       env=dict(os.environ))
        cluster.shutdown(ssc)
    finally:
        ssc.stop(stopSparkContext=False, stopGraceFully=False)
        _close(cluster)
    assert _no_active_ssc()
    assert not list(key_dir.glob("*.key")), "key file left behind"
    reps = _reports(out)
    assert len(reps) == 2
    assert sum(r["rows"] for r in reps) == 3 * ROWS_PER_RDD
    assert sum(r["sum"] for r in reps) == sum(sum(v) for v in values)
    assert tfos_streaming.stream_stats(cluster)["batches"] >= 3  # later micro-batches of the drained queue are empty


def test_dstream_unauthenticated_stop_is_refused(sc, tmp_path, key_dir, no_leftovers):
    """A stop request without the cluster's key (wrong key file) does not stop the cluster."""
    from pyspark.streaming import StreamingContext

    out = tmp_path / "out"
    out.mkdir()
    rdds, values = _queue(sc, 1)
    cluster = TFCluster.run(sc, stream_count_fun, {"out": str(out)}, 2, 0, input_mode=INPUT)
    ssc = StreamingContext(sc, 1)
    try:
        cluster.train(ssc.queueStream(rdds), 1)
        ssc.start()
        _wait_batches(cluster, 1)
        host, port = tfos_streaming.stop_address(cluster)
        (key_file,) = key_dir.glob("*.key")
        good = key_file.read_text()
        data = json.loads(good)
        data["key"] = "00" * (len(data["key"]) // 2)
        key_file.write_text(json.dumps(data))
        proc = subprocess.run([sys.executable, "-m", "tfos.streaming", "stop", host, str(port)], timeout=120,
                              capture_output=True, text=True, env=dict(os.environ))
        assert proc.returncode != 0
        assert good[10:40] not in proc.stderr  # the key is never printed
        assert ssc._jssc.getState().toString() == "ACTIVE"
        key_file.write_text(good)
        tfos_streaming.request_stop(cluster)
        cluster.shutdown(ssc)
    finally:
        ssc.stop(stopSparkContext=False, stopGraceFully=False)
        _close(cluster)
    assert _no_active_ssc()
    reps = _reports(out)
    assert sum(r["rows"] for r in reps) == ROWS_PER_RDD
    assert sum(r["sum"] for r in reps) == sum(values[0])


def test_shutdown_timeout_stops_an_idle_stream_and_the_nodes_cleanly(sc, tmp_path, key_dir, no_leftovers):
    """shutdown(ssc, timeout=T) with a stream that never ends and no stop request: after T
    the stream is stopped and the nodes, seeing the end of the feed, return within a
    timeout of their own (it used to raise DeadlineExceededError blaming main_fun: the
    stream wait had used the whole T)."""
    from pyspark.streaming import StreamingContext

    out = tmp_path / "out"
    out.mkdir()
    rdds, values = _queue(sc, 2)
    cluster = TFCluster.run(sc, stream_count_fun, {"out": str(out)}, 2, 0, input_mode=INPUT)
    ssc = StreamingContext(sc, 1)
    try:
        cluster.train(ssc.queueStream(rdds), 1)
        ssc.start()
        _wait_batches(cluster, 2)  # the queue is drained: later micro-batches are empty
        t0 = time.monotonic()
        cluster.shutdown(ssc, timeout=8)
        assert time.monotonic() - t0 >= 8  # the stream was waited for first
    finally:
        ssc.stop(stopSparkContext=False, stopGraceFully=False)
        _close(cluster)
    assert _no_active_ssc()
    reps = _reports(out)
    assert sum(r["rows"] for r in reps) == 2 * ROWS_PER_RDD
    assert sum(r["sum"] for r in reps) == sum(sum(v) for v in values)


def test_dstream_node_failure_stops_the_context(sc, tmp_path, key_dir, no_leftovers):
    from pyspark.streaming import StreamingContext

    out = tmp_path / "out"
    out.mkdir()
    rdds, _ = _queue(sc, 20)
    cluster = TFCluster.run(sc, stream_count_fun, {"out": str(out), "fail_after": 100}, 2, 0, input_mode=INPUT)
    ssc = StreamingContext(sc, 1)
    try:
        cluster.train(ssc.queueStream(rdds), 1)
        ssc.start()
        t0 = time.monotonic()
        with pytest.raises(ClusterFailedError) as ei:
            cluster.shutdown(ssc)
        elapsed = time.monotonic() - t0
    finally:
        ssc.stop(stopSparkContext=False, stopGraceFully=False)
        _close(cluster)
    assert "failed on purpose" in str(ei.value)
    assert elapsed < 180, f"the failure took {elapsed:.0f} s to surface"
    assert _no_active_ssc()
    assert tfos_streaming.stream_stats(cluster)["batches"] < 20


def test_shutdown_during_dstream_feeds_whole_batches(sc, tmp_path, key_dir, no_leftovers):
    """shutdown() without ssc while the stream runs: the stream stops gracefully, every
    micro-batch fed is fed whole, nothing is left running."""
    from pyspark.streaming import StreamingContext

    out = tmp_path / "out"
    out.mkdir()
    rdds, values = _queue(sc, 40, rows=100)
    cluster = TFCluster.run(sc, stream_count_fun, {"out": str(out)}, 2, 0, input_mode=INPUT)
    ssc = StreamingContext(sc, 1)
    try:
        cluster.train(ssc.queueStream(rdds), 1)
        ssc.start()
        _wait_batches(cluster, 2)
        cluster.shutdown()
    finally:
        ssc.stop(stopSparkContext=False, stopGraceFully=False)
        _close(cluster)
    assert _no_active_ssc()
    fed = tfos_streaming.stream_stats(cluster)["batches"]
    assert 2 <= fed < 40
    reps = _reports(out)
    assert sum(r["rows"] for r in reps) == fed * 100  # whole micro-batches only, in queue order
    assert sum(r["sum"] for r in reps) == sum(sum(v) for v in values[:fed])


def test_structured_file_stream_every_row_once(sc, tmp_path, key_dir, no_leftovers):
    from pyspark.sql import SparkSession

    spark = SparkSession(sc)
    src = tmp_path / "src"
    src.mkdir()
    out = tmp_path / "out"
    out.mkdir()

    def add_file(i: int, vals: list) -> None:
        tmp = tmp_path / f"part{i}.tmp"
        tmp.write_text("".join(json.dumps({"x": v}) + "\n" for v in vals))
        os.replace(tmp, src / f"part{i}.json")  # atomic: the source never sees half a file

    files = [list(range(i * 10000, i * 10000 + 250)) for i in range(4)]
    add_file(0, files[0])
    cluster = TFCluster.run(sc, stream_count_fun, {"out": str(out)}, 2, 0, input_mode=INPUT)
    query = None
    try:
        sdf = spark.readStream.schema("x long").option("maxFilesPerTrigger", 1).json(str(src))
        query = cluster.train(sdf, checkpointLocation=str(tmp_path / "ckpt"), trigger={"processingTime": "1 second"},
                              queryName="tfos_test_stream")
        for i in range(1, 4):
            time.sleep(1.5)
            add_file(i, files[i])
        query.processAllAvailable()
        cluster.shutdown()
    finally:
        if query is not None and query.isActive:
            query.stop()
        _close(cluster)
    assert not query.isActive
    assert query.exception() is None
    reps = _reports(out)
    assert sum(r["rows"] for r in reps) == 4 * 250
    assert sum(r["sum"] for r in reps) == sum(sum(f) for f in files)


def stream_square_fun(args, ctx):
    """Inference: answers every batch with x * x (x: an int, or the first field of a row)."""
    from tfos import TFNode

    feed = TFNode.DataFeed(ctx.mgr, train_mode=False)
    while not feed.should_stop():
        batch = feed.next_batch(40)
        if batch:
            vals = [int(x[0]) if isinstance(x, (tuple, list)) else int(x) for x in batch]
            feed.batch_results([v * v for v in vals])


def test_dstream_inference_per_micro_batch(sc, tmp_path, key_dir, no_leftovers):
    from pyspark.streaming import StreamingContext

    rdds, values = _queue(sc, 3, rows=200)
    cluster = TFCluster.run(sc, stream_square_fun, {}, 2, 0, input_mode=INPUT)
    ssc = StreamingContext(sc, 1)
    got: list[list[int]] = []
    try:
        results = cluster.inference(ssc.queueStream(rdds))
        results.foreachRDD(lambda rdd: got.append(rdd.collect()))
        ssc.start()
        _wait_batches(cluster, 3)
        deadline = time.monotonic() + 120
        while sum(1 for g in got if g) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        tfos_streaming.request_stop(cluster)
        cluster.shutdown(ssc)
    finally:
        ssc.stop(stopSparkContext=False, stopGraceFully=False)
        _close(cluster)
    assert _no_active_ssc()
    nonempty = [g for g in got if g]
    assert nonempty == [[v * v for v in vals] for vals in values]  # one result per row, in order, per batch


def _add_json(tmp_path: Path, src: Path, i: int, vals: list) -> None:
    tmp = tmp_path / f"part{i}.tmp"
    tmp.write_text("".join(json.dumps({"x": v}) + "\n" for v in vals))
    os.replace(tmp, src / f"part{i}.json")


def test_structured_inference_stream_to_parquet_and_function(sc, tmp_path, key_dir, no_leftovers):
    from pyspark.sql import SparkSession

    from tfos.streaming import inference_stream

    spark = SparkSession(sc)
    src = tmp_path / "src"
    src.mkdir()
    files = [list(range(i * 1000, i * 1000 + 150)) for i in range(3)]
    _add_json(tmp_path, src, 0, files[0])
    cluster = TFCluster.run(sc, stream_square_fun, {}, 2, 0, input_mode=INPUT)
    sdf = spark.readStream.schema("x long").option("maxFilesPerTrigger", 1).json(str(src))
    seen: dict[int, int] = {}
    queries = []
    try:
        queries.append(inference_stream(cluster, sdf, {"format": "parquet", "path": str(tmp_path / "pq"), "schema": "y long"},
                                        checkpointLocation=str(tmp_path / "ck1")))
        for i in range(1, 3):
            time.sleep(1.0)
            _add_json(tmp_path, src, i, files[i])
        queries[0].processAllAvailable()
        queries.append(inference_stream(cluster, sdf, lambda res, df, bid: seen.__setitem__(bid, sum(res.collect())),
                                        checkpointLocation=str(tmp_path / "ck2"), trigger={"availableNow": True}))
        queries[1].awaitTermination(300)
        cluster.shutdown()
    finally:
        for q in queries:
            if q.isActive:
                q.stop()
        _close(cluster)
    squares = [v * v for f in files for v in f]
    ys = [r.y for r in spark.read.parquet(str(tmp_path / "pq")).collect()]
    assert sorted(ys) == sorted(squares)
    assert sum(seen.values()) == sum(squares)
    assert all(not q.isActive and q.exception() is None for q in queries)


def _slow_square_sum(results) -> int:
    def slow(y):
        import time as _t

        _t.sleep(0.02)
        return y

    return results.map(slow).sum()


def test_structured_inference_shutdown_lets_the_running_sink_finish(sc, tmp_path, key_dir, no_leftovers):
    """shutdown() while the sink of an inference query runs its own Spark job: query.stop()
    cancelled that job (InterruptedException) and shutdown() raised "a streaming micro-batch
    failed" (6 of 13 stops, new-user helper). The running micro-batch now ends first."""
    import threading

    from pyspark.sql import SparkSession

    from tfos.streaming import inference_stream

    spark = SparkSession(sc)
    src = tmp_path / "src"
    src.mkdir()
    vals = list(range(150))
    _add_json(tmp_path, src, 0, vals)
    cluster = TFCluster.run(sc, stream_square_fun, {}, 2, 0, input_mode=INPUT)
    sdf = spark.readStream.schema("x long").option("maxFilesPerTrigger", 1).json(str(src))
    in_sink = threading.Event()
    seen: dict[int, int] = {}

    def sink(res, df, bid):
        in_sink.set()
        seen[bid] = _slow_square_sum(res)  # 150 rows x 20 ms in the sink's own Spark job

    query = None
    try:
        query = inference_stream(cluster, sdf, sink, checkpointLocation=str(tmp_path / "ck"))
        assert in_sink.wait(300), "the sink never ran"
        t0 = time.monotonic()
        cluster.shutdown()  # raised TFOSError before
        waited = time.monotonic() - t0
    finally:
        if query is not None and query.isActive:
            query.stop()
        _close(cluster)
    assert seen == {0: sum(v * v for v in vals)}
    assert not query.isActive and waited < 120


def test_structured_node_failure_stops_the_query(sc, tmp_path, key_dir, no_leftovers):
    from pyspark.sql import SparkSession

    spark = SparkSession(sc)
    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):
        _add_json(tmp_path, src, i, list(range(i * 1000, i * 1000 + 200)))
    out = tmp_path / "out"
    out.mkdir()
    cluster = TFCluster.run(sc, stream_count_fun, {"out": str(out), "fail_after": 60}, 2, 0, input_mode=INPUT)
    query = None
    try:
        sdf = spark.readStream.schema("x long").option("maxFilesPerTrigger", 1).json(str(src))
        query = cluster.train(sdf, checkpointLocation=str(tmp_path / "ckpt"))
        t0 = time.monotonic()
        with pytest.raises(ClusterFailedError) as ei:
            cluster.shutdown(query)
        elapsed = time.monotonic() - t0
    finally:
        if query is not None and query.isActive:
            query.stop()
        _close(cluster)
    assert "failed on purpose" in str(ei.value)
    assert elapsed < 180, f"the failure took {elapsed:.0f} s to surface"
    deadline = time.monotonic() + 60
    while query.isActive and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not query.isActive
    assert query.exception() is not None and "failed on purpose" in str(query.exception())


def tfos_style_fun(args, ctx):
    """A TFoS streaming main_fun (imports renamed): reads one row at a time until the feed ends."""
    import json as _json

    from tfos import TFNode

    tf_feed = TFNode.DataFeed(ctx.mgr)
    n = total = 0
    while not tf_feed.should_stop():
        batch = tf_feed.next_batch(1)
        if len(batch) > 0:
            image, label = batch[0]
            n += 1
            total += sum(image) + label
        else:
            break
    with open(f"{args['out']}/{ctx.job_name}{ctx.task_index}.json", "w") as f:
        _json.dump({"rows": n, "sum": total}, f)


def test_tfos_style_text_file_stream_stopped_by_tfos_stop_script(sc, tmp_path, key_dir, caplog, no_leftovers):
    """TFoS's streaming program shape: textFileStream, train(stream, feed_timeout=86400),
    ssc.start(), shutdown(ssc); stopped by TFoS's stop script (imports renamed) given the
    (host, port) read from the driver's log, which never shows the key."""
    import logging
    import re
    import threading

    from pyspark.streaming import StreamingContext

    caplog.set_level(logging.INFO, logger="tfos._driver.stream_stop")
    src = tmp_path / "src"
    src.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    lines = [f"{i % 10}," + ",".join(str((i * 7 + j) % 256) for j in range(8)) for i in range(400)]
    expected = sum(int(v) for ln in lines for v in ln.split(","))

    def parse(ln):
        vec = [int(x) for x in ln.split(",")]
        return (vec[1:], vec[0])

    cluster = TFCluster.run(sc, tfos_style_fun, {"out": str(out)}, 2, 0, input_mode=TFCluster.InputMode.SPARK)
    ssc = StreamingContext(sc, 1)
    stopper_error: list = []
    try:
        stream = ssc.textFileStream(str(src))
        cluster.train(stream.map(parse), feed_timeout=86400)
        ssc.start()
        m = re.search(r"Client\(\('([^']+)', (\d+)\)\)", caplog.text)
        assert m, caplog.text
        host, port = m.group(1), m.group(2)
        key = json.loads(next(key_dir.glob("*.key")).read_text())["key"]
        assert key not in caplog.text

        def drop_files_then_stop():
            try:
                for i in range(2):
                    time.sleep(1.5)
                    tmp = tmp_path / f"f{i}.tmp"
                    tmp.write_text("\n".join(lines[i * 200:(i + 1) * 200]) + "\n")
                    os.replace(tmp, src / f"f{i}.txt")
                deadline = time.monotonic() + 180
                while tfos_streaming.stream_stats(cluster)["batches"] < 2 and time.monotonic() < deadline:
                    time.sleep(0.5)
                time.sleep(3)  # later (empty) micro-batches: the files were picked up
                script = Path(__file__).resolve().parents[2] / "examples" / "streaming" / "stop_streaming.py"
                subprocess.run([sys.executable, str(script), host, port], check=True, timeout=120, env=dict(os.environ))
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                stopper_error.append(exc)
                tfos_streaming.request_stop(cluster)

        t = threading.Thread(target=drop_files_then_stop, daemon=True)
        t.start()
        cluster.shutdown(ssc)
        t.join(60)
    finally:
        ssc.stop(stopSparkContext=False, stopGraceFully=False)
        _close(cluster)
    assert not stopper_error, stopper_error
    assert _no_active_ssc()
    reps = _reports(out)
    assert sum(r["rows"] for r in reps) == 400
    assert sum(r["sum"] for r in reps) == expected


@pytest.mark.tf
@pytest.mark.parametrize("api", ["structured", "dstream"])
def test_streaming_example_runs(api, tmp_path, no_leftovers):
    """examples/streaming/streaming_regression.py as a user runs it (its own Spark driver)."""
    import re

    env = dict(os.environ)
    for name in ("PYSPARK_GATEWAY_PORT", "PYSPARK_GATEWAY_SECRET"):
        env.pop(name, None)
    env["TFOS_KEY_DIR"] = str(tmp_path / "keys")
    script = Path(__file__).resolve().parents[2] / "examples" / "streaming" / "streaming_regression.py"
    cmd = [sys.executable, str(script), "--api", api, "--files", "4", "--rows", "3000", "--every", "1.5", "--work_dir", str(tmp_path / "work")]
    if api == "dstream":
        cmd.append("--auto_stop")
    proc = subprocess.run(cmd, cwd=str(tmp_path), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=900)
    # The JVM's shutdown noise comes last: show the driver's own traceback, when there is one.
    tb = proc.stderr.rfind("Traceback (most recent call last)")
    assert proc.returncode == 0, f"stderr:\n{proc.stderr[tb:tb + 6000] if tb >= 0 else ''}\n...\n{proc.stderr[-6000:]}"
    # Each node trains on its own share of the stream; under load Spark may feed one node
    # every row, and the other then ends cleanly after 0 steps.
    per_node = re.search(r"steps per node: (.+)", proc.stderr)
    assert per_node, proc.stderr[-6000:]
    steps_by_node = {n: int(k) for n, k in re.findall(r"(\S+) (\d+)", per_node.group(1))}
    assert set(steps_by_node) == {"chief:0", "worker:0"}, per_node.group(0)
    m = re.search(r"model of (\S+) after (\d+) steps: w = \(([-0-9.]+), ([-0-9.]+)\), b = ([-0-9.]+)", proc.stderr)
    assert m, proc.stderr[-6000:]
    steps, w1, w2, b = int(m.group(2)), float(m.group(3)), float(m.group(4)), float(m.group(5))
    assert steps == max(steps_by_node.values()) > 0
    assert abs(w1 - 3) < 0.2 and abs(w2 + 2) < 0.2 and abs(b - 1) < 0.2, m.group(0)
    assert not list((tmp_path / "keys").glob("*.key"))


def test_shutdown_during_structured_stream_feeds_whole_batches(sc, tmp_path, key_dir, no_leftovers):
    """shutdown() while a query runs: the query is stopped (the running micro-batch is fed
    whole), the feed ends, nothing is left running."""
    from pyspark.sql import SparkSession

    spark = SparkSession(sc)
    src = tmp_path / "src"
    src.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    files = [list(range(i * 1000, i * 1000 + 200)) for i in range(30)]
    for i, vals in enumerate(files):
        _add_json(tmp_path, src, i, vals)
        os.utime(src / f"part{i}.json", (1_000_000 + i, 1_000_000 + i))  # the source takes files oldest first
    cluster = TFCluster.run(sc, stream_count_fun, {"out": str(out)}, 2, 0, input_mode=INPUT)
    query = None
    try:
        sdf = spark.readStream.schema("x long").option("maxFilesPerTrigger", 1).json(str(src))
        query = cluster.train(sdf, checkpointLocation=str(tmp_path / "ckpt"))
        _wait_batches(cluster, 2)
        cluster.shutdown()
    finally:
        if query is not None and query.isActive:
            query.stop()
        _close(cluster)
    assert not query.isActive
    fed = tfos_streaming.stream_stats(cluster)["batches"]
    assert 2 <= fed < 30
    reps = _reports(out)
    assert sum(r["rows"] for r in reps) == fed * 200
    assert sum(r["sum"] for r in reps) == sum(sum(f) for f in files[:fed])
