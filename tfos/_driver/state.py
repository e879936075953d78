"""The driver's view of one cluster: registry, node states, failures, directives (driver only).

This is a pure, thread-safe state machine: the control server asks :meth:`ClusterState.prepare`
for every authenticated request (a typed message of :mod:`tfos._control.messages`, looked up
in a dispatch table; long-polls are deferred answers, :class:`tfos._control.protocol.LongPoll`,
woken by the state's change topics), a liveness thread calls
:meth:`ClusterState.check_liveness`, and the driver API waits on it. It never touches Spark,
so it is unit-tested directly (:meth:`ClusterState.handle` answers a request synchronously).

Node life cycle as seen by the driver::

    pending --register--> registered --status running--> running --+--> finished
                                                                   +--> failed
                                      running --status serving--> serving (counts as done
                                      for shutdown(); stopped with the ps) --> finished
    (any non-terminal) --no heartbeat for heartbeat_timeout_s--> failed (lost)
    supervisor 'exited' report: the node's processes are gone (code/signal recorded)
"""

from __future__ import annotations

import functools
import json
import logging
import signal
import threading
import time
from typing import Any, Callable, Hashable, Iterable, Optional, Sequence

from tfos._common.deadline import Deadline
from tfos._control import messages as _msg
from tfos._control.messages import NodeState
from tfos._control.protocol import Call, LongPoll, RawJSON, Reply, Topic, node_topic
from tfos._driver import ps_loss
from tfos._driver.restart import NON_RETRYABLE
from tfos._driver.task_world import AccumulatorInbox
from tfos._node import output as _node_output
from tfos.cluster_template import NodeInfo, NodeRole, build_cluster_spec
from tfos.errors import ClusterFailedError, ControlProtocolError, DeadlineExceededError, NodeFailure, is_root_cause

__all__ = ["ClusterState", "describe_exit", "kill_hint", "format_bytes"]

log = logging.getLogger(__name__)

_MAX_POLL_S = 5.0
#: Longest wait, in seconds, of a ``node_stack`` request for the node's answer.
_MAX_STACK_WAIT_S = 10.0
#: Longest stack text kept from a node, in characters.
_MAX_STACK_CHARS = 20000
#: Feeds whose per-partition record (claimed, skipped, acknowledged, handed over) the driver
#: keeps; the oldest is forgotten when a newer one starts. train() calls run one after
#: another and read their record before they return, so only inference RDDs computed
#: after 64 newer feeds started lose their record (a re-run of one of their tasks is then
#: no longer refused).
MAX_FEEDS_KEPT = 64
TERMINAL = (NodeState.FINISHED, NodeState.FAILED, NodeState.STOPPED)


def describe_exit(code: int) -> str:
    """Human text for a process exit status (negative = killed by that signal)."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}"
    return f"exit code {code}"


def kill_hint(code: int, rss_bytes: int = 0) -> str:
    """What usually causes exit status ``code``: for SIGKILL a memory limit, with the last
    sampled RSS when known; '' for other statuses (pure)."""
    if code != -signal.SIGKILL:
        return ""
    text = (
        "; a SIGKILL that nobody sent by hand usually means a memory limit: the kernel's OOM killer, or "
        "YARN/Kubernetes ending the container over its memory limit"
    )
    if rss_bytes:
        text += f" (last sampled RSS of the TF process and its children: {format_bytes(rss_bytes)})"
    return text


def format_bytes(n: int) -> str:
    """``1536`` -> ``'1.5 KiB'`` (pure)."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    return f"{size:.1f} GiB"


