"""A feed task's authenticated connection to its node, and what the task tells the driver
about it (Spark task): the handshake and failover over the fed nodes (:func:`open_link`),
the driver's record of which node got a partition (:func:`claim`), and the reports of a
node that failed, timed out or is not the node (docs/reliability.md "Data plane")."""

from __future__ import annotations

import logging
import select
import socket
import time
import uuid
from typing import Any, Optional

from tfos._common import wire as _wire
from tfos._common.admission import REMEDY
from tfos._common.deadline import Deadline
from tfos._common.wire import DataAuthError
from tfos._control import messages as _msg
from tfos._control.client import ControlClient, shared_client
from tfos._data import local_socket as _local
from tfos._data.feed_plan import FeedPlan, choose_node
from tfos._data.framing import (
    ChunkKind,
    FeedState,
    FrameType,
    parse_json,
    recv_frame,
    recv_json,
    send_frame,
    send_frame_parts,
    send_json,
)
from tfos.cluster_template import NodeInfo
from tfos.errors import ControlProtocolError, DeadlineExceededError, FeedError, FeedTimeoutError, NodeFailure

__all__ = ["Link", "open_link", "drain_answer", "report", "timed_out", "node_gone", "auth_lost", "claim",
           "refuse_retry", "driver_client", "tell_sent", "tell_done", "tell_skipped"]

log = logging.getLogger(__name__)

_CONNECT_TIMEOUT_S = 30.0
#: Handshakes retried when the node closes the connection during one (it sheds the oldest
#: unauthenticated connections while strangers flood its port).
_HANDSHAKE_ATTEMPTS = 6


