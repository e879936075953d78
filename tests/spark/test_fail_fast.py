"""Report first, tear down second (C22); attribution after a feed timeout; busy
slots (C25); progress line after errors and exact final row count."""

from __future__ import annotations

import gc
import logging
import re
import threading
import time

import pytest
from feed_gate import after_started, mark_started

from tfos import TFCluster
from tfos.errors import ClusterFailedError, ReservationTimeoutError

pytestmark = pytest.mark.spark


def busy_and_boom(args, ctx):
    """worker 0 computes without looking at its feed; worker 1 raises after its first batch."""
    import time as _time

    if args.get("out"):
        mark_started(args["out"], ctx)
    feed = ctx.get_data_feed(train_mode=True)
    feed.next_batch(10)
    if ctx.executor_id == 0 and not args.get("busy", True):
        while not feed.should_stop():
            feed.next_batch(10)
        return
    if ctx.executor_id == 0:
        x = 0
        end = _time.monotonic() + 600
        while _time.monotonic() < end:  # busy in "compute" until the abort ends the process
            x = (x * 31 + 7) % 1000003
        return
    _time.sleep(args.get("delay", 0.0))
    raise ValueError(f"boom on executor {ctx.executor_id}")


def test_exception_while_other_node_computes_names_only_the_root_cause(sc, no_leftovers):
    cluster = TFCluster.run(sc, busy_and_boom, {}, 2, 0, input_mode=TFCluster.InputMode.SPARK, reservation_timeout=300)
    with pytest.raises(ClusterFailedError) as ei:
        cluster.train(sc.parallelize(range(200000), 4), feed_timeout=600)
    err = ei.value
    text = str(err)
    assert [(f.executor_id, f.kind, f.error_type) for f in err.failures] == [(1, "exception", "ValueError")], text
    assert "1 node(s) reported 1 distinct error(s)" in text
    assert "worker:1 (executor 1, host" in text and "ValueError: boom on executor 1" in text
    assert "in busy_and_boom" in text  # the remote traceback
    assert "FeedError" not in text and "worker:0" not in text
    # TFoS's module-level status records it too (TFoS set it when its node job failed).
    assert TFCluster.tf_status["error"].startswith("ClusterFailedError: ") and "boom on executor 1" in TFCluster.tf_status["error"]
    cluster.shutdown()  # joins the background teardown: the busy node was stopped


def test_exception_during_feeding_after_a_feed_timeout_names_the_exception(sc, tmp_path, no_leftovers):
    # worker 1 stops reading for 3.5 s (its feed task times out after 3 s), then raises:
    # the error must name the ValueError, not only the FeedTimeoutError it caused. The rows
    # go out once both main_funs run (tests/spark/feed_gate.py): a node still starting on
    # a loaded machine must not time out first; 3 s leave worker 0, which reads on, room.
    out = str(tmp_path)
    cluster = TFCluster.run(sc, busy_and_boom, {"delay": 3.5, "busy": False, "out": out}, 2, 0,
                            input_mode=TFCluster.InputMode.SPARK, reservation_timeout=300)
    rdd = sc.parallelize(range(400000), 4).mapPartitions(lambda rows: after_started(out, 2, rows))
    with pytest.raises(ClusterFailedError) as ei:
        cluster.train(rdd, feed_timeout=3)
    err = ei.value
    text = str(err)
    assert [(f.executor_id, f.error_type) for f in err.failures] == [(1, "ValueError")], text
    assert "ValueError: boom on executor 1" in text and "FeedTimeoutError" not in text
    cluster.shutdown()


def _hog(sc, started: threading.Event):
    def _sleep(x):
        import time as _t

        _t.sleep(300)
        return x

    sc.setJobGroup("tfos-test-hog", "a job that holds one executor slot", interruptOnCancel=True)
    started.set()
    try:
        sc.parallelize([0], 1).map(_sleep).collect()
    except Exception:  # noqa: BLE001 - cancelled at the end of the test
        pass


