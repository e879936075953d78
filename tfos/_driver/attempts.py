"""One cluster attempt (driver): the launch of every node and the wait for registration,
and the restarts of ``run(..., max_restarts=N)`` that repeat it.

:class:`DriverConfig` is what ``run()`` planned, :class:`Attempt` what one launch started.
:class:`_Launcher` starts attempt ``k`` (new cluster id, key, control server and barrier
stage); :class:`_Recovery` applies the restart policy of :mod:`tfos._driver.restart` to a
failed attempt and starts the next one.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Optional

from tfos._common import wire as _wire
from tfos._common.deadline import Deadline
from tfos._driver.restart import AttemptOutcome, RestartPolicy
from tfos._driver.runtime import ATTRIBUTION_S, ClusterRuntime, JobThread, install_sigterm, spark_error_text
from tfos._driver.spark_checks import busy_slots_report, live_executors
from tfos._node.launch import ClusterConfig
from tfos._node.start_task import launch_local_node, make_start_task
from tfos.cluster_template import InputMode, format_template
from tfos.errors import ClusterFailedError, NodeFailure, ReservationTimeoutError

log = logging.getLogger("tfos.cluster")

#: Seconds run() waits for the start stage before it says which slots are busy (C25).
_BUSY_WARN_S = 8.0


@dataclasses.dataclass(frozen=True)
class DriverConfig:
    """What ``run()`` decided for one cluster, fixed for its life (driver).

    Attributes:
        node: The :class:`ClusterConfig` every node receives (cluster id, key, control
            server address, roles, input mode, queues, ...).
        template: ``{job: [executor ids]}``.
        spark_ids: Executor ids of the nodes hosted by Spark tasks, in start-job
            partition order (the others, ps nodes with ``driver_ps_nodes``, run as
            processes on the driver host).
        progress: Show a progress line during train()/inference().
    """

    node: ClusterConfig
    template: dict[str, list[int]]
    spark_ids: tuple[int, ...]
    progress: bool = True

    @property
    def cluster_id(self) -> str:
        """The cluster id."""
        return self.node.cluster_id


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One launch of the cluster's nodes (driver).

    Attributes:
        nodes_rdd: The barrier RDD of the start tasks, one partition per Spark-hosted node.
        start_job: The Spark job running the start tasks (it ends when the nodes end).
    """

    nodes_rdd: Any
    start_job: JobThread