class Link:
    """One mutually authenticated data connection from a task to a node.

    ``local`` (the node is on the task's host) connects to the node's Unix-domain socket
    first, falling back to TCP; both carry the same handshake and encrypted frames.

    Raises (constructor):
        DataAuthError: The peer did not prove it holds the cluster key.
        OSError, ConnectionError, DeadlineExceededError: The node is unreachable or went away.
    """

    def __init__(self, plan: FeedPlan, node: NodeInfo, partition: int, epoch: int, index: int, local: bool = False):
        self.plan, self.node, self.partition, self.epoch = plan, node, partition, epoch
        self.where = f"partition {partition} (epoch {epoch}) -> {node.name}"
        hs = Deadline(_CONNECT_TIMEOUT_S, f"the data handshake with {node.name}")
        for attempt in range(_HANDSHAKE_ATTEMPTS):
            self.sock = self._connect(node, local)
            #: Where the connection went: the node's Unix socket path, or host:port.
            self.address = node.data_path if self.sock.family == socket.AF_UNIX else f"{node.host}:{node.data_port}"
            try:
                self.session = _wire.client_handshake(
                    self.sock, plan.key, hs, _wire.node_identity(node),
                    {_wire.node_identity(n): n.name for n in plan.nodes if n != node})
                break
            except DataAuthError as exc:
                exc.address = self.address  # for the caller's message
                exc.connection = _local.describe_connection(self.sock)
                self.close()
                raise
            except ConnectionError:
                self.close()
                if attempt + 1 >= _HANDSHAKE_ATTEMPTS or hs.expired():
                    raise
                time.sleep(hs.slice(0.05 * (attempt + 1)))
            except BaseException:
                self.close()
                raise
        try:
            send_json(self.sock, self.session, FrameType.HEADER, {
                "qname": plan.qname, "mode": plan.mode, "partition": partition, "epoch": epoch,
                "kind": (plan.kind or ChunkKind.PICKLED_BATCH).value, "feed_timeout_s": plan.feed_timeout_s,
                "feed_id": plan.feed_id, "index": index, "first_epoch": plan.first_epoch,
                "parts_per_epoch": plan.parts_per_epoch, "last_epoch": plan.last_epoch,
            })
            ftype, status = recv_json(self.sock, self.session, hs)
        except BaseException:
            self.close()
            raise
        self.status = status if ftype is FrameType.STATUS else {"state": FeedState.REFUSED, "message": f"bad {ftype.name} frame instead of a status"}
        self.sock.settimeout(plan.feed_timeout_s)

    @staticmethod
    def _connect(node: NodeInfo, local: bool) -> socket.socket:
        """A connected socket: the node's Unix-domain socket when ``local`` and it has one,
        else (or when that fails) TCP to ``host:data_port``."""
        if local and node.data_path and _local.SUPPORTED:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(_CONNECT_TIMEOUT_S)
                sock.connect(node.data_path)
                why = _local.peer_is_node(sock, node.pid)
                if why is None:
                    return sock
                sock.close()  # nothing was sent on it
                log.warning("%s: not using the Unix-domain data socket %s: %s; using TCP", node.name, node.data_path, why)
            except OSError as exc:  # not this host after all, or the node is gone: TCP decides
                sock.close()
                log.debug("%s: Unix-domain data socket %s refused (%s); using TCP", node.name, node.data_path, exc)
        sock = socket.create_connection((node.host, node.data_port), timeout=_CONNECT_TIMEOUT_S)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except BaseException:
            sock.close()
            raise
        return sock

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def shutdown(self) -> None:
        """Shuts the connection down in both directions (wakes a thread blocked on it)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def peer_spoke(self) -> bool:
        """True when the node sent something (T or X) while we were sending."""
        r, _, _ = select.select([self.sock], [], [], 0)
        return bool(r)

    def send(self, ftype: FrameType, payload: Any = b"") -> None:
        """Sends one frame; ``payload`` is bytes-like, or a list of bytes-like parts
        (an Arrow chunk from :func:`arrow_ipc_parts`) sent as one frame without joining."""
        try:
            if isinstance(payload, list):
                send_frame_parts(self.sock, self.session, ftype, payload)
            else:
                send_frame(self.sock, self.session, ftype, payload)
        except socket.timeout:
            raise FeedTimeoutError(
                f"{self.node.name} accepted no data for {self.plan.feed_timeout_s:g} s while feeding "
                f"{self.where}: main_fun is not reading queue {self.plan.qname!r} (raise feed_timeout if a "
                "step can legitimately take that long)"
            ) from None

    def recv(self) -> tuple[FrameType, bytearray]:
        """The node's next answer frame, skipping PROGRESS frames (each gives the node a
        fresh ``feed_timeout``: main_fun is still taking rows ahead of this partition's).

        Raises:
            FeedTimeoutError: Nothing, not even a PROGRESS frame, came for ``feed_timeout``.
            ConnectionError, OSError, DataAuthError: As :func:`recv_frame`.
        """
        while True:
            try:
                ftype, payload = recv_frame(
                    self.sock, self.session, Deadline(self.plan.feed_timeout_s, f"an answer from {self.node.name} for {self.where}"))
            except DeadlineExceededError:
                raise FeedTimeoutError(
                    f"{self.node.name} sent nothing for {self.plan.feed_timeout_s:g} s for {self.where}: main_fun "
                    "stopped consuming or producing results"
                ) from None
            if ftype is not FrameType.PROGRESS:
                return ftype, payload


def driver_client(plan: FeedPlan) -> ControlClient:
    # One connection per Python worker and cluster for every request of every task it
    # runs (its close() keeps it open), not one per request.
    return shared_client(plan.driver_host, plan.driver_port, plan.key, plan.cluster_id, connect_timeout_s=10.0)


def _report_intrusion(plan: FeedPlan, node: NodeInfo, text: str) -> None:
    """Tells the driver, which logs it as a WARNING, that the process at ``node``'s data
    address is not the node (Spark task; best effort: a failure is logged here only)."""
    if len(text) > 2000:  # DataIntrusion's bound
        text = text[:1980] + "... [truncated]"
    try:
        c = driver_client(plan)
        try:
            c.call(_msg.DataIntrusion(executor_id=node.executor_id, text=text), timeout_s=10.0)
        finally:
            c.close()
    except (OSError, ControlProtocolError, DeadlineExceededError) as exc:
        log.warning("could not tell the driver about the process at %s's data address: %s", node.name, exc)


def report(plan: FeedPlan, node: NodeInfo, message: str, error_type: str = "FeedError") -> None:
    failure = NodeFailure(node.executor_id, node.job_name, node.task_index, node.host, "feed", error_type, message)
    try:
        c = driver_client(plan)
        c.call(_msg.FeedError(failure=failure), timeout_s=10.0)
        c.close()
    except (OSError, ControlProtocolError, DeadlineExceededError):
        pass


#: Seconds a feed task that timed out waits for the stack of the node's main_fun.
_STACK_WAIT_S = 3.0


def timed_out(plan: FeedPlan, node: NodeInfo, exc: FeedTimeoutError) -> FeedTimeoutError:
    """Reports a feed timeout to the driver with, when the node answers within
    :data:`_STACK_WAIT_S`, the stack of its main_fun's thread (Spark task).

    Returns:
        The FeedTimeoutError to raise: ``exc``'s text plus that stack.
    """
    msg = str(exc)
    try:
        c = driver_client(plan)
        try:
            stack = str(c.call(_msg.NodeStack(executor_id=node.executor_id, wait_s=_STACK_WAIT_S),
                               timeout_s=_STACK_WAIT_S + 5.0).get("stack") or "")
        finally:
            c.close()
    except (OSError, ControlProtocolError, DeadlineExceededError) as rexc:
        log.debug("%s: no stack of main_fun: %s", node.name, rexc)
        stack = ""
    if stack:
        msg = f"{msg}\n{stack}"
    report(plan, node, msg, "FeedTimeoutError")
    return FeedTimeoutError(msg)


def node_gone(plan: FeedPlan, node: NodeInfo, where: str, exc: BaseException, connecting: bool = False) -> str:
    """Asks the driver what happened to ``node`` (Spark task).

    ``connecting``: the data connection never opened (connect or handshake failed); when the
    node is still running, the error names its data port and a flood or a firewall as the
    likely cause.

    Returns:
        'terminated' when main_fun called ``DataFeed.terminate()`` on this queue and then
        returned, 'skipped' when it returned without terminating.

    Raises:
        FeedError: The node failed or vanished.
    """
    state: dict = {}
    try:
        c = driver_client(plan)
        deadline = Deadline(8.0, "the node's final state")
        while not deadline.expired():
            state = c.call(_msg.NodeStateQuery(executor_id=node.executor_id), timeout_s=5.0)
            if state.get("state") in _msg.TERMINAL_STATES or state.get("exit_code") is not None:
                break
            time.sleep(0.3)
        c.close()
    except (OSError, ControlProtocolError, DeadlineExceededError):
        pass
    if state.get("state") in (_msg.NodeState.FINISHED, _msg.NodeState.STOPPED) and not state.get("failure"):
        if plan.qname in state.get("terminated", ()):
            log.info("%s: main_fun called DataFeed.terminate() and returned; skipping the partition", where)
            return FeedState.TERMINATED
        log.warning("%s: main_fun on the node already returned; skipping the partition", where)
        return FeedState.SKIPPED
    cause = state.get("failure") or f"{type(exc).__name__}: {exc}"
    msg = f"lost the data connection while feeding {where}: {cause}"
    if connecting and not state.get("failure") and state.get("state") == _msg.NodeState.RUNNING:
        msg = (f"could not open a data connection for {where} at {node.host}:{node.data_port} within "
               f"{_CONNECT_TIMEOUT_S:g} s ({cause}) while the node is running: a flood of connections to that port "
               f"(the node's log names their sources and counts) or a firewall between the executors does this; {REMEDY}")
    report(plan, node, msg)
    raise FeedError(msg) from None


def auth_lost(plan: FeedPlan, node: NodeInfo, where: str, exc: BaseException) -> None:
    """A frame from the node failed authentication mid-stream: report and raise (Spark task).

    Raises:
        FeedError: Always; names the node and why. Rows of the partition are not counted.
    """
    msg = (
        f"{where}: a frame on the connection to {node.name} ({node.host}:{node.data_port}) failed "
        f"authentication ({exc}); something on the path injected or altered data. The partition is "
        "not counted as consumed"
    )
    report(plan, node, msg, "DataAuthError")
    raise FeedError(msg) from None


def refuse_retry(plan: FeedPlan, node: NodeInfo, part: int, epoch: int) -> None:
    """Refuses a retried feed task: its failed attempt may already have fed some rows, and
    feeding the partition again would silently train on them twice (Spark task side)."""
    from pyspark import TaskContext

    tc = TaskContext.get()
    attempt = tc.attemptNumber() if tc is not None else 0
    if attempt > 0:
        msg = (
            f"partition {part} (epoch {epoch}) -> {node.name}: Spark retried the feed task (attempt {attempt + 1}) "
            "after an earlier attempt failed; tfos does not feed a partition twice, because rows the earlier "
            "attempt may have fed would be trained on again. Fix the cause of the first failure (the other errors "
            "listed, or the executor log), then run it again" + _RECOMPUTED_RESULTS.get(plan.mode, "")
        )
        report(plan, node, msg)
        raise FeedError(msg)


#: Added to a refused re-run of an inference task: after inference() returned, Spark re-runs
#: its tasks when a persisted result partition is lost with its executor.
_RECOMPUTED_RESULTS = {"inference": (
    ". For inference() this also happens after inference() returned, when a result partition was lost with "
    "its executor and Spark recomputes it: tfos does not rerun inference there; save the results (e.g. "
    "write them out) before the cluster's executors may go, or call inference() again"
)}


def claim(plan: FeedPlan, node: NodeInfo, index: int, where: str) -> None:
    """Asks the driver to record that partition ``index`` of this feed goes to ``node``
    (Spark task), so that a re-run of the task (a retry, or a stage resubmission that starts
    again at attempt 0) is refused wherever it runs.

    Raises:
        FeedError: The partition was already handed to a node for this feed, or the driver
            could not be asked.
    """
    try:
        c = driver_client(plan)
        try:
            # The token makes a resent claim (the client resends once when its connection
            # broke, maybe after the driver recorded the claim) the same claim, not a re-run.
            resp = c.call(_msg.ClaimPartition(feed_id=plan.feed_id, index=index, node=node.name, token=uuid.uuid4().hex),
                          timeout_s=30.0)
        finally:
            c.close()
    except (OSError, ControlProtocolError, DeadlineExceededError) as exc:
        # Reported (best effort: the driver may be just as unreachable for the report) so
        # that the driver's error names this cause, not only the refused retry it leads to.
        msg = f"{where}: could not record the partition with the tfos driver: {exc}"
        report(plan, node, msg)
        raise FeedError(msg) from None
    if not resp.get("granted"):
        msg = (
            f"{where}: the driver's record shows partition index {index} of this feed was already handed to "
            f"{resp.get('node')}; Spark re-ran its feed task (a task retry or a stage resubmission), and tfos never "
            "feeds a partition twice because its rows would be trained on again. Fix the cause of the first "
            "failure (see the executor log), then run train() again" + _RECOMPUTED_RESULTS.get(plan.mode, "")
        )
        report(plan, node, msg)
        raise FeedError(msg)


def open_link(plan: FeedPlan, index: int) -> tuple[Optional[Link], NodeInfo, str]:
    from tfos._common.executor import executor_identity, node_host

    epoch, part = divmod(index, plan.parts_per_epoch)
    epoch += plan.first_epoch
    key, _ = executor_identity()
    host = node_host(plan.driver_host, plan.driver_port)
    node, how = choose_node(plan.nodes, index, key, host)
    refuse_retry(plan, node, part, epoch)
    if how == "remote":
        log.warning("partition %d runs on an executor without a fed node; sending it to %s over the network", part, node.name)
    # Failover order when a node does not authenticate: the chosen node, then the others.
    candidates = [node] + [n for n in plan.nodes if n != node]
    refused: list[str] = []
    for cand in candidates:
        where = f"partition {part} (epoch {epoch}) -> {cand.name}"
        try:
            link = Link(plan, cand, part, epoch, index, local=cand.executor_key == key or cand.host == host)
        except DataAuthError as exc:
            address = exc.address or f"{cand.host}:{cand.data_port}"
            seen = f" ({exc.connection})" if exc.connection else ""
            if isinstance(exc, _wire.DataRelayError):
                why = (
                    f"{cand.name}: the process listening at its data address {address}{seen} relayed the handshake "
                    f"to {exc.reached}, which refused it: a process without the cluster key sits in between (the node "
                    "released its port and another process took it). No data was sent to it"
                )
            else:
                why = (
                    f"{cand.name}: the process listening at its data address {address}{seen} failed to "
                    f"authenticate ({exc}); it is not this cluster's node (the node released the port and another "
                    "process took it, or a relay sits in between). No data was sent to it"
                )
            log.warning("%s: %s", where, why)
            _report_intrusion(plan, cand, f"partition {part} (epoch {epoch}): {why}")
            refused.append(why)
            continue
        except (OSError, DeadlineExceededError, ControlProtocolError) as exc:
            if refused:  # failing over: this node cannot take the partition either
                log.warning("%s: cannot fail over to this node: %s", where, exc)
                refused.append(f"{cand.name}: unreachable ({exc})")
                continue
            return None, cand, node_gone(plan, cand, where, exc, connecting=True)
        state = link.status.get("state")
        if state == FeedState.OK:
            try:
                claim(plan, cand, index, where)
            except BaseException:
                link.close()
                raise
            if refused:
                log.warning("%s: failed over after %d node(s) did not authenticate", where, len(refused))
            return link, cand, FeedState.OK
        link.close()
        if state == FeedState.REFUSED:
            msg = f"{where}: {link.status.get('message')}"
            report(plan, cand, msg)
            raise FeedError(msg)
        if refused:
            refused.append(f"{cand.name}: not taking data (state {state})")
            continue
        return None, cand, str(state)
    msg = f"partition {part} (epoch {epoch}): no fed node authenticated or took the partition; " + "; ".join(refused)
    report(plan, node, msg, "DataAuthError")
    raise FeedError(msg)


def drain_answer(link: Link) -> tuple[str, dict]:
    """Reads the node's answer after the partition was sent (train mode)."""
    ftype, payload = link.recv()
    info = parse_json(ftype, payload)
    if ftype is FrameType.ACK:
        return FeedState.OK, info
    if ftype is FrameType.TERMINATED:
        return FeedState.TERMINATED, info
    if ftype is FrameType.ERROR:
        return str(info.get("state", FeedState.MAIN_FUN_FAILED)), info
    raise ConnectionError(f"unexpected {ftype.name} frame from the node")


