"""A lost serving worker of a ParameterServerStrategy cluster is a state, not the cluster's failure."""

from __future__ import annotations

from tfos._control.host import ClusterHost
from tfos._control.messages import NodeState
from tfos.cluster_template import NodeRole

PS_CLUSTER = [NodeRole(0, "ps", 0), NodeRole(1, "chief", 0), NodeRole(2, "worker", 0), NodeRole(3, "worker", 1)]


def _host(roles, serving=(2, 3)) -> ClusterHost:
    host = ClusterHost("c", roles, 30.0)
    for eid in serving:
        host.core.proc_state[eid] = NodeState.SERVING
    return host


def _failed(host) -> bool:
    return bool(host.core.failures)


def test_a_lost_serving_worker_is_recorded_and_the_cluster_goes_on():
    host = _host(PS_CLUSTER)
    host.record_failure(host.core.make_failure(3, "exited", "ProcessDied", "the TF process died (killed by SIGKILL)"))
    assert not _failed(host)
    assert host.core.proc_state[3] == NodeState.FAILED and host.core.is_done(3)
    assert [(f.job_name, f.task_index) for f in host.core.lost_workers] == [("worker", 1)]
    assert host.core.status()["lost_workers"][0]["error_type"] == "ProcessDied"
    # What follows from the loss (its missing heartbeat) is not a new failure either.
    host.record_failure(host.core.make_failure(3, "lost", "NodeLost", "no heartbeat"))
    assert not _failed(host)


def test_the_chief_a_ps_or_a_worker_that_does_not_serve_still_fail_the_cluster():
    for eid in (0, 1):
        host = _host(PS_CLUSTER)
        host.record_failure(host.core.make_failure(eid, "exception", "RuntimeError", "boom"))
        assert _failed(host) and not host.core.lost_workers
    host = _host(PS_CLUSTER, serving=(3,))
    host.record_failure(host.core.make_failure(2, "exception", "RuntimeError", "boom"))  # still running main_fun
    assert _failed(host)


def test_without_a_chief_a_worker_loss_fails_the_cluster():
    host = _host([NodeRole(0, "ps", 0), NodeRole(1, "worker", 0), NodeRole(2, "worker", 1)], serving=(1, 2))
    host.record_failure(host.core.make_failure(2, "exited", "ProcessDied", "killed"))
    assert _failed(host)


def test_a_loss_while_the_cluster_stops_is_not_tolerated_as_a_worker_loss():
    host = _host(PS_CLUSTER)
    host.abort("another node failed")
    host.record_failure(host.core.make_failure(3, "exited", "ProcessDied", "killed"))
    assert not host.core.lost_workers


def test_the_last_serving_worker_lost_fails_the_cluster():
    host = _host(PS_CLUSTER)
    host.record_failure(host.core.make_failure(3, "exited", "ProcessDied", "killed"))
    assert not _failed(host)
    host.record_failure(host.core.make_failure(2, "exited", "ProcessDied", "killed"))
    assert _failed(host) and [f.task_index for f in host.core.failures] == [0]
