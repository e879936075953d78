"""Spark tests of the InputMode.SPARK edge cases (C02, C07, C09-C12, C19, feed_timeout).

Each test asserts the documented behaviour and its message text, and that the call
returned (or raised) within a generous bound, so a regression shows up as a failure
rather than a hang. All run on the shared ``local-cluster[2,1,1024]`` context.
"""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pyspark")

from feed_gate import after_started, mark_started, started_at  # noqa: E402

from tfos import TFCluster  # noqa: E402
from tfos.errors import ClusterFailedError, ConfigurationError  # noqa: E402

pytestmark = pytest.mark.spark

INPUT = TFCluster.InputMode.SPARK
#: Generous bound for a call that must not hang (the machine is shared and slow).
QUICK_S = 60.0


def _reports(out_dir: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(out_dir.glob("*.json"))}


def _write(args, ctx, report: dict) -> None:
    import json as _json

    with open(f"{args['out']}/{ctx.job_name}{ctx.task_index}.json", "w") as f:
        _json.dump(report, f)


# --------------------------------------------------------------------------- main_funs


def read_ten_and_return(args, ctx):
    """C02: reads 10 rows, then returns without DataFeed.terminate()."""
    from tfos import TFNode

    feed = TFNode.DataFeed(ctx.mgr)
    _write(args, ctx, {"rows": len(feed.next_batch(10))})


def count_until_end(args, ctx):
    """Counts rows until the end of the feed. A ps node checks that it has no feed and
    waits for the stop directive (as ``server.join()`` would)."""
    from tfos import TFNode
    from tfos.errors import TFOSError

    if ctx.job_name == "ps":
        try:
            TFNode.DataFeed(ctx.mgr)
            err = ""
        except TFOSError as exc:
            err = str(exc)
        _write(args, ctx, {"mgr_is_none": ctx.mgr is None, "feed_error": err})
        ctx.stop_event.wait(300)
        return
    feed = TFNode.DataFeed(ctx.mgr)
    n = total = 0
    while not feed.should_stop():
        batch = feed.next_batch(128)
        n += len(batch)
        total += sum(batch)
    _write(args, ctx, {"rows": n, "sum": total})


def infer_times_three(args, ctx):
    """C09: inference with a big batch size; records the largest batch seen. With
    ``args['drop_last']`` it answers each batch with one result too few."""
    from tfos import TFNode

    feed = TFNode.DataFeed(ctx.mgr, train_mode=False)
    sizes = []
    while not feed.should_stop():
        batch = feed.next_batch(args["batch_size"])
        if not batch:
            continue
        sizes.append(len(batch))
        _write(args, ctx, {"batch_sizes": sizes})
        results = [3 * x for x in batch]
        feed.batch_results(results[:-1] if args.get("drop_last") else results)


def count_one_epoch_then_terminate(args, ctx):
    """C11: reads until one epoch's worth of rows arrived, then calls terminate()."""
    import time as _time

    from tfos import TFNode

    feed = TFNode.DataFeed(ctx.mgr)
    n = 0
    epochs = set()
    while n < args["rows_per_epoch"]:
        n += len(feed.next_batch(args["batch_size"]))
        epochs.update(o[2] for o in feed.last_origins)
    feed.terminate()
    after = feed.next_batch(args["batch_size"])
    _write(args, ctx, {"rows": n, "epochs_seen": sorted(epochs), "should_stop": feed.should_stop(), "after": len(after)})
    # Work after terminate() (e.g. exporting the model) must not fail the feed.
    _time.sleep(args.get("linger_s", 0))


def read_mnist_dataset(args, ctx):
    """C19: iterates ``as_dataset`` with a (float32[784], int64) signature."""
    import os as _os

    _os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    import tensorflow as tf

    from tfos import TFNode

    feed = TFNode.DataFeed(ctx.mgr)
    ds = feed.as_dataset(10, output_signature=(tf.TensorSpec((None, 784), tf.float32), tf.TensorSpec((None,), tf.int64)))
    n = 0
    for x, _y in ds:
        n += int(x.shape[0])
    _write(args, ctx, {"rows": n})


