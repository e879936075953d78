"""The control-plane core of one cluster: the node registry, the feed ledger and the
liveness verdicts, as one pure state machine (runs in the control host: the driver, or
executor 0 under Spark Connect).

State in, effects out: :meth:`ClusterCore.apply` takes one typed message and the time and
returns the answer and the effects (:mod:`tfos._control.effects`); :meth:`ClusterCore.check_liveness`
takes the time and returns the effects of its verdicts. No lock, no socket, no clock read,
no logging: :class:`tfos._control.host.ClusterHost` serialises every call and carries the
effects out. Unit-tested by feeding messages (tests/unit/test_cluster_state.py). See
docs/architecture.md "The control-plane core".
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Sequence

from tfos._control import messages as _msg
from tfos._control.effects import AccumulatorUpdates, Effect, NodeLines
from tfos._control.messages import TERMINAL_STATES, NodeState
from tfos._control.protocol import LongPoll, Reply, Topic, node_topic
from tfos._control.registry import MAX_STACK_CHARS, MAX_STACK_WAIT_S, Registry
from tfos.cluster_template import NodeRole

__all__ = ["ClusterCore"]


class ClusterCore(Registry):
    """The :class:`~tfos._control.registry.Registry` of one cluster with the rest of the
    node messages: the feed ledger's (partitions, epochs, checkpoints), stack requests,
    output lines, accumulators, TensorBoard, data-plane intrusions; and the liveness
    verdicts (pure).

    Args:
        cluster_id: The cluster id (frames must carry it).
        roles: One role per executor id.
        heartbeat_timeout_s: Seconds without a supervisor heartbeat before a node is lost.
    """

    def __init__(self, cluster_id: str, roles: Sequence[NodeRole], heartbeat_timeout_s: float):
        super().__init__(cluster_id, roles, heartbeat_timeout_s)
        self._routes: dict[type, Callable[[Any, float], Reply]] = {
            _msg.NodeStack: self._on_node_stack, _msg.Stack: self._on_stack,
            _msg.Log: self._on_log, _msg.Accumulators: self._on_accumulators,
            _msg.TensorBoard: self._on_tensorboard, _msg.PartitionSent: self._on_partition_sent,
            _msg.PartitionDone: self._on_partition_done, _msg.PartitionSkipped: self._on_partition_skipped,
            _msg.Checkpoint: self._on_checkpoint, _msg.ClaimPartition: self._on_claim_partition,
            _msg.EpochHandover: self._on_epoch_handover, _msg.DataIntrusion: self._on_data_intrusion,
        }

    def handles(self, msg_type: type) -> bool:
        """True for a message class this core answers."""
        return msg_type in self._routes or super().handles(msg_type)

    def apply(self, msg: _msg.Message, now: float) -> tuple[Reply, list[Effect]]:
        """Applies one node message at time ``now`` (the host's monotonic seconds).

        Returns:
            The answer (a dict, or a :class:`LongPoll` whose ``ready``/``expire`` read this
            core: the host calls them under its lock) and the effects.

        Raises:
            ControlProtocolError: A message of no node of this cluster, or of a type this
                core does not answer.
        """
        handler = self._routes.get(type(msg))
        if handler is None:
            return super().apply(msg, now)
        try:
            return handler(msg, now), self.drain()
        except BaseException:
            self.drain()
            raise

    def returned_without_terminate(self, executor_ids: Sequence[int], qname: str) -> list[int]:
        """Ids among ``executor_ids`` whose main_fun returned without terminating ``qname``."""
        return [e for e in executor_ids if self.proc_state.get(e) in (NodeState.FINISHED, NodeState.STOPPED)
                and qname not in self.terminated_queues.get(e, ())]

    def counters_fresh(self, base: dict[int, int]) -> bool:
        """True when every node of ``base`` (id -> reports seen) reported again or ended."""
        return all(self.counter_reports.get(e, 0) > n or e in self.exit_codes or self.proc_state.get(e) in TERMINAL_STATES
                   for e, n in base.items())

    def checkpoints(self) -> dict[str, int]:
        """``{node name ('job:task'): epochs}``: each node's latest checkpoint report."""
        return {f"{self.roles[e].job_name}:{self.roles[e].task_index}": n for e, n in self.ledger.checkpoints.items()}

    def rows_consumed(self) -> int:
        """Total rows the TF processes have taken from their feeds (from their reports)."""
        return sum(c.get("rows", 0) for c in list(self.counters.values()))

    def check_liveness(self, now: float) -> list[Effect]:
        """Declares lost every live node whose supervisor missed ``heartbeat_timeout_s``
        (the host calls it about every second, with ``now`` its monotonic clock).

        While the cluster is being stopped or aborted a silent node is not lost: it is
        taken as stopped with the cluster (its Spark task may have been killed with the
        teardown's job cancellation), with an INFO line, and no longer awaited. When the
        host itself did not run for two thirds of the timeout or more (the process was
        stopped, or starved of CPU), a node lost within twice the timeout of that stall
        gets a message that says so: the silence is mostly the host's own.
        """
        previous, self.last_liveness_check = self.last_liveness_check, now
        lost = []
        for eid, seen in self.last_heartbeat.items():
            if eid in self.exit_codes or eid in self.gone or now - seen <= self.heartbeat_timeout_s:
                continue
            if self.stop_requested:  # being torn down: no verdict
                self.gone.add(eid)
                if self.proc_state[eid] not in TERMINAL_STATES:
                    self.proc_state[eid] = NodeState.STOPPED
                self.note(logging.INFO, f"tfos node {self.node_name(eid)}: silent for {now - seen:.1f} s while the "
                                         "cluster stops; taken as stopped with it")
                self.notify(node_topic(eid))
            elif self.proc_state[eid] not in (NodeState.FAILED, NodeState.STOPPED):
                lost.append((eid, now - seen))
        if previous is not None and now - previous >= self.heartbeat_timeout_s * 2 / 3:
            self.stall = (now, now - previous)
        stall = self.stall if self.stall and now - self.stall[0] <= 2 * self.heartbeat_timeout_s else None
        for eid, silence in lost:
            self._record_failure(self.make_failure(eid, "lost", "NodeLost", self._lost_text(silence, stall, now)), now)
        return self.drain()

    def _lost_text(self, silence: float, stall: Optional[tuple[float, float]], now: float) -> str:
        head = f"no heartbeat for {silence:.1f} s (timeout {self.heartbeat_timeout_s:g} s): "
        if stall is None:
            return head + ("the executor, its Python worker or the node supervisor died without a report (executor JVM "
                           "killed, out of memory, or host lost)")
        ago = now - stall[0]
        when = "before this check" if ago < 1.0 else f"until {ago:.1f} s before this check"
        return head + (f"this driver did not run for about {stall[1]:.1f} s {when} (its process was stopped, "
                       "e.g. by SIGSTOP or a suspended VM, or starved of CPU), and a node ends itself when the driver "
                       f"does not answer it for {self.heartbeat_timeout_s:g} s; or the executor, its Python worker or "
                       "the node supervisor died without a report")

    def status(self) -> dict:
        """A snapshot of the cluster for a client (JSON-ready): registered, missing, nodes,
        states, exit_codes, failures, tensorboard_url, feed_closed, stop_requested, abort."""
        return {
            "registered": self.all_registered(), "missing": self.missing(),
            "nodes": [n.to_dict() for n in self.nodes_snapshot()],
            "states": {str(k): v.value for k, v in self.proc_state.items()},
            "exit_codes": {str(k): v for k, v in self.exit_codes.items()},
            "failures": [f.to_dict() for f in self.failures],
            "lost_workers": [f.to_dict() for f in self.lost_workers],
            "tensorboard_url": self.tensorboard_url, "feed_closed": self.feed_closed,
            "stop_requested": self.stop_requested, "abort": self.abort_reason,
        }

    def _on_node_stack(self, msg: _msg.NodeStack, now: float) -> LongPoll:
        """A feed task that timed out asks for the stack of main_fun's thread on a node: the
        node's event loop sees the request within one poll and answers with ``stack``.
        Waits ``wait_s`` (at most :data:`MAX_STACK_WAIT_S`); ``{"stack": ""}`` when the node
        did not answer in time or has ended."""
        eid = msg.executor_id
        self.role(eid)
        seq = self.stack_asked.get(eid, 0) + 1
        self.stack_asked[eid] = seq
        self.stack_all[eid] = msg.all_threads
        self.notify(node_topic(eid))

        def ready() -> Optional[dict]:
            got, text = self.stacks.get(eid, (0, ""))
            if got >= seq:
                return {"stack": text}
            return {"stack": ""} if self.proc_state[eid] in TERMINAL_STATES else None

        return LongPoll((node_topic(eid),), ready, max(0.0, min(msg.wait_s, MAX_STACK_WAIT_S)),
                        lambda: ready() or {"stack": ""})

    def _on_stack(self, msg: _msg.Stack, now: float) -> dict:
        eid = msg.executor_id
        self.role(eid)
        if msg.seq > self.stacks.get(eid, (0, ""))[0]:
            self.stacks[eid] = (msg.seq, msg.text[:MAX_STACK_CHARS])
            self.notify(node_topic(eid))
        return {"ok": True}

    def _on_data_intrusion(self, msg: _msg.DataIntrusion, now: float) -> dict:
        """A feed task found a process that is not the node at a node's data address: a
        WARNING (the first 10 of a cluster, then every 100th), not a failure."""
        self.role(msg.executor_id)
        self.intrusions += 1
        n = self.intrusions
        if n <= 10 or n % 100 == 0:
            self.note(logging.WARNING, f"tfos data plane of cluster {self.cluster_id}: {msg.text} (reported by a feed "
                                        f"task; {n} such report(s) so far)")
        return {"ok": True}

    def _on_log(self, msg: _msg.Log, now: float) -> dict:
        r = self.role(msg.executor_id)
        self.emit(NodeLines(f"{r.job_name}:{r.task_index}", tuple(msg.lines)))
        return {"ok": True}

    def _on_accumulators(self, msg: _msg.Accumulators, now: float) -> dict:
        eid = msg.executor_id
        self.role(eid)
        self.emit(AccumulatorUpdates(eid, self.node_name(eid), list(msg.updates)))
        return {"ok": True}

    def _on_tensorboard(self, msg: _msg.TensorBoard, now: float) -> dict:
        error = msg.error[:8000]
        if error:
            self.tensorboard_error = error
            self.note(logging.WARNING, f"TensorBoard of cluster {self.cluster_id} failed to start:\n{error}")
        else:
            self.tensorboard_url = msg.url
            self.note(logging.INFO, f"TensorBoard for cluster {self.cluster_id}: {msg.url}")
        self.notify()
        return {"ok": True}

    def _on_partition_sent(self, msg: _msg.PartitionSent, now: float) -> dict:
        total = self.ledger.handed_over(msg.feed_id, msg.index)
        if total is not None and not self.feed_closed:
            self.note(logging.INFO, f"feed {msg.feed_id}: all {total} partitions handed over; closing the feed of every node")
            self.feed_closed = True
            self.notify(Topic.DIRECTIVES)
        return {"ok": True}

    def _on_partition_done(self, msg: _msg.PartitionDone, now: float) -> dict:
        self.ledger.acknowledged(msg.feed_id, msg.index)
        return {"ok": True}

    def _on_checkpoint(self, msg: _msg.Checkpoint, now: float) -> dict:
        """The node's checkpoint holds the first ``epochs`` epochs of the running train()."""
        self.role(msg.executor_id)
        self.ledger.checkpoints[msg.executor_id] = msg.epochs
        self.note(logging.INFO, f"tfos node {self.node_name(msg.executor_id)}: checkpoint holds {msg.epochs} epoch(s) "
                                 "of the running train()")
        return {"ok": True}

    def _on_claim_partition(self, msg: _msg.ClaimPartition, now: float) -> dict:
        return self.ledger.claim(msg.feed_id, msg.index, msg.node, msg.token)

    def _on_partition_skipped(self, msg: _msg.PartitionSkipped, now: float) -> dict:
        self.ledger.skip(msg.feed_id, msg.index)
        return {"ok": True}

    def _on_epoch_handover(self, msg: _msg.EpochHandover, now: float) -> dict:
        return self.ledger.epoch_handover(msg.feed_id, msg.lo, msg.hi, msg.node)
