"""Every remedy in tfos's configuration errors and security WARNING is one that works on the
master the user has (pure). scripts/try_remedies.py applies them on local, local-cluster and a
standalone cluster; YARN's and Kubernetes' follow Spark's documentation and source (how each
cluster manager sizes an application, SecurityManager's secret rules)."""

from __future__ import annotations

import logging
import re

import pytest

from tfos._driver import remedies, spark_checks
from tfos._driver.spark_checks import check_static, plan_layout, warn_key_transport
from tfos.cluster_template import InputMode
from tfos.errors import ConfigurationError

TF = InputMode.TENSORFLOW


@pytest.mark.parametrize("master, kind", [
    ("local", "local"), ("local[2]", "local"), ("local[*]", "local"), ("local[2,3]", "local"),
    ("local-cluster[2,1,1024]", "local-cluster"), ("spark://h:7077", "standalone"), ("yarn", "yarn"),
    ("k8s://https://h:6443", "k8s"), ("mesos://h:5050", "other"),
])
def test_master_kind(master, kind):
    assert remedies.master_kind(master) == kind


def _too_few(master: str, n: int, **conf: str) -> str:
    conf = {k.replace("__", "."): v for k, v in conf.items()}
    with pytest.raises(ConfigurationError) as info:
        check_static(plan_layout(master, conf), conf, n, TF)
    return str(info.value)


def test_four_nodes_on_local_cluster_2_change_the_url_not_executor_instances():
    """The new-user report: 4 nodes on local-cluster[2,1,1024] suggested spark.executor.instances=4,
    which leaves local-cluster at 2 executors."""
    text = _too_few("local-cluster[2,1,1024]", 4)
    assert text == ("the cluster needs 4 executors (one per node) but the Spark application has 2 "
                    "(local-cluster[2,1,1024]). Reduce num_executors/cluster_size to 2, or start Spark with 4 "
                    "executors (the master local-cluster[4,1,1024]: its executors come from the URL)")
    # the worker memory of the URL is kept
    assert "local-cluster[3,1,512]" in _too_few("local-cluster[2,1,512]", 3)


def test_too_few_executors_per_master():
    assert _too_few("spark://h:7077", 4, spark__cores__max="2", spark__executor__cores="1").endswith(
        "(--total-executor-cores 4 (spark.cores.max) with --executor-cores 1, on workers with 4 free cores in all "
        "(SPARK_WORKER_CORES))")
    assert _too_few("yarn", 4, spark__executor__instances="2").endswith(
        "(--num-executors 4 (spark.executor.instances=4) with --executor-cores 1)")
    assert _too_few("k8s://https://h:6443", 4, spark__executor__instances="2").endswith(
        "(spark.executor.instances=4 with spark.executor.cores=1)")
    assert _too_few("local[2]", 4).endswith("use local[4] or more")


@pytest.mark.parametrize("master, fix", [
    ("yarn", "--num-executors 3 (spark.executor.instances=3)"),
    ("k8s://https://h:6443", "spark.executor.instances=3 with spark.executor.cores=1"),
    ("spark://h:7077", "--total-executor-cores 3 (spark.cores.max) with --executor-cores 1"),
])
def test_dynamic_allocation_says_how_to_size_the_application_on_each_master(master, fix):
    text = _too_few(master, 3, spark__dynamicAllocation__enabled="true")
    assert "Set spark.dynamicAllocation.enabled=false and give the application 3 executors (" in text and fix in text, text


def test_two_slots_per_executor_per_master():
    lc = _too_few("local-cluster[2,2,1024]", 2)
    assert lc.endswith("use the master local-cluster[2,1,1024] (one core per worker: its executors get their cores from "
                       "the URL), or set spark.task.cpus=2 so that one node takes all 2 cores of an executor"), lc
    yarn = _too_few("yarn", 2, spark__executor__instances="2", spark__executor__cores="4")
    assert "set spark.task.cpus equal to spark.executor.cores (e.g. spark.executor.cores=1" in yarn
    assert "standalone" not in yarn
    standalone = _too_few("spark://h:7077", 2, spark__cores__max="4", spark__executor__cores="2")
    assert standalone.endswith("; on a standalone cluster give --executor-cores 1, or an executor takes all of its "
                               "worker's cores"), standalone


def _live_slots_error(monkeypatch, master: str, have: int, slots: int, execs: int) -> str:
    class Conf:
        def getAll(self):
            return [("spark.master", master)]

    class Sc:
        def getConf(self):
            return Conf()

    Sc.master = master
    monkeypatch.setattr(spark_checks, "_max_slots", lambda sc: slots)
    monkeypatch.setattr(spark_checks, "_scheduler_executors", lambda sc: execs)
    with pytest.raises(ConfigurationError) as info:
        spark_checks._check_one_slot_per_executor(Sc(), 2, have)
    return str(info.value)


def test_live_slot_check_per_master(monkeypatch):
    yarn = _live_slots_error(monkeypatch, "yarn", 1, 2, 1)
    assert yarn.endswith("to get one executor per core, set spark.executor.cores=1 (spark-submit --executor-cores 1)")
    lc = _live_slots_error(monkeypatch, "local-cluster[1,2,1024]", 1, 2, 1)
    assert "use the master local-cluster[1,1,1024]" in lc and lc.endswith(
        "to get one executor per core, use the master local-cluster[2,1,1024]: its executors come from the URL"), lc
    assert "spark.executor.cores" not in lc
    # standalone, as many executors as nodes but 2 cores each (no --executor-cores): one-core executors
    standalone = _live_slots_error(monkeypatch, "spark://h:7077", 2, 4, 2)
    assert standalone.endswith("task slot per executor: set spark.executor.cores=1 (spark-submit --executor-cores 1; on a "
                               "standalone cluster an executor otherwise takes all of its worker's cores), or "
                               "spark.task.cpus equal to spark.executor.cores, or spark.task.resource.gpu.amount equal to "
                               "spark.executor.resource.gpu.amount"), standalone


