"""Spark feed and inference tasks (built on the driver, run in Spark tasks).

Each task takes one partition of one epoch, picks a node (its own executor's node
first), authenticates to the node's data server and streams the partition in chunks:
raw PySpark frames when possible (no unpickling here), pickled batches otherwise, or
Arrow record batches for DataFrames. It never does per-row IPC, and it never holds a
row longer than the plan's linger time (:mod:`tfos._data.outbox`): a frame goes out when
it is full or when its oldest row is that old, whichever comes first.

What a task does when the node cannot take data:

* the node called ``DataFeed.terminate()`` -> the partition is skipped at once, without
  reading its rows;
* the node's ``main_fun`` already returned -> the partition is skipped and counted; the
  driver logs a warning with the count (docs/datafeed.md "Ending early");
* the node failed or died -> the task reports a feed failure to the driver (which cancels
  this cluster's jobs) and raises an error naming the node and the partition;
* the process on the node's data port does not prove it is the node (it took over a
  released port, or relays to another node, which refuses the handshake) -> nothing but
  a nonce and a proof bound to that process's nonce and to the node's identity was sent
  to it; the task tells the driver (a WARNING there names the node and the connection),
  fails over to the next fed node, and when none authenticates it reports and raises an
  error naming the node and why (docs/reliability.md "Data plane");
* the node already received this partition index of this feed (Spark re-ran the task
  after a retry or a stage resubmission) -> the task raises instead of feeding twice.

Every frame in both directions is encrypted and authenticated (:mod:`tfos._data.framing`):
a partition counts as consumed only on an authenticated ``A`` frame, and result frames are
yielded (and later unpickled by Spark) only after their tag checked.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import select
import socket
import struct
import threading
import time
import uuid
from typing import Any, Iterator, Optional, Union

from tfos._common import wire as _wire
from tfos._common.deadline import Deadline
from tfos._common.wire import DataAuthError
from tfos._control import messages as _msg
from tfos._control.client import ControlClient, shared_client
from tfos._data import local_socket as _local
from tfos._data.framing import (
    MAX_DATA_FRAME_BYTES,
    SPARK_SCHEMA_KEY,
    ChunkKind,
    FrameType,
    parse_json,
    recv_frame,
    recv_json,
    send_frame,
    send_frame_parts,
    send_json,
)
from tfos._data.outbox import InputFailed, Outbox, feed_linger_s
from tfos.cluster_template import NodeInfo
from tfos.errors import ControlProtocolError, DeadlineExceededError, FeedError, FeedTimeoutError, NodeFailure, TFOSError

__all__ = ["FeedPlan", "choose_node", "make_feed_fn", "make_arrow_feed_fn", "make_infer_fn", "arrow_slices", "FeedError",
           "arrow_ipc_parts"]

log = logging.getLogger(__name__)

#: Most rows per chunk when rows are pickled in the task (RDDs that are not fed as raw
#: PySpark batches, e.g. a Python-pipelined RDD run in the feed task's own worker); fewer
#: when the rows are large (a chunk of about :data:`PACK_BYTES`).
GENERIC_CHUNK_ROWS = 1024
#: Target size of one Arrow chunk, in bytes. Spark hands ``mapInArrow`` record batches of up
#: to ``spark.sql.execution.arrow.maxRecordsPerBatch`` (10,000) rows, 30 MB for MNIST rows;
#: they are sliced (zero copy) so that the node's bounded queue holds megabytes, not
#: hundreds of megabytes, and the node decodes while the task still sends.
ARROW_CHUNK_BYTES = 1 << 20
#: Bytes of PySpark pickled batches a feed task packs into one data frame
#: (``ChunkKind.PICKLED_BATCHES``; a frame closes once it holds at least this many, so it
#: is at most this plus one batch). PySpark pickles an RDD's rows in batches of about 64 to
#: 100 KB (32 MNIST rows), and each frame costs a tag, a send, a receive and a queue
#: hand-over on top of its bytes: ``scripts/bench_frame_hop.py`` measures the
#: difference.
PACK_BYTES = 1 << 20
_CONNECT_TIMEOUT_S = 30.0
#: Handshakes retried when the node closes the connection during one (it sheds the oldest
#: unauthenticated connections while strangers flood its port).
_HANDSHAKE_ATTEMPTS = 6


@dataclasses.dataclass(frozen=True)
class FeedPlan:
    """Everything a feed task needs, captured by value in the Spark closure.

    Attributes:
        cluster_id: The cluster id.
        key: The cluster key (never logged).
        driver_host, driver_port: The control server.
        nodes: The feedable nodes (chief/master/worker), ordered by executor id.
        qname: The node queue to feed.
        mode: 'train' or 'inference'.
        kind: The chunk encoding of the input (None: rows re-pickled in the task).
        parts_per_epoch: Partitions in one epoch of the input.
        feed_timeout_s: Longest time a node may accept no data (or return no results).
        feed_id: Id of this feed job (its Spark job group).
        report_sent: Tell the driver when each partition has been handed over (sent or
            skipped), so it can end the feed of every node as soon as all are
            (``train(..., end_of_feed=True)``).
        first_epoch: Epoch number of the job's first epoch (a feed resumed after a
            restart starts at the failed epoch; rows keep their epoch numbers).
        report_done: Tell the driver each partition the node acknowledged (consumed or
            skipped after ``terminate()``), so a restart knows where to resume
            (``max_restarts``).
        last_epoch: Epoch number of the job's last epoch (-1: not known, e.g. a stream's
            feed), so a node that gets no row of the last epochs still knows they exist
            (``as_dataset(steps_per_epoch=S)`` gives ``S`` batches for each).
        linger_s: Longest time a row read by the task waits to be sent, in seconds
            (default: the driver's ``TFOS_FEED_LINGER_MS``, else 0.05; see
            :mod:`tfos._data.outbox` and docs/datafeed.md "Latency: the linger time").
    """

    cluster_id: str
    key: bytes = dataclasses.field(repr=False)
    driver_host: str = ""
    driver_port: int = 0
    nodes: tuple[NodeInfo, ...] = ()
    qname: str = "input"
    mode: str = "train"
    kind: Optional[ChunkKind] = None
    parts_per_epoch: int = 1
    feed_timeout_s: float = 600.0
    feed_id: str = ""
    report_sent: bool = False
    first_epoch: int = 0
    report_done: bool = False
    last_epoch: int = -1
    linger_s: float = dataclasses.field(default_factory=feed_linger_s)

    def __post_init__(self) -> None:
        if not self.nodes:
            raise TFOSError("the cluster has no chief/master/worker node to feed")
        if self.mode not in ("train", "inference"):
            raise ValueError(f"bad feed mode {self.mode!r}")
        if self.feed_timeout_s <= 0:
            raise ValueError("feed_timeout must be > 0 seconds")
        if not 0 <= self.linger_s <= 60:
            raise ValueError(f"linger_s must be 0 to 60 seconds, got {self.linger_s!r}")


def choose_node(nodes: tuple[NodeInfo, ...], index: int, executor_key: str, host: str) -> tuple[NodeInfo, str]:
    """Picks the node that receives partition ``index`` (pure).

    Nodes on the task's own executor come first (under ``local[N]`` all nodes share one
    executor, and partitions are spread over them by index, so no node steals another's
    data); then nodes on the same host; then any node (the task runs on an executor that
    hosts no feedable node, e.g. a ps executor or a spare one: docs/datafeed.md "Which node
    gets which partition").

    Returns:
        ``(node, how)`` where how is 'executor', 'host' or 'remote'.
    """
    for how, group in (
        ("executor", [n for n in nodes if n.executor_key == executor_key]),
        ("host", [n for n in nodes if n.host == host]),
        ("remote", list(nodes)),
    ):
        if group:
            return group[index % len(group)], how
    raise TFOSError("no node to feed")


class _Link:
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
                "kind": (plan.kind or ChunkKind.PICKLED_BATCH).value, "feed_timeout": plan.feed_timeout_s,
                "feed_id": plan.feed_id, "index": index, "first_epoch": plan.first_epoch,
                "parts_per_epoch": plan.parts_per_epoch, "last_epoch": plan.last_epoch,
            })
            ftype, status = recv_json(self.sock, self.session, hs)
        except BaseException:
            self.close()
            raise
        self.status = status if ftype is FrameType.STATUS else {"state": "error", "message": f"bad {ftype.name} frame instead of a status"}
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


def _client(plan: FeedPlan) -> ControlClient:
    # One connection per Python worker and cluster for every request of every task it
    # runs (its close() keeps it open), not one per request.
    return shared_client(plan.driver_host, plan.driver_port, plan.key, plan.cluster_id, connect_timeout_s=10.0)


def _report_intrusion(plan: FeedPlan, node: NodeInfo, text: str) -> None:
    """Tells the driver, which logs it as a WARNING, that the process at ``node``'s data
    address is not the node (Spark task; best effort: a failure is logged here only)."""
    if len(text) > 2000:  # DataIntrusion's bound
        text = text[:1980] + "... [truncated]"
    try:
        c = _client(plan)
        try:
            c.call(_msg.DataIntrusion(executor_id=node.executor_id, text=text), timeout_s=10.0)
        finally:
            c.close()
    except (OSError, ControlProtocolError, DeadlineExceededError) as exc:
        log.warning("could not tell the driver about the process at %s's data address: %s", node.name, exc)


def _report(plan: FeedPlan, node: NodeInfo, message: str, error_type: str = "FeedError") -> None:
    failure = NodeFailure(node.executor_id, node.job_name, node.task_index, node.host, "feed", error_type, message)
    try:
        c = _client(plan)
        c.call(_msg.FeedError(failure=failure), timeout_s=10.0)
        c.close()
    except (OSError, ControlProtocolError, DeadlineExceededError):
        pass


#: Seconds a feed task that timed out waits for the stack of the node's main_fun.
_STACK_WAIT_S = 3.0


def _timed_out(plan: FeedPlan, node: NodeInfo, exc: FeedTimeoutError) -> FeedTimeoutError:
    """Reports a feed timeout to the driver with, when the node answers within
    :data:`_STACK_WAIT_S`, the stack of its main_fun's thread (Spark task).

    Returns:
        The FeedTimeoutError to raise: ``exc``'s text plus that stack.
    """
    msg = str(exc)
    try:
        c = _client(plan)
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
    _report(plan, node, msg, "FeedTimeoutError")
    return FeedTimeoutError(msg)


def _node_gone(plan: FeedPlan, node: NodeInfo, where: str, exc: BaseException) -> str:
    """Asks the driver what happened to ``node`` (Spark task).

    Returns:
        'terminated' when main_fun called ``DataFeed.terminate()`` on this queue and then
        returned, 'skipped' when it returned without terminating.

    Raises:
        FeedError: The node failed or vanished.
    """
    state: dict = {}
    try:
        c = _client(plan)
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
            return "terminated"
        log.warning("%s: main_fun on the node already returned; skipping the partition", where)
        return "skipped"
    cause = state.get("failure") or f"{type(exc).__name__}: {exc}"
    msg = f"lost the data connection while feeding {where}: {cause}"
    _report(plan, node, msg)
    raise FeedError(msg) from None


def _auth_lost(plan: FeedPlan, node: NodeInfo, where: str, exc: BaseException) -> None:
    """A frame from the node failed authentication mid-stream: report and raise (Spark task).

    Raises:
        FeedError: Always; names the node and why. Rows of the partition are not counted.
    """
    msg = (
        f"{where}: a frame on the connection to {node.name} ({node.host}:{node.data_port}) failed "
        f"authentication ({exc}); something on the path injected or altered data. The partition is "
        "not counted as consumed"
    )
    _report(plan, node, msg, "DataAuthError")
    raise FeedError(msg) from None


def _refuse_retry(plan: FeedPlan, node: NodeInfo, part: int, epoch: int) -> None:
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
        _report(plan, node, msg)
        raise FeedError(msg)


#: Added to a refused re-run of an inference task: after inference() returned, Spark re-runs
#: its tasks when a persisted result partition is lost with its executor.
_RECOMPUTED_RESULTS = {"inference": (
    ". For inference() this also happens after inference() returned, when a result partition was lost with "
    "its executor and Spark recomputes it: tfos does not rerun inference there; save the results (e.g. "
    "write them out) before the cluster's executors may go, or call inference() again"
)}


def _claim(plan: FeedPlan, node: NodeInfo, index: int, where: str) -> None:
    """Asks the driver to record that partition ``index`` of this feed goes to ``node``
    (Spark task), so that a re-run of the task (a retry, or a stage resubmission that starts
    again at attempt 0) is refused wherever it runs.

    Raises:
        FeedError: The partition was already handed to a node for this feed, or the driver
            could not be asked.
    """
    try:
        c = _client(plan)
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
        _report(plan, node, msg)
        raise FeedError(msg) from None
    if not resp.get("granted"):
        msg = (
            f"{where}: the driver's record shows partition index {index} of this feed was already handed to "
            f"{resp.get('node')}; Spark re-ran its feed task (a task retry or a stage resubmission), and tfos never "
            "feeds a partition twice because its rows would be trained on again. Fix the cause of the first "
            "failure (see the executor log), then run train() again" + _RECOMPUTED_RESULTS.get(plan.mode, "")
        )
        _report(plan, node, msg)
        raise FeedError(msg)


def _open(plan: FeedPlan, index: int) -> tuple[Optional[_Link], NodeInfo, str]:
    from tfos._node.start_task import executor_identity, node_host

    epoch, part = divmod(index, plan.parts_per_epoch)
    epoch += plan.first_epoch
    key, _ = executor_identity()
    host = node_host(plan.driver_host, plan.driver_port)
    node, how = choose_node(plan.nodes, index, key, host)
    _refuse_retry(plan, node, part, epoch)
    if how == "remote":
        log.warning("partition %d runs on an executor without a fed node; sending it to %s over the network", part, node.name)
    # Failover order when a node does not authenticate: the chosen node, then the others.
    candidates = [node] + [n for n in plan.nodes if n != node]
    refused: list[str] = []
    for cand in candidates:
        where = f"partition {part} (epoch {epoch}) -> {cand.name}"
        try:
            link = _Link(plan, cand, part, epoch, index, local=cand.executor_key == key or cand.host == host)
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
            return None, cand, _node_gone(plan, cand, where, exc)
        state = link.status.get("state")
        if state == "ok":
            try:
                _claim(plan, cand, index, where)
            except BaseException:
                link.close()
                raise
            if refused:
                log.warning("%s: failed over after %d node(s) did not authenticate", where, len(refused))
            return link, cand, "ok"
        link.close()
        if state == "error":
            msg = f"{where}: {link.status.get('message')}"
            _report(plan, cand, msg)
            raise FeedError(msg)
        if refused:
            refused.append(f"{cand.name}: not taking data (state {state})")
            continue
        return None, cand, str(state)
    msg = f"partition {part} (epoch {epoch}): no fed node authenticated or took the partition; " + "; ".join(refused)
    _report(plan, node, msg, "DataAuthError")
    raise FeedError(msg)


def _drain_answer(link: _Link) -> tuple[str, dict]:
    """Reads the node's answer after the partition was sent (train mode)."""
    ftype, payload = link.recv()
    info = parse_json(ftype, payload)
    if ftype is FrameType.ACK:
        return "ok", info
    if ftype is FrameType.TERMINATED:
        return "terminated", info
    if ftype is FrameType.ERROR:
        return str(info.get("state", "failed")), info
    raise ConnectionError(f"unexpected {ftype.name} frame from the node")


class _Packing:
    """How the items a feed task reads from its partition become data frame payloads
    (Spark task).

    * ``ChunkKind.PICKLED_BATCHES`` (PySpark's raw pickled batches): packed, each batch
      preceded by its uint32 big-endian length, into frames of at least :data:`PACK_BYTES`
      (at most that plus one batch, and never past ``MAX_DATA_FRAME_BYTES``); a payload is
      a list of parts (the prefixes and the batches themselves, not copied), sent as one
      frame by :func:`~tfos._data.framing.send_frame_parts`;
    * kind None (rows): pickled in chunks of up to :data:`GENERIC_CHUNK_ROWS` rows, as
      many as make about :data:`PACK_BYTES` by the size of the rows pickled so far (the
      first chunk holds one row);
    * any other kind (Arrow IPC parts, other raw frames): one item per frame, as it is.

    Whatever the kind, a frame also goes out once its oldest item is ``plan.linger_s`` old
    (:class:`~tfos._data.outbox.Outbox`).
    """

    def __init__(self, kind: Optional[ChunkKind]):
        self.kind = kind
        if kind is ChunkKind.PICKLED_BATCHES:
            self.limit, self.max_size = PACK_BYTES, MAX_DATA_FRAME_BYTES
        elif kind is None:
            # The first frame holds one row: its pickled size sets the chunk size of the
            # next ones (rows of 1 MiB must not make a chunk of 1 GiB).
            self.limit, self.max_size = 1, GENERIC_CHUNK_ROWS
        else:
            self.limit, self.max_size = 1, 1

    def outbox(self, linger_s: float) -> Outbox:
        """A new :class:`Outbox` for one partition."""
        return Outbox(self.limit, linger_s, self.max_size)

    def size(self, item: Any) -> int:
        """``item``'s share of a frame (bytes with its prefix, or 1).

        Raises:
            ValueError: A PySpark batch too large for a data frame on its own (2 GiB - 5
                bytes or more).
        """
        if self.kind is not ChunkKind.PICKLED_BATCHES:
            return 1
        n = len(item) if isinstance(item, (bytes, bytearray)) else memoryview(item).nbytes
        if 4 + n > MAX_DATA_FRAME_BYTES:
            raise ValueError(f"a PySpark batch of {n} bytes is too large to feed (a data frame holds at most "
                             f"{MAX_DATA_FRAME_BYTES} bytes): use more partitions or smaller rows")
        return 4 + n

    def payload(self, items: list, outbox: Optional[Outbox] = None) -> Any:
        """The payload of one frame holding ``items`` (bytes-like, or a list of parts).

        For rows, the chunk size of later frames is adapted on ``outbox``: as many rows as
        make about :data:`PACK_BYTES`, at most :data:`GENERIC_CHUNK_ROWS`.
        """
        if self.kind is ChunkKind.PICKLED_BATCHES:
            parts: list = []
            for batch in items:
                n = len(batch) if isinstance(batch, (bytes, bytearray)) else memoryview(batch).nbytes
                parts.append(_BATCH_LEN.pack(n))
                parts.append(batch)
            return parts
        if self.kind is None:
            data = pickle.dumps(items, protocol=pickle.HIGHEST_PROTOCOL)
            if outbox is not None:
                per_row = max(1, len(data) // len(items))
                outbox.set_limit(max(1, min(GENERIC_CHUNK_ROWS, PACK_BYTES // per_row)))
            return data
        if len(items) != 1:  # pragma: no cover - Outbox(limit=1) hands these out one by one
            raise AssertionError(f"{len(items)} items taken for a one-item frame")
        return items[0]


#: Seconds beyond ``feed_timeout`` a feed task waits for its sender thread to end (each of
#: its sends is bounded by ``feed_timeout`` already).
_SENDER_JOIN_SLACK_S = 30.0


class _InputRaised(Exception):
    """Reading the partition raised :attr:`exc` (the RDD's or DataFrame's own code, e.g.
    an ``OSError`` of a remote read): not a fault of the node or of the connection. The
    caller re-raises :attr:`exc` itself."""

    def __init__(self, exc: Exception):
        super().__init__(repr(exc))
        self.exc = exc


def _send_loop(link: _Link, outbox: Outbox, packing: _Packing, out: dict, watch_node: bool) -> None:
    """The sender thread of one partition: frames from ``outbox`` to the node, then the
    end marker (Spark task). Sets ``out["state"]`` ('sent', 'interrupted': the node spoke
    first, 'failed': the input raised) or ``out["error"]``. With ``watch_node`` (train) it
    stops as soon as the node sent something (T or X); inference results come while it
    sends, so an inference task does not watch."""
    try:
        while True:
            items = outbox.take()
            if items is None:
                link.send(FrameType.END)
                out["state"] = "sent"
                return
            if watch_node and link.peer_spoke():
                out["state"] = "interrupted"
                outbox.stop()
                return
            link.send(FrameType.DATA, packing.payload(items, outbox))
    except InputFailed:
        out["state"] = "failed"  # no END: the partition was not read to its end
    except BaseException as exc:  # noqa: BLE001 - re-raised by _stream in the task's thread
        out["error"] = exc
        outbox.stop()


def _stream(link: _Link, items: Iterator[Any], packing: _Packing, watch_node: bool = True) -> str:
    """Reads ``items`` (this thread) while a sender thread sends them in frames, then the
    end marker; each item waits at most ``plan.linger_s`` to be sent (Spark task).

    Returns:
        'sent', or 'interrupted' when the node spoke first (a T or X frame: the caller
        reads it; only with ``watch_node``).

    Raises:
        _InputRaised: Reading ``items`` raised (the node gets no end marker: the partition
            was not read to its end).
        FeedTimeoutError, ConnectionError, OSError, DataAuthError: From the sends.
    """
    outbox = packing.outbox(link.plan.linger_s)
    out: dict = {}
    sender = threading.Thread(target=_send_loop, args=(link, outbox, packing, out, watch_node), name="tfos-feed-send",
                              daemon=True)
    sender.start()
    try:
        for item in items:
            if not outbox.put(item, packing.size(item)):
                break  # the sender stopped: an error, or the node spoke
        else:
            outbox.end()
    except BaseException as exc:
        outbox.fail()
        sender.join(link.plan.feed_timeout_s + _SENDER_JOIN_SLACK_S)
        if isinstance(exc, Exception):
            raise _InputRaised(exc) from None
        raise
    sender.join(link.plan.feed_timeout_s + _SENDER_JOIN_SLACK_S)
    if sender.is_alive():
        raise FeedTimeoutError(
            f"{link.node.name} accepted no data for {link.plan.feed_timeout_s:g} s while feeding {link.where}"
        )
    if "error" in out:
        raise out["error"]
    return str(out.get("state", "interrupted"))


_BATCH_LEN = struct.Struct(">I")


def _tell_driver(plan: FeedPlan, msg_type: type, index: int, what: str) -> None:
    """Sends the message of class ``msg_type`` (PartitionSent, PartitionDone, PartitionSkipped)
    for partition ``index`` of the feed to the driver; a failure is logged ("could not tell
    the driver that partition N <what>") and not raised."""
    try:
        c = _client(plan)
        try:
            c.call(msg_type(feed_id=plan.feed_id, index=index), timeout_s=10.0)
        finally:
            c.close()
    except (OSError, ControlProtocolError, DeadlineExceededError) as exc:
        log.warning("could not tell the driver that partition %d %s: %s", index, what, exc)


def _notify_sent(plan: FeedPlan, index: int) -> None:
    """Tells the driver partition ``index`` was handed over (before waiting for its ACK)."""
    if plan.report_sent:
        _tell_driver(plan, _msg.PartitionSent, index, "was sent")


def _notify_done(plan: FeedPlan, index: int) -> None:
    """Tells the driver the node acknowledged partition ``index`` (restarts resume after it)."""
    if plan.report_done:
        _tell_driver(plan, _msg.PartitionDone, index, "was consumed")


def _notify_skipped(plan: FeedPlan, index: int) -> None:
    """Tells the driver partition ``index`` went to no node, so that the nodes' epoch-aware
    readers do not wait for it (see tfos._data.tfdata.EpochOrder)."""
    if plan.mode == "train" and plan.feed_id:
        _tell_driver(plan, _msg.PartitionSkipped, index, "went to no node")


def _feed_partition(plan: FeedPlan, index: int, items: Iterator[Any]) -> tuple[int, str]:
    """Feeds one partition's ``items`` (PySpark's raw batches, rows or Arrow parts, as
    ``plan.kind`` says) to its node and waits for the node's answer (Spark task).

    Returns:
        ``(index, outcome)``: 'ok', 'terminated', 'skipped' or the node's final state.
    """
    link, node, state = _open(plan, index)
    if link is None:
        _notify_skipped(plan, index)
        _notify_sent(plan, index)
        if state == "terminated":
            _notify_done(plan, index)
        return index, state
    try:
        failed: Optional[Exception] = None
        try:
            _stream(link, items, _Packing(plan.kind))
            _notify_sent(plan, index)
            state, info = _drain_answer(link)
        except _InputRaised as raised:
            failed = raised.exc
        except FeedTimeoutError:
            raise  # a TimeoutError, hence an OSError: not a lost connection
        except DataAuthError as exc:
            _auth_lost(plan, node, link.where, exc)
        except (ConnectionError, OSError) as exc:
            return index, _node_gone(plan, node, link.where, exc)
        if failed is not None:
            # The RDD's own code failed (an OSError of a remote read too), not the node:
            # raised as it is, outside the except clause so that its own cause stays.
            raise failed
        if state in ("ok", "terminated"):
            _notify_done(plan, index)
            return index, state
        if state == "finished":
            log.warning("%s: main_fun returned before the partition was consumed", link.where)
            return index, "skipped"
        msg = f"{link.where}: the node failed: {info.get('message', '')}"
        _report(plan, node, msg)
        raise FeedError(msg)
    except FeedTimeoutError as exc:
        raise _timed_out(plan, node, exc) from None
    finally:
        link.close()


def make_feed_fn(plan: FeedPlan):
    """The ``mapPartitionsWithIndex`` function of a train feed job (driver builds, task runs).

    Yields one ``(partition index, outcome)`` per partition, outcome in 'ok', 'terminated'
    (node called terminate), 'finished'/'skipped' (node's main_fun had returned).

    Raises (in the task):
        FeedError, FeedTimeoutError: The node failed, died or stopped reading; both name
            the node and partition, and are also reported to the driver.
    """

    def _feed(index: int, rows: Iterator[Any]) -> Iterator[tuple[int, str]]:
        result = _feed_partition(plan, index, rows)
        if result[1] != "ok":
            _drain(rows)
        yield result

    return _feed


#: Seconds a feed task that skips its partition (the node called terminate() or its
#: main_fun returned) spends reading the rest of the partition's input and dropping it.
#: A PySpark worker that leaves input unread exits after its task instead of serving the
#: next one, which then starts a new worker and imports tfos again (a 3x slower skip of the
#: remaining partitions was measured before this); reading a cached partition takes
#: milliseconds, and the bound keeps an expensive one from being computed for nothing.
SKIP_DRAIN_S = 0.25


def _drain(items: Iterator[Any], budget_s: float = SKIP_DRAIN_S) -> bool:
    """Reads and drops what is left of ``items`` for at most ``budget_s`` s (Spark task).

    Returns:
        True when the input was read to its end (Spark can reuse the Python worker); False
        when the budget ran out or reading raised (the error is dropped: the rows were
        skipped anyway).
    """
    deadline = time.monotonic() + budget_s
    try:
        for n, _ in enumerate(items, 1):
            if n % 64 == 0 and time.monotonic() > deadline:
                return False
    except Exception:  # noqa: BLE001 - the RDD's own code failed on rows nobody wants: skipped as before
        return False
    return True


def arrow_safe_dataframe(df: Any) -> tuple[Any, Optional[list]]:
    """``df`` ready for ``mapInArrow``, and the column names its record batches must get back (driver).

    PySpark's ``mapInArrow`` (classic and Spark Connect) passes its input columns to the
    function by name (``df[name]``), which fails for names Spark's resolver reads otherwise:
    a dot (``feature.x``: a nested field), a backtick, or a name twice (``a.id`` and
    ``b.id`` after a join; Spark compares names case-insensitively by default). For such a
    DataFrame this returns ``df.toDF("_c0", "_c1", ...)`` (columns renamed by position) and
    the original names, which the feed task puts back on every record batch
    (:func:`rename_columns`), so the node sees the names ``df.rdd`` has. Otherwise ``(df, None)``.
    """
    names = list(df.columns)
    if len({n.lower() for n in names}) == len(names) and not any("." in n or "`" in n for n in names):
        return df, None
    return df.toDF(*[f"_c{i}" for i in range(len(names))]), names


def rename_columns(batch: Any, names: Optional[list]) -> Any:
    """``batch`` (a ``pyarrow.RecordBatch``) with its columns named ``names``, or unchanged
    for None (pure; Spark task). Zero-copy: the columns are shared."""
    if names is None:
        return batch
    import pyarrow as pa

    return pa.RecordBatch.from_arrays(batch.columns, schema=pa.schema(
        [f.with_name(n) for f, n in zip(batch.schema, names)], metadata=batch.schema.metadata))


def make_arrow_feed_fn(plan: FeedPlan, spark_schema_json: Optional[str] = None, column_names: Optional[list] = None):
    """The ``mapInArrow`` function of a DataFrame train feed (driver builds, task runs).

    Each Arrow record batch Spark hands the task is cut into zero-copy slices of about
    :data:`ARROW_CHUNK_BYTES`, and each slice is sent as one IPC stream chunk whose data
    buffers go from Spark's batch to the socket without a copy (:func:`arrow_ipc_parts`);
    the function yields one record batch ``{partition: int64, outcome: string}``.

    Args:
        plan: The feed plan.
        spark_schema_json: The DataFrame's Spark schema (``df.schema.json()``), put into
            every chunk's Arrow schema metadata (:data:`tfos._data.framing.SPARK_SCHEMA_KEY`)
            so the node can decode UDT columns (Spark ML vectors), whose Arrow form is a bare
            struct. None (the default) when no column needs it (see :func:`tfos._data.framing.feed_schema_json`).
        column_names: The DataFrame's own column names when the driver renamed its columns
            for ``mapInArrow`` (:func:`arrow_safe_dataframe`); None when it did not.
    """
    meta = {SPARK_SCHEMA_KEY: spark_schema_json.encode("utf-8")} if spark_schema_json else None

    def _feed(batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa
        from pyspark import TaskContext

        tc = TaskContext.get()
        if tc is None:
            raise TFOSError("the DataFrame feed function must run in a Spark task")
        index = tc.partitionId()

        def frames() -> Iterator[Any]:
            for b in batches:
                b = rename_columns(b, column_names)
                schema = b.schema.with_metadata(meta) if meta is not None else b.schema
                for piece in arrow_slices(b, ARROW_CHUNK_BYTES):
                    yield arrow_ipc_parts(piece, schema)

        _, outcome = _feed_partition(plan, index, frames())
        if outcome != "ok":
            _drain(batches)
        yield pa.RecordBatch.from_pydict({"partition": pa.array([index], pa.int64()), "outcome": pa.array([outcome])})

    return _feed


class _GatherSink:
    """A write-only file for ``pyarrow.PythonFile`` that keeps every written buffer.

    The Arrow IPC writer hands its output stream the record batch's body buffers as
    ``pyarrow.Buffer`` objects (zero-copy views of the batch's memory) and the metadata
    and padding as small ``bytes``; this sink keeps them in order instead of copying them
    into one stream buffer.
    """

    def __init__(self) -> None:
        self.parts: list = []
        self.size = 0
        self.closed = False

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        self.parts.append(data)
        self.size += n
        return n

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False


def arrow_ipc_parts(batch: Any, schema: Any = None) -> list:
    """An Arrow IPC stream holding ``batch``, as a list of buffers (pure; Spark task).

    The concatenation of the returned buffers is exactly the stream
    ``pa.ipc.new_stream(sink, schema).write_batch(batch)`` writes into a
    ``BufferOutputStream``; the batch's data buffers are not copied (for a sliced batch,
    Arrow's writer slices them; only list offsets of a slice are rewritten). Send it as
    one frame with :func:`tfos._data.framing.send_frame_parts`; the parts reference the
    batch's memory, so the batch must stay alive until they are sent.

    Args:
        batch: A ``pyarrow.RecordBatch`` (or a slice of one).
        schema: The stream's schema: ``batch.schema``, possibly with metadata (the Spark
            schema, :data:`tfos._data.framing.SPARK_SCHEMA_KEY`). Default ``batch.schema``.

    Returns:
        Bytes-like objects (``pyarrow.Buffer`` and ``bytes``), in stream order.
    """
    import pyarrow as pa

    sink = _GatherSink()
    with pa.ipc.new_stream(pa.PythonFile(sink, mode="w"), schema if schema is not None else batch.schema) as w:
        w.write_batch(batch)
    return sink.parts


def arrow_slices(batch: Any, target_bytes: int = ARROW_CHUNK_BYTES) -> list:
    """Splits an Arrow record batch into zero-copy slices of about ``target_bytes`` (pure).

    Runs in Spark tasks (DataFrame feeds).

    Args:
        batch: A ``pyarrow.RecordBatch``.
        target_bytes: Target slice size in bytes (at least one row per slice).

    Returns:
        The slices in order (none for an empty batch); their rows are exactly the batch's.
    """
    n = batch.num_rows
    if n == 0:
        return []
    per = max(1, min(n, int(n * target_bytes // max(1, batch.nbytes))))
    if per >= n:
        return [batch]
    return [batch.slice(i, per) for i in range(0, n, per)]


def make_infer_fn(plan: FeedPlan):
    """The partition function of an inference job (driver builds, task runs).

    Sends the partition from a sender thread while reading results, so neither side can
    block the other. Yields the node's result frames unchanged: each is a pickled list of
    results, one per input row, in input order.

    Raises (in the task):
        FeedError, FeedTimeoutError: As for training; also when the node ends without
            answering every row (names how many rows were left).
    """

    def _infer(index: int, rows: Iterator[Any]) -> Iterator[Union[bytes, bytearray]]:
        link, node, state = _open(plan, index)
        if link is None:
            if state == "terminated":
                _drain(rows)
                return
            msg = f"partition {index} -> {node.name}: the node is not running inference (state {state})"
            _report(plan, node, msg)
            raise FeedError(msg)
        send_error: list[BaseException] = []
        input_failed = threading.Event()

        def _send() -> None:
            # Reads the partition (rows may come from the RDD's own code, pipelined into
            # this worker) while _stream's sender thread sends them.
            try:
                _stream(link, rows, _Packing(plan.kind), watch_node=False)
            except _InputRaised as raised:
                # Reading the input failed: the node gets no end marker, so wake the reader
                # below (blocked on the node's answer) instead of letting it wait for
                # feed_timeout; it raises this error.
                send_error.append(raised.exc)
                input_failed.set()
                link.shutdown()
            except BaseException as exc:  # noqa: BLE001 - surfaced by the reader below
                send_error.append(exc)

        sender = threading.Thread(target=_send, name="tfos-infer-send", daemon=True)
        sender.start()
        try:
            while True:
                try:
                    ftype, payload = link.recv()
                except FeedTimeoutError:
                    raise  # a TimeoutError, hence an OSError: not a lost connection
                except DataAuthError as exc:
                    _auth_lost(plan, node, link.where, exc)
                except (ConnectionError, OSError) as exc:
                    if input_failed.is_set():
                        break  # the input failed (see _send): raised below
                    _node_gone(plan, node, link.where, exc)
                    msg = f"{link.where}: main_fun returned before answering every row of the partition"
                    _report(plan, node, msg)
                    raise FeedError(msg) from None
                if ftype is FrameType.RESULTS:
                    yield payload  # a bytearray; the worker writes it to the JVM verbatim
                elif ftype is FrameType.RESULTS_END:
                    break
                elif ftype is FrameType.TERMINATED:
                    break
                else:
                    info = parse_json(ftype, payload)
                    msg = f"{link.where}: {info.get('message') or 'the node ended before answering every row'}"
                    _report(plan, node, msg)
                    raise FeedError(msg)
            sender.join(plan.feed_timeout_s + _SENDER_JOIN_SLACK_S)
            if send_error and (input_failed.is_set() or not isinstance(send_error[0], (ConnectionError, OSError))):
                raise send_error[0]
        except FeedTimeoutError as exc:
            raise _timed_out(plan, node, exc) from None
        finally:
            link.close()

    return _infer
