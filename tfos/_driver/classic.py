"""The classic backend: a tfos cluster on a ``SparkContext`` (driver only).

The control server runs in the driver; each attempt is a barrier start job (the nodes
register with the driver), and every feed and inference job is an RDD job in a thread of its
own under a job group of the attempt, so a failure cancels exactly this cluster's jobs.
:class:`ClassicLauncher` starts attempts (control server, node launch, registration) and
checks what ``train()``/``inference()`` are given; :class:`ClassicBackend` is one started
attempt, over its :class:`~tfos._driver.runtime.ClusterRuntime`. The protocol both follow
is :mod:`tfos._driver.backend`.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from typing import Any, Optional, Sequence

from tfos._common import wire as _wire
from tfos._common.deadline import Deadline
from tfos._control.host import ATTRIBUTION_S, Registration
from tfos._control.messages import NodeState
from tfos._data.arrow_codec import binary_as_bytes, feed_schema_json
from tfos._data.feed_plan import FeedPlan
from tfos._data.feed_tasks import arrow_safe_dataframe, make_arrow_feed_fn, make_feed_fn, make_infer_fn
from tfos._data.sources import FeedSource
from tfos._driver import spark_bar as _spark_bar
from tfos._driver.backend import AttemptReport, ClusterPlan, InferenceCall, TrainCall, feed_plan
from tfos._driver.runtime import ClusterRuntime, JobThread, Progress, spark_error_text
from tfos._driver.spark_checks import busy_slots_report, check_spark, live_executors
from tfos._driver.tb_scalars import scalar_writer
from tfos._node.context import normalize_default_fs
from tfos._node.launch import ClusterConfig
from tfos._node.start_task import launch_local_node, make_start_task
from tfos.cluster_template import InputMode, NodeInfo, format_template
from tfos.errors import ClusterFailedError, ConfigurationError, DeadlineExceededError, ReservationTimeoutError

__all__ = ["ClassicLauncher", "ClassicBackend"]

log = logging.getLogger(__name__)

#: Seconds run() waits for the start stage before it says which slots are busy.
_BUSY_WARN_S = 8.0


def _default_fs(sc: Any) -> str:
    try:
        fs = sc._jsc.hadoopConfiguration().get("fs.defaultFS") or "file://"
    except Exception:  # noqa: BLE001 - no JVM Hadoop conf (unusual); fall back to local
        fs = "file://"
    return normalize_default_fs(str(fs))  # 'hdfs://' (no host) stays 'hdfs://'


class ClassicLauncher:
    """Starts the attempts of a cluster on a SparkContext (driver).

    Creating it checks the Spark configuration before anything is launched (dynamic
    allocation, task slots per executor, enough executors; see
    :func:`tfos._driver.spark_checks.check_spark`).

    Raises:
        ConfigurationError: The Spark configuration cannot run the cluster.
    """

    streams = True
    spark = None

    def __init__(self, sc: Any, plan: ClusterPlan) -> None:
        self.sc = sc
        self.plan = plan
        self.working_dir: Optional[str] = os.getcwd()
        roles = plan.roles
        self.spark_ids = tuple(r.executor_id for r in roles if not (plan.driver_ps_nodes and r.job_name == "ps"))
        check_spark(sc, len(self.spark_ids), plan.input_mode, wait_s=min(plan.executor_wait_s, plan.settings.reservation_timeout_s),
                    ps_on_executors=sum(1 for r in roles if r.job_name == "ps" and r.executor_id in self.spark_ids))
        self.driver_host = sc.getConf().get("spark.driver.host", "127.0.0.1")
        self.default_fs = _default_fs(sc)
        self.local_master = str(sc.master).split("[", 1)[0] == "local"

    # ------------------------------------------------------------- attempts
    def launch(self, attempt: int, restarts_left: int, outer: Optional[Deadline]) -> "ClassicBackend":
        """Launches ``attempt`` (control server, node launch) and waits until every node
        registered, at most the reservation timeout and what is left of ``outer``.

        Raises:
            ClusterFailedError: A node failed while the cluster was forming.
            ReservationTimeoutError: Not every node registered within the reservation timeout.
        """
        plan = self.plan
        cluster_id = plan.cluster_id(attempt)
        key = _wire.new_key()
        runtime = ClusterRuntime(self.sc, cluster_id, plan.roles, plan.settings.heartbeat_timeout_s, key, self.driver_host)
        runtime.host.core.restarts_left = restarts_left
        try:
            config = ClusterConfig.of(
                plan.settings, cluster_id=cluster_id, key=key, driver_host=str(runtime.server.host),
                driver_port=runtime.server.port, input_mode=plan.input_mode, roles=plan.roles, default_fs=self.default_fs,
                local_master=self.local_master,
            )
            deadline = Deadline(
                min(plan.settings.reservation_timeout_s, outer.remaining()) if outer is not None else plan.settings.reservation_timeout_s,
                f"all {len(plan.roles)} nodes to register",
                "too few free Spark task slots (another job holds executors), executors that cannot reach the "
                "driver's control port, or node processes failing at start-up (see the executor logs)",
            )
            for r in plan.roles:
                if r.executor_id not in self.spark_ids:
                    runtime.local_nodes.append(launch_local_node(config, r.executor_id, plan.payload, os.getcwd(), attempt))
            start_fn = make_start_task(config, list(self.spark_ids), plan.payload, attempt)
            n = len(self.spark_ids)
            nodes_rdd = self.sc.parallelize(range(n), n).barrier().mapPartitionsWithIndex(start_fn)
            start_job = runtime.run_job("start", f"tfos start: {format_template(plan.template)}", nodes_rdd.collect)
            _await_registration(runtime, start_job, plan.input_mode, deadline)
            runtime.start_monitor(plan.stall_timeout_s, plan.stall_action, scalar_writer(config))
        except BaseException:
            if not runtime.closed:
                runtime.teardown(failed=True)
            raise
        return ClassicBackend(self.sc, runtime, config, nodes_rdd, plan.progress)

    def await_executors(self, outer: Optional[Deadline]) -> None:
        """Before a restart: waits (at most ``executor_wait_s``, and at most what is left of
        ``outer``) until Spark has as many live executors as the cluster has Spark-hosted
        nodes (a lost executor is being replaced)."""
        if str(self.sc.master).startswith("local") and not str(self.sc.master).startswith("local-cluster"):
            return
        wait_s = min(self.plan.executor_wait_s, outer.remaining()) if outer is not None else self.plan.executor_wait_s
        deadline = Deadline(wait_s, f"{len(self.spark_ids)} Spark executors")
        have = live_executors(self.sc)
        while have < len(self.spark_ids) and not deadline.expired():
            time.sleep(deadline.slice(0.5))  # executor registration has no event to wait on from Python
            have = live_executors(self.sc)
        if have < len(self.spark_ids):
            log.warning("restart: %d of %d executors after %g s; launching anyway", have, len(self.spark_ids), self.plan.executor_wait_s)

    # ----------------------------------------------------------------- input
    def train_input(self, data: Any, num_epochs: int, end_of_feed: bool, count: bool) -> tuple[Any, int]:
        """Checks ``data`` (an RDD or DataFrame) and counts its partitions (driver).

        Raises:
            ConfigurationError: For anything else (e.g. a Python list).
        """
        df = _as_dataframe(data)
        parts = (df.rdd if df is not None else data).getNumPartitions()
        return data, parts

    def inference_input(self, data: Any, schema: Any) -> tuple[Any, int, Any]:
        """Checks ``data`` (an RDD or DataFrame, whose ``.rdd`` rows are fed) (driver).

        Raises:
            ConfigurationError: ``schema`` given (it shapes Spark Connect's result
                DataFrame; here results are an RDD of Python objects), or ``data`` is no
                RDD or DataFrame.
        """
        if schema is not None:
            raise ConfigurationError("inference(schema=...) applies under Spark Connect, where the results are a DataFrame; "
                                     "with a SparkContext inference() returns an RDD of the results as main_fun gave them")
        df = _as_dataframe(data)
        rdd = df.rdd if df is not None else data
        return rdd, rdd.getNumPartitions(), None

    def assemble(self, sources: Sequence[Any], owner: Sequence[int]) -> Any:
        """One RDD whose partition ``i`` is partition ``i`` of ``sources[owner[i]]``."""
        from tfos._driver.recovery import assemble

        return assemble(sources, owner)


class ClassicBackend:
    """One attempt of a cluster on a SparkContext whose nodes all registered (driver).

    Args:
        sc: The SparkContext.
        runtime: The attempt's live parts (cluster state, control server, jobs, teardown).
        config: What every node got.
        nodes_rdd: The barrier RDD of the start tasks, one partition per Spark-hosted node.
        progress: Show a progress line during feed and inference jobs.
    """

    def __init__(self, sc: Any, runtime: ClusterRuntime, config: ClusterConfig, nodes_rdd: Any, progress: bool) -> None:
        self.sc = sc
        self.runtime = runtime
        self.host = runtime.host
        self.config = config
        self.nodes_rdd = nodes_rdd
        self.progress = progress
        self._last_feed_id = ""
        self._last_out: Any = None

    @property
    def server(self) -> Any:
        """The driver's control server."""
        return self.runtime.server

    @property
    def closed(self) -> bool:
        return self.runtime.closed

    @property
    def torn_down(self) -> bool:
        return self.runtime.torn_down

    @property
    def feed_closed(self) -> bool:
        return self.host.core.feed_closed

    def nodes(self) -> list[NodeInfo]:
        return self.host.read(lambda c: c.nodes_snapshot())

    def check_open(self, what: str) -> None:
        self.runtime.check_open(what)

    def clear_checkpoints(self) -> None:
        self.host.clear_checkpoints()

    # -------------------------------------------------------------- feeding
    def _progress(self, kind: str, total: int, parts: int, epochs: int, desc: str) -> Optional[Progress]:
        """The progress line of the job of ``kind`` just started (None when off)."""
        if not self.progress or os.environ.get("TFOS_PROGRESS", "1") == "0" or _spark_bar.showing(self.sc):
            return None
        monitor = self.runtime.monitor
        return Progress(self.sc.statusTracker(), self.host, self.runtime.job_group(kind), total, parts, epochs, desc,
                        monitor.mark if monitor is not None else str)

    def _feed_ids(self) -> list[int]:
        return [n.executor_id for n in self.nodes() if n.role.feedable]

    def feed(self, call: TrainCall, first_epoch: int, report_done: bool) -> list[tuple[int, str]]:
        """One train() feed job: epochs ``first_epoch..num_epochs-1`` back to back (driver)."""
        epochs = call.num_epochs - first_epoch
        df = _as_dataframe(call.data)
        last = call.num_epochs - 1
        if df is not None and _arrow_ok() and not _repeated_struct_fields(df.schema):
            parts = df.rdd.getNumPartitions()
            plan = self._plan(call, _chunk_kind("arrow"), parts, first_epoch, last, report_done)
            safe, names = arrow_safe_dataframe(df)  # dotted, backticked or repeated column names
            data = functools.reduce(lambda a, b: a.union(b), [safe] * epochs)
            fn = make_arrow_feed_fn(plan, feed_schema_json(df.schema, binary_as_bytes(df.sparkSession)), names)  # UDT and binary columns need the schema

            def action() -> Any:
                return [tuple(r) for r in data.mapInArrow(fn, "partition long, outcome string").collect()]
        else:
            rdd = df.rdd if df is not None else call.data
            parts = rdd.getNumPartitions()
            source = FeedSource.of(rdd, epochs)
            plan = self._plan(call, source.kind, parts, first_epoch, last, report_done)
            feed_fn = make_feed_fn(plan)

            def action() -> Any:
                return source.feed(feed_fn).collect()
        total = parts * epochs
        if call.end_of_feed:
            self.host.close_feed_when_sent(plan.feed_id, total)
        desc = f"tfos train: {parts} partitions x {epochs} epoch(s) -> {len(plan.nodes)} node(s)"
        log.info("%s", desc)
        job = self.runtime.run_job("train", desc, action)
        return self.runtime.await_job(job, "train()", self._progress("train", total, parts, epochs, "tfos train"), self._feed_ids)

    def _plan(self, call: Any, kind: Any, parts: int, first_epoch: int = 0, last_epoch: int = -1, report_done: bool = False) -> FeedPlan:
        plan = feed_plan(self.config, self.nodes(), call, kind, parts, first_epoch=first_epoch, last_epoch=last_epoch,
                         report_done=report_done)
        self._last_feed_id = plan.feed_id
        return plan

    def returned_without_terminate(self, executor_ids: Sequence[int], qname: str, wait_s: float) -> list[str]:
        return self.host.returned_without_terminate(executor_ids, qname, wait_s)

    def infer(self, call: InferenceCall, todo: Sequence[int]) -> Any:
        """One inference job over the partitions ``todo``; returns the persisted results RDD
        of every partition (those outside ``todo`` are not computed by it) (driver)."""
        from pyspark import StorageLevel

        from tfos._data.spark_rawio import raw_output_rdd
        from tfos._driver.recovery import prune

        source = FeedSource.of(call.data)
        plan = self._plan(call, source.kind, call.parts)
        out = raw_output_rdd(source.rdd, make_infer_fn(plan))
        # The JVM holds each result frame as one byte array either way; "deserialized"
        # storage keeps those arrays as they are, where MEMORY_AND_DISK would copy every
        # frame again into serialized 1 MB buffers (measured: scripts/bench_feed.py).
        out.persist(StorageLevel.MEMORY_AND_DISK_DESER)
        self._last_out = out
        target = out if len(todo) == call.parts else prune(out, todo)
        desc = f"tfos inference: {len(todo)} partitions -> {len(plan.nodes)} node(s)"
        # Count the result frames in the JVM: this materializes (and persists) every
        # partition without unpickling the results again in another Python worker.
        job = self.runtime.run_job("inference", desc, lambda: target._jrdd.count())
        self.runtime.await_job(job, "inference()", self._progress("inference", len(todo), len(todo), 1, "tfos inference"), self._feed_ids)
        return out

    def held_results(self, todo: Sequence[int]) -> tuple[Any, set[int]]:
        """The failed inference job's results RDD and the partitions of ``todo`` Spark
        holds for it (results cached on an executor lost with the failure do not count)."""
        from tfos._driver.recovery import cached_partitions

        out, self._last_out = self._last_out, None
        if out is None:
            return None, set()
        held = cached_partitions(out) & set(todo)
        if not held:
            out.unpersist()  # holds nothing worth keeping
        return out, held

    # -------------------------------------------------------------- shutdown
    def await_workers(self, deadline: Deadline, end_feed: bool) -> None:
        if end_feed:
            self.host.close_feed()
        if not self.host.wait_until_workers_done(deadline):
            raise self.runtime.fail("shutdown()")

    def wait_for_failure(self, timeout_s: float) -> bool:
        return self.host.wait_for_failure(timeout_s)

    def node_states(self) -> dict[int, NodeState]:
        return self.host.read(lambda c: dict(c.proc_state))

    def row_accounting(self) -> list:
        return self.runtime.rows.check() or []

    def rows_skipped(self, nodes: Sequence[str]) -> None:
        self.runtime.rows.note_skipped(nodes)

    def stop(self) -> None:
        self.runtime.teardown(failed=False)
        if self.host.core.failed:
            raise self.host.read(lambda c: c.error("shutdown()"))

    def teardown(self, failed: bool, reason: str = "") -> None:
        self.runtime.teardown(failed, reason)

    def join_teardown(self) -> None:
        self.runtime.join_teardown()

    def fail(self, context: str) -> ClusterFailedError:
        return self.runtime.fail(context)

    def report(self) -> AttemptReport:
        return self.host.read(lambda c: AttemptReport(c.rows_consumed(), c.checkpoints(),
                                                      frozenset(c.ledger.partitions_done(self._last_feed_id))))

    def tensorboard_url(self, timeout_s: float) -> Optional[str]:
        st = self.host.core
        try:
            if not self.host.wait_for_tensorboard(Deadline(timeout_s, "TensorBoard to start")):
                raise self.runtime.fail("tensorboard_url()")
        except DeadlineExceededError:
            log.warning("TensorBoard did not report a URL within %g s", timeout_s)
        if st.tensorboard_error:
            log.warning("TensorBoard of cluster %s is not running (see the error above)", self.config.cluster_id)
            return None
        return st.tensorboard_url


