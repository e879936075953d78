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
  sharding.

Port hand-over
--------------
Each tfos node reserves its port at start-up with a socket
(``ctx.reserved_port_socket``) that has ``SO_REUSEADDR`` and ``SO_REUSEPORT``
set and is bound but NOT listening. Measured with TensorFlow 2.21: TF's gRPC
server binds its listening socket with ``SO_REUSEADDR`` but *without*
``SO_REUSEPORT`` (a second ``SO_REUSEPORT`` listener cannot join it). Linux
nevertheless lets it bind, because both sockets carry ``SO_REUSEADDR`` and the
reservation is not in the LISTEN state. So the server is started while the
reservation is still held and the reservation is released right afterwards:
there is no window in which another process could grab the port. A
reservation that is listening or lacks ``SO_REUSEADDR`` would block gRPC, so
such a socket is released first and replaced by a short-lived compatible
placeholder of our own (which also serves as a bind test).

When the port is taken by someone else, TF 2.21 does not abort the process: the
``tf.distribute.Server`` constructor raises ``tf.errors.UnknownError("Could
not start gRPC server")`` and a later attempt in the same process can succeed.
This module still test-binds the port in Python first, so a taken port yields
a clear :class:`PortUnavailableError` instead of that cryptic TF error.
"""

from __future__ import annotations

import glob as _glob_module
import logging
import socket
import threading
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from .errors import ConfigurationError, TFOSError

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

#: Jobs whose tasks rank before the 'worker' tasks in :func:`worker_rank`, in order.
LEADER_JOBS: tuple[str, ...] = ("chief", "master")

_GLOB_CHARS = frozenset("*?[")
_DEFAULT_MAX_ATTEMPTS = 3
_DEFAULT_BACKOFF_S = 0.5
_POLL_INTERVAL_S = 0.5


class TFServerError(TFOSError, RuntimeError):
    """A TensorFlow server for a tfos node could not be created or started."""


class PortUnavailableError(TFServerError):
    """The node's port is held by another process, so the server cannot bind it."""


class ProtocolUnavailableError(TFServerError):
    """The requested server protocol (e.g. ``grpc+verbs``) is not in this TF build."""


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


def _node_address(ctx: ServerContext) -> str:
    return ctx.cluster_spec[ctx.job_name][ctx.task_index]


def _split_host_port(address: str) -> tuple[str, int]:
    """Split ``"host:port"`` or ``"[v6]:port"`` into host and integer port.

    Raises:
        ValueError: If the address has no valid port.
    """
    host, sep, port_s = address.rpartition(":")
    if not sep or not port_s.isdigit():
        raise ValueError(f"tfos: cluster address {address!r} is not of the form 'host:port'.")
    port = int(port_s)
    if not 0 < port < 65536:
        raise ValueError(f"tfos: cluster address {address!r} has an invalid port {port}.")
    return host.strip("[]"), port


# ---------------------------------------------------------------------------
# Port hand-over
# ---------------------------------------------------------------------------


def reservation_compatible(sock: socket.socket | None) -> bool:
    """Tell whether gRPC can bind a port while ``sock`` still holds it.

    gRPC (as built into TF 2.21) binds with ``SO_REUSEADDR`` only, which Linux
    accepts next to an existing socket only if that socket also has
    ``SO_REUSEADDR`` and is not listening.

    Args:
        sock: The node's reservation socket, or ``None``.

    Returns:
        ``True`` if the server can be started while ``sock`` stays open.
    """
    if sock is None:
        return False
    try:
        if sock.fileno() < 0:
            return False
        reuse_addr = sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR)
        listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    except OSError:
        return False
    return bool(reuse_addr) and not listening


def _release(ctx: ServerContext) -> None:
    release = getattr(ctx, "release_port", None)
    if callable(release):
        release()


