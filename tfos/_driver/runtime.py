"""The live parts of one driver-side cluster: jobs, failure handling, teardown (driver only).

:class:`ClusterRuntime` owns what exists while a cluster runs: its
:class:`~tfos._control.host.ClusterHost` (the control-plane core, its server, liveness and waits), the Spark jobs it started (each in a :class:`JobThread` under a job
group of this cluster), the node processes on the driver host and the liveness thread.
It turns a failure into a :class:`ClusterFailedError` that names the node and tears the
cluster down. :class:`tfos._driver.classic.ClassicBackend` drives it (one per attempt);
SIGTERM and interpreter exit reach it through the cluster's controller
(:mod:`tfos._driver.lifecycle`).

Every wait here is a question to the host with a deadline, woken by its condition
variable (every report, and the end of each Spark job, notifies it).
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import time
from typing import Any, Callable, Optional, Sequence

from tfos._control.host import ATTRIBUTION_S, STOP_TIMEOUT_S, ClusterHost
from tfos._driver import spark_bar as _spark_bar
from tfos._driver.console import BarConsole
from tfos._driver.monitor import StatusMonitor
from tfos._driver.open_clusters import OPEN, any_open
from tfos._driver.payload import AccumulatorInbox
from tfos._driver.row_accounting import RowAccounting
from tfos._node import output as _node_output
from tfos.cluster_template import NodeRole
from tfos.errors import ClusterFailedError, NodeFailure, TFOSError, is_root_cause

__all__ = ["ClusterRuntime", "JobThread", "Progress", "spark_error_text"]

log = logging.getLogger(__name__)

#: Seconds after the last train() job for every fed node to send its final row counter.
FINAL_COUNT_S = 3.0


class JobThread:
    """Runs one Spark action in a thread under a job group (driver).

    Attributes:
        result: The action's return value once it succeeded.
        error: The exception it raised, or None.
        done: Set when the action ended (either way).
    """

    def __init__(self, sc: Any, group: str, description: str, action: Callable[[], Any], on_done: Callable[[], None] = lambda: None):
        from pyspark import InheritableThread, SparkContext

        self.sc, self.group = sc, group
        self.result: Any = None
        self.error: Optional[BaseException] = None
        self.done = threading.Event()
        self.cancelled = False

        def _run() -> None:
            try:
                sc.setJobGroup(group, description, interruptOnCancel=True)
                if self.cancelled:  # cancelled before it was submitted (Ctrl-C in run())
                    raise TFOSError(f"job group {group} was cancelled before it started")
                self.result = action()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting driver thread
                self.error = exc
            finally:
                self.done.set()
                on_done()  # wakes the driver thread waiting on the cluster state

        # InheritableThread copies the SparkContext's local properties (job group, pool) into
        # the thread; it asserts an active SparkContext in pinned-thread mode, so anything
        # else (the scale simulator's stand-in context) gets a plain thread.
        real = isinstance(sc, SparkContext) and SparkContext._active_spark_context is sc
        thread_class = InheritableThread if real else threading.Thread
        self.thread = thread_class(target=_run, name=f"tfos-job-{group}", daemon=True)
        self.thread.start()

    def cancel(self) -> None:
        """Cancels this job group only (never other jobs of the application)."""
        if self.done.is_set() or self.cancelled:
            return  # nothing left to cancel: Spark would WARN 'Failed to cancel job group'
        self.cancelled = True
        had = self._job_ids()
        self._cancel_group()
        if had is None or had:
            return  # Spark had the job, so the cancellation reached it (or Spark is stopping)
        # The job thread had not submitted its job yet (a Ctrl-C right after run()
        # started it): a cancellation of a group with no job does nothing, and the job
        # would then start node processes nobody waits for. Cancel again once Spark has
        # the job (bounded; the thread itself skips an action not yet started). Only a
        # job still running is cancelled again: cancelling a group whose job already
        # ended makes Spark WARN 'Failed to cancel job group'.
        threading.Thread(target=self._recancel, name=f"tfos-cancel-{self.group}", daemon=True).start()

    def _job_ids(self) -> Optional[list]:
        """Spark's job ids of this group so far; None when Spark cannot be asked."""
        try:
            return list(self.sc.statusTracker().getJobIdsForGroup(self.group))
        except Exception:  # noqa: BLE001 - the context is stopping
            return None

    def _cancel_group(self) -> None:
        try:
            self.sc.cancelJobGroup(self.group)
        except Exception as exc:  # noqa: BLE001 - the context may already be stopping
            log.debug("cancelJobGroup(%s) failed: %s", self.group, exc)

    def _recancel(self, within_s: float = 10.0) -> None:
        deadline = time.monotonic() + within_s
        while not self.done.wait(0.2) and time.monotonic() < deadline:
            ids = self._job_ids()
            if ids is None:
                return
            if ids:
                try:
                    infos = [self.sc.statusTracker().getJobInfo(j) for j in ids]
                except Exception:  # noqa: BLE001 - the context is stopping
                    return
                if any(i is not None and i.status == "RUNNING" for i in infos):
                    self._cancel_group()
                return


