"""``TFCluster.run`` on a Spark Connect session (client side; see docs/connect.md).

Under Spark Connect the program is a remote client: it has no SparkContext, no RDDs, and
executors may not be able to reach it. So nothing here listens or is dialled:

* the start stage is a barrier ``mapInArrow`` (:func:`tfos._connect.tasks.make_start_fn`);
  its task 0 starts the control host (:mod:`tfos._connect.host`), the classic control
  server and cluster state moved onto an executor host, and the stage returns once every
  node registered;
* every later client operation is a Spark job: status and stop are one-task jobs whose
  task talks to the control host; ``train()``/``inference()`` are ``mapInArrow`` jobs
  whose tasks feed the nodes on their own hosts;
* failures reach the client as failed Spark jobs, or in the status a control job returns;
  either way they are raised as :class:`~tfos.errors.ClusterFailedError` naming the node.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import threading
import time
import uuid
from typing import Any, Callable, Optional, Sequence

from tfos._common import wire as _wire
from tfos._control.limits import heartbeat_interval_s
from tfos._connect.tasks import OP_SCHEMA, START_SCHEMA, StartSpec, decode_failures, make_infer_fn, make_op_fn, make_start_fn, make_train_fn
from tfos._common.deadline import Deadline
from tfos._data.feed_tasks import FeedPlan, arrow_safe_dataframe
from tfos._data.framing import binary_as_bytes, feed_schema_json
from tfos._driver.cluster import _records_failure
from tfos._driver.spark_checks import plan_layout, warn_key_transport
from tfos._node.launch import ClusterConfig
from tfos.cluster_template import InputMode, NodeInfo, build_cluster_spec, build_template, format_template, roles_from_template
from tfos.errors import ClusterFailedError, ConfigurationError, NodeFailure, ReservationTimeoutError, TFOSError, check_num_epochs

__all__ = ["ConnectTFCluster", "run_connect", "is_connect_session", "DEFAULT_CLIENT_TIMEOUT_S"]

log = logging.getLogger("tfos.connect")

#: Seconds to wait for the nodes' processes to exit after a stop directive.
_STOP_TIMEOUT_S = 45.0
#: Seconds to wait for a node's own failure report after a Spark job failed.
_ATTRIBUTION_S = 5.0
#: Seconds between keep-alive jobs while the client is idle.
_KEEPALIVE_S = 30.0
#: Smallest ``TFOS_CONNECT_CLIENT_TIMEOUT_S`` accepted (s): the idle client's keep-alive
#: jobs run every quarter of the timeout, and each must get a task slot and run in time.
MIN_CLIENT_TIMEOUT_S = 20.0
#: Default of ``TFOS_CONNECT_CLIENT_TIMEOUT_S``: the control host aborts the cluster after
#: this many seconds without any client operation.
DEFAULT_CLIENT_TIMEOUT_S = 600.0


def is_connect_session(obj: Any) -> bool:
    """True for a Spark Connect ``SparkSession`` (``pyspark.sql.connect.session``)."""
    return type(obj).__module__.startswith("pyspark.sql.connect")


def _job_error_text(exc: BaseException) -> str:
    text = str(exc)
    for marker in ("ClusterFailedError: ", "FeedError: ", "FeedTimeoutError: ", "TFOSError: "):
        if marker in text:
            return marker + text.split(marker, 1)[1].splitlines()[0]
    return text.splitlines()[0][:500] if text else type(exc).__name__


class ConnectTFCluster:
    """A running tfos cluster driven from a Spark Connect client. Created by ``TFCluster.run``.

    The same methods as :class:`tfos.TFCluster`, with DataFrames only:
    :meth:`train` feeds a DataFrame, :meth:`inference` returns a DataFrame.

    Attributes:
        spark: The Spark Connect session.
        sc: Always None (a Connect client has no SparkContext).
        cluster_id: Unique id of the cluster.
        input_mode: :class:`InputMode` of the cluster.
        num_executors: Number of nodes.
        cluster_template: ``{job: [executor ids]}``.
        queues: The queue names of the fed nodes.
    """

    def __init__(self, spark: Any, config: ClusterConfig, template: dict[str, list[int]], ctrl: tuple[str, int], nodes: list[NodeInfo],
                 client_timeout_s: float = DEFAULT_CLIENT_TIMEOUT_S):
        self.spark = spark
        self._client_timeout_s = client_timeout_s
        self.sc = None
        self.cluster_id = config.cluster_id
        self.input_mode = config.input_mode
        self.num_executors = config.num_nodes
        self.cluster_template = template
        self.defaultFS = config.default_fs
        self.working_dir = None
        self.queues = list(config.queues)
        self._config = config
        self._ctrl = ctrl
        self._nodes = nodes
        self._closed = False
        self._feed_closed = False
        self._last_op = time.monotonic()
        self._busy = 0  # feed/inference jobs in flight (their tasks keep the lease)
        self._keepalive_stop = threading.Event()
        threading.Thread(target=self._keepalive, name=f"{self.cluster_id}-keepalive", daemon=True).start()

    # ------------------------------------------------------------ properties
    @property
    def cluster_info(self) -> list[dict]:
        """The registered nodes (dicts with executor_id, job_name, task_index, host, port, ...)."""
        return [n.to_dict() for n in self._nodes]

    @property
    def cluster_spec(self) -> dict[str, list[str]]:
        """``{job: ["host:port", ...]}`` of the running cluster."""
        return build_cluster_spec(self._nodes)

    def tensorboard_url(self, timeout_s: float = 60.0) -> Optional[str]:
        """The TensorBoard URL on the lead node's host, or None when TensorBoard is off.

        The address is an executor host's: the client may not be able to open it.

        Raises:
            ClusterFailedError: A node failed while waiting.
        """
        if not self._config.tensorboard:
            return None
        deadline = Deadline(timeout_s, "TensorBoard to start")
        while True:
            # The control host answers when TensorBoard reported its URL or its start-up
            # error, a node failed, or the poll (at most 10 s) ended.
            st = self._status("tensorboard", deadline.slice(10.0), "tensorboard_url()")
            if st.get("failures"):
                raise self._fail("tensorboard_url()", self._failures(st))
            if st.get("tensorboard_url") or st.get("done") or deadline.expired():
                return st.get("tensorboard_url")

    # ------------------------------------------------------------- control jobs
    def _op(self, msg_type: str, context: str, timeout_s: float = 30.0, **fields: Any) -> dict:
        """One control request through a one-task Spark job (client)."""
        host, port = self._ctrl
        fn = make_op_fn(host, port, self._config.key, self.cluster_id, msg_type, fields, timeout_s)
        self._last_op = time.monotonic()
        try:
            rows = self.spark.range(0, 1, 1, 1).mapInArrow(fn, OP_SCHEMA).collect()
        except Exception as exc:  # noqa: BLE001 - Connect raises several exception types
            raise TFOSError(f"{context}: the control job of cluster {self.cluster_id} failed: {_job_error_text(exc)}") from exc
        finally:
            self._last_op = time.monotonic()
        return json.loads(rows[0]["reply"])

    def _status(self, until: str, poll_s: float, context: str) -> dict:
        return self._op("client_wait", context, timeout_s=poll_s + 20.0, until=until, poll_s=poll_s)

    def _keepalive(self) -> None:
        # An idle client sends a keep-alive every 30 s, or every quarter of a shorter client
        # timeout, so that three in a row may be late before the control host gives up.
        every_s = min(_KEEPALIVE_S, self._client_timeout_s / 4)
        while not self._keepalive_stop.wait(min(5.0, every_s / 2)):
            if self._closed:
                return
            if self._busy or time.monotonic() - self._last_op < every_s:
                continue
            try:
                self._status("now", 0.0, "keep-alive")
            except Exception as exc:  # noqa: BLE001 - the next client call reports real trouble
                log.debug("tfos keep-alive job failed: %s", exc)

    @staticmethod
    def _failures(status: dict) -> list[NodeFailure]:
        return [NodeFailure.from_dict(f) for f in status.get("failures", [])]

    def _lead_failure(self, kind: str, error_type: str, message: str, host: Optional[str] = None) -> NodeFailure:
        """A failure attributed to the node of start task 0 (its host also runs the control
        host), for causes no node reported (client)."""
        n = next((x for x in self._nodes if x.executor_id == 0), self._nodes[0] if self._nodes else None)
        return NodeFailure(n.executor_id if n else 0, n.job_name if n else "worker", n.task_index if n else 0,
                           host if host is not None else (n.host if n else ""), kind, error_type, message)

    def _fail(self, context: str, failures: list[NodeFailure], cause: Optional[BaseException] = None, attribution_s: float = 0.0) -> ClusterFailedError:
        """Tears the cluster down (bounded) and returns the error to raise (client).

        The control host's final failure list wins over ``failures`` (it has the nodes'
        own reports, with their tracebacks).
        """
        open_before = not self._closed
        final = self._teardown(failed=True, attribution_s=attribution_s)
        if final is not None and final.get("failures"):
            failures = self._failures(final)
        elif final is None and open_before:
            # The teardown could not reach the control host: that is the cause (its
            # executor or process died), whatever the failed job saw of it.
            host, port = self._ctrl
            failures = [self._lead_failure(
                "lost", "ControlHostLost", f"the tfos control host at {host}:{port} cannot be reached (its executor or "
                "process died): the cluster is lost and its nodes end themselves after heartbeat_timeout; start a new cluster",
                host,
            )] + list(failures)
        if not failures:
            failures = [self._lead_failure("spark", type(cause).__name__ if cause else "TFOSError",
                                           _job_error_text(cause) if cause else "unknown failure")]
        err = ClusterFailedError(self.cluster_id, failures, context)
        if cause is not None:
            err.__cause__ = cause
        return err

    def _job_failed(self, context: str, exc: BaseException) -> ClusterFailedError:
        """The error for a failed feed/inference job: the nodes' own reports (fetched while
        tearing down), else the failures the failed task carried, else its text (client)."""
        return self._fail(context, decode_failures(str(exc)), exc, attribution_s=_ATTRIBUTION_S)

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise TFOSError(f"{what}: the cluster {self.cluster_id} was already shut down")

    def _plan(self, mode: str, qname: str, parts: int, feed_timeout: float, report_sent: bool = False) -> FeedPlan:
        from tfos._data.framing import ChunkKind

        if qname not in self.queues:
            raise ConfigurationError(f"qname {qname!r} is not one of the cluster's queues {self.queues}; pass queues=[...] to TFCluster.run()")
        host, port = self._ctrl
        feedable = tuple(n for n in self._nodes if n.role.feedable)
        return FeedPlan(self.cluster_id, self._config.key, host, port, feedable, qname, mode, ChunkKind.ARROW, parts,
                        float(feed_timeout), feed_id=uuid.uuid4().hex, report_sent=report_sent)

    # ----------------------------------------------------------------- feeding
    @_records_failure
    def train(self, dataRDD: Any, num_epochs: int = 1, feed_timeout: float = 600, qname: str = "input", end_of_feed: bool = False) -> None:
        """Feeds a DataFrame to the nodes' ``DataFeed`` for ``num_epochs`` epochs (client).

        Same contract as :meth:`tfos.TFCluster.train`, with a DataFrame (its rows arrive as
        tuples, list columns as numpy arrays). Runs as one ``mapInArrow`` job whose tasks
        feed the nodes on their own hosts.

        Raises:
            ConfigurationError: Not InputMode.SPARK, not a DataFrame, ``num_epochs`` < 1,
                unknown ``qname``, or a train() after the feed ended.
            ClusterFailedError: A node failed, died or stopped reading (names the node,
                with its remote traceback).
        """
        if self.input_mode != InputMode.SPARK:
            raise ConfigurationError("train() feeds data only in InputMode.SPARK; this cluster runs InputMode.TENSORFLOW, where TensorFlow reads its own data")
        check_num_epochs(num_epochs)
        df = _as_connect_dataframe(dataRDD)
        self._check_open("train()")
        if self._feed_closed:
            raise ConfigurationError("train(): the feed already ended (an earlier train(..., end_of_feed=True)); start a new cluster to feed more data")
        # Spark Connect has no getNumPartitions(): a job counts the partitions when the
        # epoch of a task (several epochs) or the total (end_of_feed) matters.
        parts = _num_partitions(df) if (end_of_feed or num_epochs > 1) else _UNCOUNTED
        plan = self._plan("train", qname, parts, feed_timeout, end_of_feed)
        total = parts * num_epochs
        if end_of_feed:
            self._op("client_control", "train()", action="close_feed_when_sent", feed_id=plan.feed_id, total=total)
            self._feed_closed = True
        safe, names = arrow_safe_dataframe(df)  # dotted, backticked or repeated column names
        data = functools.reduce(lambda a, b: a.union(b), [safe] * num_epochs)
        log.info("tfos train: %d epoch(s) -> %d node(s)", num_epochs, len(plan.nodes))
        self._busy += 1
        try:
            fn = make_train_fn(plan, feed_schema_json(df.schema, binary_as_bytes(df.sparkSession)), names)
            rows = data.mapInArrow(fn, "partition long, outcome string").collect()
        except Exception as exc:  # noqa: BLE001 - Connect raises several exception types
            self._busy -= 1
            raise self._job_failed("train()", exc) from exc
        self._busy -= 1
        self._last_op = time.monotonic()
        outcomes = [r["outcome"] for r in rows]
        skipped = sum(1 for o in outcomes if o in ("finished", "skipped"))
        if skipped:
            try:
                # The nodes' reports may still be on their way: the control host waits up to 2 s.
                done = self._op("client_returned", "train()", executors=[n.executor_id for n in plan.nodes],
                                qname=plan.qname, wait_s=2.0).get("names", [])
            except TFOSError as exc:
                log.debug("tfos: could not ask which node returned: %s", exc)
                done = []
            log.warning(
                "train(): %d of %d partitions were not consumed to their end because main_fun on their node had "
                "returned (it stopped reading without DataFeed.terminate()); their unread rows were not trained on%s",
                skipped, len(rows), f". main_fun returned without terminate() on {', '.join(done)}" if done else "",
            )

    @_records_failure
    def inference(self, dataRDD: Any, feed_timeout: float = 600, qname: str = "input", schema: Any = "result double") -> Any:
        """Runs inference over a DataFrame and returns the results as a DataFrame (client).

        The nodes' ``main_fun`` reads batches with ``DataFeed.next_batch`` and answers each
        with ``batch_results``, as in the classic path (the same ``main_fun`` may have served
        ``train()`` on this cluster before). The job runs eagerly (the
        result is locally checkpointed), so failures surface here and inference never
        runs twice.

        Args:
            dataRDD: A Spark Connect DataFrame.
            feed_timeout: Seconds a node may go without accepting data or returning results.
            qname: The node queue to feed.
            schema: The result schema (DDL string or ``StructType``). Each result is a value
                (one-field schema), a tuple (fields by position) or a dict (by name).

        Returns:
            A DataFrame with exactly one row per input row, in input order within each
            partition (partitions in input order).

        Raises:
            ConfigurationError: Not InputMode.SPARK, not a DataFrame, unknown ``qname``, or
                the feed already ended (``train(..., end_of_feed=True)``).
            ClusterFailedError: A node failed, or returned too few/many results.
        """
        if self.input_mode != InputMode.SPARK:
            raise ConfigurationError("inference() needs InputMode.SPARK")
        df = _as_connect_dataframe(dataRDD)
        self._check_open("inference()")
        if self._feed_closed:
            raise ConfigurationError(
                "inference(): the feed already ended (an earlier train(..., end_of_feed=True) ended every queue of "
                "the nodes); run inference on a new cluster, or train without end_of_feed"
            )
        struct = schema if not isinstance(schema, str) else self.spark.createDataFrame([], schema).schema
        plan = self._plan("inference", qname, _UNCOUNTED, feed_timeout)
        self._busy += 1
        try:
            safe, names = arrow_safe_dataframe(df)
            out = safe.mapInArrow(make_infer_fn(plan, struct.json(), names), struct).localCheckpoint(eager=True)
        except Exception as exc:  # noqa: BLE001 - Connect raises several exception types
            self._busy -= 1
            raise self._job_failed("inference()", exc) from exc
        self._busy -= 1
        self._last_op = time.monotonic()
        return out

    # ---------------------------------------------------------------- shutdown
    @_records_failure
    def shutdown(self, ssc: Any = None, grace_secs: float = 0, timeout: float = 259200) -> None:
        """Ends the feed, waits for the workers' ``main_fun`` to return, stops every node (client).

        Args:
            ssc: Ignored (TFoS's Spark Streaming context).
            grace_secs: Extra seconds before stopping ps/evaluator nodes.
            timeout: Longest wait, in seconds, for the workers' ``main_fun`` to return.

        Raises:
            ClusterFailedError: Any node failed at any time (remote tracebacks included).
            DeadlineExceededError: The workers did not finish within ``timeout``.
        """
        if self._closed:
            return
        try:
            deadline = Deadline(timeout, "main_fun to return on every chief/master/worker node", "a main_fun that never ends")
            # The first poll also ends the feed (InputMode.SPARK).
            action = "close_feed" if self.input_mode == InputMode.SPARK else ""
            while True:
                st = self._op("client_wait", "shutdown()", timeout_s=30.0, until="workers_done", poll_s=10.0, action=action)
                action = ""
                if st.get("failures"):
                    raise self._fail("shutdown()", self._failures(st))
                if st.get("done"):
                    break
                if deadline.expired():
                    raise deadline.error()
            if grace_secs and any(r.is_background for r in self._config.roles):
                end = Deadline(float(grace_secs), "grace period")
                while not end.expired():
                    st = self._status("failed", min(10.0, max(0.0, end.remaining())), "shutdown()")
                    if st.get("failures"):
                        raise self._fail("shutdown()", self._failures(st))
            final = self._teardown(failed=False)
            if final is not None and final.get("failures"):
                raise ClusterFailedError(self.cluster_id, self._failures(final), "shutdown()")
        except BaseException:
            if not self._closed:
                self._teardown(failed=True)
            raise
        log.info("tfos cluster %s shut down", self.cluster_id)

    def _teardown(self, failed: bool, attribution_s: float = 0.0) -> Optional[dict]:
        """Stops every node, waits (bounded) for their exit, releases the control host.

        One control job in the common case (see ``client_teardown`` in
        :mod:`tfos._connect.host`).

        Args:
            failed: Abort the nodes (a failure) instead of stopping them.
            attribution_s: With ``failed``, seconds to wait first for a node's own report.

        Returns:
            The last status of the control host, or None when it could not be reached.
        """
        if self._closed:
            return None
        self._closed = True
        self._keepalive_stop.set()
        final: Optional[dict] = None
        try:
            deadline = Deadline(_STOP_TIMEOUT_S, "every node process to exit")
            while True:
                poll = min(10.0, max(0.5, deadline.remaining()))
                final = self._op("client_teardown", "teardown", timeout_s=attribution_s + poll + 20.0, abort=failed,
                                 attribution_s=attribution_s, poll_s=poll, release=deadline.expired())
                attribution_s = 0.0
                if final.get("done") or deadline.expired():
                    break
            if not final.get("done"):
                log.warning("tfos cluster %s: not every node reported its exit within %g s", self.cluster_id, _STOP_TIMEOUT_S)
        except TFOSError as exc:
            log.warning("tfos cluster %s: teardown could not reach the control host: %s", self.cluster_id, exc)
        return final

    def __enter__(self) -> "ConnectTFCluster":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.shutdown()
        elif not self._closed:
            try:
                self._teardown(failed=True)
            except Exception as texc:  # noqa: BLE001 - never mask the user's exception
                log.warning("teardown after an error failed: %s", texc)


def _as_connect_dataframe(data: Any) -> Any:
    """``data`` if it is a Spark Connect DataFrame, not a streaming one (client).

    Raises:
        ConfigurationError: For RDDs (not available under Spark Connect), streaming
            DataFrames, and anything else.
    """
    from pyspark.sql.connect.dataframe import DataFrame

    if isinstance(data, DataFrame):
        if data.isStreaming:
            raise ConfigurationError(
                "a streaming DataFrame cannot be fed under Spark Connect (docs/streaming.md: streams need a "
                "classic SparkContext); feed a batch DataFrame, e.g. spark.read... instead of spark.readStream..."
            )
        return data
    raise ConfigurationError(
        f"under Spark Connect tfos feeds DataFrames only (there are no RDDs), got {type(data).__name__}; "
        "use spark.createDataFrame(...) or spark.read..."
    )


#: ``parts_per_epoch`` when the partition count is not needed: every task is epoch 0 and
#: its partition index is its Spark partition id.
_UNCOUNTED = 1 << 40


def _num_partitions(df: Any) -> int:
    """Partitions of a DataFrame, empty ones included (client).

    Spark Connect has no ``getNumPartitions()``; one job with a task per partition yields
    one row each. It reads the input once, so it is only run when the count matters.
    """

    def _one(batches: Any) -> Any:
        import pyarrow as pa
        from pyspark import TaskContext

        for _ in batches:
            pass
        tc = TaskContext.get()
        yield pa.RecordBatch.from_pydict({"p": pa.array([tc.partitionId() if tc else 0], pa.int64())})

    return len(df.mapInArrow(_one, "p long").collect())


def _key_transport_conf(spark: Any) -> tuple:
    """The master and security settings the Connect server's Spark runs with (client side).

    The start/feed closures (and the cluster key in them) reach the executors through the
    server's block managers, as on the classic path, so the same WARNING applies. A setting
    the server does not let the client read counts as off; an unreadable master as a
    multi-host one (both settings are then asked for).

    Returns:
        ``(master, conf)`` for :func:`tfos._driver.spark_checks.warn_key_transport`.
    """
    conf = {}
    for name in ("spark.authenticate", "spark.network.crypto.enabled", "spark.app.id", "spark.master", "spark.task.cpus"):
        try:
            value = spark.conf.get(name, None)
        except Exception:  # noqa: BLE001 - Connect may refuse to read a static conf
            value = None
        if value is not None:
            conf[name] = str(value)
    return conf.get("spark.master", ""), conf


def _check_local_slots(master: str, conf: dict, num_nodes: int) -> None:
    """Refuses a cluster larger than the task slots of a local Connect server (client).

    Only ``local``, ``local[N]`` and ``local-cluster[E,C,M]`` masters say how many slots
    there are (``local[*]`` counts the server host's CPUs, unknown here); on other masters
    a barrier stage without enough free slots is bounded by ``reservation_timeout``.

    Raises:
        ConfigurationError: Fewer slots than nodes.
    """
    if not master.startswith("local") or master.startswith("local[*"):
        return
    try:
        layout = plan_layout(master, conf)
    except ConfigurationError:
        return
    if layout.total_slots is not None and layout.total_slots < num_nodes:
        example = f"local[{num_nodes}]"
        m = re.fullmatch(r"local-cluster\[\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*\]", master.strip())
        if m and layout.slots_per_executor:
            executors = -(-num_nodes // layout.slots_per_executor)
            example = f"local-cluster[{executors},{m.group(2)},{m.group(3)}]"
        raise ConfigurationError(
            f"the Spark Connect server's master {master} has {layout.total_slots} task slot(s) but the cluster "
            f"needs {num_nodes} (one per node, in one barrier stage): start the server with more slots "
            f"(e.g. {example}) or ask for fewer nodes"
        )


def _start_stage(spark: Any, spec: StartSpec, n: int, timeout_s: float) -> list:
    """Runs the barrier start stage of ``n`` nodes and returns its rows, within ``timeout_s``
    (client; ``reservation_timeout``).

    Spark retries a barrier stage it cannot give ``n`` free slots at once for about ten
    minutes (``spark.scheduler.barrier.maxConcurrentTasksCheck.*``); the nodes' own
    registration wait only starts once their tasks run. So the client bounds the whole
    stage: past ``timeout_s`` it interrupts the stage's operation (a Spark Connect tag).

    Raises:
        ReservationTimeoutError: The stage did not finish within ``timeout_s``.
        Exception: What the stage's ``collect()`` raised.
    """
    tag = f"{spec.config.cluster_id}-start"
    out: dict = {}

    def _collect() -> None:
        try:
            spark.addTag(tag)  # tags are per thread: only this operation carries it
            try:
                out["rows"] = spark.range(0, n, 1, n).mapInArrow(make_start_fn(spec), START_SCHEMA, barrier=True).collect()
            finally:
                spark.removeTag(tag)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            out["error"] = exc

    def _interrupt() -> list:
        try:
            return list(spark.interruptTag(tag) or [])
        except Exception as exc:  # noqa: BLE001 - the server may be gone; the caller's error says what matters
            log.warning("tfos cluster %s: could not interrupt the start stage: %s", spec.config.cluster_id, exc)
            return []

    thread = threading.Thread(target=_collect, name=tag, daemon=True)
    thread.start()
    try:
        thread.join(timeout_s)
    except BaseException:  # Ctrl-C: the stage must not go on forming a cluster nobody holds
        _interrupt()
        raise
    if thread.is_alive():
        interrupted = _interrupt()
        thread.join(30.0)
        if "rows" not in out:  # formed just as the deadline passed: use it
            raise ReservationTimeoutError(
                f"tfos cluster {spec.config.cluster_id} (Spark Connect): the start stage of {n} nodes did not finish "
                f"within reservation_timeout={timeout_s:g} s, so it was interrupted ({len(interrupted)} operation(s)). "
                f"A barrier stage needs {n} free task slots at once: the Spark application may have too few "
                "executors or cores, or other jobs hold them; otherwise the nodes did not register (see the executor logs)"
            )
    if "error" in out:
        raise out["error"]
    return out["rows"]


def client_timeout_from_env() -> float:
    """``TFOS_CONNECT_CLIENT_TIMEOUT_S`` in seconds (default 600; client).

    Raises:
        ConfigurationError: Not a number, or below :data:`MIN_CLIENT_TIMEOUT_S` (20 s): the
            idle client's keep-alive jobs, each waiting for a task slot, could not keep a
            live client's cluster from being aborted.
    """
    text = os.environ.get("TFOS_CONNECT_CLIENT_TIMEOUT_S")
    if text is None or not text.strip():
        return DEFAULT_CLIENT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= MIN_CLIENT_TIMEOUT_S or value == float("inf"):
        raise ConfigurationError(
            f"TFOS_CONNECT_CLIENT_TIMEOUT_S={text!r}: give the seconds without any client operation after which the "
            f"control host aborts the cluster, a number >= {MIN_CLIENT_TIMEOUT_S:g} (default {DEFAULT_CLIENT_TIMEOUT_S:g})"
        )
    return value


def run_connect(
    spark: Any,
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
    forward_logs: str = "chief",
    progress: bool = True,
    queue_chunks: int = 4,
    executor_wait_s: float = 60.0,
) -> ConnectTFCluster:
    """``TFCluster.run`` for a Spark Connect session (client); see :func:`tfos.TFCluster.run`.

    Differences from the classic path (docs/connect.md): ``driver_ps_nodes`` is refused;
    node output stays in the executor logs (``forward_logs`` sends it to the control
    host's log); ``progress`` is ignored; of the Spark configuration checks of the classic
    path only the slot count of a local master is made; elsewhere a start stage that
    Spark cannot schedule is interrupted after ``reservation_timeout``.

    Raises:
        ConfigurationError: Bad arguments, ``driver_ps_nodes=True``, or a local master
            with fewer task slots than nodes.
        ReservationTimeoutError: The start stage did not finish within ``reservation_timeout``
            seconds (too few free task slots, or nodes that never registered).
        ClusterFailedError: A node failed while the cluster was forming, or the start
            stage failed (too few task slots, executors that cannot reach each other).
    """
    del progress, executor_wait_s  # no SparkContext status tracker / executor list under Connect
    import pyspark

    if int(pyspark.__version__.split(".")[0]) < 4:
        raise ConfigurationError(f"tfos on Spark Connect needs PySpark >= 4.0 (DataFrame.localCheckpoint over Connect), found {pyspark.__version__}")
    if not callable(map_fun):
        raise ConfigurationError("map_fun must be callable as map_fun(args, ctx)")
    if driver_ps_nodes:
        raise ConfigurationError("driver_ps_nodes=True is not available under Spark Connect: the client is not a cluster host")
    input_mode = InputMode(int(input_mode))
    template = build_template(num_executors, num_ps, master_node, eval_node)
    roles = roles_from_template(template)
    if isinstance(queues, str) or not all(isinstance(q, str) and q for q in queues):
        raise ConfigurationError(f"queues must be a list of queue names such as ['input', 'output'], got {queues!r}")
    queues = tuple(queues)
    if input_mode == InputMode.SPARK and not queues:
        raise ConfigurationError("InputMode.SPARK needs at least one queue (the default is ['input', 'output', 'error'])")
    from tfos._driver.task_world import pickle_payload

    payload = bytes(pickle_payload(map_fun, tf_args))  # a Connect client has no broadcasts or accumulators to carry
    cluster_id = f"tfos-{uuid.uuid4().hex[:12]}"
    try:
        default_fs = str(spark.conf.get("spark.hadoop.fs.defaultFS", "file://") or "file://")
    except Exception:  # noqa: BLE001 - unreadable conf: local file system
        default_fs = "file://"
    default_fs = "file://" if default_fs.startswith("file:") else default_fs.rstrip("/")
    master, server_conf = _key_transport_conf(spark)
    warn_key_transport(master, server_conf)
    config = ClusterConfig(
        cluster_id=cluster_id, key=_wire.new_key(), driver_host="0.0.0.0", driver_port=1,  # set by the start tasks
        input_mode=input_mode, roles=tuple(roles), default_fs=default_fs,
        heartbeat_interval_s=heartbeat_interval_s(len(roles), heartbeat_timeout), heartbeat_timeout_s=float(heartbeat_timeout),
        reservation_timeout_s=float(reservation_timeout), release_port=release_port, queues=queues,
        queue_chunks=queue_chunks, tensorboard=bool(tensorboard), log_dir=log_dir, forward_logs=forward_logs,
        # local[N]: the nodes' "executor log" and the control host's stderr (where forwarded
        # lines go) are the same stream, the server's: lines show once, prefixed.
        local_master=master.split("[", 1)[0] == "local",
    )
    client_timeout = client_timeout_from_env()
    spec = StartSpec(config=config, fn_payload=payload, client_timeout_s=client_timeout)
    n = len(roles)
    log.info("tfos cluster %s (Spark Connect): %s (input mode %s)", cluster_id, format_template(template), input_mode.name)
    _check_local_slots(master, server_conf, n)
    try:
        rows = _start_stage(spark, spec, n, float(reservation_timeout))
    except ReservationTimeoutError:
        raise
    except Exception as exc:  # noqa: BLE001 - Connect raises several exception types
        failures = decode_failures(str(exc))
        if not failures:
            r = roles[0]
            failures = [NodeFailure(r.executor_id, r.job_name, r.task_index, "", "spark", type(exc).__name__, _job_error_text(exc))]
        raise ClusterFailedError(cluster_id, failures, "run()") from exc
    lead = next(r for r in rows if r["executor_id"] == 0)
    nodes = [NodeInfo.from_dict(d) for d in json.loads(lead["nodes"] or "[]")]
    cluster = ConnectTFCluster(spark, config, template, (str(lead["ctrl_host"]), int(lead["ctrl_port"])), nodes, client_timeout)
    log.info("tfos cluster %s: all %d nodes registered: %s", cluster_id, n, cluster.cluster_spec)
    return cluster