def stop_consuming(args, ctx):
    """feed_timeout: never reads the feed; waits for the driver's stop directive."""
    mark_started(args["out"], ctx)
    ctx.stop_event.wait(300)


def answer_nothing(args, ctx):
    """Inference feed_timeout: takes one batch, never answers it, waits for the stop."""
    mark_started(args["out"], ctx)
    feed = ctx.get_data_feed(train_mode=False)
    feed.next_batch(10)
    _wait_for_the_driver(ctx)


def _wait_for_the_driver(ctx):
    ctx.stop_event.wait(300)  # where the stack must point


def mwms_linear_regression(args, ctx):
    """C12: tf_keras linear regression under MultiWorkerMirroredStrategy, fed by as_dataset."""
    import os as _os

    _os.environ["TF_USE_LEGACY_KERAS"] = "1"
    _os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    import tensorflow as tf
    import tf_keras as keras

    from tfos import TFNode

    k = args["k"]
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.layers.Dense(1, input_shape=(k,))])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    feed = TFNode.DataFeed(ctx.mgr)
    ds = feed.as_dataset(args["batch_size"], output_signature=(tf.TensorSpec((None, k), tf.float32), tf.TensorSpec((None,), tf.float32)))
    opts = tf.data.Options()
    # Each node already gets its own share of the data: no tf.data sharding on top.
    opts.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    hist = model.fit(ds.with_options(opts), epochs=1, verbose=0)
    _write(args, ctx, {"rows": ctx.mgr.rows_taken, "loss": hist.history["loss"]})


def _regression_row(i: int, k: int = 4) -> tuple:
    """Row ``i`` of the linear-regression data: ``(float32[k] x, float y)``."""
    x = np.random.default_rng(i).normal(size=k).astype(np.float32)
    return x, float(x @ np.arange(1, k + 1, dtype=np.float32) - 0.5)


# ------------------------------------------------------------------------------- tests


def test_c02_main_fun_returns_early_skips_rest_with_warning(sc, tmp_path, caplog, no_leftovers):
    """C02: main_fun reads 10 rows and returns (no terminate()): train() ends quickly, the
    unfed partitions are skipped, and the driver logs a WARNING saying why."""
    caplog.set_level(logging.INFO, logger="tfos._driver")
    rdd = sc.parallelize(range(1000), 4)
    cluster = TFCluster.run(sc, read_ten_and_return, {"out": str(tmp_path)}, 2, 0, input_mode=INPUT)
    t0 = time.monotonic()
    cluster.train(rdd, num_epochs=1)
    assert time.monotonic() - t0 < QUICK_S
    cluster.shutdown(timeout=QUICK_S)
    # Each node reads 10 rows of the partitions fed to it; Spark may run every feed task on
    # one executor (its scheduling, seen once in a fresh-clone run), and the other node then
    # gets no partition and reads none before the feed ends.
    rows = {k: v["rows"] for k, v in _reports(tmp_path).items()}
    assert set(rows) == {"worker0", "worker1"} and set(rows.values()) <= {0, 10} and 10 in rows.values(), rows
    # (the once-per-process spark.authenticate WARNING of tfos._driver.spark_checks comes
    # with the first cluster of the process: not this test's concern)
    warnings = [r.getMessage() for r in caplog.records if r.name.startswith("tfos._driver.")
                and r.name != "tfos._driver.spark_checks" and r.levelno == logging.WARNING]
    # No partition was consumed to its end, so none was acknowledged: all 4 are skipped.
    # ... and names the nodes whose main_fun returned (those the driver knows of by then)
    node = r"worker:[01] \(executor [01], host [^)]+\)"
    assert len(warnings) == 1 and re.fullmatch(
        r"train\(\): 4 of 4 partitions were not consumed to their end because main_fun on their node had "
        r"returned \(it stopped reading without DataFeed\.terminate\(\)\); their unread rows were not trained on"
        rf"\. main_fun returned without terminate\(\) on {node}(, {node})?", warnings[0]), warnings


