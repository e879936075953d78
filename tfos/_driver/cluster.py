"""The driver side of a tfos cluster: ``run()`` and the :class:`TFCluster` it returns (driver only).

Only this module, :mod:`tfos._driver.runtime` and :mod:`tfos._driver.spark_checks` touch the
SparkContext. Every Spark job tfos starts runs in a thread of its own under a job group of
this cluster, so a failure cancels exactly this cluster's jobs and nothing else.

``run()`` is a handful of steps: check the arguments and Spark (:func:`_check_args`,
:func:`check_spark`), plan the roles, then start one cluster attempt
(:mod:`tfos._driver.attempts`: control server, node launch, registration), or let
:class:`~tfos._driver.attempts._Recovery` start it when ``max_restarts`` > 0; then
:class:`TFCluster` is built from what those steps made.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import numbers
import os
import threading
import time
import uuid
from typing import Any, Callable, Optional, Sequence

from tfos._node import output as _node_output
from tfos._driver.runtime import ClusterRuntime, JobThread, Progress, install_sigterm, restarting
from tfos._control.server import ControlServer
from tfos._control.limits import heartbeat_interval_s
from tfos._common.deadline import Deadline
from tfos._data.feed_tasks import FeedPlan, arrow_safe_dataframe, make_arrow_feed_fn, make_feed_fn, make_infer_fn
from tfos._data.sources import FeedSource
from tfos._data.framing import binary_as_bytes, feed_schema_json
from tfos._driver.attempts import Attempt, DriverConfig, _Launcher, _Recovery
from tfos._driver.restart import FeedResume, InferenceLedger
from tfos._driver.spark_checks import check_spark
from tfos._driver import streaming as _streaming
from tfos._driver.task_world import pickle_payload
from tfos.cluster_template import InputMode, build_template, format_template, roles_from_template
from tfos.errors import ClusterFailedError, ConfigurationError, DeadlineExceededError, RecoveryFailedError, ReservationTimeoutError, check_num_epochs

__all__ = ["TFCluster", "run", "DriverConfig", "Attempt"]

log = logging.getLogger("tfos.cluster")


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


def _default_fs(sc: Any) -> str:
    try:
        fs = sc._jsc.hadoopConfiguration().get("fs.defaultFS") or "file://"
    except Exception:  # noqa: BLE001 - no JVM Hadoop conf (unusual); fall back to local
        fs = "file://"
    from tfos.node_context import normalize_default_fs  # keeps 'hdfs://' (no host) intact (issue 11)

    return normalize_default_fs(fs)


@dataclasses.dataclass
class _TrainCall:
    """One ``train()`` call, as a restart feeds it again (driver)."""

    df: Any
    data: Any
    num_epochs: int
    parts: int
    feed_timeout: float
    qname: str
    end_of_feed: bool
    resume: Optional[FeedResume]



def _feeding_call(method: Callable) -> Callable:
    """Counts a running train()/inference() call, so that a shutdown() from another thread
    waits for it to end instead of ending its feed part-way (driver)."""

    @functools.wraps(method)
    def wrapper(self: "TFCluster", *args: Any, **kwargs: Any) -> Any:
        with self._feeds_cond:
            self._feeds_running += 1
        try:
            return method(self, *args, **kwargs)
        finally:
            with self._feeds_cond:
                self._feeds_running -= 1
                self._feeds_cond.notify_all()

    return wrapper

class TFCluster:
    """A running tfos cluster (driver side). Created by :func:`run`, not directly.

    Use it as a context manager to shut it down on exit::

        with TFCluster.run(sc, main_fun, args, 3, 0, input_mode=InputMode.SPARK) as cluster:
            cluster.train(rdd, num_epochs=2)

    Attributes:
        sc: The SparkContext.
        cluster_id: Unique id; also the Spark job group prefix.
        input_mode: :class:`InputMode` of the cluster.
        num_executors: Number of nodes.
        cluster_template: ``{job: [executor ids]}``.
        defaultFS: Spark's ``fs.defaultFS``.
        working_dir: The driver's working directory.
        queues: Queue names of the fed nodes.
        progress: Show a progress line during train()/inference().
    """

    def __init__(self, sc: Any, config: DriverConfig, runtime: ClusterRuntime, attempt: Attempt, recovery: Optional["_Recovery"] = None) -> None:
        """Built by :func:`run` from its steps' results; not meant to be called directly.

        Args:
            sc: The SparkContext.
            config: What run() decided (fixed for the cluster's life).
            runtime: The live parts: cluster state, control server, jobs, teardown.
            attempt: The launch whose nodes all registered (start job, ``nodeRDD``).
            recovery: The restarts of ``run(..., max_restarts=N)`` (None when N is 0);
                after a restart, ``config``, ``runtime`` and ``attempt`` are the new
                attempt's.
        """
        self.sc = sc
        self._config = config
        self._runtime = runtime
        self._state = runtime.state
        self._attempt = attempt
        self._recovery = recovery
        #: The last train() call, kept with max_restarts for a restart noticed by shutdown().
        self._last_train: Optional[_TrainCall] = None
        #: train()/inference() calls running (in any thread): shutdown() waits for them.
        self._feeds_running = 0
        self._feeds_cond = threading.Condition()
        self.cluster_id = config.cluster_id
        self.input_mode = config.node.input_mode
        self.num_executors = config.node.num_nodes
        self.cluster_template = config.template
        self.defaultFS = config.node.default_fs
        self.working_dir = config.node.driver_working_dir
        self.queues: list[str] = list(config.node.queues)
        self.progress = config.progress

    @property
    def nodeRDD(self) -> Any:
        """The barrier RDD of the start tasks, one partition per Spark-hosted node (TFoS name)."""
        return self._attempt.nodes_rdd

    # ------------------------------------------------------------- properties
    @property
    def cluster_info(self) -> list[dict]:
        """TFoS-style list of registered nodes (dicts with executor_id, job_name, task_index,
        host, port, ...)."""
        return [n.to_dict() for n in self._state.nodes_snapshot()]

    @property
    def cluster_spec(self) -> dict[str, list[str]]:
        """``{job: ["host:port", ...]}`` of the running cluster."""
        return self._state.cluster_spec()

    @property
    def server(self) -> Optional[ControlServer]:
        """The driver's control server (TFoS: the reservation server)."""
        return self._runtime.server

    @property
    def meta(self) -> dict:
        """Same as :attr:`cluster_meta` (TFoS set both)."""
        return self.cluster_meta

    @property
    def cluster_meta(self) -> dict:
        """TFoS-style cluster metadata: id, cluster_template, num_executors, default_fs,
        working_dir (the driver's), server_addr ``(host, port)`` and release_port."""
        cfg = self._config.node
        return {
            "id": self.cluster_id, "cluster_template": self.cluster_template, "num_executors": self.num_executors,
            "default_fs": self.defaultFS, "working_dir": cfg.driver_working_dir,
            "server_addr": (cfg.driver_host, cfg.driver_port), "release_port": cfg.release_port,
        }

    def tensorboard_url(self, timeout_s: float = 60.0) -> Optional[str]:
        """The TensorBoard URL (``http://host:port/``), or None when TensorBoard is off or
        failed to start (its stderr is then logged as a WARNING on the driver).

        Args:
            timeout_s: Longest wait for TensorBoard to come up, in seconds. The wait ends
                early when TensorBoard's process exited.

        Raises:
            ClusterFailedError: When a node failed while waiting.
        """
        if not self._config.node.tensorboard:
            return None
        st = self._state
        try:
            if not st.wait_for_tensorboard(Deadline(timeout_s, "TensorBoard to start")):
                raise self._runtime.fail("tensorboard_url()")
        except DeadlineExceededError:
            log.warning("TensorBoard did not report a URL within %g s", timeout_s)
        if st.tensorboard_error:
            log.warning("TensorBoard of cluster %s is not running (see the error above)", self.cluster_id)
            return None
        return st.tensorboard_url

    @property
    def attempt(self) -> int:
        """The running attempt: 0, or ``k`` after the ``k``-th restart (``max_restarts``)."""
        return self._recovery.attempt if self._recovery is not None else 0

    # -------------------------------------------------------------- restarts
    def _progressed(self) -> Optional[bool]:
        """Whether the running attempt made progress the driver can see (rows consumed in
        InputMode.SPARK); None when it cannot tell (InputMode.TENSORFLOW)."""
        if self.input_mode != InputMode.SPARK:
            return None
        return self._state.rows_consumed() > 0

    def _restart_or_raise(self, err: ClusterFailedError, context: str, progressed: Optional[bool],
                          outer: Optional[Deadline] = None) -> None:
        """After a failed attempt: starts the next one (this object then drives it), or
        raises (driver).

        Raises:
            ClusterFailedError: ``err`` itself when restarts are off.
            RecoveryFailedError: No further attempt (budget spent, or stopped early).
        """
        rec = self._recovery
        if rec is None or isinstance(err, RecoveryFailedError):
            raise err
        base_id = rec.launcher.base_id
        restarting(base_id, True, rec.launcher.handle_sigterm)  # SIGTERM between attempts: as Ctrl-C
        try:
            self._runtime.join_teardown()  # the failed attempt's processes are gone (bounded)
            config, runtime, attempt = rec.after_failure(err, context, progressed, outer)
        finally:
            restarting(base_id, False, rec.launcher.handle_sigterm)
        self._config, self._runtime, self._state, self._attempt = config, runtime, runtime.state, attempt
        self.cluster_id = config.cluster_id

    def _chief_name(self) -> Optional[str]:
        """'job:task' of the node whose checkpoint report is required: the chief/master,
        else worker 0 (None when neither is fed)."""
        roles = [(r.job_name, r.task_index) for r in self._config.node.roles]
        for job, index in roles:
            if job in ("chief", "master"):
                return f"{job}:{index}"
        return "worker:0" if ("worker", 0) in roles else None

    # ------------------------------------------------------------- internals
    def _feed_ids(self) -> list[int]:
        return [n.executor_id for n in self._feed_nodes()]

    def _feed_nodes(self) -> tuple:
        return tuple(n for n in self._state.nodes_snapshot() if n.role.feedable)

    def _plan(self, mode: str, qname: str, kind: Any, parts: int, feed_timeout: float, report_sent: bool = False, first_epoch: int = 0,
              last_epoch: int = -1) -> FeedPlan:
        cfg = self._config.node
        if qname not in self.queues:
            raise ConfigurationError(f"qname {qname!r} is not one of the cluster's queues {self.queues}; pass queues=[...] to TFCluster.run()")
        return FeedPlan(
            cfg.cluster_id, cfg.key, cfg.driver_host, cfg.driver_port, self._feed_nodes(), qname, mode, kind, parts,
            float(feed_timeout), feed_id=uuid.uuid4().hex, report_sent=report_sent,
            first_epoch=first_epoch, report_done=self._recovery is not None, last_epoch=last_epoch,
        )

    def _await_job(self, job: JobThread, context: str, progress: Optional[Progress] = None) -> Any:
        return self._runtime.await_job(job, context, progress, self._feed_ids)

    def _progress(self, kind: str, total: int, parts: int, epochs: int, desc: str) -> Optional[Progress]:
        """The progress line of the job of ``kind`` just started (None when off)."""
        if not self.progress or os.environ.get("TFOS_PROGRESS", "1") == "0" or _node_output.spark_shows_progress(self.sc):
            return None
        return Progress(self.sc.statusTracker(), self._state, self._runtime.job_group(kind), total, parts, epochs, desc)
    # ---------------------------------------------------------------- feeding
    @_records_failure
    @_feeding_call
    def train(self, dataRDD: Any, num_epochs: int = 1, feed_timeout: float = 600, qname: str = "input", end_of_feed: bool = False,
              **stream_options: Any) -> Any:
        """Feeds an RDD or DataFrame to the nodes' ``DataFeed`` for ``num_epochs`` epochs (driver).

        Streams (docs/streaming.md): a ``DStream`` registers a feed of every micro-batch RDD
        (returns None; feeding starts with ``ssc.start()``); a streaming DataFrame starts a
        query feeding every micro-batch and returns its ``StreamingQuery``
        (``stream_options``: ``checkpointLocation``, ``trigger``, ``queryName``).

        Blocks until every partition of every epoch was consumed by the TF processes, or the
        nodes called ``DataFeed.terminate()`` (the rest is skipped quickly). An epoch is one
        pass over every partition; epochs are fed back to back in one Spark job. With
        ``max_restarts``, a restart resumes the feed at ``min(first epoch not consumed in
        full, epochs of the nodes' reported checkpoint)`` (``ctx.report_checkpoint``;
        none lost, rows after the checkpoint fed again).

        Args:
            dataRDD: An RDD of rows (tuples, lists, numpy arrays, strings) or a Spark
                DataFrame (fed as Arrow record batches).
            num_epochs: Passes over the data, >= 1. (TFoS treated 0 as 10: tfos refuses it.)
            feed_timeout: Seconds a node may accept no data before the feed fails.
            qname: The node queue to feed.
            end_of_feed: Also end the feed (as ``shutdown()`` does) as soon as every
                partition has been handed to a node, instead of at ``shutdown()``. Needed
                when workers train in lock-step (MultiWorkerMirroredStrategy) on uneven
                data: the worker that runs out then sees the end of its dataset while the
                others still train, and TensorFlow ends them in step (C12). No further
                ``train()`` call is possible afterwards.

        Raises:
            ConfigurationError: Not InputMode.SPARK, ``num_epochs`` < 1, unknown ``qname``,
                or a train() after a feed that ended.
            ClusterFailedError: A node failed, died or stopped reading (within seconds of
                the failure; names the node, with its remote traceback).
        """
        if self.input_mode != InputMode.SPARK:
            raise ConfigurationError("train() feeds data only in InputMode.SPARK; this cluster runs InputMode.TENSORFLOW, where TensorFlow reads its own data")
        _check_seconds("train(): feed_timeout", feed_timeout)
        # --- streaming (issue 16): DStreams and streaming DataFrames, tfos/_driver/streaming.py
        if _streaming.is_dstream(dataRDD) or _streaming.is_streaming_df(dataRDD):
            if end_of_feed:
                raise ConfigurationError("train(stream, end_of_feed=True): a stream's feed ends at shutdown()")
            if _streaming.is_dstream(dataRDD):
                if stream_options:
                    raise ConfigurationError(f"train(DStream): unexpected options {sorted(stream_options)}")
                return _streaming.train_dstream(self, dataRDD, num_epochs, feed_timeout, qname)
            return _streaming.train_stream(self, dataRDD, num_epochs, feed_timeout, qname, **stream_options)
        if stream_options:
            raise ConfigurationError(f"train(): {sorted(stream_options)} apply to streaming DataFrames only")
        # --- end streaming
        check_num_epochs(num_epochs)
        df = _as_dataframe(dataRDD)
        parts = (df.rdd if df is not None else dataRDD).getNumPartitions()
        # With max_restarts, the partitions the nodes acknowledged are recorded, and a restart
        # feeds again from the first epoch not acknowledged in full (none lost, some twice).
        # ctx.report_checkpoint(epochs) reports count for this train() call: the feed never
        # resumes later than the nodes' checkpoint (see FeedResume).
        resume = FeedResume(num_epochs, parts, self._chief_name()) if self._recovery is not None else None
        self._state.clear_checkpoints()
        self._last_train = None
        call = _TrainCall(df, dataRDD, num_epochs, parts, feed_timeout, qname, end_of_feed, resume)
        self._feed_epochs(call, 0)
        if resume is not None:
            # A failure noticed later by shutdown() may re-feed the epochs after the checkpoint.
            self._last_train = call

    def _feed_epochs(self, call: "_TrainCall", first: int) -> None:
        """Feeds epochs ``first..num_epochs-1`` of ``call``, restarting on failures (driver)."""
        num_epochs, resume = call.num_epochs, call.resume
        while True:
            plan: Optional[FeedPlan] = None
            try:
                self._runtime.check_open("train()")
                if self._state.feed_closed:
                    raise ConfigurationError("train(): the feed already ended (an earlier train(..., end_of_feed=True)); start a new cluster to feed more data")
                plan, action = self._train_job(call.df, call.data, num_epochs - first, first, call.feed_timeout, call.qname, call.end_of_feed)
                self._train_await(plan, action, call.parts, num_epochs - first, call.end_of_feed)
                if resume is not None:
                    for index in self._state.partitions_done(plan.feed_id):
                        resume.record_index(index)
                return
            except ClusterFailedError as err:
                progressed = self._progressed()
                if resume is not None and plan is not None:
                    for index in self._state.partitions_done(plan.feed_id):
                        resume.record_index(index)
                failed_state = self._state
                self._restart_or_raise(err, "train()", progressed)
                # Read after the failed attempt's teardown joined: its last reports are in.
                self._record_checkpoints(resume, failed_state)
                assert resume is not None
                first = self._resume_feed(resume, "train()")
                if first >= num_epochs:
                    return

    def _record_checkpoints(self, resume: Optional[FeedResume], state: Any) -> None:
        """Folds an attempt's checkpoint reports (its ``ClusterState``) into ``resume`` (driver)."""
        if resume is not None:
            for node, epochs in state.checkpoints().items():
                resume.record_checkpoint(node, epochs)

    def _resume_feed(self, resume: FeedResume, context: str) -> int:
        """After a restart: the epoch the feed resumes at (logged); ``num_epochs`` when
        nothing is left to feed (driver)."""
        consumed = resume.first_unconsumed()
        first = resume.restart()
        if resume.epochs_left == 0:
            log.warning("%s: every partition of every epoch was consumed (and is in the reported checkpoint, if any) before the failure; nothing left to feed on attempt %d", context, self.attempt)
            return first
        ckpt = resume.checkpointed_epochs
        log.warning("train(): attempt %d resumes the feed at epoch %d of %d (epochs numbered from 0; every row of %d epoch(s) consumed; %s)",
                    self.attempt, first, resume.num_epochs, consumed,
                    "no checkpoint reported" if ckpt is None else f"checkpoint reported after {ckpt} epoch(s)")
        return first

    def _train_job(self, df: Any, dataRDD: Any, epochs: int, first_epoch: int, feed_timeout: float, qname: str, end_of_feed: bool) -> tuple[FeedPlan, Callable[[], Any]]:
        """The plan and Spark action of one train() feed job: ``epochs`` epochs back to back,
        numbered from ``first_epoch`` (driver)."""
        if df is not None and _arrow_ok() and not _repeated_struct_fields(df.schema):
            parts = df.rdd.getNumPartitions()
            plan = self._plan("train", qname, _chunk_kind("arrow"), parts, feed_timeout, end_of_feed, first_epoch, first_epoch + epochs - 1)
            safe, names = arrow_safe_dataframe(df)  # dotted, backticked or repeated column names
            data = functools.reduce(lambda a, b: a.union(b), [safe] * epochs)
            fn = make_arrow_feed_fn(plan, feed_schema_json(df.schema, binary_as_bytes(df.sparkSession)), names)  # UDT and binary columns need the schema
            action: Callable[[], Any] = lambda: [tuple(r) for r in data.mapInArrow(fn, "partition long, outcome string").collect()]
        else:
            rdd = df.rdd if df is not None else dataRDD
            parts = rdd.getNumPartitions()
            source = FeedSource.of(rdd, epochs)
            plan = self._plan("train", qname, source.kind, parts, feed_timeout, end_of_feed, first_epoch, first_epoch + epochs - 1)
            fn = make_feed_fn(plan)
            action = lambda: source.feed(fn).collect()
        return plan, action

    def _train_await(self, plan: FeedPlan, action: Callable[[], Any], parts: int, epochs: int, end_of_feed: bool) -> None:
        """Runs one train() feed job and waits for it (driver)."""
        total = parts * epochs
        if end_of_feed:
            self._state.close_feed_when_sent(plan.feed_id, total)
        desc = f"tfos train: {parts} partitions x {epochs} epoch(s) -> {len(plan.nodes)} node(s)"
        log.info("%s", desc)
        job = self._runtime.run_job("train", desc, action)
        outcomes = self._await_job(job, "train()", self._progress("train", total, parts, epochs, "tfos train"))
        skipped = [o for o in outcomes if o[1] in ("finished", "skipped")]
        terminated = [o for o in outcomes if o[1] == "terminated"]
        if terminated:
            log.info("train(): %d of %d partitions skipped after DataFeed.terminate()", len(terminated), total)
        if skipped:
            done = self._state.returned_without_terminate([n.executor_id for n in plan.nodes], plan.qname, 2.0)
            log.warning(
                "train(): %d of %d partitions were not consumed to their end because main_fun on their node had "
                "returned (it stopped reading without DataFeed.terminate()); their unread rows were not trained on%s",
                len(skipped), total, f". main_fun returned without terminate() on {', '.join(done)}" if done else "",
            )

    @_records_failure
    @_feeding_call
    def inference(self, dataRDD: Any, feed_timeout: float = 600, qname: str = "input") -> Any:
        """Runs inference over an RDD (or DataFrame) and returns the results (driver).

        A ``DStream`` returns a DStream of the results of every micro-batch; for streaming
        DataFrames use :func:`tfos.streaming.inference_stream` (docs/streaming.md).

        The nodes' ``main_fun`` reads batches with ``DataFeed.next_batch`` (a batch of
        inference rows never spans partitions, whatever ``train_mode`` says; TFoS programs
        use ``train_mode=False``) and answers each with ``batch_results``. The same
        ``main_fun`` may have served ``train()`` on this cluster before. The job runs
        eagerly under this cluster's job group, so failures surface here; the results are
        persisted (MEMORY_AND_DISK_DESER: in memory, spilling to disk) and returned as an RDD with exactly one result per
        input row, in input order within each partition.

        Args:
            dataRDD: An RDD of rows, or a DataFrame (its ``.rdd`` rows are fed).
            feed_timeout: Seconds a node may go without accepting data or returning results.
            qname: The node queue to feed.

        Returns:
            An RDD of results.

        Raises:
            ConfigurationError: Not InputMode.SPARK, unknown ``qname``, or the feed
                already ended (``train(..., end_of_feed=True)``).
            ClusterFailedError: A node failed, or returned too few/many results.
        """
        if self.input_mode != InputMode.SPARK:
            raise ConfigurationError("inference() needs InputMode.SPARK")
        _check_seconds("inference(): feed_timeout", feed_timeout)
        # --- streaming (issue 16)
        if _streaming.is_dstream(dataRDD):
            return _streaming.inference_dstream(self, dataRDD, feed_timeout, qname)
        if _streaming.is_streaming_df(dataRDD):
            raise ConfigurationError("inference(streaming DataFrame): use tfos.streaming.inference_stream(cluster, df, sink)")
        # --- end streaming
        if self._state.feed_closed and not self._runtime.closed and not self._state.failed:
            raise ConfigurationError(
                "inference(): the feed already ended (an earlier train(..., end_of_feed=True) ended every queue of "
                "the nodes); run inference on a new cluster, or train without end_of_feed"
            )
        df = _as_dataframe(dataRDD)
        rdd = df.rdd if df is not None else dataRDD
        parts = rdd.getNumPartitions()
        source = FeedSource.of(rdd)
        src, kind = source.rdd, source.kind
        from pyspark import StorageLevel

        from tfos._data.spark_rawio import raw_output_rdd
        from tfos._driver.recovery import assemble, cached_partitions, prune

        # With max_restarts, each attempt's results RDD stays persisted; a restart computes
        # only the partitions whose results no attempt holds, and the RDD returned reads
        # every partition from the attempt that holds it, in input order.
        ledger = InferenceLedger(parts)
        sources: list = []
        owner = [0] * parts
        while True:
            todo = ledger.missing()
            out = None
            try:
                self._runtime.check_open("inference()")
                plan = self._plan("inference", qname, kind, parts, feed_timeout)
                out = raw_output_rdd(src, make_infer_fn(plan))
                # The JVM holds each result frame as one byte array either way; "deserialized"
                # storage keeps those arrays as they are, where MEMORY_AND_DISK would copy every
                # frame again into serialized 1 MB buffers (measured: scripts/bench_feed.py).
                out.persist(StorageLevel.MEMORY_AND_DISK_DESER)
                target = out if len(todo) == parts else prune(out, todo)
                desc = f"tfos inference: {len(todo)} partitions -> {len(plan.nodes)} node(s)"
                # Count the result frames in the JVM: this materializes (and persists) every
                # partition without unpickling the results again in another Python worker.
                job = self._runtime.run_job("inference", desc, lambda: target._jrdd.count())
                self._await_job(job, "inference()", self._progress("inference", len(todo), len(todo), 1, "tfos inference"))
            except ClusterFailedError as err:
                progressed = self._progressed()
                if self._recovery is not None and out is not None:
                    held = cached_partitions(out) & set(todo)
                    if held:
                        for i in held:
                            owner[i] = len(sources)
                        ledger.record_all(held)
                        sources.append(out)
                    else:
                        out.unpersist()  # holds nothing worth keeping
                    progressed = progressed or bool(held)
                self._restart_or_raise(err, "inference()", progressed)
                log.warning("inference(): attempt %d runs the %d partition(s) whose results were not returned", self.attempt, len(ledger.missing()))
                continue
            if not sources:
                return out
            for i in todo:
                owner[i] = len(sources)
            sources.append(out)
            return assemble(sources, owner)

    # --------------------------------------------------------------- shutdown
    def _await_running_feeds(self, deadline: Deadline) -> None:
        """shutdown() called while train()/inference() runs in another thread: waits until
        that call ends (or a node failed), so the feed is never ended part-way (the nodes
        would see a clean end of feed with partitions unfed: silent data loss)."""
        with self._feeds_cond:
            if not self._feeds_running:
                return
            log.warning("tfos cluster %s: shutdown() waits for the train()/inference() call running in another thread "
                        "(%d) to end (at most %.0f s)", self.cluster_id, self._feeds_running, deadline.remaining())
            while self._feeds_running and not self._state.failed and not self._runtime.closed:
                if deadline.expired():
                    raise deadline.error(extra="a train()/inference() call in another thread was still feeding; "
                                               "the feed was not ended and the cluster is still up")
                self._feeds_cond.wait(deadline.slice(0.5))

    @_records_failure
    def shutdown(self, ssc: Any = None, grace_secs: float = 0, timeout: float = 259200) -> None:
        """Ends the feed, waits for the workers' ``main_fun`` to return, stops every node (driver).

        Args:
            ssc: A ``StreamingContext`` (TFoS) or ``StreamingQuery`` fed by ``train()``:
                first waits until it ends, a stop is requested (``python -m
                tfos.streaming stop HOST PORT``), every worker returned or a node failed
                (bounded by ``timeout``), then stops it gracefully (never the
                SparkContext). Without it, streams this cluster feeds are stopped
                gracefully at once. See docs/streaming.md.
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
        # --- streaming (issue 16): stop the streams feeding this cluster before the feed ends
        try:
            _streaming.stop_streams(self, ssc, Deadline(timeout, "the stream to end or a stop request"))
        except BaseException:
            if not self._runtime.closed:
                self._runtime.teardown(failed=True)
            raise
        # --- end streaming
        # A deadline of its own: when the wait for the stream above used up ``timeout``, the
        # nodes still get ``timeout`` to see the end of the feed and return.
        deadline = Deadline(timeout, "main_fun to return on every chief/master/worker node", "a main_fun that never ends (e.g. waiting for data after terminate())")
        self._await_running_feeds(deadline)
        while True:
            rt, st = self._runtime, self._state
            if rt.closed:
                rt.join_teardown()
                return
            trained = False
            try:
                if self.input_mode == InputMode.SPARK:
                    st.close_feed()
                if not st.wait_until_workers_done(deadline):
                    raise rt.fail("shutdown()")
                trained = True
                _warn_if_nobody_trained(self.cluster_id, st)
                if grace_secs and any(r.is_background for r in st.roles):
                    if st.wait_for_failure(float(grace_secs)):
                        raise rt.fail("shutdown()")
                rt.teardown(failed=False)
                if st.failed:
                    raise st.error("shutdown()")
            except ClusterFailedError as err:
                if not rt.closed:
                    rt.teardown(failed=True)
                if trained:  # every worker's main_fun had returned: nothing to train again
                    raise
                # With max_restarts: a fresh attempt; else raises. InputMode.SPARK: when the
                # nodes reported a checkpoint older than the last train()'s epochs, those
                # epochs are fed again first; then the feed is closed (main_fun restores its
                # checkpoint, trains what is fed and ends).
                last = self._last_train
                progressed = self._progressed()
                self._restart_or_raise(err, "shutdown()", progressed, deadline)
                self._record_checkpoints(last.resume if last is not None else None, st)
                if last is not None and last.resume is not None and last.resume.checkpointed_epochs is not None:
                    first = self._resume_feed(last.resume, "shutdown()")
                    if first < last.num_epochs:
                        try:
                            self._feed_epochs(last, first)
                        except ClusterFailedError:
                            if not self._runtime.closed:
                                self._runtime.teardown(failed=True)
                            raise
                continue
            except BaseException:
                if not rt.closed:
                    rt.teardown(failed=True)
                raise
            log.info("tfos cluster %s shut down", self.cluster_id)
            return

    def __enter__(self) -> "TFCluster":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        rt = self._runtime
        if exc_type is None:
            self.shutdown()
        elif not rt.closed:
            try:
                rt.teardown(failed=True, reason=f"the driver program raised {exc_type.__name__} inside `with TFCluster.run(...)`")
            except Exception as texc:  # noqa: BLE001 - never mask the user's exception
                log.warning("teardown after an error failed: %s", texc)
        else:
            rt.join_teardown()


def _warn_if_nobody_trained(cluster_id: str, st: Any) -> None:
    """Logs a WARNING when every chief/master/worker node only served (run_server_and_wait)
    and none ran main_fun to its end: a ParameterServerStrategy cluster without its
    coordinator (no master_node='chief') trains nothing, silently (driver)."""
    fg = [r.executor_id for r in st.roles if not r.is_background]
    if fg and all(st.proc_state.get(eid) == "serving" for eid in fg):
        log.warning(
            "tfos cluster %s: every chief/master/worker node only served (run_server_and_wait) and none ran a "
            "training loop, so nothing was trained. A ParameterServerStrategy cluster needs its coordinator: "
            "TFCluster.run(..., master_node='chief') and a main_fun whose chief builds the strategy and trains "
            "(docs/parameter_servers.md)", cluster_id,
        )


def _check_seconds(name: str, value: Any, allow_zero: bool = False) -> None:
    """Raises ConfigurationError unless ``value`` is a finite number of seconds > 0 (or
    >= 0 with ``allow_zero``); checked before the call does anything (driver)."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(float(value))
    if ok:
        seconds = float(value)
        ok = seconds > 0 or (allow_zero and seconds == 0)
    if not ok:
        raise ConfigurationError(f"{name} must be a finite number of seconds {'>= 0' if allow_zero else '> 0'}, got {value!r}")


def _as_dataframe(data: Any) -> Any:
    """``data`` if it is a DataFrame, None if it is an RDD (driver).

    Raises:
        ConfigurationError: For anything else (e.g. a Python list).
    """
    from pyspark import RDD
    from pyspark.sql import DataFrame

    if isinstance(data, DataFrame):
        return data
    if isinstance(data, RDD):
        return None
    raise ConfigurationError(f"expected a Spark RDD or DataFrame to feed, got {type(data).__name__}; use sc.parallelize(...) for local data")


def _arrow_ok() -> bool:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        return False
    return True


def _repeated_struct_fields(t: Any) -> bool:
    """True when a struct inside ``t`` (a Spark data type, e.g. ``df.schema``; at any depth,
    not the top-level row) has a field name twice (pure; driver).

    Spark's Arrow path refuses such structs (DUPLICATED_FIELD_NAME_IN_ARROW_STRUCT), so
    ``train(df)`` feeds them through ``df.rdd``'s rows instead, as TFoS did.
    """
    from pyspark.sql.types import StructType

    if isinstance(t, StructType):
        return any(_struct_repeats(f.dataType) for f in t.fields)
    return _struct_repeats(t)


def _struct_repeats(t: Any) -> bool:
    from pyspark.sql.types import ArrayType, MapType, StructType

    if isinstance(t, StructType):
        names = [f.name for f in t.fields]
        return len(set(names)) != len(names) or any(_struct_repeats(f.dataType) for f in t.fields)
    if isinstance(t, ArrayType):
        return _struct_repeats(t.elementType)
    if isinstance(t, MapType):
        return _struct_repeats(t.keyType) or _struct_repeats(t.valueType)
    return False


def _chunk_kind(name: str):
    from tfos._data.framing import ChunkKind

    return ChunkKind(name)


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
    reservation_timeout: float = 600,
    queues: Sequence[str] = ("input", "output", "error"),
    eval_node: bool = False,
    release_port: bool = True,
    *,
    heartbeat_timeout: float = 15.0,
    forward_logs: str = "all",
    progress: bool = True,
    queue_chunks: int = 4,
    executor_wait_s: float = 60.0,
    handle_sigterm: bool = True,
    max_restarts: int = 0,
) -> TFCluster:
    """Starts a TensorFlow cluster on Spark executors and runs ``map_fun`` on every node (driver).

    Reserves one executor per node (a barrier stage, so all nodes are gang-scheduled),
    gives each a role from the template (ps, then ``master_node``, then the evaluator,
    then workers), sets ``TF_CONFIG`` and calls ``map_fun(tf_args, ctx)`` in a TF process on
    each node. Returns once every node has registered; training then proceeds in the
    background until :meth:`TFCluster.shutdown`.

    Args:
        sc: The SparkContext, or a Spark Connect ``SparkSession`` (then the cluster is a
            :class:`tfos._connect.client.ConnectTFCluster` fed with DataFrames; see docs/connect.md).
        map_fun: ``main_fun(args, ctx)``, run on every node (must be picklable by cloudpickle).
        tf_args: Passed to ``map_fun`` unchanged: an argparse Namespace, a dict or argv list.
        num_executors: Number of nodes (ps included).
        num_ps: Number of parameter-server nodes.
        tensorboard: Start TensorBoard on the chief (or worker 0).
        input_mode: :class:`InputMode`.TENSORFLOW or .SPARK.
        log_dir: TensorBoard log directory.
        driver_ps_nodes: Run the ps nodes as processes on the driver host instead of
            executors (then only ``num_executors - num_ps`` executors are needed).
        master_node: None, 'chief' or 'master': the job name of the first non-ps node.
        reservation_timeout: Seconds to wait for every node to register.
        queues: Queue names of fed nodes (InputMode.SPARK).
        eval_node: Make one node an 'evaluator'.
        release_port: Release each node's held TF port before ``map_fun`` (set False and
            call ``ctx.release_port()`` yourself, or use ``ctx.start_cluster_server``).
        heartbeat_timeout: Seconds of silence after which a node is declared lost.
        forward_logs: Whose stdout/stderr lines are shown on the driver's stderr, each
            prefixed with its node (``[worker:0] ``): 'all' (default), 'chief' (or worker 0)
            or 'none'. Attach a handler to the 'tfos.node' logger to get them as log
            records instead.
        progress: Show a progress line on the driver during train()/inference()
            (also off with ``TFOS_PROGRESS=0``).
        queue_chunks: Bound of each node's input queue, in chunks.
        executor_wait_s: Longest wait for Spark executors to register before launching.
        handle_sigterm: Let a SIGTERM to the driver tear the cluster down as Ctrl-C does,
            then exit (status 143) with a logged message. tfos installs its handler only
            from the main thread and only while SIGTERM has its default disposition (a
            handler of yours, or of your framework, is never replaced), and removes it
            when the last cluster is shut down. Without it, SIGTERM kills the driver
            outright and the nodes end themselves ``heartbeat_timeout`` later.
        max_restarts: Restarts allowed after a node failure (exception in ``main_fun``,
            a TF process killed, an executor or host lost). 0 (default): none, the failure
            is raised. N > 0: the cluster is torn down and a fresh one started (a new
            barrier stage on whatever executors Spark offers; ``ctx.attempt`` tells
            ``main_fun`` to restore its checkpoint) up to N times, each failed attempt
            logged as a WARNING with its root causes; then a ``RecoveryFailedError`` lists
            every attempt's. A failure no restart can fix stops early (a
            ``ConfigurationError``, or the same exception again at the first step; see
            docs/reliability.md "Recovery"). InputMode.TENSORFLOW: transparent,
            ``shutdown()`` returns when the last attempt finished. InputMode.SPARK:
            ``train()`` resumes the feed at the first epoch not consumed in full (rows
            can be fed twice, none is lost); ``inference()`` re-runs only the partitions
            whose results were not returned.

    Returns:
        The running :class:`TFCluster`.

    Raises:
        ConfigurationError: Bad arguments or Spark configuration (C01, C05, C13, C14,
            dynamic allocation), before anything is launched.
        ReservationTimeoutError: Not every node registered within ``reservation_timeout``.
        ClusterFailedError: A node failed while the cluster was forming
            (``RecoveryFailedError`` with ``max_restarts`` when no attempt formed).
    """
    from tfos._connect.client import is_connect_session, run_connect

    _check_seconds("reservation_timeout", reservation_timeout)
    _check_seconds("heartbeat_timeout", heartbeat_timeout)
    _check_seconds("executor_wait_s", executor_wait_s, allow_zero=True)
    if is_connect_session(sc):  # Spark Connect client: see tfos/_connect/client.py and docs/connect.md
        if max_restarts:
            raise ConfigurationError("max_restarts is not available under Spark Connect (docs/connect.md); use a classic SparkContext")
        return run_connect(  # type: ignore[return-value]
            sc, map_fun, tf_args, num_executors, num_ps, tensorboard, input_mode, log_dir, driver_ps_nodes, master_node,
            reservation_timeout, queues, eval_node, release_port, heartbeat_timeout=heartbeat_timeout,
            forward_logs=forward_logs, progress=progress, queue_chunks=queue_chunks, executor_wait_s=executor_wait_s,
        )
    input_mode, queues, payload = _check_args(map_fun, tf_args, input_mode, queues)
    template = build_template(num_executors, num_ps, master_node, eval_node)
    roles = roles_from_template(template)
    spark_ids = tuple(r.executor_id for r in roles if not (driver_ps_nodes and r.job_name == "ps"))
    check_spark(sc, len(spark_ids), input_mode, wait_s=min(executor_wait_s, reservation_timeout),
                ps_on_executors=sum(1 for r in roles if r.job_name == "ps" and r.executor_id in spark_ids))

    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ConfigurationError(f"max_restarts must be an integer >= 0, got {max_restarts!r}")
    cluster_id = f"tfos-{uuid.uuid4().hex[:12]}"
    log.info("tfos cluster %s: %s (input mode %s)", cluster_id, format_template(template), input_mode.name)
    launcher = _Launcher(
        sc=sc, base_id=cluster_id, roles=tuple(roles), template=template, spark_ids=spark_ids, input_mode=input_mode,
        payload=payload, heartbeat_timeout_s=float(heartbeat_timeout),
        driver_host=sc.getConf().get("spark.driver.host", "127.0.0.1"), progress=progress,
        reservation_timeout_s=float(reservation_timeout), executor_wait_s=float(executor_wait_s),
        handle_sigterm=handle_sigterm,
        node_settings=dict(
            default_fs=_default_fs(sc), heartbeat_interval_s=heartbeat_interval_s(len(roles), heartbeat_timeout),
            heartbeat_timeout_s=float(heartbeat_timeout), reservation_timeout_s=float(reservation_timeout),
            release_port=release_port, queues=queues, queue_chunks=queue_chunks, tensorboard=bool(tensorboard),
            log_dir=log_dir, forward_logs=forward_logs, local_master=str(sc.master).split("[", 1)[0] == "local",
        ),
    )
    install_sigterm(handle_sigterm)
    if max_restarts == 0:
        config, runtime, attempt = launcher.start(0)
        return TFCluster(sc, config, runtime, attempt)
    recovery = _Recovery(launcher, max_restarts)
    config, runtime, attempt = recovery.first()
    return TFCluster(sc, config, runtime, attempt, recovery)


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


