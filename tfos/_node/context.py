"""``TFNodeContext``: what ``main_fun(args, ctx)`` gets (TF process; importable without TF).

The implementation; :mod:`tfos.node_context` is the public, TFoS-compatible module that
re-exports it."""

from __future__ import annotations

import getpass
import logging
import re
import socket
import threading
from typing import Any, Callable, Mapping, Optional, Sequence

from tfos.cluster_template import count_workers

__all__ = ["TFNodeContext", "absolute_path", "normalize_default_fs", "HADOOP_SCHEMES"]

log = logging.getLogger(__name__)

#: Hadoop-compatible schemes (TFoS's list plus the object stores it missed). Any path of
#: the form ``scheme://...`` is already absolute and is returned unchanged, listed or not.
HADOOP_SCHEMES = (
    "adl://", "file://", "hdfs://", "oss://", "s3://", "s3a://", "s3n://", "swift://", "viewfs://", "wasb://",
    "wasbs://", "gs://", "abfs://", "abfss://", "cos://", "cosn://", "obs://", "o3fs://", "ofs://",
)

_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def normalize_default_fs(default_fs: str) -> str:
    """Spark's ``fs.defaultFS`` in the form the path rules use (pure).

    ``file:``, ``file:/`` and ``file:///`` become ``file://``; a trailing slash after a host is
    dropped (``hdfs://nn:8020/`` -> ``hdfs://nn:8020``); a scheme without host keeps its
    ``//`` (``hdfs://`` stays ``hdfs://``, so ``/foo`` maps to ``hdfs:///foo``).

    Args:
        default_fs: The configured value, e.g. ``hdfs://nn:8020/``, ``viewfs://`` or ``file:///``.

    Returns:
        ``scheme://`` or ``scheme://authority`` (no trailing slash).
    """
    fs = (default_fs or "file://").strip()
    if fs.startswith("file:"):
        return "file://"
    if "://" not in fs:
        scheme = fs.rstrip(":/")
        return f"{scheme}://"
    scheme, rest = fs.split("://", 1)
    return f"{scheme}://{rest.rstrip('/')}"


def absolute_path(path: str, default_fs: str, working_dir: str, user: Optional[str] = None) -> str:
    """Resolves ``path`` the way TFoS's ``TFNode.hdfs_path`` does (pure; runs anywhere).

    Rules (identical to TFoS 2.2.5, plus schemes it did not know):

    * ``scheme://...`` (any scheme: hdfs, viewfs, file, s3a, gs, abfss, ...) is returned as is.
    * ``/abs/path`` is prefixed with ``default_fs``: ``hdfs:///abs/path`` for ``hdfs://``,
      ``hdfs://nn:8020/abs/path`` for ``hdfs://nn:8020``, ``file:///abs/path`` for ``file://``.
    * ``rel/path`` goes under ``/user/<user>/`` when ``default_fs`` is ``hdfs://`` or
      ``viewfs://`` (with or without a host); under ``working_dir`` when it is ``file://``;
      under the file system's root for any other scheme (TFoS did the same, with a warning).

    In a tfos cluster ``working_dir`` is the *driver's* working directory (shipped to every
    node in the cluster configuration), so every node maps a relative path to the same place.

    Args:
        path: The path to resolve.
        default_fs: Spark's ``fs.defaultFS``, e.g. ``file://`` or ``hdfs://nn:8020``
            (see :func:`normalize_default_fs`).
        working_dir: Absolute directory for relative paths on ``file://``.
        user: The user for relative HDFS paths (default: the current user).

    Returns:
        A fully qualified path, e.g. ``file:///work/dir/model`` or
        ``hdfs://nn:8020/user/alice/model``.
    """
    if _URI.match(path) or any(path.startswith(s) for s in HADOOP_SCHEMES):
        return path
    fs = normalize_default_fs(default_fs)
    if path.startswith("/"):
        return fs + path
    if fs.startswith(("hdfs://", "viewfs://")):
        return f"{fs}/user/{user or getpass.getuser()}/{path}"
    if fs.startswith("file://"):
        return f"{fs}/{working_dir.lstrip('/')}/{path}"
    log.warning("unknown default FS scheme %s for relative path %s: put at its root", fs, path)
    return f"{fs}/{path}"


