"""Spark configuration checks (C01, C05, C13, C14) and runs under ``local[N]``.

This file switches SparkContext configurations (``spark_manager.get``), so it is named to
run after the files that share the default ``local-cluster[2,1,1024]`` context. Tests are
ordered to switch contexts as few times as possible.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from conftest import tfos_processes
from tfos import TFCluster
from tfos.errors import ConfigurationError

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]

#: A refused configuration must be reported within this many seconds (no waiting for
#: executors, nothing launched).
FAIL_FAST_S = 30.0


def _write_json(path: str, obj) -> None:
    """Writes ``obj`` as JSON atomically (TF process)."""
    import json
    import os

    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def never_called_main(args, ctx):
    raise AssertionError("main_fun must not run for a refused configuration")


def trivial_main(args, ctx):
    import json
    import os

    _write_json(
        os.path.join(args["out"], f"{ctx.job_name}_{ctx.task_index}.json"),
        {"pid": os.getpid(), "ppid": os.getppid(), "tf_config": json.loads(os.environ["TF_CONFIG"])},
    )


def feed_recorder_main(args, ctx):
    """Reads the whole feed and records every row it got (InputMode.SPARK)."""
    import os

    from tfos import TFNode

    feed = TFNode.DataFeed(ctx.mgr, True)
    rows = []
    while not feed.should_stop():
        rows.extend(feed.next_batch(64))
    _write_json(os.path.join(args["out"], f"{ctx.job_name}_{ctx.task_index}.json"), {"pid": os.getpid(), "rows": rows})


def echo_main(args, ctx):
    """Answers every inference row with itself (InputMode.SPARK)."""
    from tfos import TFNode

    feed = TFNode.DataFeed(ctx.mgr, False)
    while not feed.should_stop():
        rows = feed.next_batch(64)
        if rows:
            feed.batch_results(rows)


def _read_nodes(out_dir: Path) -> dict:
    found = {}
    for p in sorted(out_dir.glob("*.json")):
        job, idx = p.stem.rsplit("_", 1)
        found[f"{job}:{idx}"] = json.loads(p.read_text())
    return found


def _refused(sc, num_executors: int, input_mode=TFCluster.InputMode.TENSORFLOW, **kwargs) -> str:
    """Runs a cluster that must be refused up front; returns the error message."""
    before = tfos_processes()
    t0 = time.monotonic()
    with pytest.raises(ConfigurationError) as info:
        TFCluster.run(sc, never_called_main, {}, num_executors, 0, False, input_mode, reservation_timeout=120, **kwargs)
    elapsed = time.monotonic() - t0
    assert elapsed < FAIL_FAST_S, f"refusal took {elapsed:.1f} s"
    assert tfos_processes() == before == [], "a refused cluster started node processes"
    return str(info.value)


# ------------------------------------------------------------- local-cluster


def test_c01_more_nodes_than_executors(spark_manager, no_leftovers):
    sc = spark_manager.get("local-cluster[2,1,1024]")
    msg = _refused(sc, 3, master_node="chief")
    assert "needs 3 executors" in msg and "has 2" in msg, msg
    assert "num_executors" in msg and "local-cluster[3,1,1024]" in msg, msg
    assert "spark.executor.instances" not in msg, msg  # does nothing on local-cluster


def test_c05_several_task_slots_per_executor(spark_manager, no_leftovers):
    sc = spark_manager.get("local-cluster[2,2,1024]")
    msg = _refused(sc, 4, master_node="chief")
    assert "spark.task.cpus=2" in msg and "2 task slots" in msg, msg
    assert "local-cluster[2,1,1024]" in msg, msg


# ------------------------------------------------------------------ local[N]


def test_c13_spark_mode_needs_python_worker_reuse(spark_manager, no_leftovers):
    sc = spark_manager.get("local[2]", **{"spark.python.worker.reuse": "false"})
    msg = _refused(sc, 2, TFCluster.InputMode.SPARK)
    assert "spark.python.worker.reuse" in msg and "InputMode.SPARK" in msg, msg


@pytest.mark.tf
def test_c14_local2_spark_mode_feeds_both_nodes_without_overlap(spark_manager, tmp_path, no_leftovers):
    sc = spark_manager.get("local[2]")
    cluster = TFCluster.run(sc, feed_recorder_main, {"out": str(tmp_path)}, 2, 0, False,
                            TFCluster.InputMode.SPARK, reservation_timeout=120)
    assert len({n["pid"] for n in cluster.cluster_info}) == 2
    cluster.train(sc.parallelize(range(1000), 4), num_epochs=1, feed_timeout=120)
    cluster.shutdown(timeout=120)
    found = _read_nodes(tmp_path)
    assert set(found) == {"worker:0", "worker:1"}
    a, b = (found[k]["rows"] for k in ("worker:0", "worker:1"))
    assert found["worker:0"]["pid"] != found["worker:1"]["pid"], "two nodes ran in one process"
    assert a and b, f"one node got no data ({len(a)} / {len(b)} rows)"
    assert len(a) == len(set(a)) and len(b) == len(set(b)), "a node got a row twice"
    assert not set(a) & set(b), "both nodes got the same rows"
    assert sorted(a + b) == list(range(1000))


def _corrupt_at_777(x):
    if x == 777:
        raise ValueError(f"corrupt record {x}: cannot parse")
    return x


@pytest.mark.parametrize("mode", ["train", "inference"])
def test_local2_an_error_in_the_rdds_own_code_is_the_error_shown(spark_manager, tmp_path, mode, no_leftovers):
    """local[N] runs each task once, so no refused retry reports the RDD's own error: the
    error showed only "PythonException: An exception was thrown from the Python worker:"
    (found by the new-user helper). It now names the exception, the partition and the
    traceback, as on local-cluster (tests/spark/test_feed_cases.py)."""
    from tfos.errors import ClusterFailedError

    sc = spark_manager.get("local[2]")
    rdd = sc.parallelize(range(2000), 4).map(_corrupt_at_777)
    main = feed_recorder_main if mode == "train" else echo_main
    cluster = TFCluster.run(sc, main, {"out": str(tmp_path)}, 2, 0, False,
                            TFCluster.InputMode.SPARK, reservation_timeout=120)
    t0 = time.monotonic()
    with pytest.raises(ClusterFailedError) as info:
        if mode == "train":
            cluster.train(rdd, num_epochs=1, feed_timeout=120)
        else:
            cluster.inference(rdd, feed_timeout=120).collect()
    assert time.monotonic() - t0 < 60
    causes = [f for f in info.value.failures if f.kind == "spark"]
    assert len(causes) == 1, info.value.failures
    f = causes[0]
    # partition 1 of 4 holds 500-999
    assert f.error_type == "ValueError" and f.message.startswith("corrupt record 777: cannot parse (raised by the RDD's or "), f
    assert "Spark task of partition 1, attempt 1," in f.message and f.message.endswith("not by main_fun)"), f
    assert 'raise ValueError(f"corrupt record {x}: cannot parse")' in f.traceback, f.traceback
    assert f"- [spark] {f.node_name}: ValueError: corrupt record 777" in str(info.value)
    cluster.shutdown(timeout=120)


def test_local2_tensorflow_mode_two_processes(spark_manager, tmp_path, no_leftovers):
    sc = spark_manager.get("local[2]")
    cluster = TFCluster.run(sc, trivial_main, {"out": str(tmp_path)}, 2, 0, False,
                            TFCluster.InputMode.TENSORFLOW, master_node="chief", reservation_timeout=120)
    spec = cluster.cluster_spec
    cluster.shutdown(timeout=120)
    found = _read_nodes(tmp_path)
    assert set(found) == {"chief:0", "worker:0"}
    assert found["chief:0"]["pid"] != found["worker:0"]["pid"]
    assert spec["chief"] != spec["worker"]
    for name, rec in found.items():
        job, idx = name.split(":")
        assert rec["tf_config"]["task"] == {"type": job, "index": int(idx)}
        assert rec["tf_config"]["cluster"] == spec


def test_c14_local1_refuses_two_nodes(spark_manager, no_leftovers):
    sc = spark_manager.get("local[1]")
    msg = _refused(sc, 2, master_node="chief")
    assert "needs 2" in msg and "local[2]" in msg, msg
    msg = _refused(sc, 2, TFCluster.InputMode.SPARK)
    assert "needs 2" in msg and "local[2]" in msg, msg
