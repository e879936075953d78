"""A lost worker of a ParameterServerStrategy cluster: a state, not the cluster's failure (control core).

Under ``ParameterServerStrategy`` the chief coordinates (``ClusterCoordinator``) and the
workers only serve (``ctx.run_server_and_wait()``, node state ``serving``). When a worker is
lost, TensorFlow's coordinator runs the closures it had on the other workers and training
goes on (``GRPC_FAIL_FAST=use_caller`` makes it notice at once). tfos therefore does not fail
the cluster for it: the node's state becomes ``failed`` and its failure is kept in
:attr:`Registry.lost_workers <tfos._control.registry.Registry>` (shown by
``TFCluster.node_states()`` and a WARNING), while the chief, the ps tasks and the other
workers go on. Every other failure (a ps, the chief, a worker that does not serve, any node
of another kind of cluster, the last serving worker) fails the cluster as before. See docs/parameter_servers.md.
"""

from __future__ import annotations

import logging
from typing import Any

from tfos._control.messages import NodeState


def coordinated(roles: Any) -> bool:
    """Whether a cluster of ``roles`` has a chief to coordinate and ps tasks (pure)."""
    jobs = {r.job_name for r in roles}
    return "chief" in jobs and "ps" in jobs


def tolerate(state: Any, failure: Any) -> bool:
    """Records ``failure`` as a lost serving worker when it is one (``state``: the control
    core's registry, applying a message). Returns True when recorded so (the cluster does not
    fail); the log line goes out as the registry's note."""
    eid = failure.executor_id
    if not 0 <= eid < len(state.roles) or state.roles[eid].job_name != "worker" or not coordinated(state.roles):
        return False
    if any(f.executor_id == eid for f in state.lost_workers):
        state.note(logging.INFO, f"tfos node {failure.node_name}, after its loss: {failure.error_type}: {failure.message}")
        return True  # a consequence of the loss already recorded (its exit, its missing heartbeat)
    if state.proc_state.get(eid) != NodeState.SERVING or state.abort_reason or state.stop_requested:
        return False
    others = [r.executor_id for r in state.roles if r.job_name == "worker" and r.executor_id != eid]
    if not any(state.proc_state.get(o) == NodeState.SERVING for o in others):
        return False  # no worker left to run the steps: the coordinator would wait for ever
    state.proc_state[eid] = NodeState.FAILED
    state.lost_workers.append(failure)
    state.note(logging.WARNING, f"tfos node {failure.node_name} lost: {failure.error_type}: {failure.message}; the chief's "
               "ParameterServerStrategy coordinator runs its steps on the other workers, and the cluster goes on "
               "(docs/parameter_servers.md)")
    return True
