"""The driver side of a tfos cluster: ``run()`` and the :class:`TFCluster` it returns (driver only).

Only this module (and :mod:`tfos._driver.spark_checks`) touches the SparkContext. Every Spark job
tfos starts runs in a thread of its own under a job group of this cluster, so a failure
cancels exactly this cluster's jobs and nothing else.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import signal
import sys
import threading
import time
import uuid
import weakref
from typing import Any, Callable, Optional, Sequence

from tfos._common import wire as _wire

from tfos._node import output as _node_output
from tfos._driver.state import ClusterState
from tfos._control.server import ControlServer
from tfos._common.deadline import Deadline
from tfos._data.feed_tasks import FeedPlan, make_arrow_feed_fn, make_feed_fn, make_infer_fn
from tfos._node.launch import ClusterConfig
from tfos._node.start_task import launch_local_node, make_start_task
from tfos._driver.spark_checks import busy_slots_report, check_spark
from tfos._driver.user_source import with_source
from tfos.cluster_template import InputMode, build_template, format_template, roles_from_template
from tfos.errors import ClusterFailedError, ConfigurationError, DeadlineExceededError, ReservationTimeoutError, TFOSError, is_root_cause

__all__ = ["TFCluster", "run"]

log = logging.getLogger("tfos.cluster")

#: Seconds to wait for nodes to exit after a stop directive.
_STOP_TIMEOUT_S = 45.0
#: Seconds to let the failed nodes' own reports (their root causes) arrive after a first
#: failure (e.g. a feed task's report of a broken connection) before raising.
_ATTRIBUTION_S = 5.0
#: Seconds run() waits for the start stage before it says which slots are busy (C25).
_BUSY_WARN_S = 8.0
#: Seconds after the last train() job for every fed node to send its final row counter.
_FINAL_COUNT_S = 3.0


def _default_fs(sc: Any) -> str:
    try:
        fs = sc._jsc.hadoopConfiguration().get("fs.defaultFS") or "file://"
    except Exception:  # noqa: BLE001 - no JVM Hadoop conf (unusual); fall back to local
        fs = "file://"
    from tfos.node_context import normalize_default_fs  # keeps 'hdfs://' (no host) intact (issue 11)

    return normalize_default_fs(fs)


class _JobThread:
    """Runs one Spark action in a thread under a job group (driver)."""

    def __init__(self, sc: Any, group: str, description: str, action: Callable[[], Any], on_done: Callable[[], None] = lambda: None):
        from pyspark import InheritableThread

        self.sc, self.group = sc, group
        self.result: Any = None
        self.error: Optional[BaseException] = None
        self.done = threading.Event()
        self.cancelled = False

        def _run() -> None:
            try:
                sc.setJobGroup(group, description, interruptOnCancel=True)
                self.result = action()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting driver thread
                self.error = exc
            finally:
                self.done.set()
                on_done()  # wakes the driver thread waiting on the cluster state

        self.thread = InheritableThread(target=_run, name=f"tfos-job-{group}", daemon=True)
        self.thread.start()

    def cancel(self) -> None:
        """Cancels this job group only (never other jobs of the application)."""
        if self.done.is_set() or self.cancelled:
            return  # nothing left to cancel: Spark would WARN 'Failed to cancel job group'
        self.cancelled = True
        try:
            self.sc.cancelJobGroup(self.group)
        except Exception as exc:  # noqa: BLE001 - the context may already be stopping
            log.debug("cancelJobGroup(%s) failed: %s", self.group, exc)


def _spark_error_text(exc: BaseException) -> str:
    text = str(exc)
    for marker in ("FeedError: ", "FeedTimeoutError: ", "TFOSError: "):
        if marker in text:
            line = text.split(marker, 1)[1].splitlines()[0]
            return marker + line
    return text.splitlines()[0][:500] if text else type(exc).__name__


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
    """

    def __init__(self) -> None:  # populated by run()
        self.sc: Any = None
        self.cluster_id = ""
        self.input_mode = InputMode.TENSORFLOW
        self.num_executors = 0
        self.cluster_template: dict[str, list[int]] = {}
        self.defaultFS = "file://"
        self.working_dir = os.getcwd()
        self.queues: list[str] = []
        self.progress = True
        self._state: Optional[ClusterState] = None
        self._server: Optional[ControlServer] = None
        self._config: Optional[ClusterConfig] = None
        self._start_job: Optional[_JobThread] = None
        self._jobs: list[_JobThread] = []
        self._local_nodes: list = []
        self._closed = False
        self._feed_seq = 0
        self._liveness_stop = threading.Event()
        self._teardown_thread: Optional[threading.Thread] = None
        #: The barrier RDD of the start tasks, one partition per Spark-hosted node (TFoS name).
        self.nodeRDD: Any = None

    # ------------------------------------------------------------- properties
    @property
    def cluster_info(self) -> list[dict]:
        """TFoS-style list of registered nodes (dicts with executor_id, job_name, task_index,
        host, port, ...)."""
        assert self._state is not None
        return [n.to_dict() for n in self._state.nodes_snapshot()]

    @property
    def cluster_spec(self) -> dict[str, list[str]]:
        """``{job: ["host:port", ...]}`` of the running cluster."""
        assert self._state is not None
        return self._state.cluster_spec()

    @property
    def server(self) -> Optional[ControlServer]:
        """The driver's control server (TFoS: the reservation server); None once shut down."""
        return self._server

    @property
    def meta(self) -> dict:
        """Same as :attr:`cluster_meta` (TFoS set both)."""
        return self.cluster_meta

    @property
    def cluster_meta(self) -> dict:
        """TFoS-style cluster metadata: id, cluster_template, num_executors, default_fs,
        working_dir (the driver's), server_addr ``(host, port)`` and release_port."""
        cfg = self._config
        return {
            "id": self.cluster_id, "cluster_template": self.cluster_template, "num_executors": self.num_executors,
            "default_fs": self.defaultFS, "working_dir": cfg.driver_working_dir if cfg else self.working_dir,
            "server_addr": (cfg.driver_host, cfg.driver_port) if cfg else None,
            "release_port": cfg.release_port if cfg else True,
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
        assert self._state is not None and self._config is not None
        if not self._config.tensorboard:
            return None
        st = self._state
        try:
            if not st.wait(lambda: st.tensorboard_url is not None or bool(st.tensorboard_error), Deadline(timeout_s, "TensorBoard to start")):
                raise self._fail("tensorboard_url()")
        except DeadlineExceededError:
            log.warning("TensorBoard did not report a URL within %g s", timeout_s)
        if st.tensorboard_error:
            log.warning("TensorBoard of cluster %s is not running (see the error above)", self.cluster_id)
            return None
        return st.tensorboard_url

    # ------------------------------------------------------------- internals
    def _fail(self, context: str) -> ClusterFailedError:
        """The error to raise for a failed cluster; starts the teardown (driver).

        Report first, tear down second: every node is told to abort at once, the error is
        built as soon as the failed nodes have reported their root causes (bounded by
        ``_ATTRIBUTION_S``), and the rest of the teardown (waiting for the healthy nodes'
        processes, bounded) goes on in a background thread that logs its outcome.
        """
        assert self._state is not None
        st = self._state
        self._cancel_jobs()
        since = time.monotonic()
        if not st.wait_until(st.failed_nodes_reported, _ATTRIBUTION_S):
            log.info("tfos cluster %s: not every failed node reported its cause within %g s", self.cluster_id, _ATTRIBUTION_S)
        # Only consequences so far (e.g. Spark killed a healthy node's barrier task because
        # another host's executor vanished with its node supervisor): a node that has gone
        # silent is then the likely cause; wait until every live node is heard from, or the
        # silent one is declared lost (at most heartbeat_timeout), so the error names it.
        if not st.has_root_cause():
            st.wait_until(lambda: st.has_root_cause() or st.heard_from_live_nodes_since(since), st.heartbeat_timeout_s + 2.0)
        st.abort("the cluster failed")
        err = st.error(context)
        self._teardown_async()
        return err

    def _cancel_jobs(self) -> None:
        for job in list(self._jobs):
            if not job.done.is_set():
                job.cancel()

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise TFOSError(f"{what}: the cluster {self.cluster_id} was already shut down")
        assert self._state is not None
        if self._state.failed:
            raise self._fail(what)

    def _on_first_failure(self, failure: Any) -> None:
        # Runs on a control-server thread. The cluster cannot recover. For a root cause,
        # direct every node to abort now (before the cancellation below kills their Spark
        # tasks, so those kills are recognised as consequences). A consequence first (a
        # feed task saw a node fail or stop reading) leaves the nodes running for the
        # attribution wait in _fail(), so that the node can still report what happened to
        # it (e.g. main_fun raising 1.5 s into a feed_timeout of 1 s). Then cancel only
        # this cluster's job groups.
        assert self._state is not None
        if is_root_cause(failure):
            self._state.abort(f"node {failure.node_name} failed")
        self._cancel_jobs()

    def _liveness_loop(self) -> None:
        assert self._state is not None
        while not self._liveness_stop.wait(1.0):
            self._state.check_liveness()

    def _run_job(self, kind: str, description: str, action: Callable[[], Any]) -> _JobThread:
        self._feed_seq += 1
        assert self._state is not None
        job = _JobThread(self.sc, f"{self.cluster_id}-{kind}-{self._feed_seq}", description, action, self._state.poke)
        self._jobs.append(job)
        return job

    def _await_job(self, job: _JobThread, context: str, progress: Optional["_Progress"] = None) -> Any:
        """Waits for a feed/inference job, failing fast on any node failure (driver).

        The wait is a question to the cluster state (woken by every report and by the job's
        end), with a tick of 0.5 s to move the progress line.
        """
        assert self._state is not None
        st = self._state
        ok = False
        try:
            while not job.done.is_set():
                st.wait_until(lambda: job.done.is_set() or st.failed, 0.5 if progress else 5.0)
                if st.failed:
                    raise self._fail(context)
                if progress:
                    progress.update()
            if job.error is not None:
                # The node's own failure report carries the real cause: give it a moment.
                if st.wait_until(lambda: st.failed, _ATTRIBUTION_S):
                    raise self._fail(context)
                text = _spark_error_text(job.error)
                st.abort("a Spark job of the cluster failed")
                self._teardown_async()
                raise ClusterFailedError(self.cluster_id, [st.make_failure(st.roles[0].executor_id, "spark", type(job.error).__name__, text)], context) from job.error
            ok = True
            if progress:
                progress.finish(self._feed_ids())
            return job.result
        except BaseException as exc:
            if not isinstance(exc, TFOSError) and not self._closed:
                # Ctrl-C (or SIGTERM, see _install_sigterm) while a job runs: tear the
                # cluster down before the interruption propagates.
                log.warning("tfos cluster %s: %s during %s; tearing the cluster down", self.cluster_id, type(exc).__name__, context)
                self._teardown(failed=True)
            raise
        finally:
            if progress and not ok:
                progress.abandon()

    def _feed_ids(self) -> list[int]:
        return [n.executor_id for n in self._feed_nodes()]

    def _feed_nodes(self) -> tuple:
        assert self._state is not None
        return tuple(n for n in self._state.nodes_snapshot() if n.role.feedable)

    def _plan(self, mode: str, qname: str, kind: Any, parts: int, feed_timeout: float, report_sent: bool = False) -> FeedPlan:
        assert self._config is not None
        cfg = self._config
        if qname not in self.queues:
            raise ConfigurationError(f"qname {qname!r} is not one of the cluster's queues {self.queues}; pass queues=[...] to TFCluster.run()")
        return FeedPlan(
            cfg.cluster_id, cfg.key, cfg.driver_host, cfg.driver_port, self._feed_nodes(), qname, mode, kind, parts,
            float(feed_timeout), feed_id=uuid.uuid4().hex, report_sent=report_sent,
        )

    def _progress(self, job_group_prefix: str, total: int, parts: int, epochs: int, desc: str) -> Optional["_Progress"]:
        if not self.progress or os.environ.get("TFOS_PROGRESS", "1") == "0" or _node_output.spark_shows_progress(self.sc):
            return None
        assert self._state is not None
        group = f"{self.cluster_id}-{job_group_prefix}-{self._feed_seq}"
        return _Progress(self.sc.statusTracker(), self._state, group, total, parts, epochs, desc)

    # ---------------------------------------------------------------- feeding
    def train(self, dataRDD: Any, num_epochs: int = 1, feed_timeout: float = 600, qname: str = "input", end_of_feed: bool = False) -> None:
        """Feeds an RDD or DataFrame to the nodes' ``DataFeed`` for ``num_epochs`` epochs (driver).

        Blocks until every partition of every epoch was consumed by the TF processes, or the
        nodes called ``DataFeed.terminate()`` (the rest is skipped quickly). An epoch is one
        pass over every partition; epochs are fed back to back in one Spark job.

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
        if isinstance(num_epochs, bool) or not isinstance(num_epochs, int) or num_epochs < 1:
            tfos_zero = " (TFoS fed 10 epochs for 0: pass num_epochs=10 to keep that)" if num_epochs == 0 and not isinstance(num_epochs, bool) else ""
            raise ConfigurationError(f"num_epochs must be an integer >= 1 (one epoch = one pass over every partition), got {num_epochs!r}{tfos_zero}")
        self._check_open("train()")
        assert self._state is not None
        if self._state.feed_closed:
            raise ConfigurationError("train(): the feed already ended (an earlier train(..., end_of_feed=True)); start a new cluster to feed more data")
        df = _as_dataframe(dataRDD)
        if df is not None and _arrow_ok():
            parts = df.rdd.getNumPartitions()
            plan = self._plan("train", qname, _chunk_kind("arrow"), parts, feed_timeout, end_of_feed)
            data = functools.reduce(lambda a, b: a.union(b), [df] * num_epochs)
            fn = make_arrow_feed_fn(plan)
            action: Callable[[], Any] = lambda: [tuple(r) for r in data.mapInArrow(fn, "partition long, outcome string").collect()]
        else:
            rdd = df.rdd if df is not None else dataRDD
            parts = rdd.getNumPartitions()
            data, kind = _raw_source(rdd, num_epochs)
            plan = self._plan("train", qname, kind, parts, feed_timeout, end_of_feed)
            fn = make_feed_fn(plan)
            action = lambda: data.mapPartitionsWithIndex(fn).collect()
        total = parts * num_epochs
        if end_of_feed:
            self._state.close_feed_when_sent(plan.feed_id, total)
        desc = f"tfos train: {parts} partitions x {num_epochs} epoch(s) -> {len(plan.nodes)} node(s)"
        log.info("%s", desc)
        job = self._run_job("train", desc, action)
        outcomes = self._await_job(job, "train()", self._progress("train", total, parts, num_epochs, "tfos train"))
        skipped = [o for o in outcomes if o[1] in ("finished", "skipped")]
        terminated = [o for o in outcomes if o[1] == "terminated"]
        if terminated:
            log.info("train(): %d of %d partitions skipped after DataFeed.terminate()", len(terminated), total)
        if skipped:
            log.warning(
                "train(): %d of %d partitions were not fed because main_fun on their node had already returned "
                "(it stopped reading without DataFeed.terminate())", len(skipped), total,
            )

    def inference(self, dataRDD: Any, feed_timeout: float = 600, qname: str = "input") -> Any:
        """Runs inference over an RDD (or DataFrame) and returns the results (driver).

        The nodes' ``main_fun`` reads batches with ``DataFeed(train_mode=False)`` (batches
        never span partitions) and answers each with ``batch_results``. The job runs
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
            ConfigurationError: Not InputMode.SPARK, or unknown ``qname``.
            ClusterFailedError: A node failed, or returned too few/many results.
        """
        if self.input_mode != InputMode.SPARK:
            raise ConfigurationError("inference() needs InputMode.SPARK")
        self._check_open("inference()")
        df = _as_dataframe(dataRDD)
        rdd = df.rdd if df is not None else dataRDD
        parts = rdd.getNumPartitions()
        src, kind = _raw_source(rdd)
        plan = self._plan("inference", qname, kind, parts, feed_timeout)
        from pyspark import StorageLevel

        from tfos._data.spark_rawio import raw_output_rdd

        out = raw_output_rdd(src, make_infer_fn(plan))
        # The JVM holds each result frame as one byte array either way; "deserialized"
        # storage keeps those arrays as they are, where MEMORY_AND_DISK would copy every
        # frame again into serialized 1 MB buffers (measured: scripts/bench_feed.py).
        out.persist(StorageLevel.MEMORY_AND_DISK_DESER)
        desc = f"tfos inference: {parts} partitions -> {len(plan.nodes)} node(s)"
        # Count the result frames in the JVM: this materializes (and persists) every
        # partition without unpickling the results again in another Python worker.
        job = self._run_job("inference", desc, lambda: out._jrdd.count())
        self._await_job(job, "inference()", self._progress("inference", parts, parts, 1, "tfos inference"))
        return out

    # --------------------------------------------------------------- shutdown
    def shutdown(self, ssc: Any = None, grace_secs: float = 0, timeout: float = 259200) -> None:
        """Ends the feed, waits for the workers' ``main_fun`` to return, stops every node (driver).

        Args:
            ssc: Ignored (TFoS's Spark Streaming context; streaming is not supported).
            grace_secs: Extra seconds to wait after the workers finished before stopping
                ps/evaluator nodes (TFoS compatibility; ignored when there are none).
                Failures are caught whatever its value, because every node reports its
                own failure.
            timeout: Longest wait, in seconds, for the workers' ``main_fun`` to return.

        Raises:
            ClusterFailedError: Any node failed at any time (remote tracebacks included).
            DeadlineExceededError: The workers did not finish within ``timeout``.
        """
        if self._closed:
            self._join_teardown()
            return
        assert self._state is not None
        st = self._state
        try:
            if self.input_mode == InputMode.SPARK:
                st.close_feed()
            workers = [r.executor_id for r in st.roles if r.feedable]
            deadline = Deadline(timeout, "main_fun to return on every chief/master/worker node", "a main_fun that never ends (e.g. waiting for data after terminate())")
            if not st.wait(lambda: all(st.is_done(e) for e in workers), deadline):
                raise self._fail("shutdown()")
            if grace_secs and any(r.is_background for r in st.roles):
                try:
                    st.wait(lambda: False, Deadline(float(grace_secs), "grace period"))
                except DeadlineExceededError:
                    pass
                if st.failed:
                    raise self._fail("shutdown()")
            self._teardown(failed=False)
            if st.failed:
                raise st.error("shutdown()")
        except BaseException:
            if not self._closed:
                self._teardown(failed=True)
            raise
        log.info("tfos cluster %s shut down", self.cluster_id)

    def _teardown(self, failed: bool) -> None:
        """Stops every node, waits (bounded) for their processes, closes the server (driver).

        Synchronous; also joins a teardown already running in the background.
        """
        if self._closed:
            self._join_teardown()
            return
        self._closed = True
        self._teardown_now(failed)

    def _teardown_async(self) -> None:
        """Starts the teardown after a failure in a background thread (driver); its outcome
        is logged, and :meth:`shutdown`, ``__exit__`` and interpreter exit join it."""
        if self._closed:
            return
        self._closed = True
        t = threading.Thread(target=self._teardown_now, args=(True,), name=f"{self.cluster_id}-teardown", daemon=True)
        self._teardown_thread = t
        t.start()

    def _join_teardown(self, timeout_s: float = _STOP_TIMEOUT_S + 15.0) -> None:
        t = self._teardown_thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout_s)
            if t.is_alive():
                log.warning("tfos cluster %s: teardown still running after %g s", self.cluster_id, timeout_s)

    def _teardown_now(self, failed: bool) -> None:
        st = self._state
        assert st is not None
        t0 = time.monotonic()
        if failed:
            st.abort("the cluster failed")
        else:
            st.request_stop()
        alive: list[int] = []
        try:
            alive = st.wait_until_exited(list(st.nodes), _STOP_TIMEOUT_S)
            if alive:
                log.warning("tfos cluster %s: nodes %s did not report their exit in %g s", self.cluster_id, alive, _STOP_TIMEOUT_S)
        finally:
            for job in self._jobs:
                if not job.done.wait(0 if failed else 10.0):
                    job.cancel()
                    job.done.wait(10.0)
            for proc in self._local_nodes:
                try:
                    proc.wait(10.0)
                except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired
                    proc.kill()
                if proc.stdin is not None:
                    proc.stdin.close()
            self._liveness_stop.set()
            if self._server is not None:
                self._server.close()
            _forget(self)
        level = logging.INFO if not alive else logging.WARNING
        log.log(level, "tfos cluster %s torn down in %.1f s%s", self.cluster_id, time.monotonic() - t0,
                f" ({len(alive)} node(s) did not report their exit)" if alive else ": every node process exited")

    def __enter__(self) -> "TFCluster":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.shutdown()
        elif not self._closed:
            try:
                self._teardown(failed=True)
            except Exception as texc:  # noqa: BLE001 - never mask the user's exception
                log.warning("teardown after an error failed: %s", texc)
        else:
            self._join_teardown()


class _Progress:
    """The progress line of one feed/inference job on the driver's stderr (tqdm)."""

    def __init__(self, tracker: Any, state: ClusterState, group: str, total: int, parts: int, epochs: int, desc: str):
        from tqdm import tqdm

        self._tracker, self._state, self._group = tracker, state, group
        self._total, self._parts, self._epochs = total, parts, epochs
        self._bar = tqdm(total=total, desc=desc, unit="part", file=sys.stderr, mininterval=0.5 if sys.stderr.isatty() else 10.0, leave=True)
        self._t0, self._rows0 = time.monotonic(), state.rows_consumed()

    def _done_parts(self) -> int:
        done = 0
        for jid in self._tracker.getJobIdsForGroup(self._group):
            info = self._tracker.getJobInfo(jid)
            for sid in info.stageIds if info else ():
                s = self._tracker.getStageInfo(sid)
                if s:
                    done += s.numCompletedTasks
        return min(done, self._total)

    def _show(self, done: int) -> None:
        rows = self._state.rows_consumed() - self._rows0
        rate = rows / max(1e-6, time.monotonic() - self._t0)
        epoch = min(self._epochs, done // max(1, self._parts) + 1)
        self._bar.set_postfix_str(f"epoch {epoch}/{self._epochs}, {rows:,} rows, {rate:,.0f} rows/s", refresh=False)
        self._bar.update(done - self._bar.n)

    def update(self) -> None:
        """Moves the line to the job's completed tasks and the nodes' row counters."""
        if not self._bar.disable and self._bar.n < self._total:
            self._show(self._done_parts())

    def finish(self, feed_nodes: Sequence[int]) -> None:
        """Closes the line at 100 % with the exact row count: waits (bounded) for one
        counter report from every fed node sent after the job ended."""
        if not self._state.wait_for_counters(feed_nodes, _FINAL_COUNT_S):
            log.debug("not every node sent its final row counter within %g s", _FINAL_COUNT_S)
        self._show(self._total)
        self._bar.close()

    def abandon(self) -> None:
        """Removes the line without a final refresh (after an error: no stale line)."""
        self._bar.leave = False
        self._bar.close()


_open_clusters: "weakref.WeakSet[TFCluster]" = weakref.WeakSet()
_sigterm_lock = threading.Lock()
_sigterm_installed = False


def _on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM handler installed by :func:`_install_sigterm` (driver main thread)."""
    global _sigterm_installed
    ids = [c.cluster_id for c in list(_open_clusters)]
    if not ids:  # every cluster is gone: behave as if tfos had never been here
        with _sigterm_lock:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            _sigterm_installed = False
        os.kill(os.getpid(), signal.SIGTERM)
        return
    log.error("tfos: the driver received SIGTERM; tearing down cluster(s) %s as for Ctrl-C, then exiting", ", ".join(ids) or "(none)")
    with _sigterm_lock:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the driver at once
        _sigterm_installed = False
    raise SystemExit(128 + signal.SIGTERM)


def _install_sigterm(enabled: bool) -> None:
    """Chains the cluster teardown to SIGTERM, only where nobody else handles it (driver).

    Installed only when ``enabled``, in the main thread, and when SIGTERM still has its
    default disposition (the user and their framework did not install a handler), and
    removed again when the last cluster is torn down. The handler raises ``SystemExit``
    in the main thread, which runs the same teardown as Ctrl-C (the ``except`` blocks of
    the blocking call, the context manager, or the atexit hook below).
    """
    global _sigterm_installed
    if not enabled or threading.current_thread() is not threading.main_thread():
        return
    with _sigterm_lock:
        if _sigterm_installed or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return
        signal.signal(signal.SIGTERM, _on_sigterm)
        _sigterm_installed = True


def _forget(cluster: TFCluster) -> None:
    global _sigterm_installed
    _open_clusters.discard(cluster)
    if _open_clusters or threading.current_thread() is not threading.main_thread():
        return
    with _sigterm_lock:
        if _sigterm_installed and signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            _sigterm_installed = False


@atexit.register
def _teardown_at_exit() -> None:
    """Interpreter exit with clusters still open (no shutdown(), no ``with``; e.g. after
    SIGTERM or Ctrl-C outside a tfos call): tear them down, bounded (driver)."""
    for cluster in list(_open_clusters):
        try:
            if cluster._closed:
                cluster._join_teardown()
            else:
                log.warning("tfos cluster %s still running at interpreter exit; tearing it down", cluster.cluster_id)
                cluster._teardown(failed=True)
        except Exception as exc:  # noqa: BLE001 - best effort at exit
            log.warning("teardown of %s at exit failed: %s", cluster.cluster_id, exc)


def _await_registration(cluster: TFCluster, deadline: Deadline) -> None:
    """Waits for every node to register (run()); raises on failure or expiry (driver).

    A question to the cluster state, woken by every registration, failure and by the end of
    the start job. When the start stage still waits after ``_BUSY_WARN_S``, a WARNING names
    the executors and jobs holding the slots (C25); the timeout error names them too.
    """
    state, start = cluster._state, cluster._start_job
    assert state is not None and start is not None
    tf_mode = cluster.input_mode == InputMode.TENSORFLOW
    t0 = time.monotonic()
    warned = False
    busy = ""
    while True:
        # A start job that ended (error, or in TENSORFLOW mode every node already exited)
        # ends the wait too.
        outcome = state.wait_until_registered(deadline, lambda: start.error is not None or (start.done.is_set() and tf_mode), tick_s=1.0)
        if outcome == "registered":
            return
        if outcome == "failed":
            raise cluster._fail("run()")
        if outcome == "stopped":
            # The node's own failure report names the real cause: give it a moment.
            if state.wait_until(lambda: state.failed or state.all_registered(), _ATTRIBUTION_S) and state.all_registered() and not state.failed:
                return
            if state.failed:
                raise cluster._fail("run()")
            what = _spark_error_text(start.error) if start.error is not None else "the start tasks returned early"
            etype = type(start.error).__name__ if start.error is not None else "StartJobEnded"
            cluster._teardown(failed=True)
            raise ClusterFailedError(cluster.cluster_id, [state.make_failure(state.missing()[0] if state.missing() else 0, "spark", etype, what)], "run()") from start.error
        if outcome == "expired":
            missing = state.missing()
            busy = busy_slots_report(cluster.sc, cluster.cluster_id) or busy
            cluster._teardown(failed=True)
            raise deadline.error(ReservationTimeoutError, f"executor ids {missing} never registered" + (f"; {busy}" if busy else ""))
        if not warned and time.monotonic() - t0 >= _BUSY_WARN_S:
            busy = busy_slots_report(cluster.sc, cluster.cluster_id)
            if busy:
                warned = True
                log.warning("tfos cluster %s: the start stage has waited %.0f s for task slots: %s", cluster.cluster_id, time.monotonic() - t0, busy)


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


def _chunk_kind(name: str):
    from tfos._data.framing import ChunkKind

    return ChunkKind(name)


def _raw_source(rdd: Any, epochs: int = 1) -> tuple[Any, Any]:
    """The RDD to feed (``epochs`` passes, unioned) and its chunk kind (driver).

    RDDs stored as PySpark pickled batches are fed as raw frames (the feed task never
    unpickles them); any other RDD is fed row by row, re-pickled in chunks (kind None).
    """
    from tfos._data.framing import ChunkKind
    from tfos._data.spark_rawio import FrameKind, raw_frames, union_raw_frames

    raw = raw_frames(rdd)
    if raw is None or raw.kind != FrameKind.PICKLED_BATCH:
        return (rdd if epochs == 1 else rdd.context.union([rdd] * epochs)), None
    if epochs > 1:
        raw = union_raw_frames([raw] * epochs)
    return raw.rdd, ChunkKind.PICKLED_BATCH


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

    Returns:
        The running :class:`TFCluster`.

    Raises:
        ConfigurationError: Bad arguments or Spark configuration (C01, C05, C13, C14,
            dynamic allocation), before anything is launched.
        ReservationTimeoutError: Not every node registered within ``reservation_timeout``.
        ClusterFailedError: A node failed while the cluster was forming.
    """
    from tfos._connect.client import is_connect_session, run_connect

    if is_connect_session(sc):  # Spark Connect client: see tfos/_connect/client.py and docs/connect.md
        return run_connect(  # type: ignore[return-value]
            sc, map_fun, tf_args, num_executors, num_ps, tensorboard, input_mode, log_dir, driver_ps_nodes, master_node,
            reservation_timeout, queues, eval_node, release_port, heartbeat_timeout=heartbeat_timeout,
            forward_logs=forward_logs, progress=progress, queue_chunks=queue_chunks, executor_wait_s=executor_wait_s,
        )
    if not callable(map_fun):
        raise ConfigurationError("map_fun must be callable as map_fun(args, ctx)")
    input_mode = InputMode(int(input_mode))
    template = build_template(num_executors, num_ps, master_node, eval_node)
    roles = roles_from_template(template)
    spark_ids = [r.executor_id for r in roles if not (driver_ps_nodes and r.job_name == "ps")]
    if isinstance(queues, str) or not all(isinstance(q, str) and q for q in queues):
        raise ConfigurationError(f"queues must be a list of queue names such as ['input', 'output'], got {queues!r}")
    queues = tuple(queues)
    if input_mode == InputMode.SPARK and not queues:
        raise ConfigurationError("InputMode.SPARK needs at least one queue (the default is ['input', 'output', 'error'])")
    check_spark(sc, len(spark_ids), input_mode, wait_s=min(executor_wait_s, reservation_timeout))

    import cloudpickle

    cluster = TFCluster()
    cluster.sc = sc
    cluster.cluster_id = f"tfos-{uuid.uuid4().hex[:12]}"
    cluster.input_mode = input_mode
    cluster.num_executors = num_executors
    cluster.cluster_template = template
    cluster.defaultFS = _default_fs(sc)
    cluster.queues = list(queues)
    cluster.progress = progress
    log.info("tfos cluster %s: %s (input mode %s)", cluster.cluster_id, format_template(template), input_mode.name)

    key = _wire.new_key()
    state = ClusterState(cluster.cluster_id, roles, heartbeat_timeout, on_failure=cluster._on_first_failure)
    cluster._state = state
    driver_host = sc.getConf().get("spark.driver.host", "127.0.0.1")
    server = ControlServer(key, state.handle, host=driver_host)
    cluster._server = server
    config = ClusterConfig(
        cluster_id=cluster.cluster_id, key=key, driver_host=str(server.host), driver_port=server.port,
        input_mode=input_mode, roles=tuple(roles), default_fs=cluster.defaultFS,
        heartbeat_interval_s=min(1.0, heartbeat_timeout / 4), heartbeat_timeout_s=float(heartbeat_timeout),
        reservation_timeout_s=float(reservation_timeout), release_port=release_port, queues=queues,
        queue_chunks=queue_chunks, tensorboard=bool(tensorboard), log_dir=log_dir, forward_logs=forward_logs,
        local_master=str(sc.master).split("[", 1)[0] == "local",
    )
    cluster._config = config
    _open_clusters.add(cluster)
    _install_sigterm(handle_sigterm)
    threading.Thread(target=cluster._liveness_loop, name=f"{cluster.cluster_id}-liveness", daemon=True).start()
    try:
        try:
            payload = cloudpickle.dumps((with_source(map_fun), tf_args))  # file names for tracebacks
        except Exception as exc:  # noqa: BLE001 - pickling errors come in many types
            raise ConfigurationError(f"map_fun and tf_args must be picklable with cloudpickle to reach the nodes: {exc}") from exc
        for r in roles:
            if r.executor_id not in spark_ids:
                cluster._local_nodes.append(launch_local_node(config, r.executor_id, payload, os.getcwd()))
        start_fn = make_start_task(config, spark_ids, payload)
        n = len(spark_ids)
        nodes_rdd = sc.parallelize(range(n), n).barrier().mapPartitionsWithIndex(start_fn)
        cluster.nodeRDD = nodes_rdd
        desc = f"tfos start: {format_template(template)}"
        cluster._start_job = cluster._run_job("start", desc, nodes_rdd.collect)
        deadline = Deadline(
            reservation_timeout, f"all {num_executors} nodes to register",
            "too few free Spark task slots (another job holds executors), executors that cannot reach the "
            "driver's control port, or node processes failing at start-up (see the executor logs)",
        )
        _await_registration(cluster, deadline)
    except BaseException:
        if not cluster._closed:
            cluster._teardown(failed=True)
        raise
    log.info("tfos cluster %s: all %d nodes registered: %s", cluster.cluster_id, num_executors, state.cluster_spec())
    return cluster
