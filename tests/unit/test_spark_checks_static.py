"""Unit tests of tfos._driver.spark_checks.plan_layout / check_static (pure: no Spark)."""

from __future__ import annotations

import os

import pytest

from tfos._driver.spark_checks import SparkLayout, check_static, plan_layout
from tfos.cluster_template import InputMode
from tfos.errors import ConfigurationError

SPARK, TF = InputMode.SPARK, InputMode.TENSORFLOW


def _check(master: str, num_nodes: int, mode: InputMode = SPARK, **conf: str) -> None:
    conf = {k.replace("__", "."): v for k, v in conf.items()}
    check_static(plan_layout(master, conf), conf, num_nodes, mode)


# -------------------------------------------------------------------- plan_layout
@pytest.mark.parametrize(
    "master, conf, expected",
    [
        ("local", {}, SparkLayout("local", True, 1, 1, 1)),
        ("local[4]", {}, SparkLayout("local[4]", True, 1, 4, 4)),
        ("local[4, 2]", {}, SparkLayout("local[4, 2]", True, 1, 4, 4)),
        ("local[4]", {"spark.task.cpus": "2"}, SparkLayout("local[4]", True, 1, 2, 2)),
        ("local-cluster[2,1,1024]", {}, SparkLayout("local-cluster[2,1,1024]", False, 2, 1, 2)),
        ("local-cluster[3, 4, 512]", {"spark.task.cpus": "4"}, SparkLayout("local-cluster[3, 4, 512]", False, 3, 1, 3)),
        ("yarn", {"spark.executor.instances": "4", "spark.executor.cores": "2"}, SparkLayout("yarn", False, 4, 2, 8)),
        ("spark://m:7077", {}, SparkLayout("spark://m:7077", False, None, None, None)),
        ("k8s://x", {"spark.executor.instances": "3"}, SparkLayout("k8s://x", False, 3, None, None)),
    ],
)
def test_plan_layout(master, conf, expected):
    assert plan_layout(master, conf) == expected


def test_plan_layout_local_star_uses_cpu_count():
    n = os.cpu_count() or 1
    assert plan_layout("local[*]", {}) == SparkLayout("local[*]", True, 1, n, n)


def test_plan_layout_non_integer_setting():
    with pytest.raises(ConfigurationError, match=r"Spark setting spark.executor.cores='two' is not an integer"):
        plan_layout("yarn", {"spark.executor.cores": "two"})


# -------------------------------------------------------------------- check_static
def test_c01_too_few_executors():
    with pytest.raises(ConfigurationError) as ei:
        _check("local-cluster[2,1,1024]", 3)
    msg = str(ei.value)
    assert "needs 3 executors" in msg
    assert "has 2" in msg
    assert "local-cluster[2,1,1024]" in msg
    # local-cluster's executors come from its URL: spark.executor.instances does nothing there
    assert "start Spark with 3 executors (the master local-cluster[3,1,1024]: its executors come from the URL)" in msg
    assert "spark.executor.instances" not in msg


def test_c01_yarn_instances():
    with pytest.raises(ConfigurationError, match=r"needs 4 executors .* has 2 \(yarn\)"):
        _check("yarn", 4, TF, spark__executor__instances="2", spark__executor__cores="1")


def test_c05_two_slots_per_executor():
    with pytest.raises(ConfigurationError) as ei:
        _check("local-cluster[2,2,1024]", 2)
    msg = str(ei.value)
    assert "each executor has 2 task slots" in msg
    assert msg.endswith("use the master local-cluster[2,1,1024] (one core per worker: its executors get their cores "
                        "from the URL), or set spark.task.cpus=2 so that one node takes all 2 cores of an executor"), msg


def test_c05_fixed_by_task_cpus():
    _check("local-cluster[2,2,1024]", 2, spark__task__cpus="2")


def test_c05_yarn_cores():
    with pytest.raises(ConfigurationError, match="spark.task.cpus"):
        _check("yarn", 2, TF, spark__executor__instances="2", spark__executor__cores="4")


def test_c13_spark_mode_without_worker_reuse():
    with pytest.raises(ConfigurationError) as ei:
        _check("local-cluster[2,1,1024]", 2, SPARK, spark__python__worker__reuse="false")
    msg = str(ei.value)
    assert "InputMode.SPARK needs spark.python.worker.reuse=true" in msg
    assert "Remove spark.python.worker.reuse=false" in msg


def test_c13_case_insensitive():
    with pytest.raises(ConfigurationError, match="spark.python.worker.reuse"):
        _check("local[2]", 2, SPARK, spark__python__worker__reuse="False")


