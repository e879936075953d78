"""The host of the control-plane core: the I/O around one cluster's pure state (driver in
the classic backend, executor 0's control host under Spark Connect).

:class:`ClusterHost` owns everything the core (:class:`tfos._control.core.ClusterCore`)
may not do: the lock, the clock, the control server, the liveness thread, the waits, the
teardown of the nodes and its timings, and carrying out the core's effects (logging,
waking long-polls, the first failure's callback, node output, accumulator updates). The
classic driver (:mod:`tfos._driver.runtime`) and the Connect control host
(:mod:`tfos._connect.control_host`) both run this one class. See docs/architecture.md
"The control-plane core".

Every wait is a question to the core with a deadline, woken by the host's condition
variable (every change the core reports notifies it).
"""

from __future__ import annotations

import enum
import functools
import json
import logging
import threading
import time
from typing import Any, Callable, Hashable, Iterable, Optional, Sequence

from tfos._common.admission import data_port_reports
from tfos._common.deadline import Deadline
from tfos._control import messages as _msg
from tfos._control.core import ClusterCore
from tfos._control.effects import AccumulatorUpdates, Effect, FirstFailure, NodeLines, Note, Notify
from tfos._control.protocol import Call, LongPoll, RawJSON, Reply, Topic
from tfos._control.registry import MAX_POLL_S
from tfos.cluster_template import NodeRole
from tfos.errors import ClusterFailedError, ControlProtocolError, DeadlineExceededError, NodeFailure

__all__ = ["ClusterHost", "Registration", "STOP_TIMEOUT_S", "ATTRIBUTION_S", "SETTLE_S", "LIVENESS_TICK_S"]

log = logging.getLogger(__name__)

#: Seconds to wait for the nodes' processes to exit after a stop or abort directive.
STOP_TIMEOUT_S = 45.0
#: Seconds to let the failed nodes' own reports (their root causes) arrive after a first
#: failure (e.g. a feed task's report of a broken connection) before raising.
ATTRIBUTION_S = 5.0
#: Seconds after the first failure during which later failures of other nodes (nodes
#: failing at about the same moment) still go into the raised error.
SETTLE_S = 0.2
#: Seconds between two liveness checks.
LIVENESS_TICK_S = 1.0



class Registration(enum.StrEnum):
    """How :meth:`ClusterHost.wait_until_registered` ended (a wait's outcome, not a node state)."""

    ALL_REGISTERED = "all_registered"
    CLUSTER_FAILED = "cluster_failed"
    STOP_ASKED = "stop_asked"
    EXPIRED = "expired"
    TICK = "tick"


#: Messages whose handling may block (their effects log, write the driver's stderr or
#: cancel Spark jobs): served off the control server's event loop.
_OFFLOAD: dict[type, Callable[[Any], bool]] = {
    _msg.Status: lambda m: m.state in (_msg.NodeState.FAILED, _msg.NodeState.EXITED),
    _msg.FeedError: lambda m: True, _msg.Log: lambda m: True, _msg.TensorBoard: lambda m: True,
    _msg.DataIntrusion: lambda m: True,
}


def _data_port_texts(core: ClusterCore) -> list[str]:
    """The nodes' data-port flood sentences from their latest figures (pure)."""

    def where(eid: int) -> str:
        node = core.nodes.get(eid)
        port = f" {node.host}:{node.data_port}" if node is not None else ""
        return f"the tfos data port{port} of node {core.node_name(eid)}"

    return data_port_reports({eid: dict(c) for eid, c in core.counters.items()}, where)


