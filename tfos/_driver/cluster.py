"""``run()`` and the :class:`TFCluster` it returns: the one cluster users get (driver).

``run()`` checks its arguments once, plans the roles, picks the backend (SparkContext:
:mod:`tfos._driver.classic`, Spark Connect: :mod:`tfos._driver.connect_backend`; protocol:
:mod:`tfos._driver.backend`) and lets the controller (:mod:`tfos._driver.lifecycle`) form it.
``TFCluster``'s methods check their own arguments and ask the controller (lifecycle, restarts).
"""

from __future__ import annotations

import functools
import logging
import math
import numbers
import uuid
from typing import Any, Callable, Optional, Sequence

from tfos._common.deadline import Deadline
from tfos._control.limits import heartbeat_interval_s
from tfos._data.feed_plan import FEED_TIMEOUT_S, check_feed_timeout
from tfos._driver import remedies
from tfos._driver import streaming as _streaming
from tfos._driver.backend import ClusterPlan, InferenceCall, Launcher, TrainCall
from tfos._driver.cluster_status import StatusMethods
from tfos._driver.lifecycle import Controller, Lifecycle
from tfos._driver.monitor import STALL_TIMEOUT_S, check_stall_args, summary_text
from tfos._driver.payload import pickle_payload
from tfos._node.launch import NodeSettings
from tfos.cluster_template import InputMode, build_cluster_spec, build_template, roles_from_template
from tfos.errors import ClusterFailedError, ConfigurationError, check_num_epochs

__all__ = ["TFCluster", "run"]

log = logging.getLogger(__name__)


#: TFoS's module-level status (``tfos.TFCluster.tf_status`` is this dict): ``{'error':
#: message}`` once ``run()`` raised, or once ``train()``, ``inference()`` or ``shutdown()`` raised a
#: :class:`ClusterFailedError` (a node failed; TFoS recorded those too, from its node
#: start job); cleared by the next ``run()``.
tf_status: dict[str, Any] = {}


