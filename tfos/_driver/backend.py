"""What a :class:`~tfos._driver.cluster.TFCluster` runs on: the backend protocol (driver).

``TFCluster`` and its controller (:mod:`tfos._driver.lifecycle`) are written once, above
this protocol; two backends implement it:

* classic, on a ``SparkContext`` (:mod:`tfos._driver.classic`): the control server runs in
  the driver, feed and inference jobs are RDD jobs under this cluster's job groups;
* Spark Connect, on a remote ``SparkSession`` (:mod:`tfos._driver.connect_backend`): the control
  plane runs on an executor host, every client operation is a Spark job.

A :class:`Launcher` (one per ``run()``) knows one kind of Spark: it checks the input of
``train()``/``inference()`` and starts attempts. A :class:`Backend` is one started attempt:
its nodes all registered, it runs feed and inference jobs, waits for the workers, and tears
its nodes down. A restart (``max_restarts``) is a new ``Backend`` from the same launcher.
See docs/architecture.md "Driver plane".
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any, Optional, Protocol, Sequence

from tfos._common.deadline import Deadline
from tfos._control.messages import NodeState
from tfos._data.feed_plan import FeedPlan
from tfos._node.launch import ClusterConfig, NodeSettings
from tfos.cluster_template import InputMode, NodeInfo, NodeRole
from tfos.errors import ClusterFailedError

__all__ = ["ClusterPlan", "TrainCall", "InferenceCall", "AttemptReport", "Launcher", "Backend", "feed_plan"]


@dataclasses.dataclass(frozen=True)
class ClusterPlan:
    """What ``run()`` decided, the same for every attempt and both backends (driver).

    Attributes:
        base_id: The cluster id of attempt 0 (attempt ``k`` is ``<base_id>-r<k>``).
        template: ``{job: [executor ids]}``.
        roles: One role per executor id.
        input_mode: :class:`InputMode` of the cluster.
        payload: cloudpickled ``(main_fun, tf_args)``, handed to every node.
        settings: What every node of every attempt gets (heartbeats, queues, TensorBoard,
            the reservation timeout, ...); an attempt's :class:`ClusterConfig` adds its id,
            key and control address and what the backend reads from Spark.
        executor_wait_s: Longest wait for Spark executors before a launch, in seconds.
        driver_ps_nodes: Run the ps nodes on the driver host.
        progress: Show a progress line during train()/inference() (classic only).
        stall_timeout_s: Seconds without progress before a node is reported (0: off).
        stall_action: 'warn' or 'fail' (see :mod:`tfos._driver.monitor`).
    """

    base_id: str
    template: dict[str, list[int]]
    roles: tuple[NodeRole, ...]
    input_mode: InputMode
    payload: bytes = dataclasses.field(repr=False)
    settings: NodeSettings = dataclasses.field(default_factory=NodeSettings)
    executor_wait_s: float = 60.0
    driver_ps_nodes: bool = False
    progress: bool = True
    stall_timeout_s: float = 600.0
    stall_action: str = "warn"

    def cluster_id(self, attempt: int) -> str:
        """The cluster id of ``attempt`` (also the prefix of its Spark job groups)."""
        return self.base_id if attempt == 0 else f"{self.base_id}-r{attempt}"

    def chief(self) -> Optional[str]:
        """'job:task' of the node whose checkpoint report a restarted feed requires: the
        chief/master, else worker 0 (None when neither exists)."""
        names = [(r.job_name, r.task_index) for r in self.roles]
        lead = next((f"{job}:{index}" for job, index in names if job in ("chief", "master")), None)
        return lead or ("worker:0" if ("worker", 0) in names else None)


@dataclasses.dataclass(frozen=True)
class TrainCall:
    """One ``train()`` call, as every attempt feeds it (driver).

    Attributes:
        data: What the backend feeds, as its launcher checked it (an RDD or a DataFrame).
        parts: Partitions in one epoch (Spark Connect: :data:`UNCOUNTED` when neither the
            epochs of a task nor the total matter).
        num_epochs: Epochs to feed, >= 1.
        feed_timeout_s: Seconds a node may accept no data before the feed fails.
        qname: The node queue fed.
        end_of_feed: End the feed once every partition was handed over.
        feed_chief: Feed the chief node too (False: a ParameterServerStrategy coordinator
            reads no feed; its share goes to the workers).
    """

    data: Any
    parts: int
    num_epochs: int
    feed_timeout_s: float
    qname: str
    end_of_feed: bool = False
    feed_chief: bool = True


@dataclasses.dataclass(frozen=True)
class InferenceCall:
    """One ``inference()`` call (driver).

    Attributes:
        data: What the backend feeds, as its launcher checked it.
        parts: Units the controller's ledger counts: input partitions (classic), or 1
            (Spark Connect: its results come back whole or not at all).
        feed_timeout_s: Seconds a node may go without accepting data or returning results.
        qname: The node queue fed.
        schema: The result schema (Spark Connect; None on the classic path).
    """

    data: Any
    parts: int
    feed_timeout_s: float
    qname: str
    schema: Any = None


#: ``TrainCall.parts`` when the partitions were not counted (Spark Connect): every task is
#: in epoch 0 and its partition index is its Spark partition id.
UNCOUNTED = 1 << 40


@dataclasses.dataclass(frozen=True)
class AttemptReport:
    """What a failed attempt's nodes got done, read after its teardown (driver).

    Attributes:
        rows_consumed: Rows the TF processes took from their feeds.
        checkpoints: ``{'job:index': epochs}``, each node's latest checkpoint report for
            the running ``train()`` call (``ctx.report_checkpoint``).
        partitions_done: Job partition indices of the last feed job that a node
            acknowledged.
    """

    rows_consumed: int = 0
    checkpoints: dict = dataclasses.field(default_factory=dict)
    partitions_done: frozenset = frozenset()


def feed_plan(config: ClusterConfig, nodes: Sequence[NodeInfo], call: "TrainCall | InferenceCall", kind: Any, parts: int, *,
              first_epoch: int = 0, last_epoch: int = -1, report_done: bool = False) -> FeedPlan:
    """The plan of one feed or inference job: where its tasks send what (driver).

    Args:
        config: The attempt's node config (cluster id, key, control address).
        nodes: The registered nodes; the feedable ones are fed.
        call: The ``train()`` or ``inference()`` call (its queue, ``feed_timeout_s`` and,
            for ``train()``, ``end_of_feed``: report each partition handed over).
        kind: The chunk kind of the job's input (``tfos._data.framing.ChunkKind``, or None
            for rows pickled by the task).
        parts: Partitions per epoch.
        first_epoch, last_epoch: The epochs the job covers (train).
        report_done: Tell the control plane each partition a node acknowledged (restarts).
    """
    train = isinstance(call, TrainCall)
    return FeedPlan(
        config.cluster_id, config.key, config.driver_host, config.driver_port, fed_nodes(nodes, getattr(call, "feed_chief", True)),
        call.qname, "train" if train else "inference", kind, parts, call.feed_timeout_s, feed_id=uuid.uuid4().hex,
        report_sent=train and bool(getattr(call, "end_of_feed", False)),
        first_epoch=first_epoch, report_done=report_done, last_epoch=last_epoch,
    )


def fed_nodes(nodes: Sequence[NodeInfo], feed_chief: bool = True) -> tuple[NodeInfo, ...]:
    """The nodes a feed job sends partitions to (pure): the feedable ones (chief, master,
    worker), without the chief when ``feed_chief`` is False (a ParameterServerStrategy
    coordinator: its share goes to the workers, docs/parameter_servers.md "InputMode.SPARK").

    Raises:
        ConfigurationError: ``feed_chief=False`` leaves no node to feed.
    """
    fed = tuple(n for n in nodes if n.role.feedable and (feed_chief or n.job_name != "chief"))
    if not fed and not feed_chief:
        from tfos.errors import ConfigurationError

        raise ConfigurationError("train(feed_chief=False): the cluster has no master or worker node to feed")
    return fed


class Backend(Protocol):
    """One attempt of a cluster whose nodes all registered (driver side).

    Every method that waits raises :class:`~tfos.errors.ClusterFailedError` (naming the
    failed nodes, after starting the teardown) when a node fails.

    Attributes:
        config: What every node of this attempt got: cluster id, key, control address.
        closed: True once the teardown started.
        feed_closed: True once the nodes' feed ended (``end_of_feed``).
        sc: The SparkContext (None under Spark Connect).
        nodes_rdd: The start stage's barrier RDD (None under Spark Connect).
        server: The driver's control server (None under Spark Connect).
    """

    config: ClusterConfig
    sc: Any
    nodes_rdd: Any

    @property
    def server(self) -> Any: ...

    @property
    def closed(self) -> bool: ...

    @property
    def feed_closed(self) -> bool: ...

    def nodes(self) -> list[NodeInfo]:
        """The registered nodes, by executor id."""

    def check_open(self, what: str) -> None:
        """Raises the cluster's error when a node failed since the last call."""

    def clear_checkpoints(self) -> None:
        """Forgets the nodes' checkpoint reports (a ``train()`` call starts)."""

    def row_accounting(self) -> list:
        """Judges the nodes' row figures (one WARNING per newly closed epoch whose counts
        disagree) and returns them (:class:`tfos._driver.row_accounting.EpochRows`)."""

    def rows_skipped(self, nodes: Sequence[str]) -> None:
        """Notes that partitions of a train feed were skipped because ``main_fun`` of these
        nodes (``job:index (executor N, host H)``) had returned: their last epoch's fed
        rows are a lower bound (row accounting, docs/datafeed.md)."""

    def feed(self, call: TrainCall, first_epoch: int, report_done: bool) -> list[tuple[int, str]]:
        """Runs one feed job: epochs ``first_epoch..num_epochs-1`` of ``call``, back to back.

        Returns:
            ``(job partition index, outcome)`` per partition, a
            :class:`tfos._data.framing.FeedState`: OK, TERMINATED (the node had called
            ``DataFeed.terminate()``), SKIPPED (its ``main_fun`` had returned).
        """

    def returned_without_terminate(self, executor_ids: Sequence[int], qname: str, wait_s: float) -> list[str]:
        """Names the nodes whose ``main_fun`` returned without terminating ``qname``."""

    def infer(self, call: InferenceCall, todo: Sequence[int]) -> Any:
        """Runs one inference job over the units ``todo`` of ``call``; returns its results
        (an RDD, or a DataFrame under Spark Connect)."""

    def held_results(self, todo: Sequence[int]) -> tuple[Any, set[int]]:
        """After a failed :meth:`infer`: its results and the units of ``todo`` whose results
        Spark still holds (``(None, set())`` when none)."""

    def await_workers(self, deadline: Deadline, end_feed: bool) -> None:
        """Ends the feed first when ``end_feed``, then waits until ``main_fun`` returned on
        every chief/master/worker node.

        Raises:
            DeadlineExceededError: ``deadline`` expired first.
        """

    def wait_for_failure(self, timeout_s: float) -> bool:
        """Waits up to ``timeout_s`` seconds; True when a node failed meanwhile."""

    def node_states(self) -> dict[int, NodeState]:
        """Each node's state (:class:`~tfos._control.messages.NodeState`)."""

    def stop(self) -> None:
        """Stops every node and waits (bounded) for their exit; raises the cluster's error
        when a node failed meanwhile."""

    def teardown(self, failed: bool, reason: str = "") -> None:
        """Stops (or, ``failed``, aborts) every node and waits, bounded, for their exit."""

    def join_teardown(self) -> None:
        """Waits (bounded) for a teardown running in the background."""

    @property
    def torn_down(self) -> bool:
        """True once the teardown ended (every node exited, or its wait ran out)."""

    def fail(self, context: str) -> ClusterFailedError:
        """The error to raise for a failed cluster; starts the teardown."""

    def report(self) -> AttemptReport:
        """What the nodes got done; read after a failure, once the teardown ended."""

    def tensorboard_url(self, timeout_s: float) -> Optional[str]:
        """The lead node's TensorBoard URL, waiting up to ``timeout_s`` seconds for it."""


