"""How the control plane scales with the number of nodes (pure; runs anywhere).

The driver's cost of a steady cluster is its request rate: each node's supervisor sends a
heartbeat every :func:`heartbeat_interval_s` and its TF process re-polls for directives
every :func:`event_poll_s` (a directive itself ends the poll at once). Both stretch with
the cluster so that the rate stays near :data:`HEARTBEATS_PER_S` and
:data:`EVENT_POLLS_PER_S`, and never beyond what detecting a lost node in time allows.
While a cluster forms, its start tasks ask for their nodes' state every
:func:`start_poll_s`, which stretches the same way (:data:`START_POLLS_PER_S`).
The server's caps (:class:`ControlLimits`) are derived from the number of nodes too.
See docs/performance.md "Scale".
"""

from __future__ import annotations

import dataclasses

from tfos._common.admission import UNPROVEN_CAP, listen_backlog

__all__ = ["ControlLimits", "heartbeat_interval_s", "event_poll_s", "HEARTBEATS_PER_S", "EVENT_POLLS_PER_S",
           "CONNECTIONS_PER_NODE", "FORMING_CONNECTIONS_PER_NODE", "START_POLLS_PER_S", "start_poll_s"]

#: Heartbeats per second a whole cluster sends at most once it is larger than this many
#: nodes (smaller clusters heartbeat every second).
HEARTBEATS_PER_S = 500.0
#: Idle directive polls per second a whole cluster sends at most (same rule).
EVENT_POLLS_PER_S = 400.0
#: The driver answers a directive poll after at most this many seconds.
MAX_EVENT_POLL_S = 5.0
#: ``node_state`` questions per second a whole forming cluster's start tasks send at most
#: once it is larger than this many / 5 nodes (smaller clusters ask every 0.2 s).
START_POLLS_PER_S = 2000.0
#: A start task asks at least this often (seconds).
MAX_START_POLL_S = 2.0
#: Control connections one node may hold at once: its supervisor and TF process (one each),
#: the Python workers of its executor (the start task, feed and inference tasks; idle
#: reused workers keep theirs), and short-lived ones (a dying process's last report).
CONNECTIONS_PER_NODE = 8
#: Connections one node opens at about the same moment while its cluster forms: its Spark
#: start task's (InputMode.SPARK: it asks for the node's state until the node registered),
#: its supervisor's and its TF process's.
FORMING_CONNECTIONS_PER_NODE = 3


def heartbeat_interval_s(num_nodes: int, heartbeat_timeout_s: float) -> float:
    """Seconds between two heartbeats of one node's supervisor (pure).

    One second (a quarter of ``heartbeat_timeout_s`` when that is shorter) up to
    :data:`HEARTBEATS_PER_S` nodes; beyond, ``num_nodes / HEARTBEATS_PER_S`` seconds, never
    more than ``heartbeat_timeout_s / 4``: a live node always has four heartbeats in a
    timeout, and a silent one is declared lost ``heartbeat_timeout_s`` after its last.
    """
    return min(heartbeat_timeout_s / 4.0, max(1.0, num_nodes / HEARTBEATS_PER_S))


def event_poll_s(num_nodes: int) -> float:
    """Seconds one directive poll of a TF process lasts when nothing changes (pure): 1 s up
    to :data:`EVENT_POLLS_PER_S` nodes, then longer, at most :data:`MAX_EVENT_POLL_S`."""
    return min(MAX_EVENT_POLL_S, max(1.0, num_nodes / EVENT_POLLS_PER_S))


def start_poll_s(num_nodes: int) -> float:
    """Seconds between two ``node_state`` questions of an InputMode.SPARK start task while
    its node's TF process starts (pure; the Spark task side): 0.2 s up to 400 nodes, then
    ``num_nodes / START_POLLS_PER_S``, at most :data:`MAX_START_POLL_S`. The start task
    notices its node's registration that much later (and frees its task slot for the
    feed); a supervisor's exit it notices at once, whatever the interval."""
    return min(MAX_START_POLL_S, max(0.2, num_nodes / START_POLLS_PER_S))


@dataclasses.dataclass(frozen=True)
class ControlLimits:
    """The control server's caps (driver, or the control host under Spark Connect).

    Attributes:
        max_connections: Connections that proved they hold the key served at once; more
            are closed on accept.
        max_unauthenticated: Connections that have not yet proven they hold the key (their
            first 52 bytes, :func:`tfos._control.protocol.client_proof`), on top of
            ``max_connections``. Over the cap the oldest are shed
            (:class:`tfos._common.admission.Admission`); a proven connection is never
            shed, so a flood of strangers cannot lock the cluster's own processes out.
        backlog: The listen backlog (the kernel caps it at ``net.core.somaxconn``; the
            server empties the queue on every turn of its loop).
        handler_threads: Threads that run the requests whose handlers may block.
        max_inflight: Unanswered requests of one connection after which the server stops
            reading it until answers went out (backpressure on one peer).
    """

    max_connections: int = 512
    max_unauthenticated: int = UNPROVEN_CAP
    backlog: int = 4096
    handler_threads: int = 4
    max_inflight: int = 32

    def __post_init__(self) -> None:
        if min(self.max_connections, self.max_unauthenticated, self.backlog, self.handler_threads, self.max_inflight) < 1:
            raise ValueError(f"control limits must be >= 1: {self}")

    @classmethod
    def for_nodes(cls, num_nodes: int) -> "ControlLimits":
        """Caps for a cluster of ``num_nodes`` nodes: :data:`CONNECTIONS_PER_NODE` connections
        per node, and :data:`FORMING_CONNECTIONS_PER_NODE` unauthenticated connections and
        as many places in the listen backlog per node (at least the defaults): a forming
        cluster opens those connections of every node at once, and none of them may be
        evicted (with two per node, 500 simulated nodes saw their own connections evicted,
        docs/performance.md "Scale"). Strangers can hold at most that many sockets, each
        with at most 52 bytes of buffer (a proof) for ``FIRST_FRAME_TIMEOUT_S``."""
        n = max(0, int(num_nodes))
        return cls(
            max_connections=max(512, CONNECTIONS_PER_NODE * n + 64),
            max_unauthenticated=max(UNPROVEN_CAP, FORMING_CONNECTIONS_PER_NODE * n + 64),
            backlog=listen_backlog(max(1024, FORMING_CONNECTIONS_PER_NODE * n)),
        )