def _placeholder_socket(port: int) -> socket.socket:
    """Bind (without listening) a socket that gRPC can bind next to.

    This doubles as a test-bind: it fails exactly when gRPC's own bind of
    ``0.0.0.0:port`` would fail because a listener (or a socket without
    ``SO_REUSEADDR``) holds the port.

    Raises:
        OSError: If the port is in use.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("", port))
    except OSError:
        sock.close()
        raise
    return sock


def _create_server(
    ctx: ServerContext,
    cluster: tf.train.ClusterSpec,
    protocol: str,
    config: Any,
    max_attempts: int,
    retry_backoff_s: float,
) -> tf.distribute.Server:
    """Create and start the node's server, handing the port over race-free.

    Args:
        ctx: The tfos node context.
        cluster: Cluster spec to serve.
        protocol: ``'grpc'`` or ``'grpc+verbs'``.
        config: Optional ``tf.compat.v1.ConfigProto`` used as the server's
            default session config.
        max_attempts: Bind attempts before giving up (>= 1).
        retry_backoff_s: Sleep before the 2nd attempt in seconds; doubled for
            each further attempt.

    Returns:
        The started server.

    Raises:
        PortUnavailableError: If the port stays taken for all attempts.
        ProtocolUnavailableError: If ``protocol`` is not built into TF.
        TFServerError: For any other server creation failure.
    """
    import tensorflow as tf

    if max_attempts < 1:
        raise ValueError(f"tfos: max_attempts must be >= 1, got {max_attempts}.")
    address = _node_address(ctx)
    _, port = _split_host_port(address)
    last_error: BaseException | None = None
    for attempt in range(1, max_attempts + 1):
        if attempt > 1:
            delay = retry_backoff_s * (2 ** (attempt - 2))
            logger.warning(
                "port %d of %s:%d busy (attempt %d/%d failed: %s); retrying in %.2f s",
                port, ctx.job_name, ctx.task_index, attempt - 1, max_attempts, last_error, delay,
            )
            time.sleep(delay)
        placeholder: socket.socket | None = None
        reserved = getattr(ctx, "reserved_port_socket", None)
        try:
            if attempt == 1 and reservation_compatible(reserved):
                logger.debug("starting server on port %d while the reservation is held", port)
            else:
                # Not shareable with gRPC (or already released): swap in a
                # compatible placeholder, which also test-binds the port.
                _release(ctx)
                try:
                    placeholder = _placeholder_socket(port)
                except OSError as exc:
                    last_error = exc
                    continue
            try:
                kwargs: dict[str, Any] = {"protocol": protocol, "start": True}
                if config is not None:
                    kwargs["config"] = config
                server = tf.distribute.Server(
                    cluster, job_name=ctx.job_name, task_index=ctx.task_index, **kwargs
                )
            except tf.errors.NotFoundError as exc:
                message = str(exc)
                if "server factor" in message:
                    available = message.rpartition("available server factories are:")[2].strip()
                    raise ProtocolUnavailableError(
                        f"tfos: protocol {protocol!r} is not available in TensorFlow "
                        f"{tf.__version__} (registered server factories: {available or '?'}). "
                        "Stock TF 2.x builds have no RDMA 'grpc+verbs' support: use "
                        "rdma=False, or a TF build that registers a verbs server."
                    ) from exc
                raise TFServerError(f"tfos: could not create the TF server: {message}") from exc
            except tf.errors.UnknownError as exc:
                if "Could not start gRPC server" not in str(exc):
                    raise TFServerError(
                        f"tfos: could not create the TF server for {ctx.job_name}:"
                        f"{ctx.task_index} at {address}: {exc.message}"
                    ) from exc
                # gRPC could not bind the port (TF raises, it does not abort).
                last_error = exc
                continue
            except tf.errors.OpError as exc:
                raise TFServerError(
                    f"tfos: could not create the TF server for {ctx.job_name}:{ctx.task_index} "
                    f"at {address}: {exc.message}"
                ) from exc
        finally:
            if placeholder is not None:
                placeholder.close()
        # The server owns the port now: drop the reservation right away.
        _release(ctx)
        logger.info(
            "started %s server for %s:%d at %s (target %s)",
            protocol, ctx.job_name, ctx.task_index, address, server.target,
        )
        return server
    _release(ctx)
    raise PortUnavailableError(
        f"tfos: could not bind port {port} for {ctx.job_name}:{ctx.task_index} ({address}) "
        f"after {max_attempts} attempt(s): {last_error}. Another process is listening on it; "
        "check for a leftover TF process of an earlier run on this host."
    )


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
    server = _create_server(ctx, cluster, protocol, config, max_attempts, retry_backoff_s)
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
        ConfigurationError: On a node fed by InputMode.SPARK (``ctx.mgr`` set): a node
            that only serves would never read its feed.
        PortUnavailableError: If the port stays in use by another process.
        TFServerError: If TF fails to create the server for another reason.
    """
    if poll_interval_s <= 0:
        raise ValueError(f"tfos: poll_interval_s must be > 0, got {poll_interval_s}.")
    if getattr(ctx, "mgr", None) is not None:
        # A fed node (InputMode.SPARK, a chief/worker with a data queue) that only serves
        # never reads its feed: train() would wait feed_timeout for it. Fail at once.
        raise ConfigurationError(
            f"run_server_and_wait() on {getattr(ctx, 'job_name', '?')}:{getattr(ctx, 'task_index', '?')}: this node is "
            "fed by InputMode.SPARK, but a node that only serves never reads its feed. ParameterServerStrategy "
            "does not fit InputMode.SPARK (its workers run no main_fun loop): run the cluster with "
            "InputMode.TENSORFLOW and read the data with tf.data (docs/parameter_servers.md)"
        )
    import tensorflow as tf

    cluster = tf.train.ClusterSpec(node_cluster(ctx))
    _create_server(ctx, cluster, "grpc", None, max_attempts, retry_backoff_s)
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


# ---------------------------------------------------------------------------
# Data sharding
# ---------------------------------------------------------------------------


def _count_data_workers(spec: dict[str, list[str]]) -> int:
    return sum(len(spec.get(job, ())) for job in LEADER_JOBS + ("worker",))