def spark_error_text(exc: BaseException) -> str:
    """The line of a Spark job's error that says what failed (tfos's own error when the
    task raised one), at most 500 characters (pure)."""
    text = str(exc)
    for marker in ("FeedError: ", "FeedTimeoutError: ", "TFOSError: "):
        if marker in text:
            line = text.split(marker, 1)[1].splitlines()[0]
            return marker + line
    lines = text.splitlines()
    if lines and lines[0].startswith("An error occurred while calling"):
        # Py4JJavaError: the first line names only the py4j call; Spark's reason follows.
        for marker in ("ExecutorLostFailure", "Job aborted due to stage failure", "SparkException: "):
            for line in lines[1:]:
                if marker in line:
                    return line.strip()[:500]
        # Otherwise the Java exception's own line (": java.lang.OutOfMemoryError: ...").
        cause = next((c for c in (ln.strip().lstrip(": ").strip() for ln in lines[1:]) if c), "")
        if cause:
            return f"{lines[0].strip()} {cause}"[:500]
    return lines[0][:500] if text else type(exc).__name__


#: Python errors of tfos's own refusals and of the teardown: consequences, never the
#: cause a failed task reports (see :func:`failed_task_errors`).
_TFOS_TASK_ERRORS = ("FeedError", "FeedTimeoutError", "TFOSError", "DataAuthError", "TaskKilled", "FeedAbortedError")


def python_error_of(text: str) -> Optional[tuple[str, str, str]]:
    """(error type, message, traceback) of the Python exception in a Spark task's error
    text (``PythonException: ... Traceback ...``), or None when it holds none (pure)."""
    at = text.find("Traceback (most recent call last):")
    if at < 0:
        return None
    lines = text[at:].split("\n\tat ", 1)[0].rstrip().splitlines()
    # The exception line: the last unindented "Type: message" line (Spark appends its own
    # lines, e.g. " SQLSTATE: 38000", indented).
    last = next((i for i in range(len(lines) - 1, 0, -1) if re.match(r"[A-Za-z_][\w.]*: ", lines[i])), None)
    if last is None:
        return None
    etype, _, message = lines[last].partition(": ")
    return etype.rsplit(".", 1)[-1], message.strip(), "\n".join(lines[:last + 1])


def failed_task_errors(sc: Any, groups: Sequence[str], limit: int = 5) -> list[tuple[int, int, str, tuple[str, str, str]]]:
    """The Python errors of failed tasks of the Spark jobs of ``groups``, first attempts
    first (driver; reads Spark's status store through py4j, best effort: [] when it
    cannot).

    A feed task that fails in the RDD's or DataFrame's own code (a ``map`` raising on a
    corrupt record) is retried by Spark, and tfos refuses the retry (it would feed rows
    twice): the refusal is what reaches tfos, the cause only Spark's task list.

    Returns:
        Up to ``limit`` tuples (partition index, task attempt, Spark executor id,
        (error type, message, traceback)), without tfos's own errors.
    """
    out: list = []
    try:
        tracker = sc.statusTracker()
        store = sc._jsc.sc().statusStore()
        for group in groups:
            for job_id in tracker.getJobIdsForGroup(group):
                info = tracker.getJobInfo(job_id)
                for stage_id in (info.stageIds if info is not None else ()):
                    stage = tracker.getStageInfo(stage_id)
                    for attempt_id in range((stage.currentAttemptId if stage is not None else 0) + 1):
                        tasks = store.taskList(stage_id, attempt_id, 10000)
                        for i in range(tasks.size()):
                            t = tasks.apply(i)
                            if t.status() != "FAILED" or not t.errorMessage().isDefined():
                                continue
                            err = python_error_of(str(t.errorMessage().get()))
                            if err is not None and err[0] not in _TFOS_TASK_ERRORS:
                                out.append((int(t.index()), int(t.attempt()), str(t.executorId()), err))
    except Exception as exc:  # noqa: BLE001 - a diagnosis only (Spark Connect, a stopped context)
        log.debug("could not read the failed tasks of %s: %s", list(groups), exc)
    out.sort(key=lambda x: (x[1], x[0]))
    first: dict = {}
    for item in out:  # the first failed attempt of each partition
        first.setdefault(item[0], item)
    return list(first.values())[:limit]