class ClusterHost:
    """The lock, clock, server, liveness and waits around one :class:`ClusterCore`.

    Args:
        cluster_id: The cluster id (frames must carry it).
        roles: One role per executor id.
        heartbeat_timeout_s: Seconds without a supervisor heartbeat before a node is lost.
        on_failure: Called once, outside the lock, with the first failure.
        on_lines: Shows the output lines a node forwarded (default: INFO records).
        on_accumulators: Takes a node's accumulator updates (default: dropped with a
            DEBUG record; only the classic driver applies them).
        logger: Where the core's lines go (the driver passes its own, under
            ``TFCluster.logger``).
    """

    def __init__(self, cluster_id: str, roles: Sequence[NodeRole], heartbeat_timeout_s: float,
                 on_failure: Optional[Callable[[NodeFailure], None]] = None,
                 on_lines: Optional[Callable[[str, list], None]] = None,
                 on_accumulators: Optional[Callable[[AccumulatorUpdates], None]] = None,
                 logger: logging.Logger = log):
        self.cluster_id = cluster_id
        self.core = ClusterCore(cluster_id, roles, heartbeat_timeout_s)
        self._on_failure = on_failure
        self.log = logger
        self._on_lines = on_lines or self._log_lines
        self._on_accumulators = on_accumulators or (lambda u: log.debug("accumulator updates of %s dropped", u.node_name))
        self._cond = threading.Condition()
        self._listeners: list[Callable[[Iterable[Hashable]], None]] = []
        #: Extra request routes of this placement (the Connect client's messages).
        self._routes: dict[type, tuple[Callable[[Any], Reply], bool]] = {}
        self.server: Any = None
        self._liveness_stop = threading.Event()

    def _log_lines(self, node: str, lines: list) -> None:
        for ln in lines:
            self.log.info("[%s] %s", node, ln)

    # ------------------------------------------------------------ placement
    def serve(self, key: bytes, bind_host: str) -> Any:
        """Starts the control server (on a free port of ``bind_host``) and the liveness
        thread; returns the server.

        Raises:
            ConfigurationError: No port could be bound.
        """
        from tfos._control.server import ControlServer  # the server module imports the loop; tests run without it

        self.server = ControlServer(key, self, host=bind_host, num_nodes=len(self.core.roles))
        threading.Thread(target=self._liveness_loop, name=f"{self.cluster_id}-liveness", daemon=True).start()
        return self.server

    def close(self) -> None:
        """Stops the liveness thread and the control server (idempotent)."""
        self._liveness_stop.set()
        if self.server is not None:
            self.server.close()

    def flood_report(self) -> str:
        """What connections without the key were turned away meanwhile, for the driver's
        errors (``""`` when none): the control port's (:meth:`ControlServer.flood_report`)
        and every node's data port's, from the nodes' latest figures (docs/reliability.md
        "Floods")."""
        texts = [self.server.flood_report()] if self.server is not None else []
        with self._cond:
            texts += _data_port_texts(self.core)
        return "; ".join(t for t in texts if t)

    def route(self, msg_type: type, handler: Callable[[Any], Reply], offload: bool = False) -> None:
        """Serves ``msg_type`` with ``handler(msg)`` (a placement's own requests)."""
        self._routes[msg_type] = (handler, offload)

    def _liveness_loop(self) -> None:
        while not self._liveness_stop.wait(LIVENESS_TICK_S):
            self.check_liveness()

    # ------------------------------------------------------------ the server side
    def prepare(self, body: dict, peer: str) -> Call:
        """Validates one authenticated request into its typed message and handler (the
        control server's entry point, see :class:`tfos._control.protocol.Routes`).

        Raises:
            ControlProtocolError: A foreign cluster id, an unknown type or bad fields.
        """
        if body.get("cluster") != self.cluster_id:
            raise ControlProtocolError("frame is for another cluster")
        msg = _msg.decode(body)
        extra = self._routes.get(type(msg))
        if extra is not None:
            return Call(functools.partial(extra[0], msg), offload=extra[1])
        if not self.core.handles(type(msg)):
            raise ControlProtocolError(f"unknown message type {body.get('type')!r}")
        offload = _OFFLOAD.get(type(msg))
        return Call(functools.partial(self.apply, msg), offload=bool(offload and offload(msg)))

    def add_change_listener(self, listener: Callable[[Iterable[Hashable]], None]) -> None:
        """Calls ``listener(topics)`` on every change from now on (the control server's
        long-polls). It is called under the host's lock: it must only take note and return."""
        with self._cond:
            self._listeners.append(listener)

    def apply(self, msg: _msg.Message) -> Reply:
        """Applies one message to the core now; carries out its effects.

        Raises:
            ControlProtocolError: A message of no node of this cluster.
        """
        with self._cond:
            reply, effects = self.core.apply(msg, time.monotonic())
            rest = self._notify(effects)
        self._carry_out(rest)
        if isinstance(reply, LongPoll):
            reply = LongPoll(reply.topics, self.locked(reply.ready), reply.timeout_s, self.locked(reply.expire))
        return reply

    def locked(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        """``fn`` made to run under the host's lock (a long-poll's checks)."""
        def call() -> Any:
            with self._cond:
                return fn()
        return call

    def _notify(self, effects: list[Effect]) -> list[Effect]:
        """Wakes the waiters and long-polls of the :class:`Notify` effects (caller holds
        the lock); returns the other effects."""
        rest: list[Effect] = []
        for e in effects:
            if isinstance(e, Notify):
                self._cond.notify_all()
                if self._listeners:
                    changed = (Topic.ANY,) + e.topics
                    for listener in self._listeners:
                        listener(changed)
            else:
                rest.append(e)
        return rest

    def _carry_out(self, effects: list[Effect]) -> None:
        for e in effects:
            if isinstance(e, Note):
                self.log.log(e.level, "%s", e.text)
            elif isinstance(e, FirstFailure):
                if self._on_failure is not None:
                    self._on_failure(e.failure)
            elif isinstance(e, NodeLines):
                self._on_lines(e.node, list(e.lines))
            elif isinstance(e, AccumulatorUpdates):
                self._on_accumulators(e)

    def _command(self, fn: Callable[..., list[Effect]], *args: Any) -> None:
        with self._cond:
            rest = self._notify(fn(*args))
        self._carry_out(rest)

    # ------------------------------------------------------------ commands
    def record_failure(self, failure: NodeFailure) -> None:
        """Records a failure, wakes every waiter and fires ``on_failure`` for the first one."""
        self._command(self.core.record_failure, failure, time.monotonic())

    def request_stop(self, feed_closed: bool = True) -> None:
        """Directs every node to stop (and, by default, closes the feed)."""
        self._command(self.core.request_stop, feed_closed)

    def close_feed(self) -> None:
        """Tells every node that no more data will be fed (end of feed)."""
        self._command(self.core.close_feed)

    def abort(self, reason: str) -> None:
        """Tells every node and late registrant to give up (e.g. run() failed)."""
        self._command(self.core.abort, reason)

    def check_liveness(self, now: Optional[float] = None) -> None:
        """Gives the core's liveness verdicts at ``now`` (default: the monotonic clock)."""
        self._command(self.core.check_liveness, time.monotonic() if now is None else now)

    def close_feed_when_sent(self, feed_id: str, total: int) -> None:
        """Closes the feed once ``total`` partitions of feed ``feed_id`` were handed over."""
        with self._cond:
            self.core.ledger.close_when_sent(feed_id, total)

    def clear_checkpoints(self) -> None:
        """Forgets the checkpoint reports (a new train() call numbers its epochs from 0)."""
        with self._cond:
            self.core.ledger.checkpoints.clear()

    def poke(self) -> None:
        """Wakes every waiter (e.g. a Spark job the driver waits for ended)."""
        with self._cond:
            self._notify([Notify()])

    def read(self, fn: Callable[[ClusterCore], Any]) -> Any:
        """``fn(core)`` under the lock: a consistent read of several fields."""
        with self._cond:
            return fn(self.core)

    # ------------------------------------------------------------ waits
    def wait(self, predicate: Callable[[], bool], deadline: Deadline, poll_s: float = 0.5) -> bool:
        """Waits until ``predicate()`` (called under the lock) or a failure, up to ``deadline``.

        Returns:
            True when the predicate holds, False when a failure was recorded first.

        Raises:
            DeadlineExceededError: When the deadline expires first.
        """
        with self._cond:
            while True:
                if self.core.failures:
                    return False
                if predicate():
                    return True
                if deadline.expired():
                    raise deadline.error()
                self._cond.wait(deadline.slice(poll_s))

    def wait_until(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Waits up to ``timeout_s`` for ``predicate()`` (called under the lock), woken by
        every change; a failure does not end the wait and expiry does not raise.

        Returns:
            The predicate's last value.
        """
        deadline = Deadline(timeout_s, "a cluster state change")
        with self._cond:
            while not predicate():
                if deadline.expired():
                    return False
                self._cond.wait(deadline.slice(MAX_POLL_S))
            return True

    def wait_for_failure(self, timeout_s: float) -> bool:
        """Waits up to ``timeout_s`` for a failure to be recorded; True when the cluster failed."""
        return self.wait_until(lambda: self.core.failed, timeout_s)

    def wait_for_event_or_failure(self, event: threading.Event, timeout_s: float) -> bool:
        """Waits up to ``timeout_s`` for ``event`` (its setter calls :meth:`poke`) or a
        failure; returns whether ``event`` is set."""
        self.wait_until(lambda: event.is_set() or self.core.failed, timeout_s)
        return event.is_set()

    def wait_for_root_causes(self, attribution_s: float, silent_s: float, settle_s: float = 0.0) -> bool:
        """After a failure, waits for the failed nodes to report their root causes.

        First up to ``attribution_s`` for every failed node's own report. When only
        consequences were recorded by then (e.g. Spark killed a healthy node's barrier task
        because another host's executor vanished), a node that has gone silent is the likely
        cause: waits up to ``silent_s`` more until a root cause arrives or every live node
        is heard from, so that the silent one is declared lost and the error names it. Last,
        until ``settle_s`` after the first failure (or until every node has ended), so that
        nodes failing at about the same moment are all in the error.

        Returns:
            True when every failed node reported within ``attribution_s``.
        """
        core, since = self.core, time.monotonic()
        reported = self.wait_until(core.failed_nodes_reported, attribution_s)
        if not core.has_root_cause():
            self.wait_until(lambda: core.has_root_cause() or core.heard_from_live_nodes_since(since), silent_s)
        first = core.first_failure_at
        if settle_s > 0 and first is not None:
            left = first + settle_s - time.monotonic()
            if left > 0:
                self.wait_until(lambda: all(core.is_done(e) for e in list(core.proc_state)), left)
            if reported:
                reported = self.wait_until(core.failed_nodes_reported, max(0.0, since + attribution_s - time.monotonic()))
        return reported

    def settle_failure(self, context: str, on_no_root_cause: Callable[[], None] = lambda: None) -> ClusterFailedError:
        """The error of a failed cluster, once the failed nodes reported their causes
        (bounded by :data:`ATTRIBUTION_S`, :data:`SETTLE_S`); aborts every node.

        ``on_no_root_cause`` runs when only consequences were reported (the driver then
        looks for the error in Spark's failed tasks)."""
        core = self.core
        if not self.wait_for_root_causes(ATTRIBUTION_S, core.heartbeat_timeout_s + 2.0, SETTLE_S):
            self.log.info("tfos cluster %s: not every failed node reported its cause within %g s", self.cluster_id, ATTRIBUTION_S)
        if not core.has_root_cause():
            on_no_root_cause()
        self.abort("the cluster failed")
        with self._cond:
            return core.error(context)

    def wait_until_workers_done(self, deadline: Deadline) -> bool:
        """Waits for ``main_fun`` to end on every chief/master/worker node.

        Returns:
            True when all are done, False when a failure was recorded first.

        Raises:
            DeadlineExceededError: When ``deadline`` expires first; names the nodes whose
                main_fun had not returned, with the stack of main_fun's thread of the first
                two (asked from the nodes, up to 3 s each; left out when one does not answer).
        """
        core = self.core
        try:
            return self.wait(core.workers_done, deadline)
        except DeadlineExceededError as exc:
            with self._cond:
                stuck = [e for e in core.feedable_ids() if not core.is_done(e)]
                names = [core.node_name(e) for e in stuck]
            if not stuck:
                raise
            text = f"{exc}; main_fun had not returned on {', '.join(names)}"
            for e in stuck[:2]:  # where main_fun waits (up to 3 s each)
                stack = str(self.resolve(self.apply(_msg.NodeStack(e, 3.0))).get("stack") or "")
                if stack:
                    text += f"\n{stack}"
            raise DeadlineExceededError(text) from None

    def wait_for_tensorboard(self, deadline: Deadline) -> bool:
        """Waits for the TensorBoard node's URL or start-up error; False after a failure.

        Raises:
            DeadlineExceededError: When ``deadline`` expires first.
        """
        return self.wait(lambda: self.core.tensorboard_url is not None or bool(self.core.tensorboard_error), deadline)

    def wait_until_registered(self, deadline: Deadline, stop_waiting: Callable[[], bool], tick_s: float = 5.0) -> str:
        """Waits for every node to register (``run()``); ``stop_waiting()`` also ends it.

        Returns:
            A :class:`Registration`: ALL_REGISTERED, CLUSTER_FAILED, STOP_ASKED
            (``stop_waiting()`` held), EXPIRED or TICK (``tick_s`` passed: the caller may
            report progress and call again).
        """
        end = Deadline(min(tick_s, max(0.0, deadline.remaining())), "a registration tick")
        core = self.core
        with self._cond:
            while True:
                if core.failures:
                    return Registration.CLUSTER_FAILED
                if core.all_registered():
                    return Registration.ALL_REGISTERED
                if stop_waiting():
                    return Registration.STOP_ASKED
                if deadline.expired():
                    return Registration.EXPIRED
                if end.expired():
                    return Registration.TICK
                self._cond.wait(end.slice(MAX_POLL_S))

    def returned_without_terminate(self, executor_ids: Sequence[int], qname: str, timeout_s: float) -> list[str]:
        """Names the nodes among ``executor_ids`` whose ``main_fun`` returned without
        ``DataFeed.terminate()`` of ``qname`` (the cause of skipped partitions:
        docs/datafeed.md "Ending early"), waiting up to ``timeout_s`` for one's report.

        Returns:
            ``job:index (executor N, host H)`` of each such node, in executor order.
        """
        core = self.core
        self.wait_until(lambda: bool(core.returned_without_terminate(executor_ids, qname)), timeout_s)
        with self._cond:
            return [core.node_name(e) for e in sorted(core.returned_without_terminate(executor_ids, qname))]

    def wait_until_exited(self, executor_ids: Sequence[int], timeout_s: float) -> list[int]:
        """Waits for the processes of ``executor_ids`` to exit (or be lost, or go silent
        while the cluster stops); returns the ids still alive."""
        ids = set(executor_ids)
        self.wait_until(lambda: not ids.intersection(self.core.alive_nodes()), timeout_s)
        with self._cond:
            return sorted(ids.intersection(self.core.alive_nodes()))

    def wait_for_counters(self, executor_ids: Sequence[int], timeout_s: float) -> bool:
        """Asks every node for a counter report and waits until each node of
        ``executor_ids`` sent one (or ended); True when all did within ``timeout_s``."""
        with self._cond:
            seen, effects = self.core.ask_counters()
            self._notify(effects)
        base = {e: seen.get(e, 0) for e in executor_ids}
        return self.wait_until(lambda: self.core.counters_fresh(base), timeout_s)

    def stop_nodes(self, failed: bool, reason: str = "", timeout_s: float = STOP_TIMEOUT_S, warn: bool = True) -> list[int]:
        """Stops (or, with ``failed``, aborts) every node and waits up to ``timeout_s`` for
        their processes; returns the ids still alive (with ``warn``, logged at WARNING)."""
        if failed:
            self.abort(reason or "the cluster failed")
        else:
            self.request_stop()
        alive = self.wait_until_exited(self.read(lambda c: sorted(c.nodes)), timeout_s)
        if alive and warn:
            self.log.warning("tfos cluster %s: nodes %s did not report their exit in %g s", self.cluster_id, alive, timeout_s)
        return alive

    def resolve(self, reply: Reply) -> dict:
        """A handler's answer as a plain dict: a long-poll is waited for in this thread."""
        if isinstance(reply, LongPoll):
            poll = reply
            answer: list[dict] = []

            def ready() -> bool:
                got = poll.ready()  # the lock is reentrant
                if got is not None:
                    answer.append(got)
                return got is not None

            reply = answer[0] if self.wait_until(ready, poll.timeout_s) else poll.expire()
        return {k: json.loads(v.text) if isinstance(v, RawJSON) else v for k, v in reply.items()}
