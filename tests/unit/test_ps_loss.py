"""A lost serving worker of a ParameterServerStrategy cluster is a state, not the cluster's failure."""

from __future__ import annotations

from tfos._control.messages import NodeState
from tfos._driver.state import ClusterState
from tfos.cluster_template import NodeRole

PS_CLUSTER = [NodeRole(0, "ps", 0), NodeRole(1, "chief", 0), NodeRole(2, "worker", 0), NodeRole(3, "worker", 1)]


def _state(roles, serving=(2, 3)) -> ClusterState:
    failures = []
    state = ClusterState("c", roles, 30.0, on_failure=failures.append)
    state.fired = failures
    for eid in serving:
        state.proc_state[eid] = NodeState.SERVING
    return state


def test_a_lost_serving_worker_is_recorded_and_the_cluster_goes_on():
    state = _state(PS_CLUSTER)
    state.record_failure(state.make_failure(3, "exited", "ProcessDied", "the TF process died (killed by SIGKILL)"))
    assert not state.failed and state.fired == []
    assert state.proc_state[3] == NodeState.FAILED and state.is_done(3)
    assert [(f.job_name, f.task_index) for f in state.lost_workers] == [("worker", 1)]
    assert state.status()["lost_workers"][0]["error_type"] == "ProcessDied"
    # Its exit report that follows is not a new failure either.
    state.record_failure(state.make_failure(3, "lost", "NodeLost", "no heartbeat"))
    assert not state.failed


def test_the_chief_a_ps_or_a_worker_that_does_not_serve_still_fail_the_cluster():
    for eid in (0, 1):
        state = _state(PS_CLUSTER)
        state.record_failure(state.make_failure(eid, "exception", "RuntimeError", "boom"))
        assert state.failed and not state.lost_workers
    state = _state(PS_CLUSTER, serving=())
    state.record_failure(state.make_failure(2, "exception", "RuntimeError", "boom"))  # a worker still running main_fun
    assert state.failed


def test_without_a_chief_or_ps_a_worker_loss_fails_the_cluster():
    roles = [NodeRole(0, "ps", 0), NodeRole(1, "worker", 0), NodeRole(2, "worker", 1)]
    state = _state(roles, serving=(1, 2))
    state.record_failure(state.make_failure(2, "exited", "ProcessDied", "killed"))
    assert state.failed


def test_a_loss_while_the_cluster_stops_is_not_tolerated_as_a_worker_loss():
    state = _state(PS_CLUSTER)
    state.abort("another node failed")
    state.record_failure(state.make_failure(3, "exited", "ProcessDied", "killed"))
    assert not state.lost_workers


def test_the_last_serving_worker_lost_fails_the_cluster():
    state = _state(PS_CLUSTER)
    state.record_failure(state.make_failure(3, "exited", "ProcessDied", "killed"))
    assert not state.failed
    state.record_failure(state.make_failure(2, "exited", "ProcessDied", "killed"))
    assert state.failed and [f.task_index for f in state.failures] == [0]