def worker_rank(ctx: ServerContext) -> int:
    """Return the node's rank among the data-consuming nodes.

    Rule: chief/master tasks come first, then the ``'worker'`` tasks. With a
    chief (or master) in the cluster the chief is rank 0 and worker task ``i``
    is rank ``i + 1``; without one, worker task ``i`` is rank ``i``. (With
    both a chief and a master, the chief precedes the master.) ps and
    evaluator nodes consume no training data and have no rank.

    Runs anywhere; needs no TensorFlow.

    Args:
        ctx: The tfos node context (``job_name``, ``task_index``, ``cluster_spec``).

    Returns:
        The rank, in ``[0, number of chief/master/worker tasks)``.

    Raises:
        ValueError: For ps/evaluator nodes, or if the task is not in the
            cluster spec.
    """
    job = ctx.job_name
    index = ctx.task_index
    spec = ctx.cluster_spec
    if job not in LEADER_JOBS and job != "worker":
        raise ValueError(
            f"tfos: a {job!r} node has no worker rank; only chief/master/worker nodes "
            "shard training data. Pass an explicit index to shard_files() instead."
        )
    tasks = spec.get(job)
    if tasks is not None and not 0 <= index < len(tasks):
        raise ValueError(
            f"tfos: task_index {index} out of range for job {job!r} with {len(tasks)} task(s)."
        )
    rank = 0
    for leader in LEADER_JOBS:
        if leader == job:
            return rank + index
        rank += len(spec.get(leader, ()))
    return rank + index


def _has_glob(pattern: str) -> bool:
    return any(ch in _GLOB_CHARS for ch in pattern)


def _glob(pattern: str) -> list[str]:
    """Glob with ``tf.io.gfile`` (any TF filesystem) or, without TF, ``glob``."""
    try:
        import tensorflow as tf
    except ImportError:
        return _glob_module.glob(pattern)
    return list(tf.io.gfile.glob(pattern))


def shard_files(
    ctx_or_index: ServerContext | int,
    pattern_or_list: str | Sequence[str],
    num_workers: int | None = None,
) -> list[str]:
    """Return this worker's share of the input files.

    The files are listed (a string is a glob pattern; in a list, entries with
    ``*``, ``?`` or ``[`` are expanded and other entries taken verbatim),
    de-duplicated, sorted, and then every ``num_workers``-th file starting at
    the worker's rank is kept: ``files[rank::num_workers]``. All workers must
    see the same listing for the shards to be disjoint and complete.

    Globbing uses ``tf.io.gfile.glob`` (so ``hdfs://``, ``gs://`` etc. work)
    when TensorFlow is importable, else :func:`glob.glob`. Runs in the TF
    process (or anywhere for an explicit index).

    Args:
        ctx_or_index: The node context, whose rank is :func:`worker_rank`
            (chief/master first, then workers), or an explicit integer rank.
        pattern_or_list: A glob pattern, or a list of paths/patterns.
        num_workers: Number of data-consuming workers. Defaults, for a
            context, to the number of chief/master/worker tasks in its cluster
            spec (falling back to ``ctx.num_workers``); required with an
            integer rank.

    Returns:
        The sorted list of this worker's files (never empty).

    Raises:
        ValueError: If nothing matches, there are fewer files than workers
            (some worker would get none), or the rank/count is invalid.
    """
    if isinstance(ctx_or_index, bool):
        raise ValueError("tfos: shard_files() needs a node context or an int rank, not a bool.")
    if isinstance(ctx_or_index, int):
        rank = ctx_or_index
        if num_workers is None:
            raise ValueError("tfos: shard_files() with an integer rank needs num_workers.")
    else:
        rank = worker_rank(ctx_or_index)
        if num_workers is None:
            num_workers = _count_data_workers(ctx_or_index.cluster_spec) or int(
                getattr(ctx_or_index, "num_workers", 0)
            )
    if num_workers < 1:
        raise ValueError(f"tfos: num_workers must be >= 1, got {num_workers}.")
    if not 0 <= rank < num_workers:
        raise ValueError(f"tfos: worker rank {rank} is out of range for {num_workers} worker(s).")

    patterns: Iterable[str]
    if isinstance(pattern_or_list, str):
        files = _glob(pattern_or_list)
        patterns = [pattern_or_list]
    else:
        patterns = list(pattern_or_list)
        files = []
        for entry in patterns:
            files.extend(_glob(entry) if _has_glob(entry) else [entry])
    files = sorted(set(files))
    if not files:
        raise ValueError(f"tfos: no input files match {list(patterns)!r}.")
    if len(files) < num_workers:
        raise ValueError(
            f"tfos: only {len(files)} input file(s) for {num_workers} workers, so some workers "
            "would get no data. Split the input into at least as many files as workers (e.g. "
            "repartition before writing), or run fewer workers."
        )
    shard = files[rank::num_workers]
    logger.info(
        "worker rank %d/%d reads %d of %d file(s)", rank, num_workers, len(shard), len(files)
    )
    return shard
