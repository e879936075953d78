"""main_fun in the Spark task's world (docs/api.md "What main_fun can use from Spark"), on
the shared local-cluster[2,1,1024]: broadcast variables (in tf_args and in main_fun's
closure), SparkFiles (sc.addFile, sc.addArchive), TaskContext / BarrierTaskContext and
accumulators, in both input modes and across a restart; and the address-space limit of
spark.executor.pyspark.memory named in the failure.

Each node writes what it saw as JSON into ``tmp_path``.
"""

from __future__ import annotations

import json
import os
import time
import zipfile

import pytest

from tfos import TFCluster
from tfos.errors import ClusterFailedError

pytestmark = [pytest.mark.spark, pytest.mark.timeout(600)]

TENSORFLOW = TFCluster.InputMode.TENSORFLOW
SPARK = TFCluster.InputMode.SPARK

#: A local property the driver thread sets before run(): main_fun reads it from TaskContext.
PROP = "tfos.test.taskworld"


def _world(args, ctx, bc_closure) -> dict:
    """What main_fun sees of Spark (TF process)."""
    from pyspark import BarrierTaskContext, SparkFiles, TaskContext

    seen: dict = {"attempt": ctx.attempt, "job": ctx.job_name, "index": ctx.task_index}
    seen["bc_args"] = sum(args["bc"].value["numbers"])
    seen["bc_closure"] = bc_closure.value
    with open(SparkFiles.get(args["file"])) as f:
        seen["file"] = f.read()
    with open(os.path.join(SparkFiles.get(args["archive"]), "inside.txt")) as f:
        seen["archive"] = f.read()
    tc = TaskContext.get()
    if tc is None:
        seen["task"] = None
    else:
        seen["task"] = {
            "partition": tc.partitionId(), "stage": tc.stageId(), "attempt": tc.attemptNumber(),
            "task_attempt": tc.taskAttemptId(), "cpus": tc.cpus(), "resources": sorted(tc.resources()),
            "prop": tc.getLocalProperty(PROP), "group": tc.getLocalProperty("spark.jobGroup.id"),
        }
        btc = BarrierTaskContext.get()
        seen["barrier_same"] = btc is tc
        seen["task_infos"] = len(btc.getTaskInfos())
        try:
            btc.barrier()
            seen["barrier"] = "returned"
        except Exception as exc:  # noqa: BLE001 - the test records what it raised
            seen["barrier"] = f"{type(exc).__name__}: {exc}"
    return seen


def _write(out: str, name: str, seen: dict) -> None:
    tmp = os.path.join(out, f".{name}.tmp")
    with open(tmp, "w") as f:
        json.dump(seen, f)
    os.replace(tmp, os.path.join(out, name))


def make_tf_mode_fun(bc_closure, acc, acc_f):
    """InputMode.TENSORFLOW: records the node's view, adds to the accumulators; on the first
    attempt worker:1 waits for worker:0's return, then raises (the cluster restarts)."""

    def main_fun(args, ctx):
        seen = _world(args, ctx, bc_closure)
        acc.add(1000 * (ctx.executor_id + 1) + 100 * ctx.attempt)
        acc_f.add(0.25)
        out = args["out"]
        _write(out, f"{ctx.job_name}{ctx.task_index}-a{ctx.attempt}.json", seen)
        if ctx.attempt == 0 and ctx.job_name == "worker" and ctx.task_index == 1:
            first = os.path.join(out, "worker0-a0.json")
            end = time.monotonic() + 120
            while not os.path.exists(first) and time.monotonic() < end:
                time.sleep(0.1)
            time.sleep(3.0)  # worker:0's main_fun returned and sent its accumulator updates
            raise RuntimeError("worker:1 fails on purpose on the first attempt")

    return main_fun


def make_spark_mode_fun(bc_closure, acc):
    """InputMode.SPARK: counts every fed row into the accumulator and records its view."""

    def main_fun(args, ctx):
        from tfos.datafeed import DataFeed

        seen = _world(args, ctx, bc_closure)
        feed = DataFeed(ctx.mgr, train_mode=True)
        rows = 0
        while not feed.should_stop():
            for _ in feed.next_batch(100):
                acc.add(1)
                rows += 1
        seen["rows"] = rows
        _write(args["out"], f"{ctx.job_name}{ctx.task_index}.json", seen)

    return main_fun


def _ship_files(sc, tmp_path) -> dict:
    """sc.addFile and sc.addArchive with names unique to this test (the context is shared)."""
    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    src = tmp_path / f"shipped-{tag}.txt"
    src.write_text(f"file {tag}")
    arch = tmp_path / f"archive-{tag}.zip"
    with zipfile.ZipFile(arch, "w") as z:
        z.writestr("inside.txt", f"archive {tag}")
    sc.addFile(str(src))
    sc.addArchive(str(arch))
    return {"file": src.name, "archive": arch.name, "file_text": f"file {tag}", "archive_text": f"archive {tag}"}


def _check_world(node: dict, files: dict, numbers: int) -> None:
    assert node["bc_args"] == sum(range(numbers)), node
    assert node["bc_closure"] == "closure value", node
    assert node["file"] == files["file_text"] and node["archive"] == files["archive_text"], node


