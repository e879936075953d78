"""Reliability: fail fast, never hang, leave nothing behind (C03, C04, C08).

Every test kills or breaks a node in a different way and asserts three things: the driver
call raises a :class:`ClusterFailedError` that names the node and the cause, it does so
well within a generous bound (far below ``feed_timeout``), and no tfos process or port is
left behind. The main_funs need no TensorFlow, so each cluster starts in a few seconds.

The executor-JVM kill test uses its own SparkContext and sits at the end of the file, so
the shared context of the other tests is never damaged.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

pytest.importorskip("pyspark")

from tfos import TFCluster  # noqa: E402
from tfos.errors import ClusterFailedError, TFOSError  # noqa: E402

from conftest import assert_no_tfos_processes, tfos_processes  # noqa: E402

def _handle(host, body: dict, peer: str = "127.0.0.1:1") -> dict:
    """One request answered in this thread (a long-poll waited for here)."""
    return host.resolve(host.prepare(body, peer).run())


pytestmark = pytest.mark.spark

SPARK = TFCluster.InputMode.SPARK
TENSORFLOW = TFCluster.InputMode.TENSORFLOW

#: Generous bound on any failing call: the point is "seconds, not feed_timeout (600 s)".
FAST_S = 60.0


# --------------------------------------------------------------------------- helpers
def _touch(path: str, text: str = "") -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _wait_for_file(path: Path, timeout_s: float = 60.0) -> str:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if path.exists():
            return path.read_text()
        time.sleep(0.05)
    raise AssertionError(f"{path} did not appear within {timeout_s} s")


def _node(cluster, executor_id: int) -> dict:
    [info] = [n for n in cluster.cluster_info if n["executor_id"] == executor_id]
    return info


def _java_ancestor(pid: int) -> psutil.Process:
    for parent in psutil.Process(pid).parents():
        if parent.name().startswith("java"):
            return parent
    raise AssertionError(f"no java ancestor of pid {pid}")


def _listening_ports(ports) -> list:
    wanted = {p for p in ports if p}
    return [c for c in psutil.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port in wanted]


def _assert_ports_closed(ports, timeout_s: float = 20.0) -> None:
    end = time.monotonic() + timeout_s
    left = _listening_ports(ports)
    while left and time.monotonic() < end:
        time.sleep(0.2)
        left = _listening_ports(ports)
    assert not left, f"ports still listening after the cluster ended: {left}"


def _assert_fast(t0: float, bound: float = FAST_S) -> float:
    elapsed = time.monotonic() - t0
    assert elapsed < bound, f"the failure took {elapsed:.1f} s to surface (bound {bound} s)"
    return elapsed


# --------------------------------------------------------------------------- main_funs
def _feed_then_die(args, ctx):
    """worker:1 dies hard after its first batch; the others read until the feed ends."""
    import os
    import signal
    import time

    feed = ctx.get_data_feed(train_mode=True)
    feed.next_batch(10)
    if ctx.executor_id == 1:
        _touch(args["marker"], str(time.time()))
        if args["how"] == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    while not feed.should_stop():
        feed.next_batch(10)
        time.sleep(0.01)


def _feed_then_raise(args, ctx):
    """worker:1 raises after its first batch (while feed tasks are still sending)."""
    feed = ctx.get_data_feed(train_mode=True)
    feed.next_batch(10)
    if ctx.executor_id == 1:
        raise ZeroDivisionError("worker one divides by zero")
    while not feed.should_stop():
        feed.next_batch(10)


def _slow_reader(args, ctx):
    """Reads slowly; worker:1 writes a marker (with its pid) after its first batch."""
    import os
    import time

    feed = ctx.get_data_feed(train_mode=True)
    first = True
    while not feed.should_stop():
        feed.next_batch(5)
        if first and ctx.executor_id == 1:
            _touch(args["marker"], str(os.getpid()))
            first = False
        time.sleep(0.05)


def _tf_mode_fault(args, ctx):
    """InputMode.TENSORFLOW: worker:1 raises or exits after a short delay."""
    import os
    import time

    time.sleep(args.get("delay", 1.0))
    if ctx.executor_id == 1:
        _touch(args["marker"], str(time.time()))
        if args["how"] == "raise":
            raise RuntimeError("boom from worker one")
        os._exit(5)
    time.sleep(args.get("others", 0.5))


def _consume_all_then_raise(args, ctx):
    """C04: reads every row, then fails 2 s after the feed ended."""
    import time

    feed = ctx.get_data_feed(train_mode=True)
    rows = 0
    while not feed.should_stop():
        rows += len(feed.next_batch(50))
    time.sleep(2.0)
    raise ValueError(f"late failure after consuming {rows} rows on executor {ctx.executor_id}")


def _sum_rows(args, ctx):
    """Sums every fed row and writes the sum to a file per node."""
    feed = ctx.get_data_feed(train_mode=True)
    total = 0
    while not feed.should_stop():
        total += sum(feed.next_batch(100))
    _touch(os.path.join(args["out"], f"sum{ctx.executor_id}"), str(total))


def _raise_at_once(args, ctx):
    feed = ctx.get_data_feed(train_mode=True)
    feed.next_batch(1)
    raise KeyError("leftover-test failure")


def _idle(args, ctx):
    """InputMode.TENSORFLOW: waits until the driver stops the node (or 120 s)."""
    ctx.stop_event.wait(args.get("wait", 120.0))


# --------------------------------------------------------------------------- C03: hard death in SPARK mode
@pytest.mark.parametrize("how,cause", [("exit", "exit code 3"), ("sigkill", "SIGKILL")])
def test_tf_process_death_fails_train_fast(sc, no_leftovers, tmp_path, how, cause):
    marker = tmp_path / "died"
    cluster = TFCluster.run(sc, _feed_then_die, {"marker": str(marker), "how": how}, 2, 0, input_mode=SPARK)
    rdd = sc.parallelize(range(20000), 8)
    t0 = time.monotonic()
    with pytest.raises(ClusterFailedError) as ei:
        cluster.train(rdd, num_epochs=2, feed_timeout=600)
    elapsed = _assert_fast(t0)
    assert marker.exists()
    text = str(ei.value)
    assert "worker:1 (executor 1" in text, text
    assert cause in text, text
    assert "during train()" in text
    assert any(f.executor_id == 1 and f.kind in ("exited", "feed") for f in ei.value.failures)
    assert elapsed < 600 / 10  # far below feed_timeout: no feed task waited for it
    # the cluster is closed: shutdown() is a no-op, further calls refuse.
    cluster.shutdown()
    with pytest.raises(TFOSError, match="already shut down"):
        cluster.train(rdd)


def test_exception_while_feeding_carries_remote_traceback(sc, no_leftovers, tmp_path):
    marker = tmp_path / "raised"
    cluster = TFCluster.run(sc, _feed_then_raise, {"marker": str(marker)}, 2, 0, input_mode=SPARK)
    t0 = time.monotonic()
    with pytest.raises(ClusterFailedError) as ei:
        cluster.train(sc.parallelize(range(20000), 8), num_epochs=1, feed_timeout=600)
    _assert_fast(t0)
    text = str(ei.value)
    # the node's own report is always in, even when a feed task reported the broken
    # connection first
    assert "worker:1 (executor 1" in text, text
    assert "ZeroDivisionError: worker one divides by zero" in text, text
    assert "Traceback" in text and "_feed_then_raise" in text, text
    assert any(f.kind == "exception" and f.executor_id == 1 and f.traceback for f in ei.value.failures)
    assert {f.executor_id for f in ei.value.failures} == {1}, text


# --------------------------------------------------------------------------- TENSORFLOW mode
def test_tensorflow_mode_exception_raises_in_shutdown(sc, no_leftovers, tmp_path):
    marker = tmp_path / "raised"
    cluster = TFCluster.run(sc, _tf_mode_fault, {"marker": str(marker), "how": "raise", "others": 60.0}, 2, 0, input_mode=TENSORFLOW)
    t0 = time.monotonic()
    with pytest.raises(ClusterFailedError) as ei:
        cluster.shutdown()
    _assert_fast(t0)
    text = str(ei.value)
    assert "worker:1 (executor 1" in text, text
    assert "RuntimeError: boom from worker one" in text, text
    assert "Traceback" in text and "_tf_mode_fault" in text, text
    # worker:0 was stopped by tfos (its start task cancelled): not reported as a failure.
    [f] = ei.value.failures
    assert (f.executor_id, f.kind, f.error_type) == (1, "exception", "RuntimeError")


def test_tensorflow_mode_exit_code(sc, no_leftovers, tmp_path):
    marker = tmp_path / "exited"
    cluster = TFCluster.run(sc, _tf_mode_fault, {"marker": str(marker), "how": "exit", "others": 60.0}, 2, 0, input_mode=TENSORFLOW)
    t0 = time.monotonic()
    with pytest.raises(ClusterFailedError) as ei:
        cluster.shutdown()
    _assert_fast(t0)
    text = str(ei.value)
    assert "worker:1 (executor 1" in text, text
    assert "exit code 5" in text, text
    assert [(f.executor_id, f.kind) for f in ei.value.failures] == [(1, "exited")], text


# --------------------------------------------------------------------------- C04
def test_late_exception_after_feed_is_reported_by_shutdown(sc, no_leftovers):
    cluster = TFCluster.run(sc, _consume_all_then_raise, None, 2, 0, input_mode=SPARK)
    cluster.train(sc.parallelize(range(1000), 4), num_epochs=1, feed_timeout=600)
    t0 = time.monotonic()
    with pytest.raises(ClusterFailedError) as ei:
        cluster.shutdown(grace_secs=0)
    _assert_fast(t0)
    text = str(ei.value)
    assert "Traceback" in text, text
    assert "ValueError: late failure after consuming" in text, text
    assert "during shutdown()" in text
    # TFoS's module-level status records it (it stayed {} when shutdown() raised: audit helper)
    assert TFCluster.tf_status["error"].startswith("ClusterFailedError: ") and "late failure after consuming" in TFCluster.tf_status["error"]
    # both nodes fail ~together; the first report ends the wait (the other may follow).
    assert {f.executor_id for f in ei.value.failures} <= {0, 1}
    assert all(f.kind == "exception" and f.error_type == "ValueError" for f in ei.value.failures)
    # each node consumed its share of the 1000 rows before failing.
    consumed = [int(f.message.split("consuming ")[1].split()[0]) for f in ei.value.failures]
    assert all(0 < c <= 1000 for c in consumed), consumed


# --------------------------------------------------------------------------- leftovers
def test_nothing_left_behind_after_success_and_failure(sc, tmp_path):
    assert_no_tfos_processes()
    before = {p for p, _ in tfos_processes()}
    assert not before

    # success
    out = tmp_path / "out"
    out.mkdir()
    cluster = TFCluster.run(sc, _sum_rows, {"out": str(out)}, 2, 0, input_mode=SPARK)
    info = cluster.cluster_info
    ports = [n["port"] for n in info] + [n["data_port"] for n in info]
    pids = [n["pid"] for n in info]
    assert all(p > 0 for p in ports) and len(set(ports)) == 4
    assert _listening_ports([n["data_port"] for n in info]), "data servers should listen while the cluster runs"
    server_port = cluster.server.port
    cluster.train(sc.parallelize(range(500), 4), num_epochs=1)
    cluster.shutdown()
    assert sum(int((out / f"sum{e}").read_text()) for e in (0, 1)) == sum(range(500))
    assert_no_tfos_processes()
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
    _assert_ports_closed(ports + [server_port])

    # failure
    cluster = TFCluster.run(sc, _raise_at_once, None, 2, 0, input_mode=SPARK)
    info = cluster.cluster_info
    ports = [n["port"] for n in info] + [n["data_port"] for n in info]
    server_port = cluster.server.port
    with pytest.raises(ClusterFailedError) as ei:
        cluster.train(sc.parallelize(range(500), 4), num_epochs=1)
    assert "KeyError" in str(ei.value) and "leftover-test failure" in str(ei.value)
    assert_no_tfos_processes()
    _assert_ports_closed(ports + [server_port])
    # the shared context still works after the failed cluster
    assert sc.parallelize(range(10), 2).sum() == 45


# --------------------------------------------------------------------------- orphan TF process
def test_tf_process_exits_when_its_supervisor_dies(sc, no_leftovers):
    cluster = TFCluster.run(sc, _idle, {"wait": 120.0}, 2, 0, input_mode=TENSORFLOW, heartbeat_timeout=5.0)
    tf_pid = _node(cluster, 1)["pid"]
    tf_proc = psutil.Process(tf_pid)
    supervisor = tf_proc.parent()
    assert "tfos._node.supervisor" in " ".join(supervisor.cmdline())
    t0 = time.monotonic()
    supervisor.kill()
    gone, _ = psutil.wait_procs([tf_proc], timeout=15.0)
    assert gone, "the TF process outlived its supervisor"
    tf_exit = time.monotonic() - t0
    assert tf_exit < 15.0
    with pytest.raises(ClusterFailedError) as ei:
        cluster.shutdown()
    _assert_fast(t0, 30.0)
    text = str(ei.value)
    assert "worker:1 (executor 1" in text, text
    # the orphaned TF process reports it before it exits (before: the heartbeat timeout)
    assert "SupervisorDied: the node's supervisor process died" in text, text
    assert [(f.executor_id, f.kind, f.error_type) for f in ei.value.failures] == [(1, "lost", "SupervisorDied")], text


# --------------------------------------------------------------------------- control plane
def test_control_server_binds_driver_host_and_port_range(sc, no_leftovers, monkeypatch):
    base = 20000 + (os.getpid() * 7) % 30000
    monkeypatch.setenv("TFOS_SERVER_PORT", f"{base}-{base + 40}")
    out_of_range = []
    with TFCluster.run(sc, _idle, {"wait": 0.5}, 2, 0, input_mode=TENSORFLOW) as cluster:
        host, port = cluster.server.host, cluster.server.port
        assert host == "127.0.0.1"
        assert base <= port <= base + 40, (port, base)
        mine = [c for c in psutil.Process().net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
        assert mine and all(c.laddr.ip == "127.0.0.1" for c in mine), mine
        out_of_range = [c for c in mine if c.laddr.ip in ("0.0.0.0", "::")]
    assert not out_of_range
    _assert_ports_closed([port])


# --------------------------------------------------------------------------- executor JVM killed
def test_executor_jvm_killed_while_training(spark_manager, tmp_path):
    sc = spark_manager.get()  # the shared context: Spark replaces the killed executor, the next get() waits for it
    assert_no_tfos_processes()
    marker = tmp_path / "reading"
    hb = 10.0
    cluster = TFCluster.run(sc, _slow_reader, {"marker": str(marker)}, 2, 0, input_mode=SPARK, heartbeat_timeout=hb)
    tf_pid = _node(cluster, 1)["pid"]
    jvm = _java_ancestor(tf_pid)
    jvm_cmdline = jvm.cmdline()
    assert "CoarseGrainedExecutorBackend" in " ".join(jvm_cmdline)
    assert sc.applicationId in " ".join(jvm.cmdline())
    killed = {}

    def _kill_when_reading() -> None:
        _wait_for_file(marker)
        killed["t"] = time.monotonic()
        jvm.send_signal(signal.SIGKILL)

    killer = threading.Thread(target=_kill_when_reading, daemon=True)
    killer.start()
    with pytest.raises(ClusterFailedError) as ei:
        cluster.train(sc.parallelize(range(200000), 8), num_epochs=1, feed_timeout=600)
    caught = time.monotonic()
    killer.join(5.0)
    assert "t" in killed, "the JVM was never killed"
    assert caught - killed["t"] < 2 * hb, f"took {caught - killed['t']:.1f} s"
    text = str(ei.value)
    assert "worker:1 (executor 1" in text, text
    # the node's supervisor sees its JVM go (within ~1 s); a heartbeat timeout is the fallback
    assert "executor JVM" in text or "no heartbeat" in text, text
    if "executor JVM" in text:  # names the JVM as Spark's "Lost executor <id>" line does
        args = jvm_cmdline
        spark_id = args[args.index("--executor-id") + 1]
        assert f"(pid {jvm.pid}, Spark executor id {spark_id})" in text, text
    assert any(f.executor_id == 1 and f.kind == "lost" for f in ei.value.failures), text
    assert_no_tfos_processes()


# --------------------------------------------------------------------------- pure regression (no Spark needed)
def test_registered_node_is_watched_before_its_first_heartbeat():
    """A supervisor that dies before its first heartbeat must still be declared lost."""
    from tfos._control.host import ClusterHost
    from tfos.cluster_template import NodeInfo, NodeRole

    st = ClusterHost("c1", [NodeRole(0, "worker", 0)], heartbeat_timeout_s=5.0)
    node = NodeInfo(0, "worker", 0, "127.0.0.1", 1234, 0, 42, "h/1")
    assert _handle(st, {"cluster": "c1", "type": "register", "node": node.to_dict()}, "peer")["ok"]
    st.check_liveness(now=time.monotonic() + 6.0)
    assert st.core.failed
    [f] = st.core.failures
    assert f.kind == "lost" and f.executor_id == 0 and "no heartbeat" in f.message