class Launcher(Protocol):
    """Starts the attempts of one cluster on one kind of Spark, and checks what ``train()``
    and ``inference()`` are given (driver; one per ``run()``).

    Attributes:
        plan: What ``run()`` decided.
        sc: The SparkContext (None under Spark Connect).
        spark: The Spark Connect session (None on the classic path).
        working_dir: The driver's working directory (None under Spark Connect).
        streams: True when the backend can feed streams (DStreams, streaming DataFrames).
    """

    plan: ClusterPlan
    sc: Any
    spark: Any
    working_dir: Optional[str]
    streams: bool

    def launch(self, attempt: int, restarts_left: int, outer: Optional[Deadline]) -> Backend:
        """Launches attempt ``attempt`` (the start stage) and waits until every node
        registered, within the reservation timeout and what is left of ``outer``.

        Raises:
            ClusterFailedError: A node failed while the cluster formed.
            ReservationTimeoutError: Not every node registered in time.
        """

    def await_executors(self, outer: Optional[Deadline]) -> None:
        """Before a restart: waits (bounded) for Spark to replace lost executors."""

    def train_input(self, data: Any, num_epochs: int, end_of_feed: bool, count: bool) -> tuple[Any, int]:
        """Checks ``data``; returns it as the backend feeds it and its partitions per epoch
        (``count``: counted even where costly; see :attr:`TrainCall.parts`).

        Raises:
            ConfigurationError: ``data`` is not something this backend feeds.
        """

    def inference_input(self, data: Any, schema: Any) -> tuple[Any, int, Any]:
        """Checks ``data`` and ``schema``; returns the data as fed, the units of the
        inference ledger (:attr:`InferenceCall.parts`) and the result schema.

        Raises:
            ConfigurationError: ``data`` or ``schema`` do not fit this backend.
        """

    def assemble(self, sources: Sequence[Any], owner: Sequence[int]) -> Any:
        """One result whose unit ``i`` is unit ``i`` of ``sources[owner[i]]``."""