def test_c07_ps_is_never_fed_all_rows_reach_the_worker(sc, tmp_path, no_leftovers):
    """C07: 1 ps + 1 worker on 2 executors; the feed tasks that run on the ps's executor
    (which hosts no fed node) send their partitions to the worker; the ps has no feed."""
    rows = 800
    rdd = sc.parallelize(range(rows), 8)
    cluster = TFCluster.run(sc, count_until_end, {"out": str(tmp_path)}, 2, 1, input_mode=INPUT)
    t0 = time.monotonic()
    cluster.train(rdd, num_epochs=1)
    assert time.monotonic() - t0 < QUICK_S
    cluster.shutdown(timeout=QUICK_S)
    reports = _reports(tmp_path)
    assert reports["worker0"] == {"rows": rows, "sum": sum(range(rows))}
    assert reports["ps0"]["mgr_is_none"] is True
    assert "this node has no data feed" in reports["ps0"]["feed_error"]
    assert "ps and evaluator nodes are never fed" in reports["ps0"]["feed_error"]


def test_c09_inference_batches_never_span_partitions(sc, tmp_path, no_leftovers):
    """C09: batch_size 3488 over 4 partitions of 872 rows: no batch spans two partitions,
    and the results come back one per row, in order."""
    rows, parts = 3488, 4
    rdd = sc.parallelize(range(rows), parts)
    args = {"out": str(tmp_path), "batch_size": rows}
    with TFCluster.run(sc, infer_times_three, args, 2, 0, input_mode=INPUT) as cluster:
        t0 = time.monotonic()
        results = cluster.inference(rdd).collect()
        assert time.monotonic() - t0 < QUICK_S
    assert results == [3 * x for x in range(rows)]
    sizes = [s for r in _reports(tmp_path).values() for s in r["batch_sizes"]]
    assert max(sizes) <= rows // parts, sizes
    assert sum(sizes) == rows


def test_c09_too_few_results_fails_inference(sc, tmp_path, no_leftovers):
    """C09: a main_fun that answers a batch with one result too few fails inference()
    quickly, with the counts and the partition in the message."""
    rows, parts = 3488, 4
    rdd = sc.parallelize(range(rows), parts)
    args = {"out": str(tmp_path), "batch_size": rows, "drop_last": True}
    cluster = TFCluster.run(sc, infer_times_three, args, 2, 0, input_mode=INPUT)
    t0 = time.monotonic()
    with pytest.raises(ClusterFailedError) as info:
        cluster.inference(rdd).collect()
    assert time.monotonic() - t0 < QUICK_S
    text = str(info.value)
    assert "during inference()" in text
    assert re.search(r"batch_results\(\) got 871 results for a batch of 872 rows \(partition [0-3], rows 0-871\)", text), text
    assert "main_fun must return exactly one result per input row" in text
    assert any(f.error_type == "InferenceResultError" for f in info.value.failures), info.value.failures
    assert TFCluster.tf_status["error"].startswith("ClusterFailedError: ") and "got 871 results" in TFCluster.tf_status["error"]
    cluster.shutdown()  # already torn down by the failure: a no-op


def test_c10_bad_num_epochs_is_refused(sc, tmp_path, no_leftovers):
    """C10: num_epochs 0, -1 and 1.5 raise ConfigurationError at once (TFoS fed 0 as 10
    epochs); the cluster is unharmed and trains afterwards."""
    rdd = sc.parallelize(range(100), 2)
    cluster = TFCluster.run(sc, count_until_end, {"out": str(tmp_path)}, 2, 0, input_mode=INPUT)
    for bad in (0, -1, 1.5):
        t0 = time.monotonic()
        with pytest.raises(ConfigurationError) as info:
            cluster.train(rdd, num_epochs=bad)
        assert time.monotonic() - t0 < 5.0
        hint = " (TFoS fed 10 epochs for 0: pass num_epochs=10 to keep that)" if bad == 0 else ""
        assert str(info.value) == f"num_epochs must be an integer >= 1 (one epoch = one pass over every partition), got {bad!r}{hint}"
    cluster.train(rdd, num_epochs=2)
    cluster.shutdown(timeout=QUICK_S)
    reports = _reports(tmp_path)
    assert sum(r["rows"] for r in reports.values()) == 200
    assert sum(r["sum"] for r in reports.values()) == 2 * sum(range(100))


