"""What the driver hands each node (pure; crosses driver -> Spark task -> supervisor -> TF process).

Everything here is a frozen dataclass validated on construction. The HMAC key travels only
inside the Spark closure and the stdin pipe of the node processes: it is excluded from
``repr`` and never put in an environment variable or a log line.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

from tfos._node.task_world import TaskWorld
from tfos.cluster_template import InputMode, NodeRole
from tfos.errors import ConfigurationError

__all__ = ["ClusterConfig", "NodeLaunch", "NodeSettings"]


@dataclasses.dataclass(frozen=True)
class NodeSettings:
    """The cluster-wide settings ``TFCluster.run`` decides once for every attempt and every
    node (driver -> nodes): each one's default and check are here.

    Attributes:
        heartbeat_interval_s: Seconds between supervisor heartbeats.
        heartbeat_timeout_s: Seconds without a heartbeat before the driver declares a node lost.
        reservation_timeout_s: Seconds a node waits for the whole cluster to register (the
            driver waits as long for every node).
        release_port: Release the held TF port right before ``main_fun`` (TFoS semantics).
        queues: Names of the data queues of each feedable node (InputMode.SPARK).
        queue_chunks: Bound of each input queue, in chunks (a chunk is one Spark batch of
            rows or one Arrow record batch).
        tensorboard: Start TensorBoard on the chief (or worker 0).
        log_dir: TensorBoard log directory (None: ``<working_dir>/tensorboard_<id>``).
        forward_logs: Which nodes' stdout/stderr lines are shown on the driver's stderr:
            'all', 'chief' (the chief, or worker 0 when there is no chief) or 'none'.
        data_timeout_s: Longest a ``DataFeed`` read waits for the next chunk.

    Raises:
        ConfigurationError: A value out of range (names it).
    """

    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 15.0
    reservation_timeout_s: float = 600.0
    release_port: bool = True
    queues: tuple[str, ...] = ("input", "output", "error")
    queue_chunks: int = 4
    tensorboard: bool = False
    log_dir: Optional[str] = None
    forward_logs: str = "all"
    data_timeout_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.heartbeat_interval_s <= 0 or self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ConfigurationError(
                f"heartbeat_timeout_s ({self.heartbeat_timeout_s}) must exceed "
                f"heartbeat_interval_s ({self.heartbeat_interval_s}) > 0"
            )
        if self.reservation_timeout_s <= 0:
            raise ConfigurationError("reservation_timeout must be > 0 seconds")
        if self.queue_chunks < 1:
            raise ConfigurationError("queue_chunks must be >= 1")
        if self.forward_logs not in ("chief", "all", "none"):
            raise ConfigurationError("forward_logs must be 'chief', 'all' or 'none'")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterConfig(NodeSettings):
    """What every node of one attempt gets (driver -> nodes): the :class:`NodeSettings`
    and the attempt's identity, key and control address.

    Attributes:
        cluster_id: Unique id of this cluster (also its Spark job group).
        key: The per-cluster HMAC key (32 bytes). Never logged.
        driver_host: Address of the driver's control server.
        driver_port: Port of the driver's control server.
        input_mode: :class:`InputMode` of the cluster.
        roles: One :class:`NodeRole` per executor id, ordered by id.
        default_fs: Spark's ``fs.defaultFS`` (e.g. ``file://`` or ``hdfs://nn:8020``).
        driver_working_dir: The driver's working directory, taken when the config is
            built (on the driver); it is every node's ``ctx.working_dir`` (TFoS semantics),
            so relative ``file://`` paths map to the same folder on every node.
        tf_use_legacy_keras: The driver's ``TF_USE_LEGACY_KERAS`` when set there (else None);
            the TF process uses it when its own environment does not set the variable.
        keras3_fix: The driver's ``TFOS_KERAS3_FIX`` when set there (else None), likewise
            (``0`` turns off the Keras 3 multi-worker fix, docs/keras.md).
        local_master: The Spark master is ``local``/``local[N]``: executors write to the
            driver's terminal, so forwarded nodes do not also copy their output there.
    """

    cluster_id: str
    key: bytes = dataclasses.field(repr=False)
    driver_host: str
    driver_port: int
    input_mode: InputMode
    roles: tuple[NodeRole, ...]
    default_fs: str = "file://"
    driver_working_dir: str = dataclasses.field(default_factory=os.getcwd)
    tf_use_legacy_keras: Optional[str] = dataclasses.field(default_factory=lambda: os.environ.get("TF_USE_LEGACY_KERAS"))
    keras3_fix: Optional[str] = dataclasses.field(default_factory=lambda: os.environ.get("TFOS_KERAS3_FIX"))
    local_master: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.key) != 32:
            raise ConfigurationError("the cluster key must be 32 bytes")
        if not (0 < self.driver_port < 65536):
            raise ConfigurationError(f"invalid driver port {self.driver_port}")
        if [r.executor_id for r in self.roles] != list(range(len(self.roles))):
            raise ConfigurationError("roles must be ordered by executor id 0..n-1")

    @classmethod
    def of(cls, settings: NodeSettings, **attempt: Any) -> "ClusterConfig":
        """The config of one attempt: ``settings`` and the attempt's fields (``cluster_id``,
        ``key``, ``driver_host``, ``driver_port``, ``input_mode``, ``roles``, ...)."""
        return cls(**{f.name: getattr(settings, f.name) for f in dataclasses.fields(NodeSettings)}, **attempt)

    @property
    def num_nodes(self) -> int:
        """Number of nodes in the cluster."""
        return len(self.roles)

    def is_lead(self, role: NodeRole) -> bool:
        """True for the chief/master, or worker 0 when the cluster has neither."""
        jobs = {r.job_name for r in self.roles}
        if jobs & {"chief", "master"}:
            return role.job_name in ("chief", "master")
        return role.job_name == "worker" and role.task_index == 0

    def forwards_logs_of(self, role: NodeRole) -> bool:
        """True when ``role``'s output lines are forwarded to the driver."""
        if self.forward_logs == "all":
            return True
        return self.forward_logs == "chief" and self.is_lead(role)

    def hosts_tensorboard(self, role: NodeRole) -> bool:
        """True for the node that runs TensorBoard (the lead node, when enabled)."""
        return self.tensorboard and self.is_lead(role)


