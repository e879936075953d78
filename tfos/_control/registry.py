"""The node registry of one cluster: nodes, their states, failures and directives (pure;
runs in the control host: the driver, or executor 0 under Spark Connect).

State in, effects out: :meth:`Registry.apply` takes one typed message
(:mod:`tfos._control.messages`) and the time, changes the state, and returns the answer
and the effects (:mod:`tfos._control.effects`) for its host to carry out. No lock, no
socket, no clock read, no logging: the host (:class:`tfos._control.host.ClusterHost`)
serialises every call and owns the I/O. The feed messages go to its
:class:`~tfos._control.ledger.FeedLedger`. See docs/architecture.md "The control-plane core".

Node life cycle as seen by the registry::

    pending --register--> registered --status running--> running --+--> finished
                                                                   +--> failed
                                      running --status serving--> serving (counts as done
                                      for shutdown(); stopped with the ps) --> finished
    (any non-terminal) --no heartbeat for heartbeat_timeout_s--> failed (lost)
    (while the cluster stops or aborts) --no heartbeat--> stopped (no verdict: it is
                                      being torn down)
    supervisor 'exited' report: the node's processes are gone (code/signal recorded)
"""

from __future__ import annotations

import json
import logging
import signal
from typing import Any, Callable, Optional, Sequence

from tfos._control import messages as _msg
from tfos._control import ps_loss
from tfos._control.effects import Effect, FirstFailure, Note, Notify
from tfos._control.ledger import FeedLedger
from tfos._control.messages import TERMINAL_STATES, NodeState
from tfos._control.protocol import LongPoll, RawJSON, Reply, Topic, node_topic
from tfos.cluster_template import NodeInfo, NodeRole, build_cluster_spec
from tfos.errors import NON_RETRYABLE, ClusterFailedError, ControlProtocolError, NodeFailure, is_root_cause

__all__ = ["Registry", "describe_exit", "kill_hint", "format_bytes", "MAX_POLL_S"]

#: Longest long-poll of a node, in seconds.
MAX_POLL_S = 5.0
#: Longest wait, in seconds, of a ``node_stack`` request for the node's answer.
MAX_STACK_WAIT_S = 10.0
#: Longest stack text kept from a node, in characters.
MAX_STACK_CHARS = 20000


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


