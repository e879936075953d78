"""After main_fun returned, every MultiWorkerMirroredStrategy task keeps its process (and
its coordination agent's heartbeats) up until the cluster stops, the members with a
deadline (tfos._node.coordination, tfos._node.tf_process._NodeRun._linger)."""

import sys
import threading
import time
import types
from types import SimpleNamespace

import pytest

from tfos._node import coordination
from tfos._node.tf_process import _NodeRun


@pytest.fixture
def tf_context(monkeypatch):
    """A TensorFlow eager context whose coordination service is led by chief:0."""
    config = SimpleNamespace(service_leader="/job:chief/replica:0/task:0")
    mod = types.ModuleType("tensorflow.python.eager.context")
    mod.context = lambda: SimpleNamespace(coordination_service=config)
    monkeypatch.setitem(sys.modules, "tensorflow.python.eager.context", mod)
    return config


def _run(job, index):
    return SimpleNamespace(launch=SimpleNamespace(node_name=f"{job}:{index}"), role=SimpleNamespace(job_name=job, task_index=index),
                           stop_event=threading.Event(), tb_proc=None)


def test_parts(tf_context, monkeypatch):
    assert coordination.part_of(SimpleNamespace(job_name="chief", task_index=0)) == "leader"
    assert coordination.part_of(SimpleNamespace(job_name="worker", task_index=0)) == "member"
    tf_context.service_leader = ""
    assert coordination.part_of(SimpleNamespace(job_name="worker", task_index=0)) == ""
    monkeypatch.delitem(sys.modules, "tensorflow.python.eager.context")
    assert coordination.part_of(SimpleNamespace(job_name="chief", task_index=0)) == ""


def test_a_finished_member_heartbeats_until_the_cluster_stops(tf_context):
    """The worker that finished first no longer exits while the leader still runs (the
    leader then logged 'The following tasks are unhealthy (stopped sending heartbeats):
    /job:worker/replica:0/task:0 The tasks have crashed' in a run that went well)."""
    run = _run("worker", 0)
    threading.Timer(0.5, run.stop_event.set).start()  # the driver stops the cluster
    t0 = time.monotonic()
    _NodeRun._linger(run)
    assert time.monotonic() - t0 >= 0.45


def test_a_members_linger_has_a_deadline(tf_context, monkeypatch, caplog):
    monkeypatch.setenv("TFOS_COORDINATION_LINGER_S", "0.2")
    run = _run("worker", 1)
    t0 = time.monotonic()
    _NodeRun._linger(run)
    assert 0.15 <= time.monotonic() - t0 < 30
    assert "did not stop within 0.2 s" in caplog.text


def test_linger_setting(monkeypatch):
    monkeypatch.delenv("TFOS_COORDINATION_LINGER_S", raising=False)
    assert coordination.linger_s() == coordination.COORDINATION_LINGER_S
    for bad in ("x", "-1", "nan"):
        monkeypatch.setenv("TFOS_COORDINATION_LINGER_S", bad)
        assert coordination.linger_s() == coordination.COORDINATION_LINGER_S
