"""Broadcast variables in main_fun with spark.io.encryption.enabled (docs/api.md "What
main_fun can use from Spark"): the executors' broadcast files are encrypted, so each start
task hands its node the value PySpark decrypted for it in an anonymous in-memory file
(never a plaintext file on disk), and a driver-hosted ps node gets the driver's value the
same way.

This file switches the SparkContext's configuration (``spark_manager.get``), so it is named
to run after the tests on the shared context.
"""

from __future__ import annotations

import json
import os

import pytest

from tfos import TFCluster

pytestmark = [pytest.mark.spark, pytest.mark.timeout(600)]


def make_read_late_fun(acc):
    """InputMode.SPARK: reads its feed to the end, then (long after its start task
    returned) the broadcast; counts its rows into the accumulator."""

    def main_fun(args, ctx):
        from tfos.datafeed import DataFeed

        rows = 0
        if ctx.job_name != "ps":
            feed = DataFeed(ctx.mgr, train_mode=True)
            while not feed.should_stop():
                rows += len(feed.next_batch(100))
        acc.add(rows)
        bc = args["bc"]
        value = bc.value
        with open(os.path.join(args["out"], f"{ctx.job_name}{ctx.task_index}.json"), "w") as f:
            json.dump({"len": len(value), "sum": sum(value[::1000]), "path": bc._path}, f)

    return main_fun


def test_encrypted_broadcast_reaches_every_node(spark_manager, tmp_path, no_leftovers):
    sc = spark_manager.get("local-cluster[2,1,1024]", spark__io__encryption__enabled="true")
    try:
        assert sc._encryption_enabled
        value = list(range(300_000))  # about 2 MB pickled
        bc = sc.broadcast(value)
        acc = sc.accumulator(0)
        out = tmp_path / "out"
        out.mkdir()
        cluster = TFCluster.run(sc, make_read_late_fun(acc), {"bc": bc, "out": str(out)}, 3, 1,
                                input_mode=TFCluster.InputMode.SPARK, driver_ps_nodes=True, reservation_timeout=240)
        cluster.train(sc.parallelize(range(1000), 4))
        cluster.shutdown(timeout=240)
        seen = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
        assert sorted(seen) == ["ps0", "worker0", "worker1"]
        for node in seen.values():
            assert node["len"] == len(value) and node["sum"] == sum(value[::1000]), node
            assert node["path"].startswith("/proc/self/fd/"), node  # an in-memory file, no plaintext copy on disk
        assert acc.value == 1000
    finally:
        spark_manager.stop()  # the next test gets the default context