def test_c11_terminate_after_one_epoch_of_five(sc, tmp_path, caplog, no_leftovers):
    """C11: the node terminates the feed after one epoch's worth of rows (of 5 epochs):
    train() returns normally and quickly, and the rest is skipped."""
    caplog.set_level(logging.INFO, logger="tfos._driver")
    rows, parts, epochs = 1000, 5, 5
    rdd = sc.parallelize(range(rows), parts)
    args = {"out": str(tmp_path), "rows_per_epoch": rows, "batch_size": 200, "linger_s": 2}
    # One node, so "one epoch" is exact; the feed tasks on the other executor reach it remotely.
    cluster = TFCluster.run(sc, count_one_epoch_then_terminate, args, 1, 0, input_mode=INPUT)
    t0 = time.monotonic()
    cluster.train(rdd, num_epochs=epochs)
    assert time.monotonic() - t0 < QUICK_S
    cluster.shutdown(timeout=QUICK_S)
    report = _reports(tmp_path)["worker0"]
    # Exactly one epoch of rows: every chunk holds one whole 200-row partition and
    # next_batch(200) never returns more than asked, so the count stops at 1000. The
    # rows may come from epochs 0 and 1 (the two executors feed partitions concurrently).
    assert report["rows"] == rows
    assert report["should_stop"] is True and report["after"] == 0
    assert set(report["epochs_seen"]) <= {0, 1, 2}
    infos = [r.getMessage() for r in caplog.records if r.name.startswith("tfos._driver.")]
    skipped = [m for m in infos if "skipped after DataFeed.terminate()" in m]
    assert len(skipped) == 1, infos
    # A partition is acknowledged ('ok') when next_batch() reads its end marker. The 5th
    # partition's marker would be read only in the call after the 1,000th row, which
    # main_fun never makes, so at most 4 are acknowledged; the 4th's marker can be queued
    # behind the 5th's chunk (two feed tasks write to the queue concurrently), hence 3 or
    # 4. All the others (the 5th, cut off by the T frame, and those whose tasks found the
    # node gone after main_fun returned) count as skipped after terminate(), never as
    # "main_fun returned early".
    m = re.fullmatch(r"train\(\): (\d+) of 25 partitions skipped after DataFeed.terminate\(\)", skipped[0])
    assert m and int(m.group(1)) in (21, 22), skipped
    assert not [m for m in infos if "not consumed to their end" in m], infos


@pytest.mark.tf
def test_c12_uneven_partitions_under_mwms_finish(sc, tmp_path, no_leftovers):
    """C12: two workers in lock-step (MultiWorkerMirroredStrategy, tf_keras) fed partitions
    of 900 and 100 rows both finish, having trained on all 1,000 rows.

    The documented way (docs/datafeed.md): ``train(..., end_of_feed=True)`` ends every
    node's feed as soon as all partitions were handed over, so the worker that runs out
    sees the end of its dataset while the other still trains; tf.distribute's end-of-input
    sync then feeds it empty batches until both are done, and they leave in step.
    """
    k = 4
    sizes = (900, 100)
    rdd = sc.parallelize(range(2), 2).flatMap(lambda p: [_regression_row(i, k) for i in range(sum(sizes[:p]), sum(sizes[: p + 1]))])
    args = {"out": str(tmp_path), "k": k, "batch_size": 20}
    cluster = TFCluster.run(sc, mwms_linear_regression, args, 2, 0, input_mode=INPUT)
    t0 = time.monotonic()
    cluster.train(rdd, num_epochs=1, feed_timeout=120, end_of_feed=True)
    assert time.monotonic() - t0 < 2 * QUICK_S
    cluster.shutdown(timeout=QUICK_S)
    reports = _reports(tmp_path)
    assert sum(r["rows"] for r in reports.values()) == sum(sizes)
    assert reports["worker0"]["loss"] == reports["worker1"]["loss"]


