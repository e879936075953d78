"""Beyond two nodes with real processes: local-cluster[8,1,512] (8 executor JVMs).

The cluster forms (8 nodes on 8 executors, one control connection per node process),
feeds an RDD with exact counts (every row once, the sum of the rows), and reports a node
whose TF process is killed while the others are fed, naming it, within two heartbeat
timeouts. Runs in its own SparkContext, last (the session's context is switched back by
the next test that asks for it).
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from conftest import assert_no_tfos_processes
from tfos import TFCluster
from tfos.errors import ClusterFailedError

pytestmark = [pytest.mark.spark, pytest.mark.slow]

MASTER = "local-cluster[8,1,512]"
NODES = 8
ROWS = 40000
HEARTBEAT_TIMEOUT_S = 10.0


def _count_rows(args, ctx):
    """Counts the rows it is fed and their sum, written after every batch."""
    import os as _os

    feed = ctx.get_data_feed(train_mode=True)
    path = _os.path.join(args["out"], str(ctx.executor_id))
    n = total = 0
    while not feed.should_stop():
        batch = feed.next_batch(250)  # a partition is 5 batches: none waits for rows of the next
        if batch:
            n += len(batch)
            total += sum(batch)
            with open(path + ".tmp", "w") as f:
                f.write(f"{n} {total}")
            _os.replace(path + ".tmp", path)


def _counts(out) -> tuple[int, int]:
    n = total = 0
    for name in os.listdir(out):
        if not name.endswith(".tmp"):
            a, b = (int(x) for x in open(os.path.join(out, name)).read().split())
            n, total = n + a, total + b
    return n, total


def test_eight_executors_form_feed_exactly_and_report_a_killed_node(spark_manager, tmp_path):
    sc = spark_manager.get(MASTER, spark__executor__memory="480m")  # Spark needs 450 MiB; a worker has 512
    cluster = None
    try:
        assert_no_tfos_processes()
        cluster = TFCluster.run(sc, _count_rows, {"out": str(tmp_path)}, NODES, 0, input_mode=TFCluster.InputMode.SPARK,
                                heartbeat_timeout=HEARTBEAT_TIMEOUT_S, reservation_timeout=300)
        info = cluster.cluster_info
        assert sorted(n["executor_id"] for n in info) == list(range(NODES))
        assert len({n["executor_key"] for n in info}) == NODES  # one node per executor JVM
        server = cluster.server
        # each node's supervisor and TF process hold one connection each (no more: one per
        # process; the start tasks' connections close as they return; under load a TF
        # process may still be opening its own when run() returns)
        deadline = time.monotonic() + 60
        while server.active_connections != 2 * NODES and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.active_connections == 2 * NODES, server.stats()

        cluster.train(sc.parallelize(range(ROWS), 32), num_epochs=1, feed_timeout=600)  # 1,250 rows a partition
        deadline = time.monotonic() + 60
        while _counts(tmp_path)[0] < ROWS and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _counts(tmp_path) == (ROWS, ROWS * (ROWS - 1) // 2)  # every row exactly once
        assert server.stats()["rejected"] == 0

        victim = 5
        [node] = [n for n in info if n["executor_id"] == victim]
        t_kill = time.monotonic()
        os.kill(node["pid"], signal.SIGKILL)
        with pytest.raises(ClusterFailedError) as ei:
            cluster.train(sc.parallelize(range(ROWS), 32), num_epochs=5, feed_timeout=600)
        took = time.monotonic() - t_kill
        text = str(ei.value)
        assert f"worker:{victim} (executor {victim}" in text and "SIGKILL" in text, text
        assert took < 2 * HEARTBEAT_TIMEOUT_S, f"the killed node was reported after {took:.1f} s"
        cluster.shutdown()
        assert not psutil.pid_exists(node["pid"]) or psutil.Process(node["pid"]).status() == psutil.STATUS_ZOMBIE
        assert_no_tfos_processes()
    except BaseException:
        if cluster is not None:  # a failed assertion leaves no cluster behind for the next tests
            try:
                cluster.shutdown(timeout=60)
            except Exception:  # noqa: BLE001 - the assertion's error is the one to see
                pass
        raise
    finally:
        spark_manager.stop()  # the next test gets the default local-cluster[2,1,1024] again