@pytest.mark.parametrize("master, where", [
    ("spark://h:7077", "on the workers (spark.worker.resource.gpu.amount"),
    ("local-cluster[2,1,1024]", "on the workers (spark.worker.resource.gpu.amount"),
    ("yarn", "on the NodeManagers (YARN's GPU scheduling, resource yarn.io/gpu"),
    ("k8s://https://h:6443", "on the Kubernetes nodes (spark.executor.resource.gpu.vendor"),
])
def test_gpu_hint_names_where_each_master_finds_gpus(master, where):
    text = remedies.gpu_hint(master, 1, 3)
    assert "so 3 executors need 3 GPUs in all " + where in text, text
    assert remedies.gpu_hint(master, 0, 3) == ""


@pytest.fixture
def warnings_of(caplog, monkeypatch):
    monkeypatch.setattr(spark_checks, "_key_warned", set())
    caplog.set_level(logging.WARNING, logger="tfos")

    def run(master: str, conf: dict) -> str:
        caplog.clear()
        warn_key_transport(master, conf)
        return " | ".join(r.getMessage() for r in caplog.records)

    return run


def test_auth_warning_remedy_per_master(warnings_of):
    local = warnings_of("local[2]", {})
    assert "Set spark.authenticate=true (on local[N] Spark generates the secret)" in local
    assert "tfos.authenticate_spark(master)" in local and "crypto" not in local
    lc = warnings_of("local-cluster[2,1,1024]", {})
    assert "spark.authenticate.secret in a properties file only you can read" in lc and "SPARK_CONF_DIR of mode 0700" in lc
    assert "tfos.authenticate_spark(master)" in lc and "crypto" not in lc
    standalone = warnings_of("spark://h:7077", {})
    assert "the standalone cluster's spark.authenticate.secret (the one its master and workers were started with)" in standalone
    assert "spark.network.crypto.enabled=true" in standalone and "tfos.authenticate_spark" not in standalone
    yarn = warnings_of("yarn", {})
    assert "on YARN Spark generates a secret per application" in yarn and "spark.network.crypto.enabled=true" in yarn
    assert "spark.authenticate.secret" not in yarn  # nothing to give there
    k8s = warnings_of("k8s://https://h:6443", {})
    assert "on Kubernetes Spark generates a secret per application" in k8s
    assert "spark.authenticate.secret.driver.file and .executor.file" in k8s
    # kept for programs that leave it off; nothing when it is on
    assert warnings_of("local-cluster[2,1,1024]", {"spark.authenticate": "true"}) == ""


@pytest.mark.parametrize("master, kind", [
    ("local", "local"), ("local[2]", "local"), ("local[*]", "local"), ("local[4,2]", "local"), ("local[*, 3]", "local"),
    ("local-cluster[2,1,1024]", "local-cluster"), ("local-cluster[ 2 , 1 , 1024 ]", "local-cluster"),
    ("spark://10.0.0.1:7077", "standalone"), ("spark://a:7077,b:7077", "standalone"), ("yarn", "yarn"),
    ("k8s://https://10.0.0.1:6443", "k8s"), ("nomad:http://10.0.0.1:4646", "other"),
])
def test_check_master_url_takes_sparks_own_forms(master, kind):
    assert remedies.check_master_url(master) == kind


@pytest.mark.parametrize("master, hint", [
    ("local-cluser[2,1,1024]", "local-cluster[2,1,1024]"), ("locall[2]", "local[2]"), ("local[2", "local[2]"),
    ("Local[2]", "local[2]"), ("local[2]x", None), ("Yarn", "yarn"), ("spark:/10.0.0.1:7077", "spark://10.0.0.1:7077"),
    (" local[2]", "local[2]"), ("", None), ("local-cluster[2,1]", None), ("localhost", None),
])
def test_an_unparseable_master_gets_sparks_diagnosis_not_another_masters_advice(master, hint):
    with pytest.raises(ConfigurationError) as info:
        remedies.check_master_url(master)
    text = str(info.value)
    assert text.startswith(f"Could not parse Master URL: {master!r}"), text
    for form in ("local[N]", "local[*]", "local-cluster[E,C,M]", "spark://HOST:PORT", "yarn", "k8s://HOST:PORT"):
        assert form in text, text
    assert "standalone cluster accepts" not in text and "secret" not in text, text
    if hint:
        assert text.endswith(f"Did you mean {hint!r}?"), text
    else:
        assert "Did you mean" not in text, text


def test_a_spark_connect_url_given_as_master_is_pointed_to_remote():
    with pytest.raises(ConfigurationError, match=r"Could not parse Master URL: 'sc://h:15002'.*builder\.remote\(\)"):
        remedies.check_master_url("sc://h:15002")


@pytest.mark.parametrize("master", ["local-cluser[2,1,1024]", "locall[2]", "local[2", "Local[2]"])
def test_tfcluster_run_checks_the_master_before_anything_else(master):
    """run() refuses the master before looking at its other arguments (here all wrong too)."""
    from tfos import TFCluster

    class FakeContext:  # a SparkContext's one attribute run() reads first
        def __init__(self, master):
            self.master = master

    with pytest.raises(ConfigurationError, match=rf"^Could not parse Master URL: {re.escape(repr(master))}"):
        TFCluster.run(FakeContext(master), "not callable", None, 0, -1, reservation_timeout=-1)