@pytest.mark.tf
def test_c19_malformed_rows_name_partition_and_row(sc, tmp_path, no_leftovers):
    """C19: a 783-float row (partition 1, row 7) and a None row (partition 2, row 13) fail
    train() with the partition and row of the bad row; the cluster shuts down cleanly."""
    per_part = 50

    def make(p, it):
        for r, i in enumerate(it):
            if (p, r) == (1, 7):
                yield (np.zeros(783, np.float32), i)
            elif (p, r) == (2, 13):
                yield None
            else:
                yield (np.full(784, i, np.float32), i)

    rdd = sc.parallelize(range(4 * per_part), 4).mapPartitionsWithIndex(make)
    cluster = TFCluster.run(sc, read_mnist_dataset, {"out": str(tmp_path)}, 2, 0, input_mode=INPUT)
    t0 = time.monotonic()
    with pytest.raises(ClusterFailedError) as info:
        cluster.train(rdd, num_epochs=1)
    assert time.monotonic() - t0 < QUICK_S
    cluster.shutdown()
    text = str(info.value)
    assert "during train()" in text
    expected = {
        "partition 1 (epoch 0), row 7": "column 0: expected shape (784,), got (783,)",
        "partition 2 (epoch 0), row 13": "the row is None",
    }
    found = re.findall(r"malformed row in (partition \d+ \(epoch \d+\), row \d+): ([^\n]*)", text)
    assert found, text
    for where, why in found:
        assert where in expected, text
        assert why.startswith(expected[where]), text
    # The node whose dataset held a bad row failed; the other one may have seen the end of
    # its feed (the abort closes it) and returned normally, having read only good rows.
    assert all(r["rows"] < 4 * per_part for r in _reports(tmp_path).values())


def test_feed_timeout_names_node_and_partition(sc, tmp_path, no_leftovers):
    """A main_fun that stops consuming: with feed_timeout=3, train() fails within seconds
    with a FeedTimeoutError text naming the node and the partition, and showing where
    main_fun is (its stack, asked from the node). The rows go out once main_fun runs
    (tests/spark/feed_gate.py), so the 3 s count while it waits, not while it starts."""
    # 2 partitions of 40 x 1 MiB rows: far more than the node's queue (4 chunks) plus the
    # socket buffers hold, so the feed task blocks sending.
    out = str(tmp_path)
    rdd = sc.parallelize(range(2), 2).flatMap(lambda p: after_started(out, 1, (bytes(1 << 20) for _ in range(40))))
    cluster = TFCluster.run(sc, stop_consuming, {"out": out}, 1, 0, input_mode=INPUT)
    with pytest.raises(ClusterFailedError) as info:
        cluster.train(rdd, num_epochs=1, feed_timeout=3)
    assert time.time() - started_at(out) < QUICK_S  # 3 s, the node's stack, the teardown
    cluster.shutdown()
    text = str(info.value)
    assert "during train()" in text
    assert re.search(
        r"worker:0 \(executor 0, host [^)]+\) accepted no data for 3 s while feeding partition [01] \(epoch 0\) "
        r"-> worker:0 \(executor 0, host [^)]+\): main_fun is not reading queue 'input'",
        text,
    ), text
    first = info.value.failures[0]
    assert (first.kind, first.error_type) == ("feed", "FeedTimeoutError"), info.value.failures
    assert "lost the data connection" not in text  # a timeout is not a lost connection
    # Where main_fun stopped: its stack, from main_fun inward, with the user's source line.
    assert re.search(r"main_fun's stack on worker:0 \(executor 0, host [^)]+\) \(TF process pid \d+, thread MainThread\), innermost call last:\n"
                     r'  File "[^"]*test_feed_cases\.py", line \d+, in stop_consuming\n'
                     r"    ctx\.stop_event\.wait\(300\)\n", first.message), first.message


