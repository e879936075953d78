"""TensorFlow-process-side server helpers (TF process, never the driver): the public,
TFoS-compatible module. ``start_cluster_server`` (TF1-style ps/worker programs),
``run_server_and_wait`` (a ps/worker of ``ParameterServerStrategy``), ``shard_files`` and
``worker_rank``. The implementation runs in the node's TF process and lives in
:mod:`tfos._node.server`; see docs/api.md "Other modules"."""

from __future__ import annotations

from tfos._node.server import (
    PortUnavailableError,
    ProtocolUnavailableError,
    ServerContext,
    TFServerError,
    node_cluster,
    reservation_compatible,
    run_server_and_wait,
    shard_files,
    start_cluster_server,
    worker_rank,
)

__all__ = [
    "PortUnavailableError",
    "ProtocolUnavailableError",
    "ServerContext",
    "TFServerError",
    "node_cluster",
    "reservation_compatible",
    "run_server_and_wait",
    "shard_files",
    "start_cluster_server",
    "worker_rank",
]