@dataclasses.dataclass(frozen=True)
class _Launcher:
    """Starts attempt ``k`` of a cluster: control server, node launch, registration (driver).

    Every attempt gets a new cluster id (``<id>-r<k>`` after the first), a new key and a new
    control server, and a new barrier stage on whatever executors Spark offers then.
    """

    sc: Any
    base_id: str
    roles: tuple
    template: dict
    spark_ids: tuple[int, ...]
    input_mode: InputMode
    payload: bytes = dataclasses.field(repr=False)
    heartbeat_timeout_s: float = 15.0
    driver_host: str = "127.0.0.1"
    progress: bool = True
    reservation_timeout_s: float = 600.0
    executor_wait_s: float = 60.0
    node_settings: dict = dataclasses.field(default_factory=dict)
    handle_sigterm: bool = True

    def cluster_id(self, k: int) -> str:
        """The cluster id of attempt ``k``."""
        return self.base_id if k == 0 else f"{self.base_id}-r{k}"

    def start(self, k: int, outer: Optional[Deadline] = None, restarts_left: int = 0) -> tuple[DriverConfig, ClusterRuntime, Attempt]:
        """Launches attempt ``k`` and waits until every node registered, at most the
        reservation timeout (and at most what is left of ``outer``, e.g. shutdown()'s
        ``timeout``, when given). ``restarts_left``: restarts left after this attempt
        (node failures are logged at WARNING while one is left).

        Raises:
            ClusterFailedError: A node failed while the cluster was forming.
            ReservationTimeoutError: Not every node registered within the reservation timeout.
        """
        cluster_id = self.cluster_id(k)
        key = _wire.new_key()
        runtime = ClusterRuntime(self.sc, cluster_id, self.roles, self.heartbeat_timeout_s, key, self.driver_host)
        runtime.state.restarts_left = restarts_left
        if k:
            # The failed attempt's teardown removed tfos's SIGTERM handler when it was the
            # last open cluster: chain it again for the new one (same rules as in run()).
            install_sigterm(self.handle_sigterm)
        try:
            node_config = ClusterConfig(
                cluster_id=cluster_id, key=key, driver_host=str(runtime.server.host), driver_port=runtime.server.port,
                input_mode=self.input_mode, roles=self.roles, **self.node_settings,
            )
            config = DriverConfig(node_config, self.template, self.spark_ids, self.progress)
            deadline = Deadline(
                min(self.reservation_timeout_s, outer.remaining()) if outer is not None else self.reservation_timeout_s,
                f"all {len(self.roles)} nodes to register",
                "too few free Spark task slots (another job holds executors), executors that cannot reach the "
                "driver's control port, or node processes failing at start-up (see the executor logs)",
            )
            attempt = _launch(self.sc, runtime, config, self.payload, k)
            _await_registration(runtime, attempt, self.input_mode, deadline)
        except BaseException:
            if not runtime.closed:
                runtime.teardown(failed=True)
            raise
        log.info("tfos cluster %s: all %d nodes registered: %s", cluster_id, len(self.roles), runtime.state.cluster_spec())
        return config, runtime, attempt

    def await_executors(self, outer: Optional[Deadline] = None) -> None:
        """Before a restart: waits (at most ``executor_wait_s``, and at most what is left of
        ``outer``) until Spark has as many live executors as the cluster has Spark-hosted
        nodes (a lost executor is being replaced)."""
        if str(self.sc.master).startswith("local") and not str(self.sc.master).startswith("local-cluster"):
            return
        wait_s = min(self.executor_wait_s, outer.remaining()) if outer is not None else self.executor_wait_s
        deadline = Deadline(wait_s, f"{len(self.spark_ids)} Spark executors")
        have = live_executors(self.sc)
        while have < len(self.spark_ids) and not deadline.expired():
            time.sleep(deadline.slice(0.5))  # executor registration has no event to wait on from Python
            have = live_executors(self.sc)
        if have < len(self.spark_ids):
            log.warning("restart: %d of %d executors after %g s; launching anyway", have, len(self.spark_ids), self.executor_wait_s)


class _Recovery:
    """The restarts of one ``run(..., max_restarts=N)`` (driver): the policy of
    :mod:`tfos._driver.restart` applied to each failed attempt, and the next attempt's launch."""

    def __init__(self, launcher: _Launcher, max_restarts: int):
        self.launcher = launcher
        self.policy = RestartPolicy(max_restarts)
        #: The running (or last) attempt.
        self.attempt = 0

    def first(self) -> tuple[DriverConfig, ClusterRuntime, Attempt]:
        """Starts attempt 0; a node failure while it forms counts as its failure.

        Raises:
            ReservationTimeoutError: Attempt 0 never formed (no restart: the same slots
                would be missing again).
            RecoveryFailedError: No attempt formed and no restart is left.
        """
        try:
            return self.launcher.start(0, restarts_left=self.policy.max_restarts)
        except ClusterFailedError as err:
            return self.after_failure(err, "run()", False)

    def after_failure(self, err: ClusterFailedError, context: str, progressed: Optional[bool],
                      outer: Optional[Deadline] = None) -> tuple[DriverConfig, ClusterRuntime, Attempt]:
        """Records the running attempt's failure and starts the next attempt that forms.

        Args:
            err: The attempt's error (its root causes and consequences are recorded).
            context: What the driver was doing, e.g. 'train()'.
            progressed: See :class:`tfos._driver.restart.AttemptOutcome`.
            outer: The caller's own deadline (shutdown()'s ``timeout``): waiting for executors
                and for the next attempt's registration never goes past it.

        Returns:
            The new attempt's config, runtime and launch.

        Raises:
            RecoveryFailedError: No further attempt (budget spent, or stopped early).
        """
        while True:
            outcome = AttemptOutcome(self.attempt, tuple(err.failures) + tuple(err.consequences), context, progressed, err.cluster_id)
            decision = self.policy.record(outcome)
            if not decision.restart:
                log.error("tfos cluster %s: attempt %d failed during %s: %s; no restart: %s",
                          err.cluster_id, self.attempt, context, outcome.summary(), decision.reason)
                raise self.policy.error(decision.reason) from err
            log.warning("tfos cluster %s: attempt %d failed during %s: %s; starting attempt %d (%s)",
                        err.cluster_id, self.attempt, context, outcome.summary(), decision.next_attempt, decision.reason)
            for f in err.failures:  # a recovered failure is raised nowhere: its traceback goes here
                if f.traceback:
                    log.warning("tfos cluster %s: attempt %d, remote traceback of %s:\n%s",
                                err.cluster_id, self.attempt, f.node_name, f.traceback.rstrip())
            self.attempt = decision.next_attempt
            self.launcher.await_executors(outer)
            t0 = time.monotonic()
            try:
                started = self.launcher.start(self.attempt, outer, self.policy.max_restarts - self.attempt)
                log.warning("tfos cluster %s: attempt %d running (%.1f s to launch and register)",
                            started[0].cluster_id, self.attempt, time.monotonic() - t0)
                return started
            except ClusterFailedError as exc:
                err, context, progressed = exc, "run()", False
            except ReservationTimeoutError as exc:
                r = self.launcher.roles[0]
                failure = NodeFailure(r.executor_id, r.job_name, r.task_index, "", "spark", "ReservationTimeoutError", str(exc).splitlines()[0])
                err, context, progressed = ClusterFailedError(self.launcher.cluster_id(self.attempt), [failure], "run()"), "run()", False


