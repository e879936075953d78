"""A finished TF process's part in TensorFlow's coordination service, and how long a
member keeps heartbeating after its ``main_fun`` returned (TF process; docs/keras.md "The
chief's process ends last")."""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["COORDINATION_LINGER_S", "part_of", "linger_s"]

log = logging.getLogger(__name__)


#: Longest wait, in seconds, of a finished MultiWorkerMirroredStrategy task that does not
#: lead the coordination service for the cluster to stop (``TFOS_COORDINATION_LINGER_S``
#: overrides it): its heartbeats keep the leader from reporting it crashed meanwhile.
COORDINATION_LINGER_S = 1800.0


def part_of(role) -> str:
    """This TF process's part in TensorFlow's coordination service (TF process, after
    ``main_fun`` returned): "leader", "member" or "" (none, or TensorFlow not imported).

    ``MultiWorkerMirroredStrategy`` makes the chief (else worker 0) the service every other
    worker heartbeats to. When the leader's process exits before theirs, TensorFlow logs
    ``StartAbort UNAVAILABLE: Failed to send RPC to coordination service`` on each of them;
    when a member's process exits while the leader still runs, the leader logs ``The
    following tasks are unhealthy (stopped sending heartbeats) ... The tasks have crashed``
    about 10 s later: errors in a run that went well."""
    mod = sys.modules.get("tensorflow.python.eager.context")
    if mod is None:
        return ""
    try:
        config = mod.context().coordination_service
    except Exception:  # noqa: BLE001 - a TensorFlow without it: nothing to wait for
        return ""
    leader = getattr(config, "service_leader", "") if config is not None else ""
    if not leader:
        return ""
    return "leader" if leader == f"/job:{role.job_name}/replica:0/task:{role.task_index}" else "member"


def linger_s() -> float:
    """:data:`COORDINATION_LINGER_S`, or ``TFOS_COORDINATION_LINGER_S`` when set (seconds >= 0)."""
    raw = os.environ.get("TFOS_COORDINATION_LINGER_S", "")
    if not raw:
        return COORDINATION_LINGER_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (0 <= value < float("inf")):
        log.warning("TFOS_COORDINATION_LINGER_S must be a number of seconds >= 0, got %r; using %g s", raw, COORDINATION_LINGER_S)
        return COORDINATION_LINGER_S
    return value
