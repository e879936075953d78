"""The lifecycle of a tfos cluster: its named states (forming, running, shutting down,
restarting, closed, failed) and the controller that moves it between them (driver). The
state diagram and its rules: docs/architecture.md "Driver plane".

:class:`Controller` is the one place where the state changes. It holds the running
attempt's :class:`~tfos._driver.backend.Backend` and owns what spans attempts: the restart
policy (:class:`~tfos._driver.restart.RestartPolicy`), where a restarted feed resumes
(:class:`~tfos._driver.restart.FeedResume`), the inference results an attempt kept
(:class:`~tfos._driver.restart.InferenceLedger`), SIGTERM and interpreter exit
(:mod:`tfos._driver.open_clusters`). Every transition is logged once on this module's
logger (a child of ``TFCluster.logger``), with the state in ``record.tfos_state``. See
docs/reliability.md "Recovery".
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import time
from typing import Any, Callable, Iterator, Optional, TypeVar

from tfos._common.deadline import Deadline
from tfos._control.messages import NodeState
from tfos._data.framing import FeedState
from tfos._driver.backend import AttemptReport, Backend, InferenceCall, Launcher, TrainCall
from tfos._driver.open_clusters import OPEN, install_sigterm
from tfos._driver.restart import AttemptOutcome, FeedResume, InferenceLedger, RestartPolicy
from tfos.cluster_template import InputMode, build_cluster_spec, format_template
from tfos.errors import ClusterFailedError, ConfigurationError, NodeFailure, ReservationTimeoutError, TFOSError

__all__ = ["Lifecycle", "TRANSITIONS", "Controller"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class Lifecycle(enum.Enum):
    """The states of a cluster (see the module docstring for the picture)."""

    FORMING = "forming"
    RUNNING = "running"
    RESTARTING = "restarting"
    SHUTTING_DOWN = "shutting down"
    CLOSED = "closed"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        """True for closed and failed: the nodes are stopped (or being torn down) for good."""
        return self in (Lifecycle.CLOSED, Lifecycle.FAILED)


_L = Lifecycle
#: Every transition the controller makes: state -> the states it may go to next.
TRANSITIONS: dict[Lifecycle, frozenset[Lifecycle]] = {
    _L.FORMING: frozenset({_L.RUNNING, _L.RESTARTING, _L.FAILED, _L.CLOSED}),
    _L.RUNNING: frozenset({_L.RESTARTING, _L.SHUTTING_DOWN, _L.FAILED, _L.CLOSED}),
    _L.RESTARTING: frozenset({_L.RUNNING, _L.RESTARTING, _L.FAILED, _L.CLOSED}),  # restarting again: the next attempt failed to form
    _L.SHUTTING_DOWN: frozenset({_L.CLOSED, _L.RESTARTING, _L.FAILED}),
    _L.CLOSED: frozenset(),
    _L.FAILED: frozenset(),
}


class Controller:
    """Drives one cluster through its lifecycle (driver).

    Args:
        launcher: Starts attempts on one kind of Spark (see :mod:`tfos._driver.backend`).
        max_restarts: Restarts allowed after a node failure (``run(..., max_restarts)``).
        handle_sigterm: Chain the teardown to SIGTERM (see :func:`install_sigterm`).

    Attributes:
        state: The :class:`Lifecycle` state.
        transitions: Every transition made, ``(from, to)``, in order.
        attempt: The running (or last) attempt: 0, or ``k`` after the ``k``-th restart.
        policy: The :class:`RestartPolicy`.
    """

    def __init__(self, launcher: Launcher, max_restarts: int = 0, handle_sigterm: bool = True):
        self.launcher = launcher
        self.plan = launcher.plan
        self.policy = RestartPolicy(max_restarts)
        self.handle_sigterm = handle_sigterm
        self.state = Lifecycle.FORMING
        self.transitions: list[tuple[Lifecycle, Lifecycle]] = []
        self.attempt = 0
        self._backend: Optional[Backend] = None
        self._lock = threading.RLock()
        #: The last train() call and its resume ledger (with restarts): a failure noticed
        #: by shutdown() feeds its epochs after the nodes' checkpoint again.
        self._last_train: Optional[tuple[TrainCall, FeedResume]] = None
        #: train()/inference() calls running (in any thread): shutdown() waits for them.
        self.feeds = RunningFeeds()

    # ------------------------------------------------------------- the state
    @property
    def backend(self) -> Backend:
        """The running (or last) attempt."""
        if self._backend is None:
            raise TFOSError(f"tfos cluster {self.plan.base_id} has not formed")
        return self._backend

    @property
    def cluster_id(self) -> str:
        """The running attempt's cluster id."""
        return self.plan.cluster_id(self.attempt)

    def _enter(self, new: Lifecycle, level: int, msg: str, *args: Any) -> None:
        """Moves to ``new`` and logs the transition (one record, ``record.tfos_state``)."""
        with self._lock:
            old = self.state
            if new not in TRANSITIONS[old]:
                raise TFOSError(f"tfos cluster {self.cluster_id}: no transition from {old.value} to {new.value}")
            self.state = new
            self.transitions.append((old, new))
        log.log(level, msg, *args, extra={"tfos_state": new.value})
        if new.terminal:
            self._forget_when_torn_down()

    def _forget_when_torn_down(self) -> None:
        """A closed or failed cluster leaves the open ones once its teardown ended (a
        background teardown still holds the SIGTERM handler and is joined at exit)."""
        backend = self._backend
        if backend is None or backend.torn_down:
            OPEN.discard(self)
            return

        def wait() -> None:
            backend.join_teardown()
            OPEN.discard(self)

        threading.Thread(target=wait, name=f"{self.cluster_id}-forget", daemon=True).start()

    def check_usable(self, what: str) -> None:
        """Raises TFOSError once the cluster is closed or failed."""
        if self.state.terminal:
            raise TFOSError(f"{what}: the cluster {self.cluster_id} was already shut down")

    # ------------------------------------------------------------- forming
    def start(self) -> None:
        """Forms attempt 0 (forming -> running); with restarts, a node failure while it
        forms counts as its failure.

        Raises:
            ReservationTimeoutError: Attempt 0 never formed (no restart: the same slots
                would be missing again).
            ClusterFailedError: A node failed while the cluster formed (a
                :class:`RecoveryFailedError` with restarts, once none is left).
        """
        OPEN.add(self)
        install_sigterm(self.handle_sigterm)
        log.info("tfos cluster %s: %s (input mode %s)", self.plan.base_id, format_template(self.plan.template),
                 self.plan.input_mode.name, extra={"tfos_state": self.state.value})
        try:
            self._backend = self.launcher.launch(0, self.policy.max_restarts, None)
        except ClusterFailedError as err:
            self._recover(err, "run()", progressed=False)
            return
        except BaseException as exc:
            self._end(exc, "run()")
            raise
        self._enter(Lifecycle.RUNNING, logging.INFO, "tfos cluster %s: all %d nodes registered: %s", self.cluster_id,
                    len(self.plan.roles), build_cluster_spec(self.backend.nodes()))

    # ------------------------------------------------------------ restarts
    def _recover(self, err: ClusterFailedError, context: str, progressed: Optional[bool] = None,
                 outer: Optional[Deadline] = None) -> AttemptReport:
        """After the running attempt failed: starts the next one that forms (-> restarting
        -> running), or raises (-> failed).

        Args:
            err: The attempt's error.
            context: What the driver was doing, e.g. 'train()'.
            progressed: Progress the caller saw (e.g. inference results kept); the rows
                the nodes consumed count too (InputMode.SPARK).
            outer: The caller's own deadline (shutdown()'s ``timeout``).

        Returns:
            The failed attempt's report (what its nodes consumed and checkpointed).

        Raises:
            ClusterFailedError: ``err`` itself when restarts are off.
            RecoveryFailedError: No further attempt (budget spent, or stopped early).
        """
        if self.policy.max_restarts == 0:
            self._enter(Lifecycle.FAILED, logging.INFO, "tfos cluster %s failed during %s (max_restarts=0)", err.cluster_id, context)
            raise err
        try:
            return self._restart(err, context, progressed, outer)
        except BaseException as exc:
            if not self.state.terminal:
                self._end(exc, context)
            raise

    def _restart(self, err: ClusterFailedError, context: str, progressed: Optional[bool], outer: Optional[Deadline]) -> AttemptReport:
        report = AttemptReport()
        if self._backend is not None:
            failed = self._backend
            if not failed.closed:
                failed.teardown(failed=True)
            failed.join_teardown()  # its processes are gone (bounded); its last reports are in
            report = failed.report()
        if self.plan.input_mode == InputMode.SPARK and progressed is not False:
            progressed = bool(progressed) or report.rows_consumed > 0
        while True:
            outcome = AttemptOutcome(self.attempt, tuple(err.failures) + tuple(err.consequences), context, progressed, err.cluster_id)
            decision = self.policy.record(outcome)
            if not decision.restart:
                self._enter(Lifecycle.FAILED, logging.ERROR, "tfos cluster %s: attempt %d failed during %s: %s; no restart: %s",
                            err.cluster_id, self.attempt, context, outcome.summary(), decision.reason)
                raise self.policy.error(decision.reason) from err
            self._enter(Lifecycle.RESTARTING, logging.WARNING, "tfos cluster %s: attempt %d failed during %s: %s; starting attempt %d (%s)",
                        err.cluster_id, self.attempt, context, outcome.summary(), decision.next_attempt, decision.reason)
            for f in err.failures:  # a recovered failure is raised nowhere: its traceback goes here
                if f.traceback:
                    log.warning("tfos cluster %s: attempt %d, remote traceback of %s:\n%s", err.cluster_id, self.attempt,
                                f.node_name, f.traceback.rstrip())
            self.attempt = decision.next_attempt
            self.launcher.await_executors(outer)
            t0 = time.monotonic()
            try:
                backend = self.launcher.launch(self.attempt, self.policy.max_restarts - self.attempt, outer)
            except ClusterFailedError as exc:
                err, context, progressed = exc, "run()", False
                continue
            except ReservationTimeoutError as exc:
                r = self.plan.roles[0]
                failure = NodeFailure(r.executor_id, r.job_name, r.task_index, "", "spark", "ReservationTimeoutError", str(exc).splitlines()[0])
                err, context, progressed = ClusterFailedError(self.cluster_id, [failure], "run()"), "run()", False
                continue
            with self._lock:
                self._backend = backend
            self._enter(Lifecycle.RUNNING, logging.WARNING, "tfos cluster %s: attempt %d running (%.1f s to launch and register)",
                        self.cluster_id, self.attempt, time.monotonic() - t0)
            return report

    def _end(self, exc: BaseException, context: str) -> None:
        """The cluster ends because ``exc`` interrupted ``context``: tears it down (bounded)
        and moves to closed (the program's own exception: Ctrl-C, SystemExit) or failed
        (an error of tfos)."""
        backend = self._backend
        if backend is not None and not backend.closed:
            try:
                backend.teardown(failed=True, reason=f"{type(exc).__name__} on the driver during {context}")
            except Exception as texc:  # noqa: BLE001 - never mask the exception that ends the cluster
                log.warning("teardown after %s failed: %s", type(exc).__name__, texc)
        if self.state.terminal:
            return
        if isinstance(exc, TFOSError):
            self._enter(Lifecycle.FAILED, logging.INFO, "tfos cluster %s failed during %s: %s", self.cluster_id, context, type(exc).__name__)
        else:
            self._enter(Lifecycle.CLOSED, logging.WARNING, "tfos cluster %s: %s during %s; the cluster was torn down",
                        self.cluster_id, type(exc).__name__, context)

    def call(self, context: str, step: Callable[[Backend], T], *, before_restart: Optional[Callable[[Backend], Optional[bool]]] = None,
             after_restart: Optional[Callable[[AttemptReport], bool]] = None) -> Optional[T]:
        """Runs ``step`` on the running attempt; a node failure restarts the cluster (while
        a restart is left) and runs ``step`` again on the new attempt.

        Args:
            context: What the caller does, e.g. 'train()' (in errors and the log).
            step: The work, given the running attempt's backend.
            before_restart: Called with the failed attempt's backend before the restart;
                returns whether the attempt made progress (None: unknown).
            after_restart: Called with the failed attempt's report once the next attempt
                runs; False ends the call (it returns None) instead of running ``step``.

        Raises:
            TFOSError: The cluster was already shut down.
            ClusterFailedError: A node failed and no restart is left.
        """
        self.check_usable(context)
        while True:
            backend = self.backend
            try:
                backend.check_open(context)
                return step(backend)
            except ClusterFailedError as err:
                progressed = before_restart(backend) if before_restart is not None else None
                report = self._recover(err, context, progressed)
                if after_restart is not None and not after_restart(report):
                    return None
            except BaseException as exc:
                if not isinstance(exc, TFOSError):
                    self._end(exc, context)
                raise

    # ------------------------------------------------------------- feeding
    def train(self, call: TrainCall) -> None:
        """Feeds ``call`` (every epoch); after a restart, from the epoch the feed resumes at.

        With restarts, the partitions the nodes acknowledged are recorded, and a restart
        feeds again from the first epoch not acknowledged in full, or earlier at the nodes'
        checkpoint report (none lost, some twice; see :class:`FeedResume`).
        """
        resume = FeedResume(call.num_epochs, call.parts, self.plan.chief()) if self.policy.max_restarts else None
        with self.feeds.running():
            self._last_train = None
            if resume is not None:
                self.call("train()", lambda backend: backend.clear_checkpoints())
            self._feed(call, resume, 0)
        if resume is not None:
            self._last_train = (call, resume)  # a failure noticed by shutdown() may feed again

    def _feed(self, call: TrainCall, resume: Optional[FeedResume], first: int) -> None:
        def step(backend: Backend) -> None:
            if backend.feed_closed:
                raise ConfigurationError("train(): the feed already ended (an earlier train(..., end_of_feed=True)); start a new cluster to feed more data")
            outcomes = backend.feed(call, first, resume is not None)
            _log_outcomes(backend, call, outcomes)
            if resume is not None:
                for index, outcome in outcomes:
                    if outcome in (FeedState.OK, FeedState.TERMINATED):
                        resume.record_index(index)

        def resumed(report: AttemptReport) -> bool:
            nonlocal first
            assert resume is not None  # a restart needs max_restarts
            for index in report.partitions_done:
                resume.record_index(index)
            for node, epochs in report.checkpoints.items():
                resume.record_checkpoint(node, epochs)
            first = _resume_at(resume, "train()", self.attempt)
            return first < call.num_epochs

        self.call("train()", step, after_restart=resumed)

    def inference(self, call: InferenceCall) -> Any:
        """Runs inference over ``call``; after a restart only the units whose results no
        attempt kept run again, and the result reads every unit from the attempt that
        holds it (:class:`InferenceLedger`)."""
        ledger = InferenceLedger(call.parts)
        sources: list = []
        owner = [0] * call.parts

        def step(backend: Backend) -> Any:
            if backend.feed_closed:
                raise ConfigurationError("inference(): the feed already ended (an earlier train(..., end_of_feed=True) ended every "
                                         "queue of the nodes); run inference on a new cluster, or train without end_of_feed")
            todo = ledger.missing()
            out = backend.infer(call, todo)
            if not sources:
                return out
            for i in todo:
                owner[i] = len(sources)
            sources.append(out)
            return self.launcher.assemble(sources, owner)

        def keep(backend: Backend) -> Optional[bool]:
            if not self.policy.max_restarts:
                return None
            kept, held = backend.held_results(ledger.missing())
            for i in held:
                owner[i] = len(sources)
            if held:
                ledger.record_all(held)
                sources.append(kept)
            return bool(held) or None

        def rerun(report: AttemptReport) -> bool:
            log.warning("inference(): attempt %d runs the %d partition(s) whose results were not returned", self.attempt, len(ledger.missing()))
            return True

        with self.feeds.running():
            return self.call("inference()", step, before_restart=keep, after_restart=rerun)

    # ------------------------------------------------------------- shutdown
    def shutdown(self, deadline: Deadline, grace_s: float) -> None:
        """Ends the feed, waits for every worker's ``main_fun``, stops every node
        (shutting down -> closed); a failure restarts the cluster while a restart is left
        (-> restarting -> running -> shutting down again).

        Raises:
            ClusterFailedError: A node failed (after every worker's main_fun returned, or
                with no restart left).
            DeadlineExceededError: ``deadline`` expired first.
        """
        self.feeds.await_end(deadline, self.cluster_id, lambda: self.state.terminal or self.backend.closed)
        while True:
            with self._lock:
                done = self.state.terminal  # a failure already raised by train()/inference(), or a second shutdown()
                if not done:
                    self._enter(Lifecycle.SHUTTING_DOWN, logging.INFO, "tfos cluster %s: shutting down (attempt %d)", self.cluster_id, self.attempt)
            backend = self.backend
            if done:
                backend.join_teardown()
                return
            trained = False
            try:
                backend.await_workers(deadline, end_feed=self.plan.input_mode == InputMode.SPARK)
                trained = True
                backend.row_accounting()  # every worker's final figures are in (docs/datafeed.md)
                _warn_if_nobody_trained(self.cluster_id, self.plan.roles, backend.node_states())
                if grace_s and any(r.is_background for r in self.plan.roles) and backend.wait_for_failure(grace_s):
                    raise backend.fail("shutdown()")
                backend.stop()
            except ClusterFailedError as err:
                if not backend.closed:
                    backend.teardown(failed=True)
                if trained:  # every worker's main_fun had returned: nothing to train again
                    self._enter(Lifecycle.FAILED, logging.INFO, "tfos cluster %s failed during shutdown() after every worker's "
                                "main_fun returned (no restart: nothing left to train)", self.cluster_id)
                    raise
                report = self._recover(err, "shutdown()", outer=deadline)
                self._feed_again(report)
                continue
            except BaseException as exc:
                self._end(exc, "shutdown()")
                raise
            self._enter(Lifecycle.CLOSED, logging.INFO, "tfos cluster %s shut down", self.cluster_id)
            return

    def _feed_again(self, report: AttemptReport) -> None:
        """After a restart noticed by shutdown() (InputMode.SPARK): when the nodes reported
        a checkpoint older than the last train()'s epochs, those epochs are fed to the new
        attempt before its feed is closed (main_fun restores its checkpoint, trains what
        is fed and ends)."""
        if self._last_train is None:
            return
        call, resume = self._last_train
        for node, epochs in report.checkpoints.items():
            resume.record_checkpoint(node, epochs)
        if resume.checkpointed_epochs is None:
            return
        first = _resume_at(resume, "shutdown()", self.attempt)
        if first < call.num_epochs:
            self._feed(call, resume, first)

    def abort(self, reason: str) -> None:
        """Tears the cluster down after an error of the driver program (``__exit__``);
        joins a teardown already running."""
        backend = self._backend
        if self.state.terminal or backend is None:
            if backend is not None:
                backend.join_teardown()
            return
        if not backend.closed:
            try:
                backend.teardown(failed=True, reason=reason)
            except Exception as texc:  # noqa: BLE001 - never mask the user's exception
                log.warning("teardown after an error failed: %s", texc)
        self._enter(Lifecycle.CLOSED, logging.WARNING, "tfos cluster %s torn down: %s", self.cluster_id, reason)

    def at_exit(self) -> None:
        """Interpreter exit with the cluster still open (no shutdown(), no ``with``): tears
        it down, bounded; joins a teardown already running."""
        backend = self._backend
        if backend is None:
            return
        if backend.closed or self.state.terminal:
            backend.join_teardown()
            return
        log.warning("tfos cluster %s still running at interpreter exit; tearing it down", self.cluster_id)
        backend.teardown(failed=True)
        self._enter(Lifecycle.CLOSED, logging.INFO, "tfos cluster %s torn down at interpreter exit", self.cluster_id)


