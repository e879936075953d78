"""``TFNodeContext``: what ``main_fun(args, ctx)`` gets (TF process; importable without TF)."""

from __future__ import annotations

import getpass
import logging
import socket
import threading
from typing import Any, Callable, Mapping, Optional, Sequence

from .cluster_template import count_workers

__all__ = ["TFNodeContext", "absolute_path", "HADOOP_SCHEMES"]

log = logging.getLogger(__name__)

#: Paths with these schemes are already absolute and are returned unchanged.
HADOOP_SCHEMES = (
    "adl://", "file://", "hdfs://", "oss://", "s3://", "s3a://", "s3n://", "swift://", "viewfs://", "wasb://", "gs://", "abfs://", "abfss://",
)


def absolute_path(path: str, default_fs: str, working_dir: str, user: Optional[str] = None) -> str:
    """Resolves ``path`` the way TFoS's ``TFNode.hdfs_path`` does (pure).

    Rules: a path with a known scheme is returned as is; an absolute path is prefixed with
    ``default_fs``; a relative path goes under ``/user/<user>/`` on ``hdfs://``/``viewfs://``
    and under ``working_dir`` on ``file://``.

    Args:
        path: The path to resolve.
        default_fs: Spark's ``fs.defaultFS``, e.g. ``file://`` or ``hdfs://nn:8020``
            (a trailing slash is ignored).
        working_dir: The executor's working directory (absolute).
        user: The user for relative HDFS paths (default: the current user).

    Returns:
        A fully qualified path, e.g. ``file:///work/dir/model`` or
        ``hdfs://nn:8020/user/alice/model``.
    """
    if any(path.startswith(s) for s in HADOOP_SCHEMES):
        return path
    fs = "file://" if default_fs.startswith("file:") else default_fs.rstrip("/")
    if path.startswith("/"):
        return fs + path
    if fs.startswith(("hdfs://", "viewfs://")):
        return f"{fs}/user/{user or getpass.getuser()}/{path}"
    if fs.startswith("file://"):
        return f"{fs}/{working_dir.lstrip('/')}/{path}"
    log.warning("unknown default FS scheme %s for relative path %s", fs, path)
    return f"{fs}/{path}"


class TFNodeContext:
    """The node's context, passed to ``main_fun(args, ctx)`` in the TF process.

    Attributes:
        executor_id: 0-based node id.
        job_name: 'ps', 'chief', 'master', 'worker' or 'evaluator'.
        task_index: Index of the node within its job.
        cluster_spec: ``{job: ["host:port", ...]}`` of every node (evaluator included).
        num_workers: chief/master plus worker nodes.
        defaultFS: Spark's ``fs.defaultFS``.
        working_dir: The executor's working directory.
        mgr: The node's feed hub in InputMode.SPARK (chief/master/worker), else None;
            pass it to ``TFNode.DataFeed``.
        tmp_socket: The socket holding this node's TF port until :meth:`release_port`.
        host: This node's address.
        port: This node's TF server port.
        stop_event: Set when the driver asks this node to stop (``cluster.shutdown()``).
        on_serving: Called (no arguments) by :func:`tfos.tf_server.run_server_and_wait` once
            the node's server is up: tells the driver that this node only serves from now
            on, so ``shutdown()`` does not wait for its ``main_fun`` (set by the TF process).
    """

    def __init__(
        self,
        executor_id: int = 0,
        job_name: str = "",
        task_index: int = 0,
        cluster_spec: Optional[Mapping[str, Sequence[str]]] = None,
        defaultFS: str = "file://",
        working_dir: str = ".",
        mgr: Any = None,
        tmp_socket: Optional[socket.socket] = None,
        host: str = "",
        port: int = 0,
        stop_event: Optional[threading.Event] = None,
        on_serving: Optional[Callable[[], None]] = None,
    ):
        self.executor_id = executor_id
        self.job_name = job_name
        self.task_index = task_index
        self.cluster_spec = {k: list(v) for k, v in (cluster_spec or {}).items()}
        self.num_workers = count_workers(self.cluster_spec)
        self.defaultFS = defaultFS
        self.working_dir = working_dir
        self.mgr = mgr
        self.tmp_socket = tmp_socket
        self.host = host
        self.port = port
        #: Set when the driver asks this node to stop (``cluster.shutdown()``).
        self.stop_event = stop_event or threading.Event()
        self.on_serving = on_serving

    def __repr__(self) -> str:
        return f"TFNodeContext({self.job_name}:{self.task_index}, executor {self.executor_id}, {self.num_workers} workers)"

    @property
    def reserved_port_socket(self) -> Optional[socket.socket]:
        """The socket holding the TF port (None once released)."""
        return self.tmp_socket

    def absolute_path(self, path: str) -> str:
        """``path`` resolved against ``defaultFS`` and ``working_dir`` (see :func:`absolute_path`)."""
        return absolute_path(path, self.defaultFS, self.working_dir)

    def release_port(self) -> None:
        """Closes the socket that holds this node's TF port, so TensorFlow can bind it.

        Idempotent. Called automatically before ``main_fun`` when ``TFCluster.run(...,
        release_port=True)`` (the default).
        """
        if self.tmp_socket is not None:
            try:
                self.tmp_socket.close()
            finally:
                self.tmp_socket = None

    def get_data_feed(self, train_mode: bool = True, qname_in: str = "input", qname_out: str = "output", input_mapping: Optional[dict] = None):
        """A :class:`~tfos.datafeed.DataFeed` on this node's queues (InputMode.SPARK).

        Raises:
            TFOSError: When this node is not fed.
        """
        from .datafeed import DataFeed

        return DataFeed(self.mgr, train_mode, qname_in, qname_out, input_mapping)

    def start_cluster_server(self, num_gpus: int = 1, rdma: bool = False):
        """TF1-style ``(tf.train.ClusterSpec, tf.distribute.Server)`` for this node.

        See :func:`tfos.tf_server.start_cluster_server`.
        """
        from .tf_server import start_cluster_server

        return start_cluster_server(self, num_gpus, rdma)

    def run_server_and_wait(self, timeout_s: Optional[float] = None) -> None:
        """Starts a standard TF server for this node and blocks until the driver stops the
        cluster (TF2 ParameterServerStrategy ps/worker nodes).

        Once the server is up the driver is told that this node only serves, so
        ``cluster.shutdown()`` waits for the chief alone, then stops this node (a PSS
        'worker' node would otherwise be waited for like a training worker: a deadlock).

        See :func:`tfos.tf_server.run_server_and_wait`.
        """
        from .tf_server import run_server_and_wait

        run_server_and_wait(self, self.stop_event, timeout_s)

    def export_saved_model(self, model: Any, export_dir: str, is_chief: Optional[bool] = None) -> None:
        """Saves a Keras model as a SavedModel (the chief's copy is kept).

        See :func:`tfos.compat.export_saved_model`.
        """
        from . import compat

        if is_chief is None:
            is_chief = self.job_name in ("chief", "master") or (
                self.job_name == "worker" and self.task_index == 0 and not ({"chief", "master"} & set(self.cluster_spec))
            )
        compat.export_saved_model(model, export_dir, is_chief)