def _tell_driver(plan: FeedPlan, msg_type: type, index: int, what: str) -> None:
    """Sends the message of class ``msg_type`` (PartitionSent, PartitionDone, PartitionSkipped)
    for partition ``index`` of the feed to the driver; a failure is logged ("could not tell
    the driver that partition N <what>") and not raised."""
    try:
        c = driver_client(plan)
        try:
            c.call(msg_type(feed_id=plan.feed_id, index=index), timeout_s=10.0)
        finally:
            c.close()
    except (OSError, ControlProtocolError, DeadlineExceededError) as exc:
        log.warning("could not tell the driver that partition %d %s: %s", index, what, exc)


def tell_sent(plan: FeedPlan, index: int) -> None:
    """Tells the driver partition ``index`` was handed over (before waiting for its ACK)."""
    if plan.report_sent:
        _tell_driver(plan, _msg.PartitionSent, index, "was sent")


def tell_done(plan: FeedPlan, index: int) -> None:
    """Tells the driver the node acknowledged partition ``index`` (restarts resume after it)."""
    if plan.report_done:
        _tell_driver(plan, _msg.PartitionDone, index, "was consumed")


def tell_skipped(plan: FeedPlan, index: int) -> None:
    """Tells the driver partition ``index`` went to no node, so that the nodes' epoch-aware
    readers do not wait for it (see tfos._data.epoch_order.EpochOrder)."""
    if plan.mode == "train" and plan.feed_id:
        _tell_driver(plan, _msg.PartitionSkipped, index, "went to no node")