class ClusterRuntime:
    """The live parts of one cluster attempt on the driver; created by
    :class:`tfos._driver.classic.ClassicLauncher`.

    Creating it creates the cluster state, starts the control server (bound to
    ``driver_host``, on a free port) and the liveness thread.

    Args:
        sc: The SparkContext.
        cluster_id: The cluster id (also the prefix of its Spark job groups).
        roles: One role per executor id.
        heartbeat_timeout_s: Seconds of silence after which a node is declared lost.
        key: The cluster's 32-byte HMAC key.
        driver_host: Address the control server binds to.
    """

    def __init__(self, sc: Any, cluster_id: str, roles: Sequence[NodeRole], heartbeat_timeout_s: float, key: bytes, driver_host: str):
        self.sc = sc
        self.cluster_id = cluster_id
        #: main_fun's accumulator updates, applied when the attempt shuts down cleanly.
        self.accumulators = AccumulatorInbox()
        self.host = ClusterHost(cluster_id, roles, heartbeat_timeout_s, on_failure=self._on_first_failure,
                                on_lines=_node_output.emit, on_accumulators=self._receive_accumulators, logger=log)
        #: Rows fed vs trained per node and epoch, judged as figures arrive (docs/datafeed.md).
        self.rows = RowAccounting(self.host.core)
        #: Every Spark job this cluster started, in order.
        self.jobs: list[JobThread] = []
        #: Node processes on the driver host (``driver_ps_nodes=True``).
        self.local_nodes: list = []
        self._job_seq = 0
        self._closed = False
        self._teardown_thread: Optional[threading.Thread] = None
        self._torn_down = threading.Event()
        #: The attempt's status monitor (docs/status.md), once :meth:`start_monitor` ran.
        self.monitor: Optional[StatusMonitor] = None
        install_py4j_redaction()
        self.server = self.host.serve(key, driver_host)
        OPEN.note_context(sc)  # stopped at interpreter exit on local-cluster (tfos._driver.open_clusters)
        _spark_bar.pause(sc)  # Spark's console bar is off while this cluster lives (tfos._driver.spark_bar)
        _node_output.note_spark_bar(_spark_bar.showing(sc))

    def start_monitor(self, stall_timeout_s: float, stall_action: str, scalars: Any = None) -> StatusMonitor:
        """Starts the attempt's status monitor (live figures, verdict, stall watch)."""
        monitor = StatusMonitor(self.host, stall_timeout_s, stall_action, scalars)
        monitor.feeding = lambda: any(not j.done.is_set() and ("-train-" in j.group or "-inference-" in j.group) for j in self.jobs)
        self.monitor = monitor.start()
        return monitor

    @property
    def closed(self) -> bool:
        """True once the teardown started (shut down, failed, or interrupted)."""
        return self._closed

    @property
    def torn_down(self) -> bool:
        """True once the teardown ended (every node exited, or its wait ran out)."""
        return self._torn_down.is_set()

    # ------------------------------------------------------------------ jobs
    def run_job(self, kind: str, description: str, action: Callable[[], Any]) -> JobThread:
        """Starts ``action`` as a Spark job under the job group ``<cluster id>-<kind>-<n>``."""
        self._job_seq += 1
        job = JobThread(self.sc, self.job_group(kind), description, action, self.host.poke)
        self.jobs.append(job)
        return job

    def stages_active(self) -> bool:
        """True while a stage of one of this cluster's Spark jobs is active: the tasks of a
        cancelled job still run (driver; False when Spark cannot be asked)."""
        try:
            tracker = self.sc.statusTracker()
            active = set(tracker.getActiveStageIds())
            if not active:
                return False
            for job in self.jobs:
                for jid in tracker.getJobIdsForGroup(job.group):
                    info = tracker.getJobInfo(jid)
                    if info is not None and active.intersection(info.stageIds):
                        return True
        except Exception:  # noqa: BLE001 - a stopped context: nothing runs
            return False
        return False

    def job_group(self, kind: str) -> str:
        """The job group of the last job of ``kind`` started (or about to be)."""
        return f"{self.cluster_id}-{kind}-{self._job_seq}"

    def cancel_jobs(self) -> None:
        """Cancels every job of this cluster that still runs."""
        for job in list(self.jobs):
            if not job.done.is_set():
                job.cancel()

    def await_job(self, job: JobThread, context: str, progress: Optional["Progress"] = None, feed_ids: Callable[[], Sequence[int]] = list) -> Any:
        """Waits for a feed/inference job, failing fast on any node failure (driver).

        The wait is a question to the cluster state (woken by every report and by the job's
        end), with a tick of 0.5 s to move the progress line.

        Returns:
            The job's result.

        Raises:
            ClusterFailedError: A node failed, or the job failed (then names the Spark error).
        """
        host, core = self.host, self.host.core
        ok = False
        try:
            # Until the job ends or a node fails (the wait answers whether the job ended: it
            # must not be asked again once a failure is recorded, which it would answer at
            # once, spinning until the job's cancellation ended it).
            while not host.wait_for_event_or_failure(job.done, 0.5 if progress else 5.0) and not core.failed:
                if progress:
                    progress.update()
                    self.rows.check()
            if core.failed:
                raise self.fail(context)
            if job.error is not None:
                # The node's own failure report carries the real cause: give it a moment.
                if host.wait_for_failure(ATTRIBUTION_S):
                    raise self.fail(context)
                # The RDD's or DataFrame's own code raised, and no retry of the task was
                # refused (which would have reported it): local[N] runs a task once.
                self._record_task_errors()
                if core.has_root_cause():
                    raise self.fail(context)
                text = spark_error_text(job.error)
                host.abort("a Spark job of the cluster failed")
                self.teardown_async()
                text += (f" (the Spark job of {context} failed and no node reported a cause: it may lie on the driver "
                         f"or in Spark itself; listed under the first node, {core.roles[0].job_name}:{core.roles[0].task_index})")
                raise ClusterFailedError(self.cluster_id, [core.make_failure(core.roles[0].executor_id, "spark", type(job.error).__name__, text)], context) from job.error
            ok = True
            if progress:
                progress.finish(feed_ids())
                self.rows.check()
            return job.result
        except BaseException as exc:
            if not isinstance(exc, TFOSError) and not self._closed:
                # Ctrl-C (or SIGTERM, see open_clusters.install_sigterm) while a job runs: tear the
                # cluster down before the interruption propagates.
                log.warning("tfos cluster %s: %s during %s; tearing the cluster down", self.cluster_id, type(exc).__name__, context)
                self.teardown(failed=True, reason=f"{type(exc).__name__} on the driver during {context}")
            raise
        finally:
            if progress and not ok:
                progress.abandon()

    # -------------------------------------------------------------- failures
    def fail(self, context: str) -> ClusterFailedError:
        """The error to raise for a failed cluster; starts the teardown (driver).

        Report first, tear down second: every node is told to abort at once, the error is
        built as soon as the failed nodes have reported their root causes (bounded by
        ``ATTRIBUTION_S``) and ``SETTLE_S`` has passed since the first failure (other nodes
        failing at about the same moment go into it too), and the rest of the teardown
        (waiting for the healthy nodes' processes, bounded) goes on in a background thread
        that logs its outcome.
        """
        self.cancel_jobs()
        err = self.host.settle_failure(context, self._record_task_errors)
        err.flood = self.host.flood_report()
        self.teardown_async()
        return err

    def _record_task_errors(self) -> None:
        """Only consequences were reported (e.g. a refused retry of a feed task): records
        the Python errors Spark's failed tasks of this cluster's jobs died with, which say
        why (the RDD's own code raised), each charged to the node its partition went to."""
        errors: list = []
        deadline = time.monotonic() + 1.0  # the status store lags the task events a little
        while not errors and time.monotonic() < deadline:
            errors = failed_task_errors(self.sc, [job.group for job in self.jobs if job.group.split("-")[-2] in ("train", "inference")])
            if not errors:
                time.sleep(0.1)
        core = self.host.core
        for index, attempt, spark_eid, (etype, message, tb) in errors:
            target = next((f.executor_id for f in list(core.failures) if f.message.startswith(f"partition {index} ")),
                          core.roles[0].executor_id)
            self.host.record_failure(core.make_failure(
                target, "spark", etype,
                f"{message} (raised by the RDD's or DataFrame's own code in the Spark task of partition {index}, "
                f"attempt {attempt + 1}, on Spark executor {spark_eid}; not by main_fun)", tb,
            ))

    def check_open(self, what: str) -> None:
        """Raises when the cluster was shut down or has failed.

        Raises:
            TFOSError: After shutdown.
            ClusterFailedError: When a node failed.
        """
        if self._closed:
            raise TFOSError(f"{what}: the cluster {self.cluster_id} was already shut down")
        if self.host.core.failed:
            raise self.fail(what)

    def _on_first_failure(self, failure: NodeFailure) -> None:
        # Runs on a control-server thread. The cluster cannot recover. For a root cause,
        # direct every node to abort now (before the cancellation below kills their Spark
        # tasks, so those kills are recognised as consequences). A consequence first (a
        # feed task saw a node fail or stop reading) leaves the nodes running for the
        # attribution wait in fail(), so that the node can still report what happened to
        # it (e.g. main_fun raising 1.5 s into a feed_timeout of 1 s). Then cancel only
        # this cluster's job groups.
        if is_root_cause(failure):
            self.host.abort(f"node {failure.node_name} failed")
        self.cancel_jobs()

    def _receive_accumulators(self, u: Any) -> None:
        self.accumulators.receive(u.executor_id, u.node_name, u.updates)

    # -------------------------------------------------------------- teardown
    def teardown(self, failed: bool, reason: str = "") -> None:
        """Stops every node, waits (bounded) for their processes, closes the server (driver).

        Synchronous; also joins a teardown already running in the background.

        Args:
            failed: Abort the nodes (their feeds are cut off) instead of stopping them.
            reason: Why, for the nodes' FeedAbortedError ("the cluster failed" when empty).
        """
        if self._closed:
            self.join_teardown()
            return
        self._closed = True
        self._teardown_now(failed, reason)

    def teardown_async(self) -> None:
        """Starts the teardown after a failure in a background thread (driver); its outcome
        is logged, and ``shutdown()``, ``__exit__`` and interpreter exit join it."""
        if self._closed:
            return
        self._closed = True
        t = threading.Thread(target=self._teardown_now, args=(True,), name=f"{self.cluster_id}-teardown", daemon=True)
        self._teardown_thread = t
        t.start()

    def join_teardown(self, timeout_s: float = STOP_TIMEOUT_S + 15.0) -> None:
        """Waits up to ``timeout_s`` for a background teardown (none: returns at once)."""
        t = self._teardown_thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout_s)
            if t.is_alive():
                log.warning("tfos cluster %s: teardown still running after %g s", self.cluster_id, timeout_s)

    def _teardown_now(self, failed: bool, reason: str = "") -> None:
        t0 = time.monotonic()
        alive: list[int] = []
        try:
            alive = self.host.stop_nodes(failed, reason)
        finally:
            for job in self.jobs:
                if not job.done.wait(0 if failed else 10.0):
                    job.cancel()
                    job.done.wait(10.0)
            for proc in self.local_nodes:
                try:
                    proc.wait(10.0)
                except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired
                    proc.kill()
                if proc.stdin is not None:
                    proc.stdin.close()
            if self.monitor is not None:
                self.monitor.stop()  # a last read of the figures, for the summary
            self.host.close()
            _spark_bar.resume(self.sc, self.stages_active)
            self._torn_down.set()
        # main_fun's accumulator updates count once, for an attempt that ended well (a
        # failed one's nodes run again after a restart): tfos._driver.payload.
        if failed or self.host.core.failed:
            self.accumulators.drop(self.cluster_id, "the cluster attempt failed" + (f" ({reason})" if reason else ""))
        else:
            self.accumulators.apply(self.cluster_id)
        level = logging.INFO if not alive else logging.WARNING
        log.log(level, "tfos cluster %s torn down in %.1f s%s", self.cluster_id, time.monotonic() - t0,
                f" ({len(alive)} node(s) did not report their exit)" if alive else ": every node process exited")


