"""InputMode.SPARK feeding on non-default Spark configurations.

Each test here asks ``spark_manager`` for its own SparkContext (replacing the shared one),
which is why this file sorts after the files that use the shared ``sc``.
"""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("pyspark")

from tfos import TFCluster  # noqa: E402

pytestmark = pytest.mark.spark


def count_rows(args, ctx):
    """Counts rows until the end of the feed; writes count and sum."""
    import json as _json

    from tfos import TFNode

    feed = TFNode.DataFeed(ctx.mgr)
    n = total = 0
    while not feed.should_stop():
        batch = feed.next_batch(100)
        n += len(batch)
        total += sum(batch)
    with open(f"{args['out']}/{ctx.job_name}{ctx.task_index}.json", "w") as f:
        _json.dump({"rows": n, "sum": total}, f)


def test_c06_more_executors_than_nodes(spark_manager, tmp_path, caplog, no_leftovers):
    """C06: 3 executors, a cluster of 2 nodes: the feed tasks that run on the spare
    executor (no node there) send their partitions to a node on the same host; every
    row arrives, with no AttributeError/KeyError."""
    sc = spark_manager.get("local-cluster[3,1,1024]")
    rows, parts = 1200, 6
    rdd = sc.parallelize(range(rows), parts)
    # Wait (bounded) for all three executors, so the spare one really takes feed tasks.
    deadline = time.monotonic() + 60
    while sc._jsc.sc().getExecutorMemoryStatus().size() < 4 and time.monotonic() < deadline:  # 3 + driver
        time.sleep(0.5)
    assert sc._jsc.sc().getExecutorMemoryStatus().size() == 4
    cluster = TFCluster.run(sc, count_rows, {"out": str(tmp_path)}, 2, 0, input_mode=TFCluster.InputMode.SPARK)
    t0 = time.monotonic()
    cluster.train(rdd, num_epochs=2)
    assert time.monotonic() - t0 < 60
    cluster.shutdown(timeout=60)
    reports = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    assert set(reports) == {"worker0", "worker1"}
    assert sum(r["rows"] for r in reports.values()) == 2 * rows
    assert sum(r["sum"] for r in reports.values()) == 2 * sum(range(rows))
    assert not [r for r in caplog.records if r.levelno >= 40], [r.getMessage() for r in caplog.records if r.levelno >= 40]


def _cmdlines_with(text: bytes) -> list[int]:
    import os

    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def test_spark_authenticate_and_crypto_on(spark_manager, tmp_path, caplog, monkeypatch, no_leftovers):
    """The configuration the key-transport WARNING asks for works: with spark.authenticate
    (its secret in a spark-defaults.conf only the user can read, so no command line shows
    it) and spark.network.crypto.enabled on, Spark's block managers no longer serve the task
    closures (and the cluster key in them) to unauthenticated processes; a cluster starts,
    every row of 2 epochs arrives, and no key-transport WARNING is logged."""
    import logging
    import os
    import secrets

    secret = secrets.token_hex(16)
    conf_dir = tmp_path / "spark-conf"
    conf_dir.mkdir(mode=0o700)
    defaults = conf_dir / "spark-defaults.conf"
    defaults.write_text(f"spark.authenticate.secret {secret}\n")
    defaults.chmod(0o600)
    out = tmp_path / "out"
    out.mkdir()
    spark_manager.discard_jvm()  # spark-submit reads SPARK_CONF_DIR when it starts the JVM
    monkeypatch.setenv("SPARK_CONF_DIR", str(conf_dir))
    try:
        sc = spark_manager.get("local-cluster[2,1,1024]", spark__authenticate="true", spark__network__crypto__enabled="true")
        assert sc.getConf().get("spark.authenticate.secret") == secret
        assert _cmdlines_with(secret.encode()) == []  # no process shows it (ps, /proc/PID/cmdline)
        _run_authenticated(sc, out, caplog, secret)
    finally:
        spark_manager.discard_jvm()  # the next test must not inherit the authenticated JVM


def _run_authenticated(sc, tmp_path, caplog, secret) -> None:
    import logging

    caplog.set_level(logging.WARNING, logger="tfos")
    rows, parts = 3000, 4
    rdd = sc.parallelize(range(rows), parts)
    cluster = TFCluster.run(sc, count_rows, {"out": str(tmp_path)}, 2, 0, input_mode=TFCluster.InputMode.SPARK)
    cluster.train(rdd, num_epochs=2)
    cluster.shutdown(timeout=60)
    reports = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    assert set(reports) == {"worker0", "worker1"}
    assert sum(r["rows"] for r in reports.values()) == 2 * rows
    assert sum(r["sum"] for r in reports.values()) == 2 * sum(range(rows))
    texts = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [t for t in texts if "spark.authenticate" in t or "cluster key" in t], texts
    assert all(secret not in t for t in texts)