def _launch(sc: Any, runtime: ClusterRuntime, config: DriverConfig, payload: bytes, attempt: int = 0) -> Attempt:
    """Launches every node once: the driver-hosted ones as local processes, the others as
    the barrier start job (driver). Returns at once; see :func:`_await_registration`.
    ``attempt`` reaches every node's ``main_fun`` as ``ctx.attempt``."""
    for r in config.node.roles:
        if r.executor_id not in config.spark_ids:
            runtime.local_nodes.append(launch_local_node(config.node, r.executor_id, payload, os.getcwd(), attempt))
    start_fn = make_start_task(config.node, list(config.spark_ids), payload, attempt)
    n = len(config.spark_ids)
    nodes_rdd = sc.parallelize(range(n), n).barrier().mapPartitionsWithIndex(start_fn)
    start_job = runtime.run_job("start", f"tfos start: {format_template(config.template)}", nodes_rdd.collect)
    return Attempt(nodes_rdd, start_job)


def _await_registration(runtime: ClusterRuntime, attempt: Attempt, input_mode: InputMode, deadline: Deadline) -> None:
    """Waits for every node of ``attempt`` to register; raises on failure or expiry (driver).

    A question to the cluster state, woken by every registration, failure and by the end of
    the start job. When the start stage still waits after ``_BUSY_WARN_S``, a WARNING names
    the executors and jobs holding the slots (C25); the timeout error names them too.

    Raises:
        ClusterFailedError: A node failed, or the start job ended first.
        ReservationTimeoutError: ``deadline`` expired first.
    """
    state, start, cluster_id = runtime.state, attempt.start_job, runtime.cluster_id
    tf_mode = input_mode == InputMode.TENSORFLOW
    t0 = time.monotonic()
    warned = False
    busy = ""
    while True:
        # A start job that ended (error, or in TENSORFLOW mode every node already exited)
        # ends the wait too. The 1 s tick only times the busy-slots warning below.
        outcome = state.wait_until_registered(deadline, lambda: start.error is not None or (start.done.is_set() and tf_mode), tick_s=1.0)
        if outcome == "registered":
            return
        if outcome == "failed":
            raise runtime.fail("run()")
        if outcome == "stopped":
            # The node's own failure report names the real cause: give it a moment.
            if state.wait_until(lambda: state.failed or state.all_registered(), ATTRIBUTION_S) and state.all_registered() and not state.failed:
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
            raise ClusterFailedError(cluster_id, [state.make_failure(state.missing()[0] if state.missing() else 0, kind, etype, what)], "run()") from start.error
        if outcome == "expired":
            missing = state.missing()
            busy = busy_slots_report(runtime.sc, cluster_id) or busy
            runtime.teardown(failed=True)
            raise deadline.error(ReservationTimeoutError, f"executor ids {missing} never registered" + (f"; {busy}" if busy else ""))
        if not warned and time.monotonic() - t0 >= _BUSY_WARN_S:
            busy = busy_slots_report(runtime.sc, cluster_id)
            if busy:
                warned = True
                log.warning("tfos cluster %s: the start stage has waited %.0f s for task slots: %s", cluster_id, time.monotonic() - t0, busy)
