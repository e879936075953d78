"""GPU assignment through Spark's resource scheduling, with a fake GPU discovery script
(no GPU needed): each node's TF process gets Spark's GPU address as CUDA_VISIBLE_DEVICES."""

from __future__ import annotations

import json
import stat

import pytest

from tfos import TFCluster

pytestmark = pytest.mark.spark


def record_gpus(args, ctx):
    import json as _json
    import os as _os

    from pyspark import TaskContext

    # the start task's resources, as TaskContext.get() gives them to main_fun (docs/api.md)
    task_gpus = TaskContext.get().resources()["gpu"].addresses
    with open(_os.path.join(args["out"], f"node{ctx.executor_id}.json"), "w") as f:
        _json.dump({"cuda": _os.environ.get("CUDA_VISIBLE_DEVICES"), "task_gpus": task_gpus}, f)


def test_spark_gpu_resources_become_cuda_visible_devices(spark_manager, tmp_path, no_leftovers):
    script = tmp_path / "discover_gpus.sh"
    script.write_text('#!/usr/bin/env bash\necho \'{"name": "gpu", "addresses": ["0"]}\'\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    sc = spark_manager.get(
        "local-cluster[2,1,1024]",
        **{
            "spark.worker.resource.gpu.amount": "1",
            "spark.worker.resource.gpu.discoveryScript": str(script),
            "spark.executor.resource.gpu.amount": "1",
            "spark.task.resource.gpu.amount": "1",
        },
    )
    out = tmp_path / "out"
    out.mkdir()
    cluster = TFCluster.run(sc, record_gpus, {"out": str(out)}, 2, 0, input_mode=TFCluster.InputMode.TENSORFLOW)
    cluster.shutdown(timeout=120)
    seen = {p.name: json.loads(p.read_text()) for p in out.glob("*.json")}
    assert seen == {"node0.json": {"cuda": "0", "task_gpus": ["0"]}, "node1.json": {"cuda": "0", "task_gpus": ["0"]}}
    spark_manager.stop()  # the next test gets a context without GPU resources


def test_gpus_not_cores_limit_the_slots(spark_manager, tmp_path, no_leftovers):
    """Two cores but one GPU per executor: Spark runs one task per executor, and so does
    tfos's slot check (it used to count cores only and refuse the layout)."""
    script = tmp_path / "discover_gpus.sh"
    script.write_text('#!/usr/bin/env bash\necho \'{"name": "gpu", "addresses": ["0"]}\'\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    sc = spark_manager.get(
        "local-cluster[2,2,1024]",
        **{
            "spark.worker.resource.gpu.amount": "1",
            "spark.worker.resource.gpu.discoveryScript": str(script),
            "spark.executor.resource.gpu.amount": "1",
            "spark.task.resource.gpu.amount": "1",
        },
    )
    try:
        jsc = sc._jsc.sc()
        assert jsc.maxNumConcurrentTasks(jsc.resourceProfileManager().defaultResourceProfile()) == 2
        out = tmp_path / "out"
        out.mkdir()
        cluster = TFCluster.run(sc, record_gpus, {"out": str(out)}, 2, 0, input_mode=TFCluster.InputMode.TENSORFLOW,
                                executor_wait_s=300, reservation_timeout=300)
        cluster.shutdown(timeout=120)
        seen = {p.name: json.loads(p.read_text()) for p in out.glob("*.json")}
        assert seen == {"node0.json": {"cuda": "0", "task_gpus": ["0"]}, "node1.json": {"cuda": "0", "task_gpus": ["0"]}}
    finally:
        spark_manager.stop()
