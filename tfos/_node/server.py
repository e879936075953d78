"""TensorFlow-process-side server helpers for tfos nodes.

Everything in this module runs inside the child "TF process" that executes the
user's ``main_fun(args, ctx)`` on a Spark executor, never on the Spark driver.

It provides:

* :func:`start_cluster_server` -- a TF2-compatible replacement for
  TensorFlowOnSpark's ``TFNode.start_cluster_server`` used by TF1-style
  between-graph programs written with ``tf.compat.v1`` (ps/worker).
* :func:`run_server_and_wait` -- run a standard ``tf.distribute.Server`` for a
  ``tf.distribute.ParameterServerStrategy`` ps/worker node and block until told
  to stop.
* :func:`shard_files` and :func:`worker_rank` -- deterministic per-worker file
  sharding (:mod:`tfos._node.sharding`).

The port hand-over (the server binds the node's reserved port with no window for another
process) is in :mod:`tfos._node.port_handover`; sharding in :mod:`tfos._node.sharding`.
The public, TFoS-compatible module :mod:`tfos.tf_server` re-exports this one.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Protocol

from tfos._node.port_handover import create_server, reservation_compatible
from tfos._node.sharding import shard_files, worker_rank
from tfos.errors import ConfigurationError, PortUnavailableError, ProtocolUnavailableError, TFServerError

if TYPE_CHECKING:  # pragma: no cover - typing only
    import tensorflow as tf

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

logger = logging.getLogger(__name__)

_DEFAULT_MAX_ATTEMPTS = 3
_DEFAULT_BACKOFF_S = 0.5
_POLL_INTERVAL_S = 0.5


class ServerContext(Protocol):
    """The subset of the tfos node context used by this module.

    Attributes:
        executor_id: Spark executor id of the node.
        job_name: ``'ps'``, ``'chief'``, ``'master'``, ``'worker'`` or ``'evaluator'``.
        task_index: Index of the node within its job.
        cluster_spec: Job name to list of ``"host:port"`` strings, ordered by
            task index.
        num_workers: Number of data-consuming nodes (chief/master + workers).

    ``release_port()`` and ``reserved_port_socket`` are optional here: they are
    looked up with ``getattr``.
    """

    executor_id: int
    job_name: str
    task_index: int
    cluster_spec: dict[str, list[str]]
    num_workers: int


# ---------------------------------------------------------------------------
# Cluster spec helpers
# ---------------------------------------------------------------------------


def node_cluster(ctx: ServerContext) -> dict[str, list[str]]:
    """Return the cluster definition a node's TF server should be built with.

    Training nodes (ps/chief/master/worker) get every job except
    ``'evaluator'``. The evaluator is not part of the training cluster: if it
    were listed but not serving, every TF1 session on a training node would
    block in device discovery waiting for it. Conversely an evaluator whose
    cluster listed the training jobs would block in its own sessions whenever
    a ps or worker is down (measured: a ``tf.compat.v1.Session`` on such a
    server hangs). So the evaluator gets a one-task cluster of its own.

    Runs in the TF process; needs no TensorFlow.

    Args:
        ctx: The tfos node context.

    Returns:
        A new dict of job name to list of ``"host:port"`` strings.

    Raises:
        ValueError: If the node's job or task index is not in ``ctx.cluster_spec``.
    """
    spec = ctx.cluster_spec
    job = ctx.job_name
    index = ctx.task_index
    if job not in spec:
        raise ValueError(
            f"tfos: job {job!r} of this node is not in the cluster spec (jobs: "
            f"{sorted(spec)}); the node context is inconsistent."
        )
    if not 0 <= index < len(spec[job]):
        raise ValueError(
            f"tfos: task_index {index} is out of range for job {job!r}, which has "
            f"{len(spec[job])} task(s) in the cluster spec."
        )
    if job == "evaluator":
        return {"evaluator": list(spec["evaluator"])}
    return {name: list(addrs) for name, addrs in spec.items() if name != "evaluator" and addrs}



# ---------------------------------------------------------------------------
# Public server API
# ---------------------------------------------------------------------------


def start_cluster_server(
    ctx: ServerContext,
    num_gpus: int = 1,
    rdma: bool = False,
    *,
    config: Any = None,
    max_attempts: int = _DEFAULT_MAX_ATTEMPTS,
    retry_backoff_s: float = _DEFAULT_BACKOFF_S,
) -> tuple[tf.train.ClusterSpec, tf.distribute.Server]:
    """Start the TF server of a node in a TF1-style between-graph cluster.

    A TF2-compatible replacement for TensorFlowOnSpark's
    ``TFNode.start_cluster_server`` (which raises "deprecated" on TF2). Use it
    from ``main_fun`` of programs written with ``tf.compat.v1`` (ps/worker):
    ``ps`` nodes typically call ``server.join()``; workers build their graph
    under ``tf.compat.v1.train.replica_device_setter(cluster=cluster)`` and
    pass ``server.target`` as ``master`` to their session.

    Runs in the TF process. The server is started while the node's port
    reservation is still held (see the module docstring) and
    ``ctx.release_port()`` is called right after, so no other process can take
    the port in between. If the reservation was already released (e.g. by
    ``TFCluster.run(..., release_port=True)`` before ``main_fun``), a
    placeholder socket test-binds and holds the port during the hand-over,
    but the gap since that earlier release is not covered. A TF server cannot
    be stopped in-process: the port is freed when the TF process exits.

    Args:
        ctx: The tfos node context (``job_name``, ``task_index``,
            ``cluster_spec``, ``release_port``, ``reserved_port_socket``).
        num_gpus: Informational, kept for TFoS compatibility: GPUs this node
            was meant to use. Device visibility is decided elsewhere by tfos
            (``CUDA_VISIBLE_DEVICES`` is set before ``main_fun`` runs), so
            this function does not select or hide GPUs; it only logs the
            value.
        rdma: If true use the ``'grpc+verbs'`` protocol instead of ``'grpc'``.
            Stock TF 2.x builds have no verbs support, which raises
            :class:`ProtocolUnavailableError`.
        config: Optional ``tf.compat.v1.ConfigProto`` installed as the
            server's default session config, e.g. with ``device_filters`` so
            a worker's sessions need only the ps tasks and itself.
        max_attempts: Bind attempts (>= 1) when the port is found busy.
        retry_backoff_s: Seconds to wait before the second attempt, doubled
            for each further attempt.

    Returns:
        ``(cluster, server)``: the ``tf.train.ClusterSpec`` the server serves
        (every job but ``'evaluator'`` for training nodes; only the
        evaluator's own task for the evaluator, see :func:`node_cluster`) and
        the started ``tf.distribute.Server``.

    Raises:
        ValueError: If the context is inconsistent (job or task not in the
            cluster spec, bad address).
        PortUnavailableError: If the port stays in use by another process.
        ProtocolUnavailableError: If ``rdma`` is requested but unsupported.
        TFServerError: If TF fails to create the server for another reason.
    """
    import tensorflow as tf

    cluster_def = node_cluster(ctx)
    protocol = "grpc+verbs" if rdma else "grpc"
    logger.info(
        "executor %s starting %s:%d (protocol %s, num_gpus %d informational) in cluster %s",
        getattr(ctx, "executor_id", "?"), ctx.job_name, ctx.task_index, protocol, num_gpus,
        cluster_def,
    )
    cluster = tf.train.ClusterSpec(cluster_def)
    server = create_server(ctx, cluster, protocol, config, max_attempts, retry_backoff_s)
    _SERVER_STARTED.set()
    return cluster, server


#: Set once :func:`start_cluster_server` started a server in this process.
_SERVER_STARTED = threading.Event()


def server_started() -> bool:
    """Whether :func:`start_cluster_server` started a TF server in this process (TF
    process). A tfos node whose ``main_fun`` did so keeps its process, hence the server, up
    after ``main_fun`` returns, until the driver stops the cluster: a peer's TF1 session
    may still need it (TFoS's reused Python worker kept it serving)."""
    return _SERVER_STARTED.is_set()


def _check_fed(ctx: Any) -> bool:
    """Whether ``ctx`` is a fed worker of a cluster with a chief and ps tasks, whose feed the
    coordinator's per-worker datasets read (tfos._node.ps_feed).

    Raises:
        ConfigurationError: Any other fed node (InputMode.SPARK, a chief/worker with a data
            queue): one that only serves never reads its feed, and train() would wait
            feed_timeout for it. Raised at once.
    """
    from tfos._node.ps_serving import coordinated

    if getattr(ctx, "mgr", None) is None:
        return False
    if getattr(ctx, "job_name", "") == "worker" and coordinated(getattr(ctx, "cluster_spec", None) or {}):
        return True
    raise ConfigurationError(
        f"run_server_and_wait() on {getattr(ctx, 'job_name', '?')}:{getattr(ctx, 'task_index', '?')}: this node is "
        "fed by InputMode.SPARK, but a node that only serves never reads its feed. Under ParameterServerStrategy "
        "only workers of a cluster with a chief and ps tasks serve their feed to the coordinator's per-worker "
        "datasets (docs/parameter_servers.md)"
    )


def run_server_and_wait(
    ctx: ServerContext,
    stop_event: threading.Event | None = None,
    timeout_s: float | None = None,
    *,
    poll_interval_s: float = _POLL_INTERVAL_S,
    max_attempts: int = _DEFAULT_MAX_ATTEMPTS,
    retry_backoff_s: float = _DEFAULT_BACKOFF_S,
) -> bool:
    """Serve as a ParameterServerStrategy ps/worker node until told to stop.

    Starts a standard ``tf.distribute.Server`` (the node's cluster spec,
    ``job_name``, ``task_index``, protocol ``'grpc'``, ``start=True``) -- what
    a TF2 ``tf.distribute.experimental.ParameterServerStrategy`` coordinator
    (the chief) expects on its ps and worker tasks -- and then blocks, polling
    ``stop_event`` every ``poll_interval_s`` seconds, until the event is set
    or ``timeout_s`` elapses. It never calls ``server.join()``, which would
    not return.

    When the context has an ``on_serving`` callback (tfos nodes do), it is called once
    the server is up: the driver then treats the node like a ps, i.e. ``shutdown()``
    does not wait for its ``main_fun`` and stops it with the others.

    Runs in the TF process. A TF server cannot be shut down in-process: after
    this function returns the server keeps serving and holding its port until
    the TF process exits, so return from ``main_fun`` (letting the process
    end) soon after; a normal interpreter exit works with the server still
    running (measured with TF 2.21). The port hand-over is as in
    :func:`start_cluster_server`. TF's ParameterServerStrategy guide also sets
    ``GRPC_FAIL_FAST=use_caller`` in every process of the cluster (the
    measured runs did too); it must be in the environment before TensorFlow
    is imported, so this function does not set it.

    Args:
        ctx: The tfos node context.
        stop_event: Event that ends the wait when set. ``None`` uses
            ``ctx.stop_event`` when the context has one (set when the driver
            stops the cluster), else waits for the timeout only.
        timeout_s: Maximum wait in seconds. ``None`` waits without limit (with
            no ``stop_event`` either, until the process is killed).
        poll_interval_s: Seconds between checks of ``stop_event``.
        max_attempts: Bind attempts (>= 1) when the port is found busy.
        retry_backoff_s: Seconds to wait before the second bind attempt,
            doubled for each further attempt.

    Returns:
        ``True`` if ``stop_event`` was set, ``False`` if ``timeout_s`` elapsed.

    Raises:
        ValueError: If the context is inconsistent or ``poll_interval_s`` <= 0.
        ConfigurationError: On a node fed by InputMode.SPARK (``ctx.mgr`` set) that is not
            a worker of a cluster with a chief and ps tasks: a node that only serves would
            never read its feed (a ParameterServerStrategy worker's feed is read by the
            coordinator's per-worker datasets: docs/parameter_servers.md "InputMode.SPARK").
        PortUnavailableError: If the port stays in use by another process.
        TFServerError: If TF fails to create the server for another reason.
    """
    if poll_interval_s <= 0:
        raise ValueError(f"tfos: poll_interval_s must be > 0, got {poll_interval_s}.")
    fed_worker = _check_fed(ctx)
    import tensorflow as tf

    cluster = tf.train.ClusterSpec(node_cluster(ctx))
    create_server(ctx, cluster, "grpc", None, max_attempts, retry_backoff_s)
    if fed_worker:
        from tfos._node import ps_feed

        ps_feed.serve(ctx)  # the coordinator's per-worker datasets read this node's feed (docs/parameter_servers.md)
    on_serving = getattr(ctx, "on_serving", None)
    if callable(on_serving):
        # Tells the driver this node only serves now: shutdown() must not wait for it.
        on_serving()
    if stop_event is None:
        stop_event = getattr(ctx, "stop_event", None)
    event = stop_event if stop_event is not None else threading.Event()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    logger.info(
        "%s:%d serving; waiting for stop (timeout %s s)",
        ctx.job_name, ctx.task_index, timeout_s,
    )
    while True:
        wait_s = poll_interval_s
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                logger.info("%s:%d wait timed out", ctx.job_name, ctx.task_index)
                return event.is_set()
            wait_s = min(wait_s, remaining)
        if event.wait(wait_s):
            logger.info("%s:%d stop requested", ctx.job_name, ctx.task_index)
            return True