class TFNodeContext:
    """The node's context, passed to ``main_fun(args, ctx)`` in the TF process.

    Attributes:
        executor_id: 0-based node id.
        job_name: 'ps', 'chief', 'master', 'worker' or 'evaluator'.
        task_index: Index of the node within its job.
        cluster_spec: ``{job: ["host:port", ...]}`` of every node (evaluator included).
        num_workers: chief/master plus worker nodes.
        worker_num: Same as ``executor_id`` (TFoS's old name, kept).
        defaultFS: Spark's ``fs.defaultFS``.
        working_dir: The *driver's* working directory (as in TFoS): relative paths on a
            ``file://`` default FS resolve against it, so every node maps them alike.
        mgr: The node's feed hub in InputMode.SPARK (chief/master/worker), else None;
            pass it to ``TFNode.DataFeed``.
        tmp_socket: The socket holding this node's TF port until :meth:`release_port`.
        host: This node's address.
        port: This node's TF server port.
        stop_event: Set when the driver asks this node to stop (``cluster.shutdown()``).
        on_serving: Called (no arguments) by :func:`tfos.tf_server.run_server_and_wait` once
            the node's server is up: tells the driver that this node only serves from now
            on, so ``shutdown()`` does not wait for its ``main_fun`` (set by the TF process).
        attempt: Which attempt of the cluster this is: 0 for the first, ``k`` for the
            ``k``-th restart (``TFCluster.run(..., max_restarts=N)`` starts a fresh cluster
            after a node failure, at most N times). Every node of one attempt sees the same
            number. ``main_fun`` should restore its state from its checkpoint when
            ``attempt > 0`` (e.g. ``tf.keras.callbacks.BackupAndRestore`` does so by itself
            whenever its backup directory holds a backup); the model directory must be on
            storage every executor reaches, since a restart may run on other executors.
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
        attempt: int = 0,
        on_checkpoint: Optional[Callable[[int], None]] = None,
    ):
        if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 0:
            raise ValueError(f"attempt must be an int >= 0, got {attempt!r}")
        self.executor_id = executor_id
        self.worker_num = executor_id  # TFoS's name for executor_id
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
        #: 0 for the cluster's first attempt, k after the k-th restart.
        self.attempt = attempt
        #: Sends a checkpoint report to the driver (set by the TF process); see report_checkpoint().
        self.on_checkpoint = on_checkpoint

    def __repr__(self) -> str:
        again = f", attempt {self.attempt}" if self.attempt else ""
        return f"TFNodeContext({self.job_name}:{self.task_index}, executor {self.executor_id}, {self.num_workers} workers{again})"

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

    def report_checkpoint(self, epochs: int) -> None:
        """Tells the driver that this node's checkpoint holds the first ``epochs`` epochs
        of the running ``train()`` call (TF process; InputMode.SPARK with ``max_restarts``).

        Call it right after the checkpoint of an epoch end was written (or use
        :meth:`checkpoint_callback`). When a node fails, the restarted ``train()`` resumes the
        feed at ``min(first epoch not fully consumed, checkpointed epochs)``, so a
        ``main_fun`` whose ``DataFeed``/``as_dataset`` read ahead of its checkpoint gets
        every row after the checkpoint again. The driver keeps each node's latest report
        for the whole ``train()`` call (over every attempt) and uses the minimum over the
        nodes; the chief (chief/master, else worker 0) must have reported for any report to
        count (it writes the checkpoint under MultiWorkerMirroredStrategy). Epochs are
        numbered from 0 per ``train()`` call (as the feed numbers them); reports made
        outside a ``train()`` call are forgotten when the next one starts. Without
        ``max_restarts`` the report is recorded and has no effect.

        Blocks for one request to the driver: milliseconds normally; when the driver does
        not answer, at most about 80 s (two tries, each up to 30 s to connect and 10 s for
        the answer).

        Args:
            epochs: Epochs the checkpoint holds, an int >= 0 (``epoch + 1`` at a Keras
                ``on_epoch_end(epoch)``).

        Raises:
            TypeError: ``epochs`` is not an int (bool refused).
            ValueError: ``epochs`` < 0.
            TFOSError: This context belongs to no running cluster (no driver to report to).
            ConnectionError, DeadlineExceededError: The driver could not be reached or did
                not answer in time.
            ControlProtocolError: The driver's answer failed authentication.
        """
        if isinstance(epochs, bool) or not isinstance(epochs, int):
            raise TypeError(f"report_checkpoint(epochs): epochs must be an int, got {type(epochs).__name__} {epochs!r}")
        if epochs < 0:
            raise ValueError(f"report_checkpoint(epochs): epochs must be >= 0, got {epochs}")
        if self.on_checkpoint is None:
            from tfos.errors import TFOSError

            raise TFOSError(f"report_checkpoint(): {self!r} belongs to no running tfos cluster")
        self.on_checkpoint(int(epochs))

    def checkpoint_callback(self, keras: Any = None) -> Any:
        """A Keras callback calling :meth:`report_checkpoint` with ``epoch + 1`` at every
        epoch end (TF process). List it **after** ``BackupAndRestore`` in ``fit(callbacks=...)``:
        Keras runs callbacks in list order and the report must follow the save.

        Args:
            keras: ``tf_keras`` or ``keras`` (default ``tf.keras``); see
                :func:`tfos.compat.checkpoint_callback`.

        Returns:
            A ``keras.callbacks.Callback``.
        """
        from tfos.compat import checkpoint_callback

        return checkpoint_callback(self.report_checkpoint, keras)

    def get_data_feed(self, train_mode: bool = True, qname_in: str = "input", qname_out: str = "output", input_mapping: Optional[dict] = None):
        """A :class:`~tfos.datafeed.DataFeed` on this node's queues (InputMode.SPARK).

        Raises:
            TFOSError: When this node is not fed.
        """
        from tfos.datafeed import DataFeed

        return DataFeed(self.mgr, train_mode, qname_in, qname_out, input_mapping)

    def start_cluster_server(self, num_gpus: int = 1, rdma: bool = False):
        """TF1-style ``(tf.train.ClusterSpec, tf.distribute.Server)`` for this node.

        See :func:`tfos.tf_server.start_cluster_server`.
        """
        from tfos._node.server import start_cluster_server

        return start_cluster_server(self, num_gpus, rdma)

    def run_server_and_wait(self, timeout_s: Optional[float] = None) -> None:
        """Starts a standard TF server for this node and blocks until the driver stops the
        cluster (TF2 ParameterServerStrategy ps/worker nodes).

        Once the server is up the driver is told that this node only serves, so
        ``cluster.shutdown()`` waits for the chief alone, then stops this node (a PSS
        'worker' node would otherwise be waited for like a training worker: a deadlock).

        See :func:`tfos.tf_server.run_server_and_wait`.
        """
        from tfos._node.server import run_server_and_wait

        run_server_and_wait(self, self.stop_event, timeout_s)

    def export_saved_model(self, model_or_sess: Any = None, export_dir: Optional[str] = None, *args: Any, **kwargs: Any) -> None:
        """Exports a SavedModel; two forms (TF process).

        * ``ctx.export_saved_model(model, export_dir, is_chief=None)``: a Keras 3, ``tf_keras``
          or ``tf.Module`` model, collective-safe (every worker calls it; the chief's copy is
          kept; ``is_chief=None`` means "this node is the chief/master, or worker 0 without
          one"). See :func:`tfos.compat.export_saved_model`.
        * ``ctx.export_saved_model(sess, export_dir, tag_set, signatures)``: TFoS's TF1 form
          for a ``tf.compat.v1.Session`` (chosen when a ``tag_set`` and ``signatures`` are
          given, or the first argument is a session). See :func:`tfos.TFNode.export_saved_model`.

        Raises:
            TypeError: Unsupported model type, or a wrong combination of arguments.
            ValueError: Empty ``signatures`` (TF1 form), or from Keras (unbuilt model).
        """
        if model_or_sess is None:
            model_or_sess = kwargs.pop("sess", None) if "sess" in kwargs else kwargs.pop("model", None)
        if model_or_sess is None or export_dir is None:
            raise TypeError("export_saved_model needs a model (or TF1 session) and an export_dir")
        tf1_kw = {"tag_set", "signatures"} & set(kwargs)
        is_session = type(model_or_sess).__name__ == "Session" and hasattr(model_or_sess, "graph")
        if len(args) == 2 or tf1_kw or is_session:
            from tfos._node.tf1_export import export_saved_model as _tf1_export

            params = dict(zip(("tag_set", "signatures"), args), **kwargs)
            missing = {"tag_set", "signatures"} - set(params)
            if missing or set(params) - {"tag_set", "signatures"}:
                raise TypeError(
                    "TF1 form is export_saved_model(sess, export_dir, tag_set, signatures); "
                    f"got arguments {sorted(params)}"
                )
            _tf1_export(model_or_sess, export_dir, params["tag_set"], params["signatures"])
            return
        if len(args) > 1 or set(kwargs) - {"is_chief"}:
            raise TypeError(
                "export_saved_model(model, export_dir, is_chief=None) or the TF1 form "
                "export_saved_model(sess, export_dir, tag_set, signatures)"
            )
        is_chief: Optional[bool] = args[0] if args else kwargs.get("is_chief")
        from tfos import compat

        if is_chief is None:
            is_chief = self.job_name in ("chief", "master") or (
                self.job_name == "worker" and self.task_index == 0 and not ({"chief", "master"} & set(self.cluster_spec))
            )
        compat.export_saved_model(model_or_sess, export_dir, bool(is_chief))