class Progress:
    """The progress line of one feed/inference job on the driver's stderr (tqdm).

    Log records and the bar never share a line (:class:`tfos._driver.console.BarConsole`):
    on a terminal the program's console handlers clear and redraw the bar around each
    record while it is shown; elsewhere the bar is written as whole lines, one per 10 s.
    """

    def __init__(self, tracker: Any, state: ClusterHost, group: str, total: int, parts: int, epochs: int, desc: str,
                 verdict: Callable[[], str] = str):
        from tqdm import tqdm

        self._verdict = verdict  # the status monitor's bottleneck, a few characters (docs/status.md)
        self._tracker, self._state, self._group = tracker, state, group
        self._total, self._parts, self._epochs = total, parts, epochs
        self._console = BarConsole(sys.stderr, interval_s=10.0)
        self._bar = tqdm(total=total, desc=desc, unit="part", file=self._console.bar_file,
                         mininterval=0.5 if self._console.terminal else 10.0, leave=True, postfix=f"epoch 1/{epochs}, starting")
        self._console.start()
        self._t0, self._rows0 = time.monotonic(), state.core.rows_consumed()

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
        rows = self._state.core.rows_consumed() - self._rows0
        rate = rows / max(1e-6, time.monotonic() - self._t0)
        epoch = min(self._epochs, done // max(1, self._parts) + 1)
        mark = self._verdict()
        figures = f"{rows:,} rows, {rate:,.0f} rows/s" if rows else "starting"  # no rate before the first rows
        self._bar.set_postfix_str(f"epoch {epoch}/{self._epochs}, {figures}{', ' + mark if mark and rows else ''}", refresh=False)
        self._bar.update(done - self._bar.n)

    def update(self) -> None:
        """Moves the line to the job's completed tasks and the nodes' row counters."""
        if not self._bar.disable and self._bar.n < self._total:
            self._show(self._done_parts())

    def finish(self, feed_nodes: Sequence[int]) -> None:
        """Closes the line at 100 % with the exact row count: waits (bounded) for one
        counter report from every fed node sent after the job ended."""
        if not self._state.wait_for_counters(feed_nodes, FINAL_COUNT_S):
            log.debug("not every node sent its final row counter within %g s", FINAL_COUNT_S)
        self._show(self._total)
        self._bar.close()
        self._console.stop()

    def abandon(self) -> None:
        """Removes the line without a final refresh (after an error: no stale line)."""
        self._bar.leave = False
        self._bar.close()
        self._console.stop()


# ------------------------------------------------------- the key and py4j's DEBUG log
#: Loggers py4j writes every command it sends to the JVM to, at DEBUG.
PY4J_COMMAND_LOGGERS = ("py4j.clientserver", "py4j.java_gateway")


class Py4jCommandRedactor(logging.Filter):
    """Elides the text of py4j's "Command to send" DEBUG records while a tfos cluster is open.

    py4j logs every command the driver sends to the JVM, and a command that submits a Spark
    job carries the job's pickled task closure in base64, where tfos's start and feed tasks
    hold the cluster key: with DEBUG logging on, the key would reach the driver's log. The
    record stays (with the command's length), only its text goes; records of other kinds,
    and every record while no cluster is open, pass unchanged (driver).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.DEBUG or not any_open():
            return True
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - a record logging cannot format is not ours to fix
            return True
        if text.startswith("Command to send"):
            record.msg = (f"Command to send: [{len(text) - 17} characters elided by tfos while a cluster is open: "
                          "py4j commands carry Spark task closures, which hold the cluster key]")
            record.args = ()
        return True


_py4j_redactor = Py4jCommandRedactor()


def install_py4j_redaction() -> None:
    """Adds :class:`Py4jCommandRedactor` to py4j's command loggers, once (driver)."""
    for name in PY4J_COMMAND_LOGGERS:
        logger = logging.getLogger(name)
        if _py4j_redactor not in logger.filters:
            logger.addFilter(_py4j_redactor)