def read_slowly_and_steadily(args, ctx):
    """Reads 10 rows every 0.1 s (100 rows/s) to the end of the feed: never a second
    without taking rows, but far slower than the feed."""
    import time as _time

    mark_started(args["out"], ctx)
    feed = ctx.get_data_feed()
    rows = []
    while not feed.should_stop():
        rows.extend(feed.next_batch(10))
        _time.sleep(0.1)
    _write(args, ctx, {"rows": len(rows), "sum": sum(rows)})


def test_feed_timeout_bounds_a_stall_not_the_time_to_consume_queued_rows(sc, tmp_path, no_leftovers):
    """A node that takes rows steadily, just slowly, is not "stopped consuming": each
    partition (600 rows, one chunk, sent at once) takes the node about 6 s to read, 1.5 x
    feed_timeout=4 after its END. The feed task waits for its ACK past feed_timeout because
    the node tells it that main_fun is still taking rows. The rows go out once both
    main_funs run (tests/spark/feed_gate.py): a node still starting takes none."""
    out = str(tmp_path)
    rdd = sc.parallelize(range(1200), 2).mapPartitions(lambda rows: after_started(out, 2, rows))
    cluster = TFCluster.run(sc, read_slowly_and_steadily, {"out": out}, 2, 0, input_mode=INPUT)
    t0 = time.monotonic()
    cluster.train(rdd, num_epochs=1, feed_timeout=4)
    took = time.monotonic() - t0
    cluster.shutdown(timeout=QUICK_S)
    reports = _reports(tmp_path)
    assert sum(r["rows"] for r in reports.values()) == 1200
    assert sum(r["sum"] for r in reports.values()) == sum(range(1200))
    assert took > 4  # the partitions did take longer than feed_timeout to consume


def test_inference_timeout_shows_where_main_fun_waits(sc, tmp_path, no_leftovers):
    """Inference with a main_fun that takes a batch and never answers: with feed_timeout=3,
    inference() fails within seconds with a FeedTimeoutError naming the node and the
    partition, followed by main_fun's stack down to the line it waits on. The rows go out
    once main_fun runs (tests/spark/feed_gate.py)."""
    out = str(tmp_path)
    rdd = sc.parallelize(range(40), 2).mapPartitions(lambda rows: after_started(out, 1, rows))
    cluster = TFCluster.run(sc, answer_nothing, {"out": out}, 1, 0, input_mode=INPUT)
    with pytest.raises(ClusterFailedError) as info:
        cluster.inference(rdd, feed_timeout=3).count()
    assert time.time() - started_at(out) < QUICK_S
    cluster.shutdown()
    first = info.value.failures[0]
    assert (first.kind, first.error_type) == ("feed", "FeedTimeoutError"), info.value.failures
    assert re.search(r"worker:0 \(executor 0, host [^)]+\) sent nothing for 3 s for partition [01] \(epoch 0\) "
                     r"-> worker:0 \(executor 0, host [^)]+\): main_fun stopped consuming or producing results\n"
                     r"main_fun's stack on worker:0 \(executor 0, host [^)]+\) \(TF process pid \d+, thread MainThread\), "
                     r"innermost call last:\n"
                     r'  File "[^"]*test_feed_cases\.py", line \d+, in answer_nothing\n'
                     r"    _wait_for_the_driver\(ctx\)\n"
                     r'  File "[^"]*test_feed_cases\.py", line \d+, in _wait_for_the_driver\n'
                     r"    ctx\.stop_event\.wait\(300\)  # where the stack must point\n", first.message), first.message
    assert str(info.value).count("main_fun's stack on worker:0") >= 1


def _corrupt_at_12345(x):
    if x == 12345:
        raise ValueError(f"corrupt record {x}: cannot parse")
    return x