def _check_task(node: dict, prop: "str | None" = "set before run()") -> None:
    task = node["task"]
    assert task["prop"] == prop, node
    assert task["group"].startswith("tfos-") and "-start-" in task["group"], node
    assert task["attempt"] == 0 and task["cpus"] == 1 and task["resources"] == [], node
    assert node["barrier_same"] is True and node["task_infos"] == 2, node
    assert node["barrier"].startswith("TFOSError: BarrierTaskContext.barrier() is not available in main_fun"), node


def test_tensorflow_mode_broadcasts_files_task_context_accumulators_across_a_restart(sc, tmp_path, no_leftovers):
    """worker:0 and worker:1 on the executors, ps:0 on the driver host (driver_ps_nodes):
    each reads both broadcasts and both shipped files; the executors' nodes see their start
    task's context; the accumulators hold the second attempt's updates only (the first
    attempt's worker:0 returned and sent its updates before worker:1 failed)."""
    numbers = 20000
    bc = sc.broadcast({"numbers": list(range(numbers))})
    bc_closure = sc.broadcast("closure value")
    acc, acc_f = sc.accumulator(0), sc.accumulator(0.0)
    files = _ship_files(sc, tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    sc.setLocalProperty(PROP, "set before run()")
    try:
        cluster = TFCluster.run(sc, make_tf_mode_fun(bc_closure, acc, acc_f), {"bc": bc, "out": str(out), **files}, 3, 1,
                                input_mode=TENSORFLOW, driver_ps_nodes=True, max_restarts=1, reservation_timeout=240)
    finally:
        sc.setLocalProperty(PROP, None)
    cluster.shutdown(timeout=240)
    assert cluster.attempt == 1
    seen = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    assert {"ps0-a1", "worker0-a1", "worker1-a1", "worker0-a0", "worker1-a0"} <= set(seen), sorted(seen)
    for name, node in seen.items():
        _check_world(node, files, numbers)
        if node["job"] == "ps":
            assert node["task"] is None, node  # started by the driver, not by a Spark task
        else:
            # a job's local properties are those of the driver thread that submits it: the
            # restart's start job was submitted from shutdown(), after the property was unset
            _check_task(node, "set before run()" if node["attempt"] == 0 else None)
    partitions = {seen[f"worker{i}-a1"]["task"]["partition"] for i in (0, 1)}
    assert partitions == {0, 1}
    assert seen["worker0-a1"]["task"]["stage"] != seen["worker0-a0"]["task"]["stage"]  # the restart's own start stage
    # ps:0 (executor 0), worker:0 (1), worker:1 (2) of attempt 1, each 1000 * (executor id + 1) + 100
    assert acc.value == 1100 + 2100 + 3100
    assert acc_f.value == 0.75


def test_spark_mode_broadcasts_files_task_context_accumulators(sc, tmp_path, no_leftovers):
    """InputMode.SPARK: the start tasks return before main_fun reads its feed; the nodes
    still read both broadcasts, the shipped files and their start task's context, and the
    3,000 rows they count reach the driver's accumulator at shutdown."""
    numbers = 5000
    bc = sc.broadcast({"numbers": list(range(numbers))})
    bc_closure = sc.broadcast("closure value")
    acc = sc.accumulator(0)
    files = _ship_files(sc, tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    sc.setLocalProperty(PROP, "set before run()")
    try:
        cluster = TFCluster.run(sc, make_spark_mode_fun(bc_closure, acc), {"bc": bc, "out": str(out), **files}, 2, 0,
                                input_mode=SPARK, reservation_timeout=240)
    finally:
        sc.setLocalProperty(PROP, None)
    cluster.train(sc.parallelize(range(3000), 4))
    assert acc.value == 0  # applied when the cluster shut down, once
    cluster.shutdown(timeout=240)
    seen = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    assert sorted(seen) == ["worker0", "worker1"]
    for node in seen.values():
        _check_world(node, files, numbers)
        _check_task(node)
    assert sum(n["rows"] for n in seen.values()) == 3000
    assert acc.value == 3000


def import_tensorflow(args, ctx):
    import tensorflow as tf

    tf.constant(1.0) + 1.0


def test_pyspark_memory_limit_is_named_in_the_failure(sc, tmp_path, no_leftovers):
    """spark.executor.pyspark.memory=1g limits the start task's Python worker to 1 GiB of
    address space (RLIMIT_AS), which its node processes inherit: importing TensorFlow fails.
    Spark hands the setting to its Python runner as the job's local property
    resource.pyspark.memory (from the resource profile), which the test sets directly on
    the shared context. The failure names the limit, the setting and the fix."""
    sc.setLocalProperty("resource.pyspark.memory", "1024")
    try:
        with pytest.raises(ClusterFailedError) as err:
            cluster = TFCluster.run(sc, import_tensorflow, {}, 2, 0, input_mode=TENSORFLOW, reservation_timeout=240)
            cluster.shutdown(timeout=240)
    finally:
        sc.setLocalProperty("resource.pyspark.memory", None)
    text = str(err.value)
    assert "RLIMIT_AS" in text and "1.0 GiB" in text, text
    assert "spark.executor.pyspark.memory (1024 MiB)" in text, text
    assert "leave spark.executor.pyspark.memory unset" in text, text