def _records_failure(method: Callable) -> Callable:
    """Records a ClusterFailedError that ``method`` raises in :data:`tf_status` (driver)."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except ClusterFailedError as exc:
            tf_status["error"] = f"{type(exc).__name__}: {exc}"
            raise

    return wrapper


class TFCluster(StatusMethods):
    """A running tfos cluster (driver side). Created by :func:`run`, not directly.

    Use it as a context manager to shut it down on exit::

        with TFCluster.run(sc, main_fun, args, 3, 0, input_mode=InputMode.SPARK) as cluster:
            cluster.train(rdd, num_epochs=2)

    The same class runs on a ``SparkContext`` and on a Spark Connect session; under Spark
    Connect ``train()`` and ``inference()`` take DataFrames, ``inference()`` returns a
    DataFrame, and ``sc`` is None (docs/connect.md).

    Attributes:
        sc: The SparkContext (None under Spark Connect).
        spark: The Spark Connect session (None with a SparkContext).
        input_mode: :class:`InputMode` of the cluster.
        num_executors: Number of nodes.
        cluster_template: ``{job: [executor ids]}``.
        defaultFS: Spark's ``fs.defaultFS``.
        working_dir: The driver's working directory (None under Spark Connect).
        queues: Queue names of the fed nodes.
        progress: Show a progress line during train()/inference() (SparkContext only).
    """

    def __init__(self, controller: Controller) -> None:
        """Built by :func:`run` around the cluster's controller; not meant to be called directly."""
        self._ctl = controller
        self._shut_down = False  # a shutdown() returned: a second one does nothing
        launcher = controller.launcher
        plan = controller.plan
        self.sc = launcher.sc
        self.spark = launcher.spark
        self.input_mode = plan.input_mode
        self.num_executors = len(plan.roles)
        self.cluster_template = plan.template
        self.defaultFS = controller.backend.config.default_fs
        self.working_dir = launcher.working_dir
        self.queues: list[str] = list(plan.settings.queues)
        self.progress = plan.progress

    # ------------------------------------------------------------- properties
    @property
    def cluster_id(self) -> str:
        """The running attempt's cluster id (``<id>-r<k>`` after the ``k``-th restart); also
        the prefix of its Spark job groups."""
        return self._ctl.cluster_id

    @property
    def state(self) -> Lifecycle:
        """Where the cluster is in its lifecycle: a ``TFCluster.Lifecycle`` (forming, running,
        restarting, shutting down, closed, failed; docs/architecture.md "Driver plane")."""
        return self._ctl.state

    @property
    def attempt(self) -> int:
        """The running attempt: 0, or ``k`` after the ``k``-th restart (``max_restarts``)."""
        return self._ctl.attempt

    @property
    def nodeRDD(self) -> Any:
        """The barrier RDD of the start tasks, one partition per Spark-hosted node (TFoS
        name; None under Spark Connect)."""
        return self._ctl.backend.nodes_rdd

    @property
    def cluster_info(self) -> list[dict]:
        """TFoS-style list of registered nodes (dicts with executor_id, job_name, task_index,
        host, port, ...)."""
        return [n.to_dict() for n in self._ctl.backend.nodes()]

    @property
    def cluster_spec(self) -> dict[str, list[str]]:
        """``{job: ["host:port", ...]}`` of the running cluster."""
        return build_cluster_spec(self._ctl.backend.nodes())

    @property
    def server(self) -> Any:
        """The driver's control server (TFoS: the reservation server; None under Spark
        Connect, whose control plane runs on an executor host)."""
        return self._ctl.backend.server

    @property
    def meta(self) -> dict:
        """Same as :attr:`cluster_meta` (TFoS set both)."""
        return self.cluster_meta

    @property
    def cluster_meta(self) -> dict:
        """TFoS-style cluster metadata: id, cluster_template, num_executors, default_fs,
        working_dir (the driver's), server_addr ``(host, port)`` of the control plane and
        release_port."""
        cfg = self._ctl.backend.config
        return {
            "id": self.cluster_id, "cluster_template": self.cluster_template, "num_executors": self.num_executors,
            "default_fs": self.defaultFS, "working_dir": self.working_dir,
            "server_addr": (cfg.driver_host, cfg.driver_port), "release_port": cfg.release_port,
        }

    def tensorboard_url(self, timeout_s: float = 60.0) -> Optional[str]:
        """The TensorBoard URL (``http://host:port/``), or None when TensorBoard is off or
        failed to start (its stderr is then logged as a WARNING on the driver). Under Spark
        Connect it is an executor host's address, which the client may not reach.

        Args:
            timeout_s: Longest wait for TensorBoard to come up, in seconds. The wait ends
                early when TensorBoard's process exited.

        Raises:
            ClusterFailedError: When a node failed while waiting (with ``max_restarts``,
                once no restart is left).
        """
        if not self._ctl.backend.config.tensorboard:
            return None
        if self._ctl.state.terminal:  # what the last attempt's TensorBoard reported
            return self._ctl.backend.tensorboard_url(timeout_s)
        return self._ctl.call("tensorboard_url()", lambda backend: backend.tensorboard_url(timeout_s))

    # ---------------------------------------------------------------- feeding
    def _check_open(self, what: str) -> None:
        """Raises when the cluster was shut down, or a node failed (restarting it when a
        restart is left)."""
        self._ctl.call(what, lambda backend: None)

    def _classic(self, what: str) -> Any:
        """The running classic backend, for the streaming feeds (driver).

        Raises:
            ConfigurationError: Under Spark Connect (no streams there).
        """
        if not self._ctl.launcher.streams:
            raise ConfigurationError(
                f"{what}: streams cannot be fed under Spark Connect (docs/streaming.md: streams need a classic "
                "SparkContext); feed a batch DataFrame, e.g. spark.read... instead of spark.readStream..."
            )
        return self._ctl.backend

    @_records_failure
    def train(self, dataRDD: Any, num_epochs: int = 1, feed_timeout: float = FEED_TIMEOUT_S, qname: str = "input", end_of_feed: bool = False,
              feed_chief: bool = True, **stream_options: Any) -> Any:
        """Feeds an RDD or DataFrame to the nodes' ``DataFeed`` for ``num_epochs`` epochs (driver).

        Streams (docs/streaming.md; SparkContext only): a ``DStream`` registers a feed of
        every micro-batch RDD (returns None; feeding starts with ``ssc.start()``); a
        streaming DataFrame starts a query feeding every micro-batch and returns its
        ``StreamingQuery`` (``stream_options``: ``checkpointLocation``, ``trigger``,
        ``queryName``).

        Blocks until every partition of every epoch was consumed by the TF processes, or the
        nodes called ``DataFeed.terminate()`` (the rest is skipped quickly). An epoch is one
        pass over every partition; epochs are fed back to back in one Spark job. With
        ``max_restarts``, a restart resumes the feed at ``min(first epoch not consumed in
        full, epochs of the nodes' reported checkpoint)`` (``ctx.report_checkpoint``;
        none lost, rows after the checkpoint fed again).

        Args:
            dataRDD: An RDD of rows (tuples, lists, numpy arrays, strings) or a Spark
                DataFrame (fed as Arrow record batches); under Spark Connect a batch
                DataFrame (list columns arrive as numpy arrays).
            num_epochs: Passes over the data, >= 1. (TFoS treated 0 as 10: tfos refuses it.)
            feed_timeout: Seconds a node may accept no data before the feed fails.
            qname: The node queue to feed.
            end_of_feed: Also end the feed (as ``shutdown()`` does) as soon as every
                partition has been handed to a node, instead of at ``shutdown()``. Needed
                when workers train in lock-step (MultiWorkerMirroredStrategy) on uneven
                data: the worker that runs out then sees the end of its dataset while the
                others still train, and TensorFlow ends them in step (docs/datafeed.md).
                No further ``train()`` call is possible afterwards.
            feed_chief: Feed the chief node (``master_node='chief'``) too, as TFoS does.
                False for a ParameterServerStrategy program whose chief coordinates
                ``model.fit`` and whose workers serve: the chief reads no feed, so its share
                of the partitions goes to the workers (docs/parameter_servers.md
                "InputMode.SPARK"). A TF1 between-graph chief reads its feed: keep True.

        Raises:
            ConfigurationError: Not InputMode.SPARK, ``num_epochs`` < 1, unknown ``qname``,
                data this backend cannot feed, or a train() after a feed that ended.
            ClusterFailedError: A node failed, died or stopped reading (within seconds of
                the failure; names the node, with its remote traceback).
        """
        if self.input_mode != InputMode.SPARK:
            raise ConfigurationError("train() feeds data only in InputMode.SPARK; this cluster runs InputMode.TENSORFLOW, where TensorFlow reads its own data")
        feed_timeout = check_feed_timeout(feed_timeout, "train(): feed_timeout")
        if self._ctl.launcher.streams and (_streaming.is_dstream(dataRDD) or _streaming.is_streaming_df(dataRDD)):
            if end_of_feed:
                raise ConfigurationError("train(stream, end_of_feed=True): a stream's feed ends at shutdown()")
            if not feed_chief:
                raise ConfigurationError("train(stream, feed_chief=False): streams feed every chief/master/worker node")
            if _streaming.is_dstream(dataRDD):
                if stream_options:
                    raise ConfigurationError(f"train(DStream): unexpected options {sorted(stream_options)}")
                return _streaming.train_dstream(self, dataRDD, num_epochs, feed_timeout, qname)
            return _streaming.train_stream(self, dataRDD, num_epochs, feed_timeout, qname, **stream_options)
        if stream_options:
            raise ConfigurationError(f"train(): {sorted(stream_options)} apply to streaming DataFrames only")
        check_num_epochs(num_epochs)
        self._check_qname(qname)
        data, parts = self._ctl.launcher.train_input(dataRDD, num_epochs, end_of_feed, count=self._ctl.policy.max_restarts > 0)
        self._ctl.train(TrainCall(data, parts, num_epochs, feed_timeout, qname, end_of_feed, bool(feed_chief)))
        return None

    def _check_qname(self, qname: str) -> None:
        if qname not in self.queues:
            raise ConfigurationError(f"qname {qname!r} is not one of the cluster's queues {self.queues}; pass queues=[...] to TFCluster.run()")

    @_records_failure
    def inference(self, dataRDD: Any, feed_timeout: float = FEED_TIMEOUT_S, qname: str = "input", schema: Any = None) -> Any:
        """Runs inference over an RDD (or DataFrame) and returns the results (driver).

        A ``DStream`` returns a DStream of the results of every micro-batch; for streaming
        DataFrames use :func:`tfos.streaming.inference_stream` (docs/streaming.md).

        The nodes' ``main_fun`` reads batches with ``DataFeed.next_batch`` (a batch of
        inference rows never spans partitions, whatever ``train_mode`` says; TFoS programs
        use ``train_mode=False``) and answers each with ``batch_results``. The same
        ``main_fun`` may have served ``train()`` on this cluster before. The job runs
        eagerly under this cluster's job group, so failures surface here; the results are
        persisted (MEMORY_AND_DISK_DESER: in memory, spilling to disk) and returned as an
        RDD with exactly one result per input row, in input order within each partition.
        Under Spark Connect the results are a DataFrame of ``schema`` (locally
        checkpointed), one row per input row in input order.

        Args:
            dataRDD: An RDD of rows, or a DataFrame (its ``.rdd`` rows are fed; under Spark
                Connect its rows, as tuples).
            feed_timeout: Seconds a node may go without accepting data or returning results.
            qname: The node queue to feed.
            schema: Spark Connect only: the result schema (DDL string or ``StructType``,
                default ``"result double"``); each result is a value (one-field schema), a
                tuple (fields by position) or a dict (by name).

        Returns:
            An RDD of results (a DataFrame under Spark Connect).

        Raises:
            ConfigurationError: Not InputMode.SPARK, unknown ``qname``, ``schema`` with a
                SparkContext, or the feed already ended (``train(..., end_of_feed=True)``).
            ClusterFailedError: A node failed, or returned too few/many results.
        """
        if self.input_mode != InputMode.SPARK:
            raise ConfigurationError("inference() needs InputMode.SPARK")
        feed_timeout = check_feed_timeout(feed_timeout, "inference(): feed_timeout")
        if self._ctl.launcher.streams:
            if _streaming.is_dstream(dataRDD):
                return _streaming.inference_dstream(self, dataRDD, feed_timeout, qname)
            if _streaming.is_streaming_df(dataRDD):
                raise ConfigurationError("inference(streaming DataFrame): use tfos.streaming.inference_stream(cluster, df, sink)")
        self._check_qname(qname)
        data, parts, result_schema = self._ctl.launcher.inference_input(dataRDD, schema)
        return self._ctl.inference(InferenceCall(data, parts, feed_timeout, qname, result_schema))

    def row_accounting(self) -> list:
        """Rows fed vs rows trained, per node and epoch of every ``train()`` call (driver).

        On each fed node tfos counts the rows of every epoch of ``train(data, num_epochs)``
        its feed handed to TensorFlow, and the rows Keras's ``train_step`` consumed while
        that epoch was handed out. The epoch here is the feed's (``num_epochs``, from 0 in
        each ``train()`` call), not a Keras epoch. An epoch's figures are final once the
        next one began on that node or its ``main_fun`` returned (after ``shutdown()``: all
        of them). See docs/datafeed.md, "Row accounting".

        Returns:
            :class:`tfos._driver.row_accounting.EpochRows` records (``node``,
            ``train_call``, ``epoch``, ``fed``, ``trained``, ``carried``, ``closed``,
            ``difference``, ``cause``, ``ok``), ordered by call, epoch and executor id, of
            the current attempt; empty in InputMode.TENSORFLOW and under Spark Connect.
        """
        return self._ctl.backend.row_accounting()

    def node_states(self) -> dict[str, str]:
        """Each node's state by name (``"ps:0"``, ``"chief:0"``, ``"worker:1"``): 'registered',
        'running', 'serving', 'finished', 'failed', 'stopped' (driver). A worker of a
        ParameterServerStrategy cluster that was lost shows 'failed' while the cluster goes on
        (docs/parameter_servers.md)."""
        roles = {r.executor_id: f"{r.job_name}:{r.task_index}" for r in self._ctl.backend.config.roles}
        return {roles.get(eid, str(eid)): getattr(state, "value", str(state)) for eid, state in self._ctl.backend.node_states().items()}

    # --------------------------------------------------------------- shutdown
    @_records_failure
    def shutdown(self, ssc: Any = None, grace_secs: float = 0, timeout: float = 259200) -> None:
        """Ends the feed, waits for the workers' ``main_fun`` to return, stops every node (driver).

        Args:
            ssc: A ``StreamingContext`` (TFoS) or ``StreamingQuery`` fed by ``train()``:
                first waits until it ends, a stop is requested (``python -m
                tfos.streaming stop HOST PORT``), every worker returned or a node failed
                (bounded by ``timeout``), then stops it gracefully (never the
                SparkContext). Without it, streams this cluster feeds are stopped
                gracefully at once. See docs/streaming.md. Ignored under Spark Connect.
            grace_secs: Extra seconds to wait after the workers finished before stopping
                ps/evaluator nodes (TFoS compatibility; ignored when there are none).
                Failures are caught whatever its value, because every node reports its
                own failure.
            timeout: Longest wait, in seconds, for the workers' ``main_fun`` to return
                after the feed ended (over every attempt, with ``max_restarts``). With
                ``ssc`` it also bounds the wait for the stream, before that: the nodes
                get a fresh ``timeout`` once the streams are stopped.

        With ``max_restarts``, a node failure while waiting starts a fresh attempt (see
        :func:`run`), and this returns when the last attempt finished. In InputMode.SPARK,
        when the nodes reported a checkpoint (``ctx.report_checkpoint``) holding fewer
        epochs than the last ``train()`` call fed, the new attempt is fed those epochs again
        before its feed is closed.

        Raises:
            ClusterFailedError: Any node failed at any time (remote tracebacks included);
                a :class:`~tfos.errors.RecoveryFailedError` listing every attempt's root
                causes when restarts were allowed. A failure that ``train()`` or
                ``inference()`` already raised tore the cluster down then; ``shutdown()``
                returns without raising it again.
            DeadlineExceededError: The workers did not finish within ``timeout``; or a
                train()/inference() call running in another thread did not end within
                it (shutdown() waits for such a call before it ends the feed).
        """
        _check_seconds("shutdown(): timeout", timeout, allow_zero=True)
        _check_seconds("shutdown(): grace_secs", grace_secs, allow_zero=True)
        if self._shut_down:  # e.g. inside `with TFCluster.run(...)`, whose exit calls it again
            return
        if self._ctl.launcher.streams:  # stop the streams feeding this cluster before the feed ends
            try:
                _streaming.stop_streams(self, ssc, Deadline(timeout, "the stream to end or a stop request"))
            except BaseException as exc:
                self._ctl.abort(f"{type(exc).__name__} while stopping the cluster's streams")
                raise
        # A deadline of its own: when the wait for the stream above used up ``timeout``, the
        # nodes still get ``timeout`` to see the end of the feed and return.
        deadline = Deadline(timeout, "main_fun to return on every chief/master/worker node", "a main_fun that never ends (e.g. waiting for data after terminate())")
        self._ctl.shutdown(deadline, float(grace_secs))
        self._shut_down = True
        if self._monitor_or_none() is not None:
            log.info("%s", summary_text(self.summary()))

    def __enter__(self) -> "TFCluster":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.shutdown()
        else:
            self._ctl.abort(f"the driver program raised {exc_type.__name__} inside `with TFCluster.run(...)`")