class Registry:
    """Nodes, node states, failures and directives of one cluster (pure).

    Args:
        cluster_id: The cluster id (frames must carry it).
        roles: One role per executor id.
        heartbeat_timeout_s: Seconds without a supervisor heartbeat before a node is lost.
    """

    def __init__(self, cluster_id: str, roles: Sequence[NodeRole], heartbeat_timeout_s: float):
        self.cluster_id = cluster_id
        self.roles = list(roles)
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.ledger = FeedLedger()
        self.nodes: dict[int, NodeInfo] = {}
        self.proc_state: dict[int, NodeState] = {r.executor_id: NodeState.PENDING for r in roles}
        self.exit_codes: dict[int, int] = {}
        self.last_heartbeat: dict[int, float] = {}
        self.failures: list[NodeFailure] = []
        #: Serving workers of a ParameterServerStrategy cluster that were lost (tfos._control.ps_loss).
        self.lost_workers: list[NodeFailure] = []
        #: Nodes that went silent while the cluster was being stopped or aborted: taken as
        #: stopped with it, never declared lost.
        self.gone: set[int] = set()
        self.last_liveness_check: Optional[float] = None
        #: The host's last stall seen by :meth:`check_liveness`: (when it ended, seconds).
        self.stall: Optional[tuple[float, float]] = None
        self.stop_requested = False
        self.feed_closed = False
        self.abort_reason = ""
        #: Time (the host's monotonic clock) of the first failure (None before).
        self.first_failure_at: Optional[float] = None
        #: Restarts ``run(..., max_restarts=N)`` has left after this attempt (set by the
        #: launcher). While one is left a node failure is logged at WARNING, not ERROR.
        self.restarts_left = 0
        self.counters: dict[int, dict[str, int]] = {}
        self.counter_reports: dict[int, int] = {}
        self.report_asked = 0
        self.tensorboard_url: Optional[str] = None
        self.tensorboard_error = ""
        self.hosts: dict[int, str] = {}
        #: Queues each node's main_fun had terminated (DataFeed.terminate()) when it returned.
        self.terminated_queues: dict[int, list[str]] = {}
        #: Last resident memory (bytes) of each node's TF process tree, from heartbeats.
        self.rss: dict[int, int] = {}
        #: Stack requests per node and the latest answer, (request number, text).
        self.stack_asked: dict[int, int] = {}
        self.stack_all: dict[int, bool] = {}  # the last request asks for every thread
        self.stacks: dict[int, tuple[int, str]] = {}
        self.intrusions = 0
        self._spec_json: Optional[RawJSON] = None
        self._out: list[Effect] = []
        self._handlers: dict[type, Callable[[Any, float], Reply]] = {
            _msg.Register: self._on_register, _msg.AwaitCluster: self._on_await_cluster,
            _msg.Heartbeat: self._on_heartbeat, _msg.WaitEvent: self._on_wait_event,
            _msg.Status: self._on_status, _msg.FeedError: self._on_feed_error,
            _msg.NodeStateQuery: self._on_node_state,
        }

    # ------------------------------------------------------------ the entry point
    def handles(self, msg_type: type) -> bool:
        """True for a message class this registry answers."""
        return msg_type in self._handlers

    def apply(self, msg: _msg.Message, now: float) -> tuple[Reply, list[Effect]]:
        """Applies one node message at time ``now`` (the host's monotonic seconds).

        Returns:
            The answer (a dict, or a :class:`LongPoll` whose ``ready``/``expire`` read this
            registry: the host calls them under its lock) and the effects.

        Raises:
            ControlProtocolError: A message of no node of this cluster, or of a type this
                registry does not answer.
        """
        handler = self._handlers.get(type(msg))
        if handler is None:
            raise ControlProtocolError(f"unknown message type {msg.TYPE!r}")
        try:
            return handler(msg, now), self.drain()
        except BaseException:
            self.drain()
            raise

    def drain(self) -> list[Effect]:
        """The effects gathered since the last call (and forgets them)."""
        out, self._out = self._out, []
        return out

    def note(self, level: int, text: str) -> None:
        """Adds a log line to the effects of the message being applied."""
        self._out.append(Note(level, text))

    def notify(self, *topics: Any) -> None:
        """Adds a change of ``topics`` to the effects of the message being applied."""
        self._out.append(Notify(topics))

    def emit(self, effect: Effect) -> None:
        """Adds ``effect`` to the effects of the message being applied."""
        self._out.append(effect)

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
        return f"{r.job_name}:{r.task_index} (executor {executor_id}, host {self.hosts.get(executor_id, 'unknown host')})"

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
        return ClusterFailedError(self.cluster_id, list(self.failures), context)

    def is_done(self, executor_id: int) -> bool:
        """True when the node's main_fun ended (or its processes are gone), or the node
        only serves until stopped (state 'serving', e.g. a ParameterServerStrategy worker)."""
        return (self.proc_state[executor_id] in TERMINAL_STATES or self.proc_state[executor_id] == NodeState.SERVING
                or executor_id in self.exit_codes)

    def workers_done(self) -> bool:
        """True when main_fun ended on every chief/master/worker node."""
        return all(self.is_done(e) for e in self.feedable_ids())

    def failed_nodes_reported(self) -> bool:
        """True when every node with a recorded failure has reported its root cause, or its
        processes are gone (so nothing better will come)."""
        for eid in {f.executor_id for f in self.failures}:
            if not 0 <= eid < len(self.roles) or eid in self.exit_codes or eid not in self.nodes:
                continue
            if not any(f.executor_id == eid and is_root_cause(f) for f in self.failures):
                return False
        return True

    def has_root_cause(self) -> bool:
        """True once a failure that can cause a cluster failure was recorded."""
        return any(is_root_cause(f) for f in self.failures)

    def heard_from_live_nodes_since(self, since: float) -> bool:
        """True when every registered node that has neither exited nor failed sent a
        heartbeat after ``since`` (the host's monotonic seconds)."""
        return all(self.last_heartbeat.get(eid, 0.0) > since for eid in self.nodes
                   if eid not in self.exit_codes and self.proc_state.get(eid) != NodeState.FAILED)

    def alive_nodes(self) -> list[int]:
        """Registered nodes whose processes have not reported their exit, were not lost
        and did not go silent while the cluster stopped."""
        lost = {f.executor_id for f in self.failures if f.kind == "lost"}
        return [e for e in sorted(self.nodes) if e not in self.exit_codes and e not in lost and e not in self.gone]

    def all_exited(self) -> bool:
        """True when every registered node's processes exited, were lost or went silent
        while the cluster stopped."""
        return not self.alive_nodes()

    def feedable_ids(self) -> list[int]:
        """Executor ids of the chief/master/worker nodes (those that run the training)."""
        return [r.executor_id for r in self.roles if r.feedable]

    def cluster_spec(self) -> dict[str, list[str]]:
        """The cluster spec of the registered nodes."""
        return build_cluster_spec(self.nodes_snapshot())

    def nodes_snapshot(self) -> list[NodeInfo]:
        """The registered nodes, ordered by executor id."""
        return sorted(self.nodes.values(), key=lambda n: n.executor_id)

    def directives(self) -> dict:
        """What every node is told on each heartbeat and event poll."""
        return {"stop": self.stop_requested, "feed_closed": self.feed_closed, "abort": self.abort_reason,
                "failed": bool(self.failures)}

    # ---------------------------------------------------------------- commands
    def make_failure(self, executor_id: int, kind: str, error_type: str, message: str, tb: str = "") -> NodeFailure:
        """A :class:`NodeFailure` for a node of this cluster."""
        r = self.role(executor_id)
        return NodeFailure(executor_id, r.job_name, r.task_index, self.hosts.get(executor_id, ""), kind, error_type, message, tb)

    def record_failure(self, failure: NodeFailure, now: float) -> list[Effect]:
        """Records a failure (the first one also gives :class:`FirstFailure`)."""
        self._record_failure(failure, now)
        return self.drain()

    def _record_failure(self, failure: NodeFailure, now: float) -> None:
        first, eid = not self.failures, failure.executor_id
        if failure in self.failures:
            return  # the control client resent the report after a broken connection
        # One root cause per node: a process exit, loss or feed error after a reported
        # root cause of the same node is a consequence of it.
        if failure.kind in ("exited", "lost", "feed") and any(f.executor_id == eid and is_root_cause(f) for f in self.failures):
            self.note(logging.INFO, f"tfos node {failure.node_name}, after its failure: {failure.error_type}: {failure.message}")
            return
        if self.abort_reason and (failure.kind == "feed" or failure.error_type in ("SparkTaskKilled", "FeedAbortedError")):
            # The cluster already failed and is being stopped: broken feeds and killed start
            # tasks are consequences of that teardown, not new errors.
            self.note(logging.INFO, f"tfos node {failure.node_name} after the abort: {failure.error_type}: {failure.message}")
            if 0 <= eid < len(self.roles) and failure.kind != "feed":
                # The node itself ended with that error: its exit that follows is not a
                # death of its own (see _on_status, 'unprompted').
                self.proc_state[eid] = NodeState.FAILED
                self.notify(node_topic(eid))
            return
        if ps_loss.tolerate(self, failure):
            self.notify(node_topic(eid))
            return
        self.failures.append(failure)
        if self.first_failure_at is None:
            self.first_failure_at = now
        if 0 <= eid < len(self.roles):
            self.proc_state[eid] = NodeState.FAILED
        self.notify(Topic.DIRECTIVES, node_topic(eid))
        what = f"{failure.node_name}: {failure.error_type}: {failure.message}"
        if not is_root_cause(failure):  # shown in the driver's error only if no root cause arrives
            self.note(logging.INFO, f"tfos node {failure.node_name} reported: {failure.error_type}: {failure.message}")
        elif self.restarts_left > 0 and failure.error_type not in NON_RETRYABLE:
            self.note(logging.WARNING, f"tfos node failed: {what} (run() has {self.restarts_left} restart(s) left; "
                                        "the driver logs whether it restarts)")
        else:
            self.note(logging.ERROR, f"tfos node failed: {what}")
        if first:
            self._out.append(FirstFailure(failure))

    def request_stop(self, feed_closed: bool = True) -> list[Effect]:
        """Directs every node to stop (and, by default, closes the feed)."""
        self.stop_requested = True
        self.feed_closed = self.feed_closed or feed_closed
        return [Notify((Topic.DIRECTIVES,))]

    def close_feed(self) -> list[Effect]:
        """Tells every node that no more data will be fed (end of feed)."""
        self.feed_closed = True
        return [Notify((Topic.DIRECTIVES,))]

    def abort(self, reason: str) -> list[Effect]:
        """Tells every node and late registrant to give up (e.g. run() failed)."""
        self.abort_reason = reason
        self.stop_requested = True
        return [Notify((Topic.DIRECTIVES,))]

    def ask_counters(self) -> tuple[dict[int, int], list[Effect]]:
        """Asks every node for a fresh counter report; returns the reports seen so far."""
        self.report_asked += 1  # every node's directive poll returns and reports now
        return dict(self.counter_reports), [Notify((Topic.DIRECTIVES,))]

    # -------------------------------------------------------- message handlers
    def _on_register(self, msg: _msg.Register, now: float) -> dict:
        node = msg.node
        role = self.role(node.executor_id)
        if (node.job_name, node.task_index) != (role.job_name, role.task_index):
            raise ControlProtocolError(f"executor {node.executor_id} registered as {node.job_name}:{node.task_index}, "
                                       f"template says {role.job_name}:{role.task_index}")
        if self.abort_reason or self.failures:
            return {"ok": False, "abort": self.abort_reason or "the cluster has already failed"}
        old = self.nodes.get(node.executor_id)
        if old is not None and old.pid != node.pid:
            return {"ok": False, "abort": f"executor id {node.executor_id} is already taken by pid {old.pid} on {old.host} "
                                          "(a retried Spark task?)"}
        clash = [n for n in self.nodes.values()
                 if n.executor_key and n.executor_key == node.executor_key and n.executor_id != node.executor_id]
        self.nodes[node.executor_id] = node
        self.hosts[node.executor_id] = node.host
        self._spec_json = None
        # A registered node is watched from now on, even if its supervisor dies before
        # its first heartbeat (else check_liveness would never see it).
        self.last_heartbeat.setdefault(node.executor_id, now)
        if self.proc_state[node.executor_id] == NodeState.PENDING:
            self.proc_state[node.executor_id] = NodeState.REGISTERED
        self.notify(node_topic(node.executor_id), *((Topic.FORMED,) if self.all_registered() else ()))
        data = f", data port {node.data_port}" if node.data_port else ""
        self.note(logging.INFO, f"tfos node registered: {node.name}, TF port {node.port}{data}")
        return {"ok": True, "shared_executor": [n.executor_id for n in clash]}

    def _cluster_ready(self) -> Optional[dict]:
        if self.abort_reason or self.failures:
            return {"ready": False, "abort": self.abort_reason or "another node failed"}
        if not self.all_registered():
            return None
        if self._spec_json is None:  # encoded once for every node's answer
            self._spec_json = RawJSON(json.dumps(build_cluster_spec(self.nodes.values()), separators=(",", ":")))
        return {"ready": True, "cluster_spec": self._spec_json}

    def _on_await_cluster(self, msg: _msg.AwaitCluster, now: float) -> LongPoll:
        """``{"ready": true, "cluster_spec": {job: [host:port]}}`` once every node registered,
        ``{"ready": false, "abort": why}`` after a failure, else ``{"ready": false,
        "missing": [ids]}`` at the end of the poll."""
        return LongPoll((Topic.FORMED, Topic.DIRECTIVES), self._cluster_ready, min(msg.poll_s, MAX_POLL_S),
                        lambda: self._cluster_ready() or {"ready": False, "missing": self.missing()})

    def _on_heartbeat(self, msg: _msg.Heartbeat, now: float) -> dict:
        eid = msg.executor_id
        self.role(eid)
        self.last_heartbeat[eid] = now
        if msg.host is not None and eid not in self.hosts:
            self.hosts[eid] = msg.host
        if msg.rss is not None:
            self.rss[eid] = msg.rss
        return self.directives()

    def _on_wait_event(self, msg: _msg.WaitEvent, now: float) -> LongPoll:
        """The directives as soon as they differ from ``known`` (or at the end of the poll),
        with ``stack`` (this node's stack requests so far) and, once counter reports were
        asked, ``report`` (how many times)."""
        eid, known = msg.executor_id, msg.known
        self.role(eid)
        if msg.counters is not None:
            self.counters[eid] = dict(msg.counters)
            self.counter_reports[eid] = self.counter_reports.get(eid, 0) + 1
            self.notify()  # the host's counter waits; no long-poll waits for this

        def current() -> dict:
            d = self.directives()
            d["stack"] = self.stack_asked.get(eid, 0)
            if self.stack_all.get(eid):
                d["stack_all"] = True
            if self.report_asked:
                d["report"] = self.report_asked
            return d

        def ready() -> Optional[dict]:
            d = current()
            return d if any(d[k] != known.get(k) for k in d) else None

        return LongPoll((Topic.DIRECTIVES, node_topic(eid)), ready, min(msg.poll_s, MAX_POLL_S), current)

    def _on_status(self, msg: _msg.Status, now: float) -> dict:
        eid, state = msg.executor_id, msg.state
        self.role(eid)
        if state == NodeState.FAILED:
            assert msg.failure is not None  # Status checks it
            self._record_failure(msg.failure, now)
        elif state == NodeState.EXITED:
            assert msg.code is not None  # Status checks it
            self._on_exit(msg, msg.code, now)
        else:
            if state == NodeState.FINISHED:  # set together with the state: node_state reads both
                self.terminated_queues[eid] = list(msg.terminated)
            if self.proc_state[eid] != NodeState.FAILED:
                self.proc_state[eid] = state
            self.notify(node_topic(eid))
            if state == NodeState.FINISHED:
                self.note(logging.INFO, f"tfos node {self.node_name(eid)}: main_fun finished")
        return {"ok": True}

    def _on_exit(self, msg: _msg.Status, code: int, now: float) -> None:
        eid = msg.executor_id
        if msg.rss is not None:
            self.rss[eid] = msg.rss or self.rss.get(eid, 0)
        self.exit_codes[eid] = code
        self.notify(node_topic(eid))
        # While the cluster stops, the supervisors end the TF processes themselves; an exit
        # they did not cause ('unprompted') is a death of its own, e.g. a node SIGKILLed just
        # before a peer's error (a consequence of that death) aborted the cluster.
        if code != 0 and self.proc_state[eid] not in TERMINAL_STATES and (not self.stop_requested or msg.unprompted):
            hint = msg.hint[:2000]  # the supervisor's: an address-space limit in force (_node/address_space.py)
            text = (f"the TF process died ({describe_exit(code)}) before main_fun returned"
                    f"{kill_hint(code, self.rss.get(eid, 0))}{hint}")
            self._record_failure(self.make_failure(eid, "exited", "ProcessDied", text), now)

    def _on_feed_error(self, msg: _msg.FeedError, now: float) -> dict:
        self._record_failure(msg.failure, now)
        return {"ok": True}

    def _on_node_state(self, msg: _msg.NodeStateQuery, now: float) -> dict:
        eid = msg.executor_id
        self.role(eid)
        fails = [f for f in self.failures if f.executor_id == eid]
        reply: dict[str, Any] = {
            "state": self.proc_state[eid].value, "exit_code": self.exit_codes.get(eid),
            "failure": f"{fails[0].error_type}: {fails[0].message}" if fails else "",
            "cluster_failed": bool(self.failures),
        }
        if self.terminated_queues.get(eid):
            reply["terminated"] = list(self.terminated_queues[eid])  # feed tasks skip them quietly
        return reply