def _await_registration(runtime: ClusterRuntime, start: JobThread, input_mode: InputMode, deadline: Deadline) -> None:
    """Waits for every node to register; raises on failure or expiry (driver).

    A question to the control host, woken by every registration, failure and by the end of
    the start job. When the start stage still waits after ``_BUSY_WARN_S``, a WARNING names
    the executors and jobs holding the slots; the timeout error names them too.

    Raises:
        ClusterFailedError: A node failed, or the start job ended first.
        ReservationTimeoutError: ``deadline`` expired first.
    """
    host, state, cluster_id = runtime.host, runtime.host.core, runtime.cluster_id
    tf_mode = input_mode == InputMode.TENSORFLOW
    t0 = time.monotonic()
    warned = False
    busy = ""
    while True:
        # A start job that ended (error, or in TENSORFLOW mode every node already exited)
        # ends the wait too. The 1 s tick only times the busy-slots warning below.
        outcome = host.wait_until_registered(deadline, lambda: start.error is not None or (start.done.is_set() and tf_mode), tick_s=1.0)
        if outcome == Registration.ALL_REGISTERED:
            return
        if outcome == Registration.CLUSTER_FAILED:
            raise runtime.fail("run()")
        if outcome == Registration.STOP_ASKED:
            # The node's own failure report names the real cause: give it a moment.
            if host.wait_until(lambda: state.failed or state.all_registered(), ATTRIBUTION_S) and state.all_registered() and not state.failed:
                return
            if state.failed:
                raise runtime.fail("run()")
            what = spark_error_text(start.error) if start.error is not None else "the start tasks returned early"
            etype = type(start.error).__name__ if start.error is not None else "StartJobEnded"
            kind = "spark"
            if "ExecutorLostFailure" in what:  # Spark's text names its executor and host
                kind, etype = "lost", "ExecutorLost"
                what = f"a Spark executor was lost while the cluster formed: {what}"
            runtime.teardown(failed=True)
            err = ClusterFailedError(cluster_id, [state.make_failure(state.missing()[0] if state.missing() else 0, kind, etype, what)], "run()")
            err.flood = runtime.host.flood_report()
            raise err from start.error
        if outcome == Registration.EXPIRED:
            missing = state.missing()
            busy = busy_slots_report(runtime.sc, cluster_id) or busy
            runtime.teardown(failed=True)
            flood = runtime.host.flood_report()
            raise deadline.error(ReservationTimeoutError, f"executor ids {missing} never registered" + (f"; {busy}" if busy else "")
                                 + (f"; meanwhile {flood}" if flood else ""))
        if not warned and time.monotonic() - t0 >= _BUSY_WARN_S:
            busy = busy_slots_report(runtime.sc, cluster_id)
            if busy:
                warned = True
                log.warning("tfos cluster %s: the start stage has waited %.0f s for task slots: %s", cluster_id, time.monotonic() - t0, busy)


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


def _chunk_kind(name: str) -> Any:
    from tfos._data.framing import ChunkKind

    return ChunkKind(name)