def test_busy_slots_are_named_within_15_s_and_in_the_timeout_error(sc, caplog, no_leftovers):
    started = threading.Event()
    t = threading.Thread(target=_hog, args=(sc, started), daemon=True)
    t.start()
    started.wait(30)
    tracker = sc.statusTracker()
    end = time.monotonic() + 120
    while time.monotonic() < end and not any(
        (tracker.getStageInfo(s) or None) and tracker.getStageInfo(s).numActiveTasks for s in tracker.getActiveStageIds()
    ):
        time.sleep(0.2)
    warned_at = []

    class _Catch(logging.Handler):
        def emit(self, record):
            if "waited" in record.getMessage() and "task slots" in record.getMessage():
                warned_at.append((time.monotonic(), record.getMessage()))

    handler = _Catch(logging.WARNING)
    logging.getLogger("tfos._driver").addHandler(handler)
    t0 = time.monotonic()
    try:
        with pytest.raises(ReservationTimeoutError) as ei:
            # The WARNING must come within 15 s of the start stage's wait; the deadline leaves
            # a loaded machine 10 s more for run()'s checks before that wait.
            TFCluster.run(sc, busy_and_boom, {}, 2, 0, input_mode=TFCluster.InputMode.SPARK, reservation_timeout=25)
    finally:
        logging.getLogger("tfos._driver").removeHandler(handler)
        sc.cancelJobGroup("tfos-test-hog")
        t.join(60)
    assert warned_at, "no WARNING about busy slots"
    when, msg = warned_at[0]
    # The start stage's own clock (the WARNING says how long it waited): 8 s, at most 15 s;
    # from before run() (its checks and the start job's submission first) at most 25 s.
    waited = float(re.search(r"has waited (\d+) s for task slots", msg).group(1))
    assert 8 <= waited <= 15, msg
    assert when - t0 <= 25.0, f"busy-slot WARNING after {when - t0:.1f} s"
    assert "1 of 2 executor slot(s) busy: executor" in msg and "'tfos-test-hog'" in msg, msg
    text = str(ei.value)
    assert "never registered" in text and "executor slot(s) busy: executor" in text and "'tfos-test-hog'" in text, text


def feed_all(args, ctx):
    feed = ctx.get_data_feed(train_mode=True)
    while not feed.should_stop():
        feed.next_batch(100)


def test_progress_final_row_count_is_exact_and_no_stale_line_after_error(sc, capfd, monkeypatch, no_leftovers):
    monkeypatch.setenv("TFOS_PROGRESS", "1")
    cluster = TFCluster.run(sc, feed_all, {}, 2, 0, input_mode=TFCluster.InputMode.SPARK, reservation_timeout=300)
    try:
        # 2 x 12,300 rows read in batches of 100: every row reaches main_fun before train()
        # returns (a partial last batch would wait for the end of the feed at shutdown())
        cluster.train(sc.parallelize(range(12300), 6), num_epochs=2)
        err = capfd.readouterr().err
        last = [ln for ln in err.replace("\r", "\n").splitlines() if "tfos train" in ln][-1]
        assert "100%" in last and "24,600 rows" in last, last
    finally:
        cluster.shutdown()
    cluster = TFCluster.run(sc, busy_and_boom, {}, 2, 0, input_mode=TFCluster.InputMode.SPARK, reservation_timeout=300)
    with pytest.raises(ClusterFailedError):
        cluster.train(sc.parallelize(range(200000), 4))
    capfd.readouterr()
    cluster.shutdown()
    gc.collect()
    assert "tfos train" not in capfd.readouterr().err  # nothing printed after the error


def test_a_program_ends_within_seconds_of_a_node_error_with_no_false_loss(tmp_path):
    """A driver program whose main_fun raises on one node (tests/spark/failing_program.py,
    its own local-cluster): the error names only that node, the healthy node is stopped
    (its exit report reaches the driver while the interpreter exits) and never reported
    lost, and the program ends within seconds of the error, not after heartbeat_timeout
    (it once logged 'NodeLost: no heartbeat for 15.6 s' for the healthy node and ended
    16 s after the error). The bound leaves room for a loaded machine: the teardown is
    one abort directive (about 1 s) plus the SparkContext's stop."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    program = Path(__file__).with_name("failing_program.py")
    env = dict(os.environ, TFOS_PROGRESS="0")
    with open(tmp_path / "err", "wb") as err:
        proc = subprocess.run([sys.executable, str(program)], env=env, stdout=subprocess.PIPE, stderr=err, timeout=600)
    ended = time.time()
    out = proc.stdout.decode()
    stderr = (tmp_path / "err").read_text(errors="replace")
    assert proc.returncode == 1, f"{out}\n{stderr[-5000:]}"
    error_at = float(next(ln.split()[1] for ln in out.splitlines() if ln.startswith("error-at ")))
    assert "ClusterFailedError" in out and "1 node(s) reported 1 distinct error(s)" in out, out
    assert "tfos node failed: worker:1 (executor 1, host 127.0.0.1): ValueError: a bug in main_fun on one node" in stderr
    assert "NodeLost" not in stderr and "tfos node failed: worker:0" not in stderr, stderr[-5000:]
    assert ended - error_at < 10.0, f"the program ended {ended - error_at:.1f} s after the error:\n{stderr[-3000:]}"
    # no wall of Spark errors at exit: on local-cluster the JVM's shutdown hooks once killed
    # the executors before the application ended, and the Master relaunched them during the
    # shutdown (300-1,400 lines of 'Failed to launch executor' / 'failed 21 times; removing it')
    assert "Failed to launch executor" not in stderr and "removing it" not in stderr, stderr[-3000:]
    assert "Shutdown hooks cannot be modified" not in stderr, stderr[-3000:]
