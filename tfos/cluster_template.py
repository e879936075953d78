"""Roles, the cluster spec and TF_CONFIG (pure: no Spark, no TensorFlow; runs anywhere).

The cluster template maps TensorFlow jobs to executor ids, in TFoS's order: the first
``num_ps`` executors are parameter servers, then one ``master_node`` (for example
``'chief'``), then one ``'evaluator'`` when ``eval_node``, then the rest are ``'worker'``.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from typing import Iterable, Mapping, Optional, Sequence

from .errors import ConfigurationError, ControlProtocolError

__all__ = [
    "InputMode",
    "NodeRole",
    "NodeInfo",
    "FEEDABLE_JOBS",
    "build_template",
    "roles_from_template",
    "format_template",
    "build_cluster_spec",
    "build_tf_config",
    "count_workers",
]

#: Jobs whose nodes consume fed data in InputMode.SPARK (never 'ps' or 'evaluator').
FEEDABLE_JOBS = ("chief", "master", "worker")
_MASTER_NAMES = ("chief", "master")


class InputMode(enum.IntEnum):
    """How data reaches TensorFlow (TFoS-compatible values).

    Attributes:
        TENSORFLOW: TensorFlow reads its own data (e.g. TFRecords, sharded per worker).
        SPARK: The driver feeds RDD/DataFrame partitions with ``cluster.train`` /
            ``cluster.inference`` into each node's :class:`~tfos.TFNode.DataFeed`.
    """

    TENSORFLOW = 0
    SPARK = 1


@dataclasses.dataclass(frozen=True)
class NodeRole:
    """The role of one node in the cluster template.

    Attributes:
        executor_id: 0-based node id (the partition index of the start job).
        job_name: 'ps', 'chief', 'master', 'evaluator' or 'worker'.
        task_index: Index of the node within its job.
    """

    executor_id: int
    job_name: str
    task_index: int

    def __post_init__(self) -> None:
        if self.executor_id < 0 or self.task_index < 0:
            raise ConfigurationError(f"negative executor id or task index in {self!r}")
        if not self.job_name:
            raise ConfigurationError("job_name must not be empty")

    @property
    def feedable(self) -> bool:
        """True when InputMode.SPARK feeds this node (chief, master or worker)."""
        return self.job_name in FEEDABLE_JOBS

    @property
    def is_background(self) -> bool:
        """True for ps and evaluator nodes, which run until the driver stops them."""
        return not self.feedable


@dataclasses.dataclass(frozen=True)
class NodeInfo:
    """A registered node, as the driver's registry and every node see it.

    Attributes:
        executor_id, job_name, task_index: The node's role (see :class:`NodeRole`).
        host: The address other nodes use to reach this node (IPv4 text or hostname).
        port: The TensorFlow server port held for this node.
        data_port: The port of the node's data server (InputMode.SPARK feedable nodes),
            0 when there is none.
        pid: The process id of the node's TF process on ``host``.
        executor_key: Identity of the Spark executor that hosts the node
            (``"host/jvm-pid"``); feed tasks use it to find the node on their own executor.
        data_path: The node's Unix-domain data socket on ``host`` ("" when there is
            none); feed tasks on the same host connect there before ``data_port``.
    """

    executor_id: int
    job_name: str
    task_index: int
    host: str
    port: int
    data_port: int = 0
    pid: int = 0
    executor_key: str = ""
    data_path: str = ""

    def __post_init__(self) -> None:
        if self.data_path and (not self.data_path.startswith("/") or "\0" in self.data_path or len(self.data_path) > 200):
            raise ControlProtocolError(f"invalid data socket path {self.data_path!r}")
        if not (0 < self.port < 65536):
            raise ControlProtocolError(f"invalid TF port {self.port} for executor {self.executor_id}")
        if not (0 <= self.data_port < 65536):
            raise ControlProtocolError(f"invalid data port {self.data_port}")
        if not self.host:
            raise ControlProtocolError(f"empty host for executor {self.executor_id}")

    @property
    def role(self) -> NodeRole:
        """The node's :class:`NodeRole`."""
        return NodeRole(self.executor_id, self.job_name, self.task_index)

    @property
    def address(self) -> str:
        """``host:port`` of the node's TensorFlow server."""
        return f"{self.host}:{self.port}"

    @property
    def name(self) -> str:
        """A short human name, e.g. ``worker:1 (executor 2, host 10.0.0.5)``."""
        return f"{self.job_name}:{self.task_index} (executor {self.executor_id}, host {self.host})"

    def to_dict(self) -> dict:
        """The node as a JSON-serialisable dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping) -> "NodeInfo":
        """Builds and validates a node from :meth:`to_dict` output (e.g. from the wire).

        Raises:
            ControlProtocolError: When a field is missing or invalid.
        """
        try:
            return cls(
                executor_id=int(data["executor_id"]),
                job_name=str(data["job_name"]),
                task_index=int(data["task_index"]),
                host=str(data["host"]),
                port=int(data["port"]),
                data_port=int(data.get("data_port", 0)),
                pid=int(data.get("pid", 0)),
                executor_key=str(data.get("executor_key", "")),
                data_path=str(data.get("data_path", "")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ControlProtocolError(f"malformed node record: {exc!r}") from None


def build_template(
    num_executors: int,
    num_ps: int = 0,
    master_node: Optional[str] = None,
    eval_node: bool = False,
) -> dict[str, list[int]]:
    """Assigns executor ids to TensorFlow jobs.

    Args:
        num_executors: Total number of nodes (ps nodes included).
        num_ps: Number of parameter servers (the first ``num_ps`` ids).
        master_node: None, 'chief' or 'master': the job of the next id.
        eval_node: When True, the next id becomes the 'evaluator'.

    Returns:
        Job name -> sorted executor ids, e.g. ``{'ps': [0], 'chief': [1], 'worker': [2, 3]}``.

    Raises:
        ConfigurationError: When the counts leave no chief/worker, or are out of range.
    """
    if not isinstance(num_executors, int) or isinstance(num_executors, bool) or num_executors < 1:
        raise ConfigurationError(f"num_executors must be an int >= 1, got {num_executors!r}")
    if not isinstance(num_ps, int) or isinstance(num_ps, bool) or num_ps < 0:
        raise ConfigurationError(f"num_ps must be an int >= 0, got {num_ps!r}")
    if master_node is not None and master_node not in _MASTER_NAMES:
        raise ConfigurationError(
            f"master_node must be None, 'chief' or 'master', got {master_node!r}"
        )
    needed = num_ps + (1 if eval_node else 0) + 1
    if num_executors < needed:
        raise ConfigurationError(
            f"num_executors={num_executors} is too small for num_ps={num_ps}"
            f"{' plus an evaluator' if eval_node else ''}: at least one chief or worker node "
            f"is required, so num_executors must be >= {needed}"
        )
    ids = list(range(num_executors))
    template: dict[str, list[int]] = {}
    if num_ps:
        template["ps"], ids = ids[:num_ps], ids[num_ps:]
    if master_node:
        template[master_node], ids = ids[:1], ids[1:]
    if eval_node:
        template["evaluator"], ids = ids[:1], ids[1:]
    if ids:
        template["worker"] = ids
    return template


def roles_from_template(template: Mapping[str, Sequence[int]]) -> list[NodeRole]:
    """The template as one :class:`NodeRole` per executor id, sorted by id.

    Raises:
        ConfigurationError: When ids are duplicated or not exactly ``0..n-1``.
    """
    roles = [
        NodeRole(eid, job, idx)
        for job, ids in template.items()
        for idx, eid in enumerate(ids)
    ]
    roles.sort(key=lambda r: r.executor_id)
    if [r.executor_id for r in roles] != list(range(len(roles))):
        raise ConfigurationError(f"template executor ids are not 0..n-1: {dict(template)}")
    return roles


def format_template(template: Mapping[str, Sequence[int]]) -> str:
    """A one-line summary, e.g. ``1 ps [0], 1 chief [1], 2 worker [2, 3]``."""
    return ", ".join(f"{len(ids)} {job} {list(ids)}" for job, ids in template.items())


def build_cluster_spec(nodes: Iterable[NodeInfo]) -> dict[str, list[str]]:
    """The TensorFlow cluster spec: job -> ``host:port`` addresses ordered by task index.

    Includes every job, the evaluator too (TFoS compatibility: ``ctx.cluster_spec``).

    Raises:
        ConfigurationError: When a job's task indexes are not exactly ``0..k-1``.
    """
    by_job: dict[str, dict[int, str]] = {}
    for n in nodes:
        slot = by_job.setdefault(n.job_name, {})
        if n.task_index in slot:
            raise ConfigurationError(f"two nodes claim {n.job_name}:{n.task_index}")
        slot[n.task_index] = n.address
    spec: dict[str, list[str]] = {}
    for job, tasks in by_job.items():
        if sorted(tasks) != list(range(len(tasks))):
            raise ConfigurationError(f"task indexes of job {job!r} are not contiguous: {sorted(tasks)}")
        spec[job] = [tasks[i] for i in range(len(tasks))]
    return spec


def build_tf_config(
    cluster_spec: Mapping[str, Sequence[str]], job_name: str, task_index: int
) -> dict:
    """The ``TF_CONFIG`` for one node, always set (even when there is no chief).

    The evaluator is not part of the training cluster (TensorFlow's convention: an
    evaluator's ``TF_CONFIG`` names the training cluster and its own task), so the
    'evaluator' job is left out of ``cluster``.

    Returns:
        ``{"cluster": {...}, "task": {"type": job_name, "index": task_index},
        "environment": "cloud"}``; serialise with ``json.dumps``.

    Raises:
        ConfigurationError: When the node's own job/index is not in the spec.
    """
    if job_name not in cluster_spec or not 0 <= task_index < len(cluster_spec[job_name]):
        raise ConfigurationError(f"{job_name}:{task_index} is not in the cluster spec {dict(cluster_spec)}")
    cluster = {job: list(addrs) for job, addrs in cluster_spec.items() if job != "evaluator"}
    return {
        "cluster": cluster,
        "task": {"type": job_name, "index": task_index},
        "environment": "cloud",
    }


def tf_config_json(cluster_spec: Mapping[str, Sequence[str]], job_name: str, task_index: int) -> str:
    """:func:`build_tf_config` as the JSON text to put in the ``TF_CONFIG`` variable."""
    return json.dumps(build_tf_config(cluster_spec, job_name, task_index), sort_keys=True)


def count_workers(cluster_spec: Mapping[str, Sequence[str]]) -> int:
    """Number of training workers: chief/master plus workers (TFoS's ``num_workers``)."""
    return sum(len(v) for k, v in cluster_spec.items() if k in FEEDABLE_JOBS)