def test_tensorflow_mode_with_reuse_false_passes():
    _check("local-cluster[2,1,1024]", 2, TF, spark__python__worker__reuse="false")


def test_c14_local_one_slot_two_nodes():
    with pytest.raises(ConfigurationError) as ei:
        _check("local[1]", 2, TF)
    msg = str(ei.value)
    assert "local[2]" in msg
    assert "has 1 task slot(s) but the cluster needs 2" in msg


def test_c14_plain_local():
    with pytest.raises(ConfigurationError, match=r"use local\[3\] or more"):
        _check("local", 3)


def test_dynamic_allocation_refused():
    with pytest.raises(ConfigurationError) as ei:
        _check("yarn", 3, TF, spark__dynamicAllocation__enabled="true")
    msg = str(ei.value)
    assert "spark.dynamicAllocation.enabled=false" in msg
    assert "spark.executor.instances=3" in msg


def test_dynamic_allocation_false_passes():
    _check("local-cluster[2,1,1024]", 2, spark__dynamicAllocation__enabled="false")


@pytest.mark.parametrize(
    "master, nodes, mode",
    [
        ("local[2]", 2, SPARK),
        ("local[4]", 3, SPARK),
        ("local-cluster[2,1,1024]", 2, SPARK),
        ("local-cluster[3,1,1024]", 2, TF),
        ("spark://m:7077", 8, SPARK),  # unknown layout: checked live, not statically
    ],
)
def test_ok_configurations(master, nodes, mode):
    _check(master, nodes, mode)


def test_local_mode_allows_several_slots_per_executor():
    # under local[N] every node is a separate process of one JVM: several slots are expected
    _check("local[4]", 4, SPARK)


# ------------------------------------------------------------ resources (issue 10)
def test_gpus_not_cores_limit_the_slots_like_spark():
    from tfos._driver.spark_checks import resource_slots

    conf = {"spark.executor.resource.gpu.amount": "1", "spark.task.resource.gpu.amount": "1"}
    assert resource_slots(conf) == {"gpu": 1}
    layout = plan_layout("local-cluster[2,2,1024]", conf)
    assert (layout.slots_per_executor, layout.total_slots) == (1, 2)
    check_static(layout, conf, 2, InputMode.SPARK)  # two cores, one GPU: one slot per executor
    # a fractional task amount shares one GPU between tasks: 2 slots, refused
    half = {"spark.executor.resource.gpu.amount": "1", "spark.task.resource.gpu.amount": "0.5"}
    assert resource_slots(half) == {"gpu": 2}
    with pytest.raises(ConfigurationError, match="2 task slots"):
        check_static(plan_layout("local-cluster[2,2,1024]", half), half, 2, InputMode.SPARK)
    # several resources: the scarcest wins
    two = {"spark.executor.cores": "4", "spark.executor.instances": "2",
           "spark.executor.resource.gpu.amount": "2", "spark.task.resource.gpu.amount": "1",
           "spark.executor.resource.fpga.amount": "1", "spark.task.resource.fpga.amount": "1"}
    assert plan_layout("yarn", two).slots_per_executor == 1


def test_task_resource_without_executor_amount_refused():
    with pytest.raises(ConfigurationError, match="spark.executor.resource.gpu.amount"):
        plan_layout("yarn", {"spark.task.resource.gpu.amount": "1"})


def test_a_multi_core_standalone_executor_is_refused_at_once_with_the_executor_cores_fix(monkeypatch):
    """One standalone executor took both cores of its worker: refused as soon as it
    registers, not after the 60 s wait for a second executor, and the message says to set
    spark.executor.cores=1 (new-user trial, session 17: 71 s, then advice that led to a
    second error)."""
    import time

    from tfos._driver import spark_checks

    class Conf:
        def getAll(self):
            return [("spark.master", "spark://127.0.0.1:7077"), ("spark.cores.max", "2"), ("spark.task.cpus", "1"),
                    ("spark.app.id", "app-unit")]

    class Sc:
        master = "spark://127.0.0.1:7077"

        def getConf(self):
            return Conf()

    monkeypatch.setattr(spark_checks, "live_executors", lambda sc: 1)
    monkeypatch.setattr(spark_checks, "_max_slots", lambda sc: 2)
    monkeypatch.setattr(spark_checks, "_scheduler_executors", lambda sc: 1)
    t0 = time.monotonic()
    with pytest.raises(ConfigurationError) as info:
        spark_checks.check_spark(Sc(), 2, InputMode.SPARK, wait_s=60.0)
    assert time.monotonic() - t0 < 5
    text = str(info.value)
    assert text.startswith("the Spark application has 2 task slots on 1 executors"), text
    assert ("The cluster needs 2 executors and Spark gave the application 1 with 2 task slots in all: to get one "
            "executor per core, set spark.executor.cores=1 (spark-submit --executor-cores 1") in text, text


