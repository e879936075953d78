"""The Spark Connect backend: a tfos cluster driven from a Spark Connect client (client
side; see docs/connect.md).

Under Spark Connect the program is a remote client: it has no SparkContext, no RDDs, and
executors may not be able to reach it. So nothing here listens or is dialled:

* the start stage is a barrier ``mapInArrow`` (:func:`tfos._connect.tasks.make_start_fn`);
  its task 0 starts the control host (:mod:`tfos._connect.control_host`), the classic control
  server and cluster state moved onto an executor host, and the stage returns once every
  node registered;
* every later client operation is a Spark job: status and stop are one-task jobs whose
  task talks to the control host; ``train()``/``inference()`` are ``mapInArrow`` jobs
  whose tasks feed the nodes on their own hosts;
* failures reach the client as failed Spark jobs, or in the status a control job returns;
  either way they are raised as :class:`~tfos.errors.ClusterFailedError` naming the node.

:class:`ConnectLauncher` starts attempts (start stages) and checks the DataFrames given to
``train()``/``inference()``; :class:`ConnectBackend` is one started attempt. The protocol
both follow is :mod:`tfos._driver.backend`; ``TFCluster`` is written once above it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import threading
import time
from typing import Any, Optional, Sequence

from tfos._common import wire as _wire
from tfos._common.deadline import Deadline
from tfos._connect.tasks import (
    OP_SCHEMA,
    StartSpec,
    decode_failures,
    make_infer_fn,
    make_op_fn,
    make_train_fn,
)
from tfos._control import messages as _msg
from tfos._control.host import ATTRIBUTION_S, STOP_TIMEOUT_S
from tfos._control.messages import NodeState
from tfos._data.arrow_codec import binary_as_bytes, feed_schema_json
from tfos._data.feed_tasks import arrow_safe_dataframe
from tfos._driver.backend import UNCOUNTED, AttemptReport, ClusterPlan, InferenceCall, TrainCall, feed_plan
from tfos._driver.connect_start import (
    DEFAULT_CLIENT_TIMEOUT_S,
    _check_local_slots,
    _key_transport_conf,
    _num_partitions,
    _start_stage,
    client_timeout_from_env,
)
from tfos._driver.spark_checks import warn_key_transport
from tfos._node.context import normalize_default_fs
from tfos._node.launch import ClusterConfig
from tfos.cluster_template import NodeInfo
from tfos.errors import ClusterFailedError, ConfigurationError, NodeFailure, ReservationTimeoutError, TFOSError

__all__ = ["ConnectLauncher", "ConnectBackend", "is_connect_session", "DEFAULT_CLIENT_TIMEOUT_S"]

log = logging.getLogger(__name__)

#: Seconds between keep-alive jobs while the client is idle.
_KEEPALIVE_S = 30.0


def is_connect_session(obj: Any) -> bool:
    """True for a Spark Connect ``SparkSession`` (``pyspark.sql.connect.session``)."""
    return type(obj).__module__.startswith("pyspark.sql.connect")


def _job_error_text(exc: BaseException) -> str:
    text = str(exc)
    for marker in ("ClusterFailedError: ", "FeedError: ", "FeedTimeoutError: ", "TFOSError: "):
        if marker in text:
            return marker + text.split(marker, 1)[1].splitlines()[0]
    return text.splitlines()[0][:500] if text else type(exc).__name__


class ConnectLauncher:
    """Starts the attempts of a cluster from a Spark Connect client (client).

    Creating it checks what can be checked from the client: PySpark >= 4,
    ``driver_ps_nodes`` refused (the client is not a cluster host), the task slots of a
    local server's master, ``TFOS_CONNECT_CLIENT_TIMEOUT_S``; it warns when the server's
    Spark sends the cluster key unprotected.

    Raises:
        ConfigurationError: One of the checks above failed.
    """

    streams = False
    sc = None
    working_dir: Optional[str] = None

    def __init__(self, spark: Any, plan: ClusterPlan) -> None:
        import pyspark

        if int(pyspark.__version__.split(".")[0]) < 4:
            raise ConfigurationError(f"tfos on Spark Connect needs PySpark >= 4.0 (DataFrame.localCheckpoint over Connect), found {pyspark.__version__}")
        if plan.driver_ps_nodes:
            raise ConfigurationError("driver_ps_nodes=True is not available under Spark Connect: the client is not a cluster host")
        self.spark = spark
        self.plan = plan
        try:
            default_fs = str(spark.conf.get("spark.hadoop.fs.defaultFS", "file://") or "file://")
        except Exception:  # noqa: BLE001 - unreadable conf: local file system
            default_fs = "file://"
        self.default_fs = normalize_default_fs(default_fs)  # 'hdfs://' (no host) stays 'hdfs://'
        master, server_conf = _key_transport_conf(spark)
        warn_key_transport(master, server_conf)
        # local[N]: the nodes' "executor log" and the control host's stderr (where forwarded
        # lines go) are the same stream, the server's: lines show once, prefixed.
        self.local_master = master.split("[", 1)[0] == "local"
        self.client_timeout_s = client_timeout_from_env()
        _check_local_slots(master, server_conf, len(plan.roles))

    def launch(self, attempt: int, restarts_left: int, outer: Optional[Deadline]) -> "ConnectBackend":
        """Runs the barrier start stage of ``attempt``; returns once every node registered
        (within ``reservation_timeout`` and what is left of ``outer``).

        Raises:
            ReservationTimeoutError: The start stage did not finish in time (too few free
                task slots, or nodes that never registered).
            ClusterFailedError: A node failed while the cluster was forming, or the start
                stage failed (too few task slots, executors that cannot reach each other).
        """
        del restarts_left  # the control host logs node failures; the client decides on restarts
        plan = self.plan
        cluster_id = plan.cluster_id(attempt)
        config = ClusterConfig.of(
            plan.settings, cluster_id=cluster_id, key=_wire.new_key(), driver_host="0.0.0.0", driver_port=1,  # set by the start tasks
            input_mode=plan.input_mode, roles=plan.roles, default_fs=self.default_fs, local_master=self.local_master,
        )
        # bytes: a Connect client has no broadcasts or accumulators to carry
        spec = StartSpec(config=config, fn_payload=bytes(plan.payload), client_timeout_s=self.client_timeout_s, attempt=attempt)
        wait_s = plan.settings.reservation_timeout_s
        timeout_s = min(wait_s, outer.remaining()) if outer is not None else wait_s
        try:
            rows = _start_stage(self.spark, spec, len(plan.roles), timeout_s)
        except ReservationTimeoutError:
            raise
        except Exception as exc:  # noqa: BLE001 - Connect raises several exception types
            failures = decode_failures(str(exc))
            if not failures:
                r = plan.roles[0]
                failures = [NodeFailure(r.executor_id, r.job_name, r.task_index, "", "spark", type(exc).__name__, _job_error_text(exc))]
            raise ClusterFailedError(cluster_id, failures, "run()") from exc
        lead = next(r for r in rows if r["executor_id"] == 0)
        nodes = [NodeInfo.from_dict(d) for d in json.loads(lead["nodes"] or "[]")]
        config = dataclasses.replace(config, driver_host=str(lead["ctrl_host"]), driver_port=int(lead["ctrl_port"]))
        return ConnectBackend(self.spark, config, nodes, self.client_timeout_s)

    def await_executors(self, outer: Optional[Deadline]) -> None:
        """Nothing to wait for: a Connect client cannot see the executors (the start stage
        waits for its task slots, bounded by ``reservation_timeout``)."""

    def train_input(self, data: Any, num_epochs: int, end_of_feed: bool, count: bool) -> tuple[Any, int]:
        """Checks ``data`` (a batch DataFrame); counts its partitions when the epoch of a
        task (several epochs), the total (``end_of_feed``) or a restart (``count``) needs it.

        Raises:
            ConfigurationError: An RDD (none under Spark Connect), a streaming DataFrame or
                anything else.
        """
        df = _as_connect_dataframe(data)
        # Spark Connect has no getNumPartitions(): a job counts the partitions.
        parts = _num_partitions(df) if (count or end_of_feed or num_epochs > 1) else UNCOUNTED
        return df, parts

    def inference_input(self, data: Any, schema: Any) -> tuple[Any, int, Any]:
        """Checks ``data`` (a batch DataFrame) and resolves ``schema`` (default
        ``"result double"``). The results come back whole or not at all, so the whole
        input is one unit of the inference ledger.

        Raises:
            ConfigurationError: ``data`` is not a batch DataFrame.
        """
        df = _as_connect_dataframe(data)
        schema = "result double" if schema is None else schema
        struct = schema if not isinstance(schema, str) else self.spark.createDataFrame([], schema).schema
        return df, 1, struct

    def assemble(self, sources: Sequence[Any], owner: Sequence[int]) -> Any:
        """The results of the one unit (see :meth:`inference_input`)."""
        return sources[owner[0]]


class ConnectBackend:
    """One attempt of a cluster driven from a Spark Connect client (client).

    Args:
        spark: The Spark Connect session.
        config: What every node got; its control address is the control host's.
        nodes: The registered nodes.
        client_timeout_s: The control host's client timeout (the keep-alive runs in time).
    """

    sc = None
    nodes_rdd = None
    server = None

    def __init__(self, spark: Any, config: ClusterConfig, nodes: list[NodeInfo], client_timeout_s: float = DEFAULT_CLIENT_TIMEOUT_S):
        self.spark = spark
        self.config = config
        self.cluster_id = config.cluster_id
        self._client_timeout_s = client_timeout_s
        self._ctrl = (config.driver_host, config.driver_port)
        self._nodes = nodes
        self._closed = False
        self._torn_down = False
        self._feed_closed = False
        self._final: dict = {}
        self._last_status: dict = {}
        self._last_feed_id = ""
        self._last_op = time.monotonic()
        self._busy = 0  # feed/inference jobs in flight (their tasks keep the lease)
        self._keepalive_stop = threading.Event()
        threading.Thread(target=self._keepalive, name=f"{self.cluster_id}-keepalive", daemon=True).start()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def torn_down(self) -> bool:
        return self._torn_down

    @property
    def feed_closed(self) -> bool:
        return self._feed_closed

    def nodes(self) -> list[NodeInfo]:
        return list(self._nodes)

    def check_open(self, what: str) -> None:
        if self._closed:
            raise TFOSError(f"{what}: the cluster {self.cluster_id} was already shut down")

    # ------------------------------------------------------------- control jobs
    def _op(self, msg: _msg.Message, context: str, timeout_s: float = 30.0) -> dict:
        """The message ``msg`` to the control host through a one-task Spark job (client)."""
        host, port = self._ctrl
        fn = make_op_fn(host, port, self.config.key, self.cluster_id, msg, timeout_s)
        self._last_op = time.monotonic()
        try:
            rows = self.spark.range(0, 1, 1, 1).mapInArrow(fn, OP_SCHEMA).collect()
        except Exception as exc:  # noqa: BLE001 - Connect raises several exception types
            raise TFOSError(f"{context}: the control job of cluster {self.cluster_id} failed: {_job_error_text(exc)}") from exc
        finally:
            self._last_op = time.monotonic()
        return json.loads(rows[0]["reply"])

    def _status(self, until: str, poll_s: float, context: str, action: str = "") -> dict:
        status = self._op(_msg.ClientWait(until=until, poll_s=poll_s, action=action), context, timeout_s=poll_s + 20.0)
        self._last_status = status
        return status

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
                self._status(_msg.WaitUntil.NOW, 0.0, "keep-alive")
            except Exception as exc:  # noqa: BLE001 - the next client call reports real trouble
                log.debug("tfos keep-alive job failed: %s", exc)

    @staticmethod
    def _failures(status: dict) -> list[NodeFailure]:
        return [NodeFailure.from_dict(f) for f in status.get("failures", [])]

    def _raise_failures(self, status: dict, context: str) -> None:
        if status.get("failures"):
            raise self._fail(context, self._failures(status))

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

    def fail(self, context: str) -> ClusterFailedError:
        return self._fail(context, [])

    def _job(self, context: str, run: Any) -> Any:
        """Runs a feed or inference job (``run()``); its failure is raised as the cluster's
        error: the nodes' own reports (fetched while tearing down), else the failures the
        failed task carried, else its text (client)."""
        self._busy += 1
        try:
            return run()
        except Exception as exc:  # noqa: BLE001 - Connect raises several exception types
            raise self._fail(context, decode_failures(str(exc)), exc, attribution_s=ATTRIBUTION_S) from exc
        finally:
            self._busy -= 1
            self._last_op = time.monotonic()

    def clear_checkpoints(self) -> None:
        self._op(_msg.ClientControl(action="clear_checkpoints"), "train()")

    # ----------------------------------------------------------------- feeding
    def feed(self, call: TrainCall, first_epoch: int, report_done: bool) -> list[tuple[int, str]]:
        """One train() feed job: one ``mapInArrow`` job whose tasks feed the nodes on their
        own hosts, epochs ``first_epoch..num_epochs-1`` back to back (client)."""
        df, epochs = call.data, call.num_epochs - first_epoch
        plan = feed_plan(self.config, self._nodes, call, _arrow_kind(), call.parts, first_epoch=first_epoch,
                         last_epoch=call.num_epochs - 1, report_done=report_done)
        self._last_feed_id = plan.feed_id
        if call.end_of_feed:
            self._op(_msg.ClientControl(action="close_feed_when_sent", feed_id=plan.feed_id, total=call.parts * epochs), "train()")
            self._feed_closed = True
        safe, names = arrow_safe_dataframe(df)  # dotted, backticked or repeated column names
        data = functools.reduce(lambda a, b: a.union(b), [safe] * epochs)
        log.info("tfos train: %d epoch(s) -> %d node(s)", epochs, len(plan.nodes))
        fn = make_train_fn(plan, feed_schema_json(df.schema, binary_as_bytes(df.sparkSession)), names)
        rows = self._job("train()", lambda: data.mapInArrow(fn, "partition long, outcome string").collect())
        return [(int(r["partition"]), str(r["outcome"])) for r in rows]

    def returned_without_terminate(self, executor_ids: Sequence[int], qname: str, wait_s: float) -> list[str]:
        try:
            # The nodes' reports may still be on their way: the control host waits up to wait_s.
            msg = _msg.ClientReturned(executors=tuple(executor_ids), qname=qname, wait_s=wait_s)
            return list(self._op(msg, "train()").get("names", []))
        except TFOSError as exc:
            log.debug("tfos: could not ask which node returned: %s", exc)
            return []

    def infer(self, call: InferenceCall, todo: Sequence[int]) -> Any:
        """One inference job: a ``mapInArrow`` job returning the nodes' results as record
        batches of ``call.schema``, made eager with ``localCheckpoint()`` so failures surface
        here and inference never runs twice (client)."""
        plan = feed_plan(self.config, self._nodes, call, _arrow_kind(), UNCOUNTED)
        safe, names = arrow_safe_dataframe(call.data)
        fn = make_infer_fn(plan, call.schema.json(), names)
        return self._job("inference()", lambda: safe.mapInArrow(fn, call.schema).localCheckpoint(eager=True))

    def held_results(self, todo: Sequence[int]) -> tuple[Any, set[int]]:
        """Nothing: a failed Connect inference job keeps no results."""
        return None, set()

    # ---------------------------------------------------------------- shutdown
    def await_workers(self, deadline: Deadline, end_feed: bool) -> None:
        # The first poll also ends the feed (InputMode.SPARK).
        action = "close_feed" if end_feed else ""
        while True:
            status = self._op(_msg.ClientWait(until=_msg.WaitUntil.WORKERS_DONE, poll_s=10.0, action=action), "shutdown()", timeout_s=30.0)
            self._last_status = status
            action = ""
            self._raise_failures(status, "shutdown()")
            if status.get("done"):
                return
            if deadline.expired():
                raise deadline.error()

    def wait_for_failure(self, timeout_s: float) -> bool:
        end = Deadline(float(timeout_s), "grace period")
        while not end.expired():
            if self._status(_msg.WaitUntil.CLUSTER_FAILED, min(10.0, max(0.0, end.remaining())), "shutdown()").get("failures"):
                return True
        return False

    def row_accounting(self) -> list:
        return []  # the nodes' row figures stay with the Spark Connect server

    def rows_skipped(self, nodes: Sequence[str]) -> None:
        pass  # judged with the figures, on the Spark Connect server

    def node_states(self) -> dict[int, NodeState]:
        return {int(k): NodeState(v) for k, v in self._last_status.get("states", {}).items()}

    def stop(self) -> None:
        final = self._teardown(failed=False)
        if final is not None and final.get("failures"):
            raise ClusterFailedError(self.cluster_id, self._failures(final), "shutdown()")

    def teardown(self, failed: bool, reason: str = "") -> None:
        del reason  # the control host aborts with "the cluster failed"
        self._teardown(failed)

    def join_teardown(self) -> None:
        """Nothing to join: the teardown is synchronous."""

    def _teardown(self, failed: bool, attribution_s: float = 0.0) -> Optional[dict]:
        """Stops every node, waits (bounded) for their exit, releases the control host.

        One control job in the common case (see ``client_teardown`` in
        :mod:`tfos._connect.control_host`); its answer also says what the nodes got done
        (:meth:`report`).

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
            deadline = Deadline(STOP_TIMEOUT_S, "every node process to exit")
            while True:
                poll = min(10.0, max(0.5, deadline.remaining()))
                msg = _msg.ClientTeardown(abort=failed, attribution_s=attribution_s, poll_s=poll, release=deadline.expired(),
                                          feed_id=self._last_feed_id)
                final = self._op(msg, "teardown", timeout_s=attribution_s + poll + 20.0)
                attribution_s = 0.0
                if final.get("done") or deadline.expired():
                    break
            if not final.get("done"):
                log.warning("tfos cluster %s: not every node reported its exit within %g s", self.cluster_id, STOP_TIMEOUT_S)
        except TFOSError as exc:
            log.warning("tfos cluster %s: teardown could not reach the control host: %s", self.cluster_id, exc)
        finally:
            self._torn_down = True
        self._final = final or {}
        return final

    def report(self) -> AttemptReport:
        final = self._final
        return AttemptReport(int(final.get("rows_consumed", 0)), dict(final.get("checkpoints", {})),
                             frozenset(int(i) for i in final.get("partitions_done", [])))

    def tensorboard_url(self, timeout_s: float) -> Optional[str]:
        """The TensorBoard URL on the lead node's host (an executor host's address, which
        the client may not be able to open)."""
        deadline = Deadline(timeout_s, "TensorBoard to start")
        while True:
            # The control host answers when TensorBoard reported its URL or its start-up
            # error, a node failed, or the poll (at most 10 s) ended.
            st = self._status(_msg.WaitUntil.TENSORBOARD, deadline.slice(10.0), "tensorboard_url()")
            self._raise_failures(st, "tensorboard_url()")
            if st.get("tensorboard_url") or st.get("done") or deadline.expired():
                return st.get("tensorboard_url")


def _arrow_kind() -> Any:
    from tfos._data.framing import ChunkKind

    return ChunkKind.ARROW


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