@dataclasses.dataclass(frozen=True)
class NodeLaunch:
    """Everything one node's supervisor and TF process need (Spark task -> node processes).

    Attributes:
        config: The cluster-wide :class:`ClusterConfig`.
        role: This node's :class:`NodeRole`.
        host: This node's address as other nodes reach it.
        executor_key: Identity of the hosting Spark executor (``host/jvm-pid``).
        watch_pid: A process whose exit means the executor (or driver) is gone; the
            supervisor stops the node when it exits. 0 disables the watch.
        watch_stdin: True when the supervisor must also stop when its parent (the Spark
            task) goes away, detected as EOF on its stdin (InputMode.TENSORFLOW).
        working_dir: The executor's working directory.
        python_path: ``sys.path`` of the Spark Python worker, so user modules import.
        fn_payload: ``cloudpickle`` of ``(main_fun, tf_args)``; only ever unpickled from
            the local pipe written by the Spark task, never from the network.
        cuda_visible_devices: GPU ids for ``CUDA_VISIBLE_DEVICES`` or None to leave as is.
        attempt: The cluster attempt this node belongs to (0 first, k after the k-th
            restart); it reaches ``main_fun`` as ``ctx.attempt``.
        feed_socket_dir: The 0700 directory for the node's Unix-domain data socket, made
            by the supervisor for the TF process ("" for none; set by the supervisor).
        on_driver: The node runs on the driver host, started by the driver
            (``driver_ps_nodes=True``): its stdout/stderr are the driver's own.
        task_world: What the TF process sets up of its start task's PySpark state before
            ``fn_payload`` is unpickled (broadcasts, SparkFiles, TaskContext); None for none.
    """

    config: ClusterConfig
    role: NodeRole
    host: str
    executor_key: str
    watch_pid: int
    watch_stdin: bool
    working_dir: str
    python_path: tuple[str, ...]
    fn_payload: bytes = dataclasses.field(repr=False)
    cuda_visible_devices: Optional[str] = None
    attempt: int = 0
    feed_socket_dir: str = ""
    on_driver: bool = False
    task_world: Optional[TaskWorld] = None

    def __post_init__(self) -> None:
        if isinstance(self.attempt, bool) or not isinstance(self.attempt, int) or self.attempt < 0:
            raise ConfigurationError(f"attempt must be an int >= 0, got {self.attempt!r}")

    @property
    def node_name(self) -> str:
        """e.g. ``worker:1 (executor 2, host 10.0.0.5)``."""
        r = self.role
        return f"{r.job_name}:{r.task_index} (executor {r.executor_id}, host {self.host})"