def test_too_few_executors_offers_driver_ps_nodes_when_there_are_ps_nodes():
    """3 nodes (1 ps) on 2 executors: the error also offers running the ps on the driver."""
    from tfos._driver import spark_checks

    class Conf:
        def getAll(self):
            return [("spark.master", "local-cluster[2,1,1024]")]

    class Sc:
        master = "local-cluster[2,1,1024]"

        def getConf(self):
            return Conf()

    with pytest.raises(ConfigurationError) as info:
        spark_checks.check_spark(Sc(), 3, InputMode.TENSORFLOW, wait_s=1.0, ps_on_executors=1)
    assert str(info.value).endswith("; or run the 1 ps node(s) on the driver (driver_ps_nodes=True), which needs 2 executor(s)"), info.value
    with pytest.raises(ConfigurationError) as info:
        spark_checks.check_spark(Sc(), 3, InputMode.TENSORFLOW, wait_s=1.0)
    assert "driver_ps_nodes" not in str(info.value)


def test_too_few_executors_on_standalone_with_gpus_names_the_gpus(monkeypatch):
    """3 nodes on a standalone master whose workers start only 2 executors asking for a GPU
    each: the error says how standalone sizes an application (spark.executor.instances
    does nothing there) and that the workers' GPUs may be what is missing."""
    from tfos._driver import spark_checks

    conf = {"spark.master": "spark://10.0.0.1:7077", "spark.executor.cores": "1", "spark.task.cpus": "1",
            "spark.executor.resource.gpu.amount": "1", "spark.task.resource.gpu.amount": "1"}

    class Conf:
        def getAll(self):
            return list(conf.items())

    class Sc:
        master = conf["spark.master"]

        def getConf(self):
            return Conf()

    monkeypatch.setattr(spark_checks, "live_executors", lambda sc: 2)
    monkeypatch.setattr(spark_checks, "_check_one_slot_per_executor", lambda sc, n, have: None)
    monkeypatch.setattr(spark_checks, "driver_jvm_pid", lambda sc: None)
    with pytest.raises(ConfigurationError) as info:
        spark_checks.check_spark(Sc(), 3, InputMode.TENSORFLOW, wait_s=0.2)
    text = str(info.value)
    assert "give the application 3 executors (--total-executor-cores 3 (spark.cores.max) with --executor-cores 1" in text, text
    assert "spark.executor.instances" not in text, text
    assert text.endswith("so 3 executors need 3 GPUs in all on the workers (spark.worker.resource.gpu.amount and what its "
                         "discoveryScript finds; the master's log and UI show each worker's resources), and waiting "
                         "longer does not help when they are not there"), text
    assert spark_checks._gpu_hint({}, 3) == "" and spark_checks._gpu_hint({"spark.executor.resource.gpu.amount": "x"}, 3) == ""


def test_standalone_executors_come_from_cores_max_not_instances():
    """Standalone ignores spark.executor.instances: 3 total cores of 1-core executors give
    at most 3 executors, and 4 nodes are refused at once (not after executor_wait_s)."""
    from tfos._driver.spark_checks import check_static, plan_layout

    conf = {"spark.cores.max": "3", "spark.executor.cores": "1", "spark.executor.instances": "8"}
    layout = plan_layout("spark://10.0.0.1:7077", conf)
    assert (layout.executors, layout.slots_per_executor, layout.total_slots) == (3, 1, 3)
    with pytest.raises(ConfigurationError) as info:
        check_static(layout, conf, 4, InputMode.SPARK)
    assert str(info.value) == (
        "the cluster needs 4 executors (one per node) but the Spark application has 3 (spark://10.0.0.1:7077). "
        "Reduce num_executors/cluster_size to 3, or start Spark with 4 executors (--total-executor-cores 4 "
        "(spark.cores.max) with --executor-cores 1, on workers with 4 free cores in all (SPARK_WORKER_CORES))")
    assert plan_layout("spark://10.0.0.1:7077", {"spark.executor.cores": "1", "spark.executor.instances": "8"}).executors is None
    assert plan_layout("yarn", conf).executors == 8