@pytest.mark.parametrize("mode", ["train", "inference"])
def test_an_error_in_the_rdds_own_code_is_the_error_shown(sc, tmp_path, mode, no_leftovers):
    """The fed RDD's own map raises on a corrupt record: Spark retries the feed task and
    tfos refuses the retry (it would feed rows twice). The error shown names the user's
    exception, its text and traceback, and the partition, not only the refusal (before,
    only "Spark retried the feed task" was listed; the cause was in Spark's WARN log)."""
    rdd = sc.parallelize(range(20000), 8).map(_corrupt_at_12345)
    main = infer_times_three if mode == "inference" else count_until_end
    args = {"out": str(tmp_path), "batch_size": 100}
    cluster = TFCluster.run(sc, main, args, 2, 0, input_mode=INPUT)
    t0 = time.monotonic()
    with pytest.raises(ClusterFailedError) as info:
        if mode == "train":
            cluster.train(rdd, num_epochs=1, feed_timeout=60)
        else:
            cluster.inference(rdd, feed_timeout=60).collect()
    assert time.monotonic() - t0 < QUICK_S
    causes = [f for f in info.value.failures if f.kind == "spark"]
    assert len(causes) == 1, info.value.failures
    f = causes[0]
    assert f.error_type == "ValueError" and f.message.startswith("corrupt record 12345: cannot parse (raised by the RDD's or "), f
    # partition 4 of 8 holds 10000-12499; attempt 1 is Spark's first try
    assert "Spark task of partition 4, attempt 1," in f.message and f.message.endswith("not by main_fun)"), f
    assert 'raise ValueError(f"corrupt record {x}: cannot parse")' in f.traceback, f.traceback
    assert f.traceback.endswith("ValueError: corrupt record 12345: cannot parse"), f.traceback
    assert f"- [spark] {f.node_name}: ValueError: corrupt record 12345" in str(info.value)
    cluster.shutdown()


def _slow_identity(x):
    time.sleep(0.0005)
    return x


def test_shutdown_from_another_thread_waits_for_the_running_train(sc, tmp_path, caplog, no_leftovers):
    """shutdown() called while train() feeds in another thread waits for that train() to
    end, then ends the feed: every row is trained on, and train() returns normally
    (before, shutdown() ended the feed part-way and the nodes saw a clean end of feed
    after 12,288 of 40,000 rows)."""
    import threading

    caplog.set_level(logging.WARNING, logger="tfos._driver")
    rows = 20000
    rdd = sc.parallelize(range(rows), 8).map(_slow_identity)  # ~5 s of feeding per executor
    cluster = TFCluster.run(sc, count_until_end, {"out": str(tmp_path)}, 2, 0, input_mode=INPUT)
    outcome: dict = {}

    def _train():
        try:
            cluster.train(rdd, num_epochs=1, feed_timeout=60)
            outcome["train"] = "ok"
        except BaseException as exc:  # noqa: BLE001 - asserted below
            outcome["train"] = repr(exc)

    t = threading.Thread(target=_train)
    t.start()
    end = time.monotonic() + QUICK_S
    while cluster._ctl.feeds._count == 0 and time.monotonic() < end:
        time.sleep(0.05)
    time.sleep(1.0)
    assert t.is_alive(), "train() ended before shutdown() was called: the test proves nothing"
    cluster.shutdown(timeout=QUICK_S)
    t.join(QUICK_S)
    assert outcome == {"train": "ok"}
    reports = _reports(tmp_path)
    assert sum(r["rows"] for r in reports.values()) == rows
    assert sum(r["sum"] for r in reports.values()) == sum(range(rows))
    assert any("shutdown() waits for the train()/inference() call running in another thread" in r.getMessage() for r in caplog.records)


def test_an_exception_in_the_with_block_tells_the_nodes_why_they_were_aborted(sc, tmp_path, no_leftovers):
    """The driver's own code raises inside ``with TFCluster.run(...)``: the nodes' feeds are
    cut off with that reason (their FeedAbortedError said "the cluster failed", though no
    node had failed), and the user's exception propagates unchanged."""
    with pytest.raises(ValueError, match="driver-side bug"):
        with TFCluster.run(sc, count_until_end, {"out": str(tmp_path)}, 2, 0, input_mode=INPUT) as cluster:
            cluster.train(sc.parallelize(range(100), 2), num_epochs=1)
            raise ValueError("driver-side bug")
    abort_reason, failures = cluster._ctl.backend.host.read(lambda core: (core.abort_reason, list(core.failures)))
    assert abort_reason == "the driver program raised ValueError inside `with TFCluster.run(...)`"
    assert not failures