class RunningFeeds:
    """The train()/inference() calls running in any thread: shutdown() from another thread
    waits for them to end instead of ending their feed part-way (driver)."""

    def __init__(self) -> None:
        self._count = 0
        self._cond = threading.Condition()

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Counts one running call."""
        with self._cond:
            self._count += 1
        try:
            yield
        finally:
            with self._cond:
                self._count -= 1
                self._cond.notify_all()

    def await_end(self, deadline: Deadline, cluster_id: str, gone: Callable[[], bool]) -> None:
        """Waits until no call runs, or ``gone()`` (the cluster failed or was torn down), so
        the feed is never ended part-way (the nodes would see a clean end of feed with
        partitions unfed: silent data loss).

        Raises:
            DeadlineExceededError: ``deadline`` expired first (the cluster is still up).
        """
        with self._cond:
            if not self._count:
                return
            log.warning("tfos cluster %s: shutdown() waits for the train()/inference() call running in another thread "
                        "(%d) to end (at most %.0f s)", cluster_id, self._count, deadline.remaining())
            while self._count and not gone():
                if deadline.expired():
                    raise deadline.error(extra="a train()/inference() call in another thread was still feeding; "
                                               "the feed was not ended and the cluster is still up")
                self._cond.wait(deadline.slice(0.5))


def _resume_at(resume: FeedResume, context: str, attempt: int) -> int:
    """After a restart: the epoch the feed resumes at (logged); ``num_epochs`` when
    nothing is left to feed."""
    consumed = resume.first_unconsumed()
    first = resume.restart()
    if resume.epochs_left == 0:
        log.warning("%s: every partition of every epoch was consumed (and is in the reported checkpoint, if any) before "
                    "the failure; nothing left to feed on attempt %d", context, attempt)
        return first
    ckpt = resume.checkpointed_epochs
    log.warning("train(): attempt %d resumes the feed at epoch %d of %d (epochs numbered from 0; every row of %d epoch(s) "
                "consumed; %s)", attempt, first, resume.num_epochs, consumed,
                "no checkpoint reported" if ckpt is None else f"checkpoint reported after {ckpt} epoch(s)")
    return first


def _log_outcomes(backend: Backend, call: TrainCall, outcomes: list[tuple[int, str]]) -> None:
    """Logs the partitions a feed job skipped: after DataFeed.terminate() (INFO), or because
    main_fun had returned without it (WARNING, naming the nodes) (driver)."""
    skipped = sum(1 for _, o in outcomes if o == FeedState.SKIPPED)
    terminated = sum(1 for _, o in outcomes if o == FeedState.TERMINATED)
    if terminated:
        log.info("train(): %d of %d partitions skipped after DataFeed.terminate()", terminated, len(outcomes))
    if skipped:
        fed = [n.executor_id for n in backend.nodes() if n.role.feedable]
        done = backend.returned_without_terminate(fed, call.qname, 2.0)
        backend.rows_skipped(done)  # their last epoch's fed rows are "at least" (docs/datafeed.md "Row accounting")
        log.warning(
            "train(): %d of %d partitions were not consumed to their end because main_fun on their node had "
            "returned (it stopped reading without DataFeed.terminate()); their unread rows were not trained on%s",
            skipped, len(outcomes), f". main_fun returned without terminate() on {', '.join(done)}" if done else "",
        )


def _warn_if_nobody_trained(cluster_id: str, roles: Any, states: dict[int, NodeState]) -> None:
    """Logs a WARNING when every chief/master/worker node only served (run_server_and_wait)
    and none ran main_fun to its end: a ParameterServerStrategy cluster without its
    coordinator (no master_node='chief') trains nothing, silently (driver)."""
    fg = [r.executor_id for r in roles if not r.is_background]
    if fg and all(states.get(eid) == NodeState.SERVING for eid in fg):
        log.warning(
            "tfos cluster %s: every chief/master/worker node only served (run_server_and_wait) and none ran a "
            "training loop, so nothing was trained. A ParameterServerStrategy cluster needs its coordinator: "
            "TFCluster.run(..., master_node='chief') and a main_fun whose chief builds the strategy and trains "
            "(docs/parameter_servers.md)", cluster_id,
        )