class ClusterState:
    """Thread-safe registry and failure aggregator of one cluster (driver side).

    Args:
        cluster_id: The cluster id (frames must carry it).
        roles: One role per executor id.
        heartbeat_timeout_s: Seconds without a supervisor heartbeat before a node is lost.
        on_failure: Called once, outside the lock, with the first failure (the driver
            cancels its job groups there).
    """

    def __init__(
        self,
        cluster_id: str,
        roles: Sequence[NodeRole],
        heartbeat_timeout_s: float,
        on_failure: Optional[Callable[[NodeFailure], None]] = None,
    ):
        self.cluster_id = cluster_id
        self.roles = list(roles)
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._on_failure = on_failure
        self._cond = threading.Condition()
        self.nodes: dict[int, NodeInfo] = {}
        self.proc_state: dict[int, NodeState] = {r.executor_id: NodeState.PENDING for r in roles}
        self.exit_codes: dict[int, int] = {}
        self.last_heartbeat: dict[int, float] = {}
        self.failures: list[NodeFailure] = []
        #: ``time.monotonic()`` of the previous :meth:`check_liveness` (None before the first).
        self._last_liveness_check: Optional[float] = None
        #: The driver's last stall seen by :meth:`check_liveness`: (when it ended, seconds).
        self._stall: Optional[tuple[float, float]] = None
        self.stop_requested = False
        self.feed_closed = False
        self.abort_reason = ""
        #: ``time.monotonic()`` when the first failure was recorded (None before).
        self.first_failure_at: Optional[float] = None
        #: Restarts ``run(..., max_restarts=N)`` has left after this attempt (set by the
        #: launcher). While one is left a node failure is logged at WARNING, not ERROR: the
        #: restart may recover it (the driver logs its decision either way).
        self.restarts_left = 0
        self.counters: dict[int, dict[str, int]] = {}
        #: Serving workers of a ParameterServerStrategy cluster that were lost (tfos._driver.ps_loss).
        self.lost_workers: list[NodeFailure] = []
        #: main_fun's accumulator updates, applied when the attempt shuts down cleanly.
        self.accumulators = AccumulatorInbox()
        self.tensorboard_url: Optional[str] = None
        self.hosts: dict[int, str] = {}
        #: feed id -> (partitions expected, partitions handed over) for end_of_feed feeds.
        self._sent: dict[str, tuple[int, set]] = {}
        #: feed id -> job partition indices a node acknowledged (restarts resume after them).
        self._done: dict[str, set[int]] = {}
        self._claimed: dict[str, dict[int, str]] = {}  # feed id -> partition index -> node
        self._claim_tokens: dict[str, dict[int, str]] = {}  # feed id -> partition index -> the claim's token
        #: Feed ids with a record above, oldest first: only the newest
        #: :data:`MAX_FEEDS_KEPT` are kept (a streaming job feeds every micro-batch as a feed).
        self._feed_ids: dict[str, None] = {}
        #: feed id -> partition indices whose feed task ended without handing them to a node
        #: (the node had terminated its queue or returned from main_fun).
        self._skipped: dict[str, set[int]] = {}
        #: Queues each node's main_fun had terminated (DataFeed.terminate()) when it returned.
        self.terminated_queues: dict[int, list[str]] = {}
        #: Last resident memory (bytes) of each node's TF process tree, from heartbeats.
        self.rss: dict[int, int] = {}
        #: Counter reports received per node (so a waiter can ask for a fresh one).
        self.counter_reports: dict[int, int] = {}
        #: stderr of a TensorBoard that failed to start ('' while none failed).
        self.tensorboard_error = ""
        #: Latest checkpoint report per node: epochs of the running train() its checkpoint holds.
        self._checkpoints: dict[int, int] = {}
        #: Stack requests per node (a counter the node sees in its event directives) and the
        #: latest answer, (request number, text): a feed task that timed out asks for the
        #: stack of main_fun's thread to put in its FeedTimeoutError.
        self._stack_asked: dict[int, int] = {}
        self._stack_all: dict[int, bool] = {}  # the last request asks for every thread
        self._stacks: dict[int, tuple[int, str]] = {}
        #: Counter reports asked of every node so far (``report`` in wait_event answers).
        self._report_asked = 0
        #: The cluster spec as JSON once every node registered (the same for every node).
        self._spec_json: Optional[RawJSON] = None
        #: Called with the topics of every change (the control server's long-polls).
        self._listeners: list[Callable[[Iterable[Hashable]], None]] = []
        #: message class -> (handler, runs off the server's loop: bool or a test of the message)
        self._routes: dict[type, tuple[Callable[[Any], Reply], Any]] = {
            _msg.Register: (self._on_register, False),
            _msg.AwaitCluster: (self._on_await_cluster, False),
            _msg.Heartbeat: (self._on_heartbeat, False),
            _msg.WaitEvent: (self._on_wait_event, False),
            _msg.Status: (self._on_status, lambda m: m.state in (NodeState.FAILED, NodeState.EXITED)),
            _msg.NodeStack: (self._on_node_stack, False),
            _msg.Stack: (self._on_stack, False),
            _msg.FeedError: (self._on_feed_error, True),
            _msg.NodeStateQuery: (self._on_node_state, False),
            _msg.Log: (self._on_log, True),
            _msg.Accumulators: (self._on_accumulators, False),
            _msg.TensorBoard: (self._on_tensorboard, True),
            _msg.PartitionSent: (self._on_partition_sent, False),
            _msg.PartitionDone: (self._on_partition_done, False),
            _msg.PartitionSkipped: (self._on_partition_skipped, False),
            _msg.Checkpoint: (self._on_checkpoint, False),
            _msg.ClaimPartition: (self._on_claim_partition, False),
            _msg.EpochHandover: (self._on_epoch_handover, False),
            _msg.DataIntrusion: (self._on_data_intrusion, True),
        }
        #: Feed tasks' reports of a process that is not the node at a node's data address.
        self._intrusions = 0

    # ----------------------------------------------------------------- queries
    def role(self, executor_id: int) -> NodeRole:
        """The role of ``executor_id``.

        Raises:
            ControlProtocolError: For an id outside the cluster.
        """
        if not isinstance(executor_id, int) or not 0 <= executor_id < len(self.roles):
            raise ControlProtocolError(f"unknown executor id {executor_id!r}")
        return self.roles[executor_id]

    def node_name(self, executor_id: int) -> str:
        """``job:index (executor N, host H)`` for reports."""
        r = self.role(executor_id)
        host = self.hosts.get(executor_id, "unknown host")
        return f"{r.job_name}:{r.task_index} (executor {executor_id}, host {host})"

    @property
    def failed(self) -> bool:
        """True once any node failure was recorded."""
        return bool(self.failures)

    def all_registered(self) -> bool:
        """True once every node registered."""
        return len(self.nodes) == len(self.roles)

    def missing(self) -> list[int]:
        """Executor ids that have not registered yet."""
        return [r.executor_id for r in self.roles if r.executor_id not in self.nodes]

    def error(self, context: str) -> ClusterFailedError:
        """The aggregated error for everything that failed so far."""
        with self._cond:
            return ClusterFailedError(self.cluster_id, list(self.failures), context)

    def is_done(self, executor_id: int) -> bool:
        """True when the node's main_fun ended (or its processes are gone), or the node
        only serves until stopped (state 'serving', e.g. a ParameterServerStrategy worker)."""
        return self.proc_state[executor_id] in TERMINAL + (NodeState.SERVING,) or executor_id in self.exit_codes

    def failed_nodes_reported(self) -> bool:
        """True when every node with a recorded failure has reported its root cause, or its
        processes are gone (so nothing better will come). Called under the lock or not."""
        with self._cond:
            for eid in {f.executor_id for f in self.failures}:
                if not 0 <= eid < len(self.roles):
                    continue
                if eid in self.exit_codes or eid not in self.nodes:
                    continue
                if not any(f.executor_id == eid and is_root_cause(f) for f in self.failures):
                    return False
            return True

    def has_root_cause(self) -> bool:
        """True once a failure that can cause a cluster failure was recorded (not only
        consequences such as a killed Spark task)."""
        with self._cond:
            return any(is_root_cause(f) for f in self.failures)

    def heard_from_live_nodes_since(self, since: float) -> bool:
        """True when every registered node that has neither reported its exit nor failed sent
        a heartbeat after ``since`` (monotonic seconds). False while one is silent, e.g. on a
        host that crashed or was cut off and is not yet declared lost."""
        with self._cond:
            return all(
                self.last_heartbeat.get(eid, 0.0) > since
                for eid in self.nodes
                if eid not in self.exit_codes and self.proc_state.get(eid) != NodeState.FAILED
            )

    def alive_nodes(self) -> list[int]:
        """Registered nodes whose processes have not reported their exit and were not lost."""
        with self._cond:
            return [
                e for e in sorted(self.nodes)
                if e not in self.exit_codes and not any(f.executor_id == e and f.kind == "lost" for f in self.failures)
            ]

    def registered_ids(self) -> list[int]:
        """Executor ids of the registered nodes, ascending."""
        with self._cond:
            return sorted(self.nodes)

    def feedable_ids(self) -> list[int]:
        """Executor ids of the chief/master/worker nodes (those that run the training)."""
        return [r.executor_id for r in self.roles if r.feedable]

    def all_exited(self) -> bool:
        """True when every registered node's processes reported their exit or were lost."""
        with self._cond:
            lost = {f.executor_id for f in self.failures if f.kind == "lost"}
            return all(e in self.exit_codes or e in lost for e in self.nodes)

    def poke(self) -> None:
        """Wakes every waiter (e.g. a Spark job the driver waits for ended)."""
        with self._cond:
            self._notify()

    def add_change_listener(self, listener: Callable[[Iterable[Hashable]], None]) -> None:
        """Calls ``listener(topics)`` on every change from now on (the control server's
        long-polls; see :class:`tfos._control.protocol.Topic`). It is called under the
        state's lock, from any thread: it must only take note and return."""
        with self._cond:
            self._listeners.append(listener)

    def _notify(self, *topics: Hashable) -> None:
        """Wakes the driver's waiters and the long-polls watching ``topics`` (every change
        is also :attr:`Topic.ANY`). The caller holds the lock."""
        self._cond.notify_all()
        if self._listeners:
            changed = (Topic.ANY,) + topics
            for listener in self._listeners:
                listener(changed)

    # ---------------------------------------------------------------- mutation
    def record_failure(self, failure: NodeFailure) -> None:
        """Records a failure, wakes every waiter and fires ``on_failure`` for the first one."""
        with self._cond:
            first = not self.failures
            eid = failure.executor_id
            if failure in self.failures:
                return  # the control client resent the report after a broken connection
            # One root cause per node: a process exit, loss or feed error after a reported
            # root cause of the same node is a consequence of it.
            if failure.kind in ("exited", "lost", "feed") and any(
                f.executor_id == eid and is_root_cause(f) for f in self.failures
            ):
                log.info("tfos node %s, after its failure: %s: %s", failure.node_name, failure.error_type, failure.message)
                return
            if self.abort_reason and (failure.kind == "feed" or failure.error_type in ("SparkTaskKilled", "FeedAbortedError")):
                # The cluster already failed and tfos is stopping it: broken feeds and killed
                # start tasks are consequences of that teardown, not new errors.
                log.info("tfos node %s after the abort: %s: %s", failure.node_name, failure.error_type, failure.message)
                if 0 <= eid < len(self.roles) and failure.kind != "feed":
                    # The node itself ended with that error: its exit that follows is not
                    # a death of its own (see _on_status, 'unprompted').
                    self.proc_state[eid] = NodeState.FAILED
                    self._notify(node_topic(eid))
                return
            if ps_loss.tolerate(self, failure):
                self._notify(node_topic(eid))
                return
            self.failures.append(failure)
            if self.first_failure_at is None:
                self.first_failure_at = time.monotonic()
            if 0 <= eid < len(self.roles):
                self.proc_state[eid] = NodeState.FAILED
            self._notify(Topic.DIRECTIVES, node_topic(eid))
        if is_root_cause(failure):
            if self.restarts_left > 0 and failure.error_type not in NON_RETRYABLE:
                log.warning("tfos node failed: %s: %s: %s (run() has %d restart(s) left; the driver logs whether it restarts)",
                            failure.node_name, failure.error_type, failure.message, self.restarts_left)
            else:
                log.error("tfos node failed: %s: %s: %s", failure.node_name, failure.error_type, failure.message)
        else:  # shown in the driver's error only if no root cause arrives
            log.info("tfos node %s reported: %s: %s", failure.node_name, failure.error_type, failure.message)
        if first and self._on_failure is not None:
            self._on_failure(failure)

    def make_failure(self, executor_id: int, kind: str, error_type: str, message: str, tb: str = "") -> NodeFailure:
        """A :class:`NodeFailure` for a node of this cluster."""
        r = self.role(executor_id)
        return NodeFailure(executor_id, r.job_name, r.task_index, self.hosts.get(executor_id, ""), kind, error_type, message, tb)

    def request_stop(self, feed_closed: bool = True) -> None:
        """Directs every node to stop (and, by default, closes the feed)."""
        with self._cond:
            self.stop_requested = True
            self.feed_closed = self.feed_closed or feed_closed
            self._notify(Topic.DIRECTIVES)

    def close_feed(self) -> None:
        """Tells every node that no more data will be fed (end of feed)."""
        with self._cond:
            self.feed_closed = True
            self._notify(Topic.DIRECTIVES)

    def _record_feed(self, feed_id: str) -> None:
        """Notes that ``feed_id`` has a record, forgetting the oldest feeds' records beyond
        :data:`MAX_FEEDS_KEPT` (caller holds the lock)."""
        if feed_id in self._feed_ids:
            return
        self._feed_ids[feed_id] = None
        while len(self._feed_ids) > MAX_FEEDS_KEPT:
            old = next(iter(self._feed_ids))
            del self._feed_ids[old]
            for record in (self._sent, self._done, self._claimed, self._claim_tokens, self._skipped):
                record.pop(old, None)

    def close_feed_when_sent(self, feed_id: str, total: int) -> None:
        """Closes the feed once ``total`` partitions of feed ``feed_id`` were handed over."""
        with self._cond:
            self._record_feed(feed_id)
            self._sent[feed_id] = (total, set())

    # --- restarts (docs/reliability.md "Recovery"): partitions the nodes acknowledged, per feed ---
    def partitions_done(self, feed_id: str) -> set[int]:
        """Job partition indices of feed ``feed_id`` that a node acknowledged (a copy)."""
        with self._cond:
            return set(self._done.get(feed_id, ()))

    # --- checkpoint reports (ctx.report_checkpoint): where a restarted train() resumes ---
    def checkpoints(self) -> dict[str, int]:
        """``{node name ('job:task'): epochs}``: each node's latest checkpoint report (a copy)."""
        with self._cond:
            return {f"{self.roles[eid].job_name}:{self.roles[eid].task_index}": n for eid, n in self._checkpoints.items()}

    def clear_checkpoints(self) -> None:
        """Forgets the checkpoint reports (a new train() call numbers its epochs from 0)."""
        with self._cond:
            self._checkpoints.clear()

    def abort(self, reason: str) -> None:
        """Tells every node and late registrant to give up (e.g. run() failed)."""
        with self._cond:
            self.abort_reason = reason
            self.stop_requested = True
            self._notify(Topic.DIRECTIVES)

    def check_liveness(self, now: Optional[float] = None) -> None:
        """Declares lost every live node whose supervisor missed ``heartbeat_timeout_s``.

        Called about every second by the driver's (or Connect control host's) liveness
        thread. When that thread itself did not run for at least two thirds of
        ``heartbeat_timeout_s`` (the driver process was stopped, e.g. by SIGSTOP or a
        suspended VM, or starved of CPU), the silence is mostly the driver's own: a node
        declared lost within ``2 x heartbeat_timeout_s`` of that stall gets a message
        that says so, since the nodes end themselves when the driver does not answer
        for ``heartbeat_timeout_s`` (heartbeats the driver took from its sockets right
        after resuming can delay the loss by up to ``heartbeat_timeout_s``).
        """
        now = time.monotonic() if now is None else now
        lost = []
        with self._cond:
            previous, self._last_liveness_check = self._last_liveness_check, now
            for eid, seen in self.last_heartbeat.items():
                if eid in self.exit_codes or self.proc_state[eid] in (NodeState.FAILED, NodeState.STOPPED):
                    continue
                if self.stop_requested and self.proc_state[eid] in TERMINAL:
                    continue
                if now - seen > self.heartbeat_timeout_s:
                    lost.append((eid, now - seen))
        if previous is not None and now - previous >= self.heartbeat_timeout_s * 2 / 3:
            self._stall = (now, now - previous)
        stall = self._stall if self._stall and now - self._stall[0] <= 2 * self.heartbeat_timeout_s else None
        for eid, silence in lost:
            if stall is not None:
                ago = now - stall[0]
                when = "before this check" if ago < 1.0 else f"until {ago:.1f} s before this check"
                why = (
                    f"this driver did not run for about {stall[1]:.1f} s {when} (its process was stopped, "
                    "e.g. by SIGSTOP or a suspended VM, or starved of CPU), and a node ends itself when the driver "
                    f"does not answer it for {self.heartbeat_timeout_s:g} s; or the executor, its Python worker or "
                    "the node supervisor died without a report"
                )
            else:
                why = (
                    "the executor, its Python worker or the node supervisor died without a report (executor JVM "
                    "killed, out of memory, or host lost)"
                )
            self.record_failure(
                self.make_failure(
                    eid, "lost", "NodeLost", f"no heartbeat for {silence:.1f} s (timeout {self.heartbeat_timeout_s:g} s): {why}"
                )
            )

    # --------------------------------------------------------------- waiting
    def wait(self, predicate: Callable[[], bool], deadline: Deadline, poll_s: float = 0.5) -> bool:
        """Waits until ``predicate()`` (called under the lock) or a failure, up to ``deadline``.

        Returns:
            True when the predicate holds, False when a failure was recorded first.

        Raises:
            DeadlineExceededError: When the deadline expires first.
        """
        with self._cond:
            while True:
                if self.failures:
                    return False
                if predicate():
                    return True
                if deadline.expired():
                    raise deadline.error()
                self._cond.wait(deadline.slice(poll_s))

    def wait_until(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Waits up to ``timeout_s`` for ``predicate()`` (called under the lock), woken by every
        state change; unlike :meth:`wait`, a failure does not end the wait and expiry does
        not raise.

        Returns:
            The predicate's last value.
        """
        deadline = Deadline(timeout_s, "a cluster state change")
        with self._cond:
            while not predicate():
                if deadline.expired():
                    return False
                self._cond.wait(deadline.slice(_MAX_POLL_S))
            return True

    def wait_for_failure(self, timeout_s: float) -> bool:
        """Waits up to ``timeout_s`` for a failure to be recorded (e.g. a failed node's own
        report, which usually trails its failed Spark task by a moment).

        Returns:
            True when the cluster has failed.
        """
        return self.wait_until(lambda: self.failed, timeout_s)

    def wait_for_event_or_failure(self, event: threading.Event, timeout_s: float) -> bool:
        """Waits up to ``timeout_s`` for ``event`` (e.g. a Spark job's end) or a failure.

        The setter of ``event`` must call :meth:`poke` to end the wait early.

        Returns:
            Whether ``event`` is set.
        """
        self.wait_until(lambda: event.is_set() or self.failed, timeout_s)
        return event.is_set()

    def wait_for_root_causes(self, attribution_s: float, silent_s: float, settle_s: float = 0.0) -> bool:
        """After a failure, waits for the failed nodes to report their root causes (driver).

        First up to ``attribution_s`` for every failed node's own report
        (:meth:`failed_nodes_reported`). When only consequences were recorded by then (e.g.
        Spark killed a healthy node's barrier task because another host's executor vanished
        with its node supervisor), a node that has gone silent is the likely cause: then
        waits up to ``silent_s`` more (about the heartbeat timeout) until a root cause
        arrives or every live node is heard from, so that the silent one is declared lost
        and the error names it. Last, until ``settle_s`` seconds after the first failure
        (or until every node has ended), so that nodes failing at about the same moment
        are all in the error, and for their reports (within what is left of
        ``attribution_s``).

        Returns:
            True when every failed node reported within ``attribution_s``.
        """
        since = time.monotonic()
        reported = self.wait_until(self.failed_nodes_reported, attribution_s)
        if not self.has_root_cause():
            self.wait_until(lambda: self.has_root_cause() or self.heard_from_live_nodes_since(since), silent_s)
        first = self.first_failure_at
        if settle_s > 0 and first is not None:
            left = first + settle_s - time.monotonic()
            if left > 0:
                self.wait_until(lambda: all(self.is_done(e) for e in list(self.proc_state)), left)
            if reported:
                reported = self.wait_until(self.failed_nodes_reported, max(0.0, since + attribution_s - time.monotonic()))
        return reported

    def wait_until_workers_done(self, deadline: Deadline) -> bool:
        """Waits for ``main_fun`` to end on every chief/master/worker node (see :meth:`is_done`).

        Returns:
            True when all are done, False when a failure was recorded first.

        Raises:
            DeadlineExceededError: When ``deadline`` expires first; names the nodes whose
                main_fun had not returned, with the stack of main_fun's thread of the first
                two (asked from the nodes, up to 3 s each; left out when one does not answer).
        """
        workers = self.feedable_ids()
        try:
            return self.wait(lambda: all(self.is_done(e) for e in workers), deadline)
        except DeadlineExceededError as exc:
            with self._cond:
                stuck = [e for e in workers if not self.is_done(e)]
                names = [self.node_name(e) for e in stuck]
            if not stuck:
                raise
            msg = f"{exc}; main_fun had not returned on {', '.join(names)}"
            for e in stuck[:2]:  # where main_fun waits (up to 3 s each)
                stack = str(self._resolve(self._on_node_stack(_msg.NodeStack(e, 3.0))).get("stack") or "")
                if stack:
                    msg += f"\n{stack}"
            raise DeadlineExceededError(msg) from None

    def wait_for_tensorboard(self, deadline: Deadline) -> bool:
        """Waits for the TensorBoard node to report its URL or its start-up error.

        Returns:
            True when it reported, False when a failure was recorded first.

        Raises:
            DeadlineExceededError: When ``deadline`` expires first.
        """
        return self.wait(lambda: self.tensorboard_url is not None or bool(self.tensorboard_error), deadline)

    def wait_until_registered(self, deadline: Deadline, stop_waiting: Callable[[], bool], tick_s: float = 5.0) -> str:
        """Waits for every node to register (driver's ``run()``).

        Args:
            deadline: The reservation deadline.
            stop_waiting: Also ends the wait (e.g. the start job ended).
            tick_s: Longest single wait; the caller may then report progress and call again.

        Returns:
            'registered', 'failed', 'stopped' (``stop_waiting()`` held), 'expired' or 'tick'.
        """
        end = Deadline(min(tick_s, max(0.0, deadline.remaining())), "a registration tick")
        with self._cond:
            while True:
                if self.failures:
                    return "failed"
                if self.all_registered():
                    return "registered"
                if stop_waiting():
                    return "stopped"
                if deadline.expired():
                    return "expired"
                if end.expired():
                    return "tick"
                self._cond.wait(end.slice(_MAX_POLL_S))

    def returned_without_terminate(self, executor_ids: Sequence[int], qname: str, timeout_s: float) -> list[str]:
        """Names the nodes among ``executor_ids`` whose ``main_fun`` returned without
        ``DataFeed.terminate()`` of ``qname`` (the cause of skipped partitions: docs/datafeed.md "Ending early").

        A skipped partition means such a node exists, but its report may still be on its
        way: waits up to ``timeout_s`` for at least one (driver or control host).

        Returns:
            ``job:index (executor N, host H)`` of each such node, in executor order; empty
            when none reported in time.
        """
        def returned() -> list[int]:
            return [e for e in executor_ids if self.proc_state.get(e) in (NodeState.FINISHED, NodeState.STOPPED)
                    and qname not in self.terminated_queues.get(e, ())]

        self.wait_until(lambda: bool(returned()), timeout_s)
        with self._cond:
            return [self.node_name(e) for e in sorted(returned())]

    def wait_until_exited(self, executor_ids: Sequence[int], timeout_s: float) -> list[int]:
        """Waits for the processes of ``executor_ids`` to exit (or be lost).

        Returns:
            The ids still alive when the wait ended (empty: all gone).
        """
        ids = set(executor_ids)
        self.wait_until(lambda: not ids.intersection(self.alive_nodes()), timeout_s)
        return sorted(ids.intersection(self.alive_nodes()))

    def wait_for_counters(self, executor_ids: Sequence[int], timeout_s: float) -> bool:
        """Waits until every node in ``executor_ids`` sent a counter report newer than now.

        Returns:
            True when all did within ``timeout_s``.
        """
        with self._cond:
            base = {e: self.counter_reports.get(e, 0) for e in executor_ids}
            self._report_asked += 1  # every node's directive poll returns and reports now
            self._notify(Topic.DIRECTIVES)
        return self.wait_until(
            lambda: all(
                self.counter_reports.get(e, 0) > n or e in self.exit_codes or self.proc_state.get(e) in TERMINAL
                for e, n in base.items()
            ),
            timeout_s,
        )

    # -------------------------------------------------------------- snapshots
    def nodes_snapshot(self) -> list[NodeInfo]:
        """The registered nodes, ordered by executor id."""
        with self._cond:
            return sorted(self.nodes.values(), key=lambda n: n.executor_id)

    def cluster_spec(self) -> dict[str, list[str]]:
        """The cluster spec of the registered nodes."""
        return build_cluster_spec(self.nodes_snapshot())

    def status(self) -> dict:
        """A consistent snapshot of the cluster for a client (JSON-ready): registered,
        missing, nodes, states, exit_codes, failures, tensorboard_url, feed_closed,
        stop_requested, abort."""
        with self._cond:
            return {
                "registered": self.all_registered(),
                "missing": self.missing(),
                "nodes": [n.to_dict() for n in sorted(self.nodes.values(), key=lambda n: n.executor_id)],
                "states": {str(k): v.value for k, v in self.proc_state.items()},
                "exit_codes": {str(k): v for k, v in self.exit_codes.items()},
                "failures": [f.to_dict() for f in self.failures],
                "lost_workers": [f.to_dict() for f in self.lost_workers],
                "tensorboard_url": self.tensorboard_url,
                "feed_closed": self.feed_closed,
                "stop_requested": self.stop_requested,
                "abort": self.abort_reason,
            }

    def rows_consumed(self) -> int:
        """Total rows the TF processes have taken from their feeds (from heartbeats)."""
        with self._cond:
            return sum(c.get("rows", 0) for c in self.counters.values())

    # -------------------------------------------------------- control handlers
    def prepare(self, body: dict, peer: str) -> Call:
        """Validates one authenticated request into its typed message and handler (the
        control server's entry point, see :class:`tfos._control.protocol.Routes`).

        Raises:
            ControlProtocolError: A foreign cluster id, an unknown type or bad fields.
        """
        if body.get("cluster") != self.cluster_id:
            raise ControlProtocolError("frame is for another cluster")
        msg = _msg.decode(body)
        route = self._routes.get(type(msg))
        if route is None:
            raise ControlProtocolError(f"unknown message type {body.get('type')!r}")
        handler, offload = route
        return Call(run=functools.partial(handler, msg), offload=offload(msg) if callable(offload) else offload)

    def handle(self, body: dict, peer: str) -> dict:
        """Answers one authenticated request, waiting for a long-poll's answer in this
        thread (tests, and servers of plain functions).

        Raises:
            ControlProtocolError: For an unknown type, a foreign cluster id or bad fields.
        """
        try:
            return self._resolve(self.prepare(body, peer).run())
        except (KeyError, TypeError, ValueError) as exc:
            raise ControlProtocolError(f"malformed {body.get('type')!r} message: {exc!r}") from None

    def _resolve(self, reply: Reply) -> dict:
        """A handler's answer as a plain dict: a long-poll is waited for in this thread."""
        if isinstance(reply, LongPoll):
            poll = reply
            answer: list[dict] = []

            def ready() -> bool:
                got = poll.ready()
                if got is not None:
                    answer.append(got)
                return got is not None

            reply = answer[0] if self.wait_until(ready, poll.timeout_s) else poll.expire()
        return {k: json.loads(v.text) if isinstance(v, RawJSON) else v for k, v in reply.items()}

    def _directives(self) -> dict:
        return {
            "stop": self.stop_requested,
            "feed_closed": self.feed_closed,
            "abort": self.abort_reason,
            "failed": bool(self.failures),
        }

    def _on_register(self, msg: _msg.Register) -> dict:
        node = msg.node
        role = self.role(node.executor_id)
        if (node.job_name, node.task_index) != (role.job_name, role.task_index):
            raise ControlProtocolError(f"executor {node.executor_id} registered as {node.job_name}:{node.task_index}, template says {role.job_name}:{role.task_index}")
        with self._cond:
            if self.abort_reason or self.failures:
                return {"ok": False, "abort": self.abort_reason or "the cluster has already failed"}
            old = self.nodes.get(node.executor_id)
            if old is not None and old.pid != node.pid:
                return {"ok": False, "abort": f"executor id {node.executor_id} is already taken by pid {old.pid} on {old.host} (a retried Spark task?)"}
            clash = [n for n in self.nodes.values() if n.executor_key and n.executor_key == node.executor_key and n.executor_id != node.executor_id]
            self.nodes[node.executor_id] = node
            self.hosts[node.executor_id] = node.host
            self._spec_json = None
            # A registered node is watched from now on, even if its supervisor dies before
            # its first heartbeat (else check_liveness would never see it).
            self.last_heartbeat.setdefault(node.executor_id, time.monotonic())
            if self.proc_state[node.executor_id] == NodeState.PENDING:
                self.proc_state[node.executor_id] = NodeState.REGISTERED
            self._notify(node_topic(node.executor_id), *((Topic.FORMED,) if self.all_registered() else ()))
        log.info("tfos node registered: %s, TF port %d%s", node.name, node.port, f", data port {node.data_port}" if node.data_port else "")
        return {"ok": True, "shared_executor": [n.executor_id for n in clash]}

    def _cluster_ready(self) -> Optional[dict]:
        """The answer of ``await_cluster`` once it is known (caller holds the lock)."""
        if self.abort_reason or self.failures:
            return {"ready": False, "abort": self.abort_reason or "another node failed"}
        if not self.all_registered():
            return None
        if self._spec_json is None:  # encoded once for every node's answer
            self._spec_json = RawJSON(json.dumps(build_cluster_spec(self.nodes.values()), separators=(",", ":")))
        return {"ready": True, "cluster_spec": self._spec_json}

    def _on_await_cluster(self, msg: _msg.AwaitCluster) -> LongPoll:
        """Answers ``{"ready": true, "cluster_spec": {job: [host:port]}}`` once every node
        registered, ``{"ready": false, "abort": why}`` after a failure, else
        ``{"ready": false, "missing": [ids]}`` at the end of the poll."""
        def ready() -> Optional[dict]:
            with self._cond:
                return self._cluster_ready()

        def expire() -> dict:
            with self._cond:
                return self._cluster_ready() or {"ready": False, "missing": self.missing()}

        return LongPoll((Topic.FORMED, Topic.DIRECTIVES), ready, min(msg.poll_s, _MAX_POLL_S), expire)

    def _on_heartbeat(self, msg: _msg.Heartbeat) -> dict:
        eid = msg.executor_id
        self.role(eid)
        with self._cond:
            self.last_heartbeat[eid] = time.monotonic()
            if msg.host is not None and eid not in self.hosts:
                self.hosts[eid] = msg.host
            if msg.rss is not None:
                self.rss[eid] = msg.rss
            return self._directives()

    def _on_wait_event(self, msg: _msg.WaitEvent) -> LongPoll:
        """Answers the directives as soon as they differ from ``known`` (or at the end of
        the poll), with ``stack`` (this node's stack requests so far) and, once the driver
        asked for counter reports, ``report`` (how many times)."""
        eid = msg.executor_id
        self.role(eid)
        known = msg.known
        with self._cond:
            if msg.counters is not None:
                self.counters[eid] = dict(msg.counters)
                self.counter_reports[eid] = self.counter_reports.get(eid, 0) + 1
                self._cond.notify_all()  # the driver's wait_for_counters; no long-poll waits for this

        def current() -> dict:
            d = self._directives()
            d["stack"] = self._stack_asked.get(eid, 0)
            if self._stack_all.get(eid):
                d["stack_all"] = True
            if self._report_asked:
                d["report"] = self._report_asked
            return d

        def ready() -> Optional[dict]:
            with self._cond:
                d = current()
                return d if any(d[k] != known.get(k) for k in d) else None

        def expire() -> dict:
            with self._cond:
                return current()

        return LongPoll((Topic.DIRECTIVES, node_topic(eid)), ready, min(msg.poll_s, _MAX_POLL_S), expire)

    def _on_status(self, msg: _msg.Status) -> dict:
        eid = msg.executor_id
        self.role(eid)
        state = msg.state
        if state == NodeState.FAILED:
            assert msg.failure is not None  # Status checks it
            self.record_failure(msg.failure)
        elif state == NodeState.EXITED:
            code = msg.code
            assert code is not None  # Status checks it
            with self._cond:
                if msg.rss is not None:
                    self.rss[eid] = msg.rss or self.rss.get(eid, 0)
                rss = self.rss.get(eid, 0)
                self.exit_codes[eid] = code
                proc = self.proc_state[eid]
                stopping = self.stop_requested
                self._notify(node_topic(eid))
            # While the cluster stops, the supervisors end the TF processes themselves; an
            # exit they did not cause ('unprompted') is a death of its own, e.g. a node
            # SIGKILLed just before a peer's error (a consequence of that death) aborted
            # the cluster: it is recorded, so the error names the node that died.
            if code != 0 and proc not in TERMINAL and (not stopping or msg.unprompted):
                hint = msg.hint[:2000]  # the supervisor's: an address-space limit in force (_node/address_space.py)
                self.record_failure(
                    self.make_failure(eid, "exited", "ProcessDied", f"the TF process died ({describe_exit(code)}) before main_fun returned{kill_hint(code, rss)}{hint}")
                )
        else:
            with self._cond:
                if state == NodeState.FINISHED:  # set together with the state: node_state reads both
                    self.terminated_queues[eid] = list(msg.terminated)
                if self.proc_state[eid] != NodeState.FAILED:
                    self.proc_state[eid] = state
                self._notify(node_topic(eid))
            if state == NodeState.FINISHED:
                log.info("tfos node %s: main_fun finished", self.node_name(eid))
        return {"ok": True}

    def _on_node_stack(self, msg: _msg.NodeStack) -> LongPoll:
        """A feed task that timed out asks for the stack of main_fun's thread on a node:
        the node's event loop sees the request within one poll and answers with ``stack``.
        Waits ``wait_s`` (at most :data:`_MAX_STACK_WAIT_S`); ``{"stack": ""}`` when the
        node did not answer in time (e.g. a C call that holds the GIL) or has ended."""
        eid = msg.executor_id
        self.role(eid)
        wait = max(0.0, min(msg.wait_s, _MAX_STACK_WAIT_S))
        with self._cond:
            seq = self._stack_asked.get(eid, 0) + 1
            self._stack_asked[eid] = seq
            self._stack_all[eid] = msg.all_threads
            self._notify(node_topic(eid))

        def ready() -> Optional[dict]:
            with self._cond:
                got, text = self._stacks.get(eid, (0, ""))
                if got >= seq:
                    return {"stack": text}
                if self.proc_state[eid] in TERMINAL:
                    return {"stack": ""}
                return None

        return LongPoll((node_topic(eid),), ready, wait, lambda: ready() or {"stack": ""})

    def _on_stack(self, msg: _msg.Stack) -> dict:
        """A node's answer to a stack request (see :meth:`_on_node_stack`)."""
        eid = msg.executor_id
        self.role(eid)
        with self._cond:
            if msg.seq > self._stacks.get(eid, (0, ""))[0]:
                self._stacks[eid] = (msg.seq, msg.text[:_MAX_STACK_CHARS])
                self._notify(node_topic(eid))
        return {"ok": True}

    def _on_data_intrusion(self, msg: _msg.DataIntrusion) -> dict:
        """A feed task found a process that is not the node at a node's data address (one
        that took its released port, or relays to another node): logged as a WARNING (the
        first 10 of a cluster, then every 100th), not a failure; no row reached it."""
        self.role(msg.executor_id)
        with self._cond:
            self._intrusions += 1
            n = self._intrusions
        if n <= 10 or n % 100 == 0:
            log.warning("tfos data plane of cluster %s: %s (reported by a feed task; %d such report(s) so far)",
                        self.cluster_id, msg.text, n)
        return {"ok": True}

    def _on_feed_error(self, msg: _msg.FeedError) -> dict:
        self.record_failure(msg.failure)
        return {"ok": True}

    def _on_node_state(self, msg: _msg.NodeStateQuery) -> dict:
        eid = msg.executor_id
        self.role(eid)
        with self._cond:
            fails = [f for f in self.failures if f.executor_id == eid]
            reply: dict[str, Any] = {
                "state": self.proc_state[eid].value,
                "exit_code": self.exit_codes.get(eid),
                "failure": f"{fails[0].error_type}: {fails[0].message}" if fails else "",
                "cluster_failed": bool(self.failures),
            }
            if self.terminated_queues.get(eid):
                # Queues main_fun terminated before returning (feed tasks skip them quietly).
                reply["terminated"] = list(self.terminated_queues[eid])
            return reply

    def _on_log(self, msg: _msg.Log) -> dict:
        r = self.role(msg.executor_id)
        _node_output.emit(f"{r.job_name}:{r.task_index}", list(msg.lines))
        return {"ok": True}

    def _on_accumulators(self, msg: _msg.Accumulators) -> dict:
        # What main_fun added to its payload's accumulators (tfos._driver.task_world).
        eid = msg.executor_id
        self.role(eid)
        self.accumulators.receive(eid, self.node_name(eid), list(msg.updates))
        return {"ok": True}

    def _on_tensorboard(self, msg: _msg.TensorBoard) -> dict:
        error = msg.error[:8000]
        with self._cond:
            if error:
                self.tensorboard_error = error
            else:
                self.tensorboard_url = msg.url
            self._notify()
        if error:
            log.warning("TensorBoard of cluster %s failed to start:\n%s", self.cluster_id, error)
        else:
            log.info("TensorBoard for cluster %s: %s", self.cluster_id, self.tensorboard_url)
        return {"ok": True}

    def _on_partition_sent(self, msg: _msg.PartitionSent) -> dict:
        with self._cond:
            entry = self._sent.get(msg.feed_id)
            if entry is not None:
                entry[1].add(msg.index)
                if len(entry[1]) >= entry[0] and not self.feed_closed:
                    log.info("feed %s: all %d partitions handed over; closing the feed of every node", msg.feed_id, entry[0])
                    self.feed_closed = True
                    self._notify(Topic.DIRECTIVES)
        return {"ok": True}

    def _on_partition_done(self, msg: _msg.PartitionDone) -> dict:
        """Partitions the nodes acknowledged, per feed (a restarted train() resumes after them)."""
        with self._cond:
            self._record_feed(msg.feed_id)
            self._done.setdefault(msg.feed_id, set()).add(msg.index)
        return {"ok": True}

    def _on_checkpoint(self, msg: _msg.Checkpoint) -> dict:
        """The node's checkpoint holds the first ``epochs`` epochs of the running train()
        call (a later report replaces it)."""
        eid = msg.executor_id
        self.role(eid)
        with self._cond:
            self._checkpoints[eid] = msg.epochs
        log.info("tfos node %s: checkpoint holds %d epoch(s) of the running train()", self.node_name(eid), msg.epochs)
        return {"ok": True}

    def _on_claim_partition(self, msg: _msg.ClaimPartition) -> dict:
        """A feed task is about to stream partition ``index`` of feed ``feed_id`` to ``node``:
        granted once per (feed, index); a re-run task (retry, stage resubmission) is refused.

        ``token`` (random, one per claim a task makes) makes the request idempotent: the
        control client resends a request once when its connection broke, possibly after
        the driver recorded the claim, and the resent claim must be granted again, not
        taken for a re-run task."""
        feed_id, index = msg.feed_id, msg.index
        with self._cond:
            self._record_feed(feed_id)
            claimed = self._claimed.setdefault(feed_id, {})
            tokens = self._claim_tokens.setdefault(feed_id, {})
            if index in claimed:
                if msg.token and tokens.get(index) == msg.token:
                    return {"granted": True}
                return {"granted": False, "node": claimed[index]}
            claimed[index] = msg.node
            tokens[index] = msg.token
        return {"granted": True}

    def _on_partition_skipped(self, msg: _msg.PartitionSkipped) -> dict:
        """A feed task ended without handing partition ``index`` of feed ``feed_id`` to any
        node (its node had terminated the queue, or main_fun had returned)."""
        with self._cond:
            self._record_feed(msg.feed_id)
            self._skipped.setdefault(msg.feed_id, set()).add(msg.index)
        return {"ok": True}

    def _on_epoch_handover(self, msg: _msg.EpochHandover) -> dict:
        """A node's epoch-aware reader asks whether the job partition indices ``lo..hi-1``
        of feed ``feed_id`` (whole epochs) were all settled: handed to a node (claimed) or
        skipped. Answers ``{"settled": count, "mine": [indices claimed by node, ascending]}``;
        the node closes those epochs once ``settled == hi - lo`` and it has read every
        partition in ``mine`` (see tfos._data.tfdata.EpochOrder)."""
        lo, hi, node = msg.lo, msg.hi, msg.node
        with self._cond:
            claimed = self._claimed.get(msg.feed_id, {})
            skipped = self._skipped.get(msg.feed_id, set())
            idx: Iterable[int]
            if hi - lo <= len(claimed) + len(skipped):
                idx = range(lo, hi)
            else:
                idx = sorted(i for i in set(claimed) | skipped if lo <= i < hi)
            settled = sum(1 for i in idx if i in claimed or i in skipped)
            mine = sorted(i for i in idx if claimed.get(i) == node)
        return {"settled": settled, "mine": mine}