def _check_seconds(name: str, value: Any, allow_zero: bool = False) -> None:
    """Raises ConfigurationError unless ``value`` is a finite number of seconds > 0 (or
    >= 0 with ``allow_zero``); checked before the call does anything (driver)."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(float(value))
    if ok:
        seconds = float(value)
        ok = seconds > 0 or (allow_zero and seconds == 0)
    if not ok:
        raise ConfigurationError(f"{name} must be a finite number of seconds {'>= 0' if allow_zero else '> 0'}, got {value!r}")



def _check_master(sc: Any) -> None:
    """Raises ConfigurationError for a master URL Spark cannot parse (a Spark Connect
    session is skipped: its server's master is its own)."""
    from tfos._driver.connect_backend import is_connect_session

    if is_connect_session(sc):
        return
    master = getattr(sc, "master", None)
    if master is None and hasattr(sc, "sparkContext"):
        master = sc.sparkContext.master
    if master is not None:
        remedies.check_master_url(master)


def _launcher(sc: Any, plan: ClusterPlan) -> Launcher:
    """The launcher of ``plan``'s attempts: Spark Connect (docs/connect.md) or classic."""
    from tfos._driver.connect_backend import is_connect_session

    if is_connect_session(sc):
        from tfos._driver.connect_backend import ConnectLauncher

        return ConnectLauncher(sc, plan)
    from tfos._driver.classic import ClassicLauncher

    return ClassicLauncher(sc, plan)

def run(
    sc: Any,
    map_fun: Callable[[Any, Any], Any],
    tf_args: Any,
    num_executors: int,
    num_ps: int,
    tensorboard: bool = False,
    input_mode: InputMode = InputMode.TENSORFLOW,
    log_dir: Optional[str] = None,
    driver_ps_nodes: bool = False,
    master_node: Optional[str] = None,
    reservation_timeout: float = NodeSettings.reservation_timeout_s,
    queues: Sequence[str] = NodeSettings.queues,
    eval_node: bool = False,
    release_port: bool = NodeSettings.release_port,
    *,
    heartbeat_timeout: float = NodeSettings.heartbeat_timeout_s,
    forward_logs: str = NodeSettings.forward_logs,
    progress: bool = True,
    queue_chunks: int = NodeSettings.queue_chunks,
    executor_wait_s: float = 60.0,
    handle_sigterm: bool = True,
    max_restarts: int = 0,
    stall_timeout: float = STALL_TIMEOUT_S,
    stall_action: str = "warn",
) -> TFCluster:
    """Starts a TensorFlow cluster on Spark executors and runs ``map_fun`` on every node (driver).

    Reserves one executor per node (a barrier stage: all nodes are gang-scheduled), gives
    each a role (ps, then ``master_node``, then the evaluator, then workers), sets
    ``TF_CONFIG`` and calls ``map_fun(tf_args, ctx)`` in a TF process on each node. Returns
    once every node has registered; training goes on in the background until
    :meth:`TFCluster.shutdown`. Every argument is explained at length in docs/api.md
    ("TFCluster.run").

    Args:
        sc: The SparkContext, or a Spark Connect ``SparkSession`` (docs/connect.md).
        map_fun: ``main_fun(args, ctx)``, run on every node (picklable by cloudpickle).
        tf_args: Passed to ``map_fun`` unchanged (argparse Namespace, dict or argv list).
        num_executors: Number of nodes (ps included).
        num_ps: Number of parameter-server nodes.
        tensorboard: Start TensorBoard on the chief (or worker 0).
        input_mode: :class:`InputMode`.TENSORFLOW or .SPARK.
        log_dir: TensorBoard log directory.
        driver_ps_nodes: Run the ps nodes as processes on the driver host (not under Connect).
        master_node: None, 'chief' or 'master': the job name of the first non-ps node.
        reservation_timeout: Seconds to wait for every node to register.
        queues: Queue names of fed nodes (InputMode.SPARK).
        eval_node: Make one node an 'evaluator'.
        release_port: Release each node's held TF port before ``map_fun``.
        heartbeat_timeout: Seconds of silence after which a node is declared lost.
        forward_logs: Whose stdout/stderr lines reach the driver's stderr: 'all', 'chief', 'none'.
        progress: Show a progress line during train()/inference() (``TFOS_PROGRESS=0``: off).
        queue_chunks: Bound of each node's input queue, in chunks.
        executor_wait_s: Longest wait, in seconds, for Spark executors to register.
        handle_sigterm: A SIGTERM to the driver tears the cluster down as Ctrl-C does, then
            exits with status 143 (installed only over SIGTERM's default disposition).
        max_restarts: Restarts allowed after a node failure (0: the failure is raised);
            docs/reliability.md "Recovery".
        stall_timeout: Seconds a chief/master/worker may make no progress before one WARNING
            naming it (0: off); docs/status.md "Where is it stuck?".
        stall_action: 'warn' (only the WARNING) or 'fail' (the cluster fails with that text).

    Returns:
        The running :class:`TFCluster`.

    Raises:
        ConfigurationError: A master URL Spark cannot parse, bad arguments or Spark
            configuration (docs/deploy.md), before anything is launched.
        ReservationTimeoutError: Not every node registered within ``reservation_timeout``.
        ClusterFailedError: A node failed while the cluster was forming
            (``RecoveryFailedError`` with ``max_restarts`` when no attempt formed).
    """
    _check_master(sc)  # before anything else
    _check_seconds("reservation_timeout", reservation_timeout)
    _check_seconds("heartbeat_timeout", heartbeat_timeout)
    _check_seconds("executor_wait_s", executor_wait_s, allow_zero=True)
    stall_timeout_s, stall_action = check_stall_args(stall_timeout, stall_action)
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ConfigurationError(f"max_restarts must be an integer >= 0, got {max_restarts!r}")
    input_mode, queues, payload = _check_args(map_fun, tf_args, input_mode, queues)
    template = build_template(num_executors, num_ps, master_node, eval_node)
    roles = tuple(roles_from_template(template))
    plan = ClusterPlan(
        base_id=f"tfos-{uuid.uuid4().hex[:12]}", template=template, roles=roles, input_mode=input_mode, payload=payload,
        executor_wait_s=float(executor_wait_s), driver_ps_nodes=bool(driver_ps_nodes), progress=progress,
        stall_timeout_s=stall_timeout_s, stall_action=stall_action,
        settings=NodeSettings(
            heartbeat_interval_s=heartbeat_interval_s(len(roles), heartbeat_timeout), heartbeat_timeout_s=float(heartbeat_timeout),
            reservation_timeout_s=float(reservation_timeout), release_port=release_port, queues=queues,
            queue_chunks=queue_chunks, tensorboard=bool(tensorboard), log_dir=log_dir, forward_logs=forward_logs,
        ),
    )
    controller = Controller(_launcher(sc, plan), max_restarts, handle_sigterm)
    controller.start()
    return TFCluster(controller)


def _check_args(map_fun: Any, tf_args: Any, input_mode: Any, queues: Sequence[str]) -> tuple[InputMode, tuple[str, ...], bytes]:
    """Checks run()'s arguments; returns the input mode, the queue names and the pickled
    ``(map_fun, tf_args)`` the nodes receive (driver).

    Raises:
        ConfigurationError: For a map_fun that is not callable, bad queue names, or
            ``map_fun``/``tf_args`` that cloudpickle cannot pickle.
    """
    if not callable(map_fun):
        raise ConfigurationError("map_fun must be callable as map_fun(args, ctx)")
    mode = InputMode(int(input_mode))
    if isinstance(queues, str) or not all(isinstance(q, str) and q for q in queues):
        raise ConfigurationError(f"queues must be a list of queue names such as ['input', 'output'], got {queues!r}")
    names = tuple(queues)
    if mode == InputMode.SPARK and not names:
        raise ConfigurationError("InputMode.SPARK needs at least one queue (the default is ['input', 'output', 'error'])")
    # with the broadcasts it refers to; accumulators checked (docs/api.md "What main_fun can use from Spark")
    payload = pickle_payload(map_fun, tf_args)
    return mode, names, payload
