"""The node's data server and bounded queues (runs in the TF process, InputMode.SPARK).

Spark feed tasks connect here, authenticate mutually with the cluster key and the node's
identity (:func:`tfos._common.wire.server_handshake`), announce a partition and stream its
chunks in encrypted, authenticated frames (a chunk is queued, and later unpickled, only
after its tag checked). A reader thread per connection puts chunks on the named queue,
which is bounded in chunks, so a slow TensorFlow consumer pushes back through TCP to
the feed task. :class:`~tfos.datafeed.DataFeed` takes chunks off the queue in the main
thread, decodes them, and answers each partition (consumed / results) on its connection.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from typing import Any, Callable, Optional

from tfos._common import wire as _wire
from tfos._common.admission import RejectLog, listen_backlog
from tfos._common.deadline import Deadline
from tfos._data import local_socket as _local
from tfos._data.feed_connection import END_OF_FEED, PROGRESS_EVERY_S, Chunk, FeedConnection, PartitionEnd
from tfos._data.feed_gate import FeedGate
from tfos._data.framing import FeedState, FrameType, recv_frame, recv_json, send_json
from tfos._data.local_socket import SocketDir
from tfos.errors import TFOSError

__all__ = ["FeedHub"]

log = logging.getLogger(__name__)

_HANDSHAKE_TIMEOUT_S = 10.0
#: Most authenticated connections served at once (feed tasks run at most one per Spark core).
MAX_CONNECTIONS = 256
class FeedHub:
    """A node's data server and its bounded queues (TF process, InputMode.SPARK).

    Args:
        host: Address to listen on (the node's host address).
        key: The cluster key; feed connections must prove they hold it.
        queues: Names of the queues to create (e.g. 'input', 'output', 'error').
        queue_chunks: Bound of each queue, in chunks.
        node_name: For log and error messages.
        local_socket: Also listen on a Unix-domain socket (``path``) for feed tasks on the
            same host; they connect there first and fall back to ``port``.
        socket_dir: The directory for that socket, made by the node's supervisor (which
            removes it); None: the hub makes one and removes it in :meth:`close`.

    Attributes:
        port: The listening TCP port.
        path: The Unix-domain socket's path, "" when there is none. It lives in a
            directory of mode 0700 made for it under ``TMPDIR``.
        rows_taken: Rows handed to ``main_fun`` (all queues), reported to the driver.
    """

    def __init__(self, host: str, key: bytes, queues: tuple[str, ...], queue_chunks: int, node_name: str,
                 local_socket: bool = True, socket_dir: Optional[SocketDir] = None):
        self._key = key
        self.node_name = node_name
        #: The node's identity, bound into every data handshake (set by the TF process
        #: once the node's address is known: ``wire.node_identity(NodeInfo)``); b"" until then.
        self.identity = b""
        self.queues: dict[str, queue.Queue] = {q: queue.Queue(maxsize=queue_chunks) for q in queues}
        self.terminated: set[str] = set()
        #: The driver's abort reason once the cluster aborted ("" until then): DataFeed then
        #: raises FeedAbortedError instead of ever reporting an end of feed.
        self.aborted = ""
        self._marker_thread: Optional[threading.Thread] = None
        self.state = FeedState.OK  # MAIN_FUN_RETURNED/MAIN_FUN_FAILED once closed
        self.rows_taken = 0
        self._conns: set[FeedConnection] = set()
        self._lock = threading.Lock()
        self._closing = False
        self._reading = 0  # connections still receiving a partition
        self._feed_closing = False
        self._end_queued = False
        self._pending: dict[socket.socket, float] = {}  # proven, in the handshake -> since
        self._authed = 0
        #: (feed id, partition index) pairs whose data this node accepted: a retried or
        #: resubmitted feed task for one of them is refused (no row is fed twice).
        self.delivered: set[tuple[str, int]] = set()
        #: Connections refused or closed before authentication, for figures and tests.
        self.rejected = 0
        self._reject_log = RejectLog()
        #: Longest wait for the next chunk in DataFeed (and for queue room for END_OF_FEED).
        self.data_timeout_s = 3600.0
        #: ``ask_driver(message) -> dict``: one control message to the driver
        #: (set by the TF process; None in tests without a driver). The epoch-aware tf.data
        #: readers use it to learn when an epoch's partitions were all handed over.
        self.ask_driver: Optional[Callable[..., dict]] = None
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind((host, 0))
        self._listener.listen(listen_backlog(1024))  # emptied on every turn of the gate
        self.port = self._listener.getsockname()[1]
        #: Path of the Unix-domain listener for feed tasks on this host ("" when there is none).
        self.path = ""
        self._own_dir: Optional[SocketDir] = None
        self._sock_id: Optional[tuple[int, int]] = None
        self._unix: Optional[socket.socket] = None
        if local_socket and _local.SUPPORTED:
            listening = _local.open_listener(socket_dir, node_name)
            if listening is not None:
                self._unix, self.path, self._own_dir, self._sock_id = listening
        self.gate = FeedGate([self._listener, self._unix], key, self._admit, node_name, self._count_reject, f"{host}:{self.port}",
                             lambda: self.identity)

    # -------------------------------------------------------------- accepting
    def _count_reject(self) -> None:
        with self._lock:
            self.rejected += 1

    def _admit(self, sock: socket.socket, peer: tuple) -> None:
        """Serves a connection that proved it holds the key (on the gate's thread: must not
        block) on a thread of its own."""
        with self._lock:
            if self._closing:
                raise ConnectionError("the data server is closing")
            if len(self._pending) + self._authed >= MAX_CONNECTIONS:
                raise ConnectionError(f"more than {MAX_CONNECTIONS} data connections")
            self._pending[sock] = time.monotonic()
        try:
            threading.Thread(target=self._serve, args=(sock, peer), name="tfos-feed-conn", daemon=True).start()
        except BaseException:
            self._discard_pending(sock)
            raise

    def _discard_pending(self, sock: socket.socket) -> bool:
        with self._lock:
            return self._pending.pop(sock, None) is not None

    def _serve(self, sock: socket.socket, peer: tuple) -> None:
        conn: Optional[FeedConnection] = None
        authed = False
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hs = Deadline(_HANDSHAKE_TIMEOUT_S, "the data-connection handshake")
            session = _wire.server_handshake(sock, self._key, hs, self.identity, proven=True)
            with self._lock:
                if self._pending.pop(sock, None) is None:
                    raise ConnectionError("the data server closed")
                if self._authed >= MAX_CONNECTIONS:
                    raise ConnectionError(f"more than {MAX_CONNECTIONS} data connections")
                self._authed += 1
                authed = True
            ftype, header = recv_json(sock, session, hs)
            if ftype is not FrameType.HEADER:
                raise ConnectionError("first data frame is not a header")
            qname = str(header["qname"])
            feed_key = (str(header.get("feed_id", "")), int(header.get("index", -1)))
            if not feed_key[0] or feed_key[1] < 0:
                # Every tfos feed task sends both, after claiming the partition index at the
                # driver; a header without them was sent by no feed task of this cluster.
                raise ValueError(f"bad feed header: feed_id {feed_key[0]!r}, index {feed_key[1]!r} (a feed task sends both)")
            q = self.queues.get(qname)
            with self._lock:
                status = _refusal(self, qname, q, feed_key)
                if status is None:
                    status = {"state": FeedState.OK}
                    conn = FeedConnection(sock, session, header)
                    if feed_key[0]:
                        self.delivered.add(feed_key)
                    self._conns.add(conn)
                    self._reading += 1
            if conn is None or q is None:
                send_json(sock, session, FrameType.STATUS, status)
                _close_quietly(sock)
                return
            try:
                if not conn.send_json(FrameType.STATUS, status):
                    raise ConnectionError("the feed task went away")
                self._read_partition(conn, q)
            finally:
                with self._lock:
                    self._reading -= 1
                    last = self._feed_closing and self._reading == 0
                if last:
                    self._enqueue_end_of_feed()
            _report_progress(self, conn)
        except Exception as exc:  # noqa: BLE001 - protocol errors, broken peers, bad headers
            if conn is None:
                with self._lock:
                    self.rejected += 1
                    n = self.rejected
                    due = self._reject_log.due(n)
                if due:
                    log.warning("node %s rejected a data connection from %s:%s: %s (%d rejected so far)",
                                self.node_name, peer[0], peer[1], exc, n)
                _close_quietly(sock)
            elif not conn.closed:
                if conn.qname in self.terminated:
                    log.debug("feed task of %r closed after terminate(): %s", conn, exc)
                else:
                    log.warning("data connection for %r broke: %s", conn, exc)
                conn.close()
        finally:
            self._discard_pending(sock)
            if authed:
                with self._lock:
                    self._authed -= 1
            if conn is not None and conn.closed:
                with self._lock:
                    self._conns.discard(conn)

    def _put(self, q: queue.Queue, conn: FeedConnection, item: object) -> bool:
        while True:
            if self._closing or self.aborted or conn.closed or conn.qname in self.terminated:
                return False
            try:
                q.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue

    def _read_partition(self, conn: FeedConnection, q: queue.Queue) -> None:
        # Each frame must arrive within feed_timeout of the previous one.
        discard = False
        while True:
            ftype, payload = recv_frame(conn.sock, conn.session, Deadline(conn.feed_timeout_s, f"data for {conn!r}"))
            if ftype is FrameType.DATA:
                if not discard and not self._put(q, conn, Chunk(conn, payload)):
                    if self._closing or self.aborted or conn.closed:
                        return  # the feed task is answered by close() at the process's exit
                    # Terminated: keep reading (and dropping) until the task, told by the T
                    # frame, stops sending; closing now could break its pipe mid-send.
                    discard = True
            elif ftype is FrameType.END:
                conn.end_received = True
                if discard:
                    conn.close()
                else:
                    self._put(q, conn, PartitionEnd(conn))
                return
            else:
                raise ConnectionError(f"unexpected {ftype.name} frame from a feed task")

    # ------------------------------------------------ TFoS's TFManager methods
    def get_queue(self, qname: str) -> Any:
        """TFoS's ``ctx.mgr.get_queue(qname)`` (TF process).

        Raises:
            TFOSError: Always: a tfos node has no row queues (rows arrive in chunks on the
                node's data connections); the message says what to use instead.
        """
        raise TFOSError(
            f"ctx.mgr.get_queue({qname!r}): a tfos node has no manager row queues (rows arrive in chunks on the "
            "node's data connections); read rows with ctx.get_data_feed(qname_in=...).next_batch(n), batches() or "
            "as_dataset(), and answer inference batches with batch_results()"
        )

    def get(self, key: str) -> Any:
        """TFoS's ``ctx.mgr.get(key)`` (TF process; TFoS kept the node's ``'state'`` there).

        Raises:
            TFOSError: Always; the message says what to use instead.
        """
        raise TFOSError(
            f"ctx.mgr.get({key!r}): a tfos node keeps no manager state; DataFeed.should_stop() says whether "
            "the feed ended or was terminated (TFoS's 'terminating' state)"
        )

    def set(self, key: str, value: Any) -> None:
        """TFoS's ``ctx.mgr.set(key, value)`` (TF process).

        Raises:
            TFOSError: Always; the message says what to use instead.
        """
        raise TFOSError(
            f"ctx.mgr.set({key!r}, ...): a tfos node keeps no manager state; to stop the feed call "
            "DataFeed.terminate() (TFoS set 'state' to 'terminating')"
        )

    # ------------------------------------------------------------ consumer API
    def finish_connection(self, conn: FeedConnection, ftype: FrameType, info: dict) -> None:
        """Sends the final frame of a partition and closes its connection."""
        conn.send_json(ftype, info)
        conn.close()
        with self._lock:
            self._conns.discard(conn)

    def abort(self, reason: str) -> None:
        """The cluster aborted (TF process, control thread): readers of every queue get
        :class:`~tfos.errors.FeedAbortedError`, never an end of feed (``DataFeed`` checks
        :attr:`aborted` before and after every take, so an END_OF_FEED queued before or
        during this is never handed out), no END_OF_FEED is queued after this, reader
        threads queue nothing more (so no partition is acknowledged after the abort), and
        :meth:`terminate` becomes a no-op. Queued chunks are dropped. Idempotent.

        Args:
            reason: The driver's abort reason (shown in the error).
        """
        with self._lock:
            if self.aborted:
                return
            self.aborted = reason or "the cluster failed"
            self._end_queued = True  # a later close_feed() must not look like a normal end
            marker = self._marker_thread
        if marker is not None:
            marker.join(2.0)  # its put in flight (at most 0.5 s) lands before the drain
        for name in self.queues:
            self._drain(name)

    def terminate(self, qname: str) -> None:
        """Stops feeding ``qname`` (``DataFeed.terminate()``): feed tasks skip the rest.

        Open connections get a ``T`` frame and are closed; later connections are refused
        with 'terminated'; queued chunks are dropped. A no-op after :meth:`abort`: feed
        tasks count a terminated partition as consumed, and after an abort its rows were not.
        """
        with self._lock:
            if self.aborted:
                return
            self.terminated.add(qname)
            conns = [c for c in self._conns if c.qname == qname]
        for c in conns:
            # The reader thread drains what the task still sends and closes the connection.
            c.send_json(FrameType.TERMINATED, {"rows": c.rows_taken})
        self._drain(qname)

    def _drain(self, qname: str) -> None:
        q = self.queues.get(qname)
        while q is not None:
            try:
                q.get_nowait()
            except queue.Empty:
                return

    def close_feed(self) -> None:
        """The driver closed the feed: END_OF_FEED goes on every queue after all data.

        The marker is queued once every partition still being received has been queued
        (so no row is ever cut off by the end of the feed), from a thread of its own that
        waits for room in full queues; it never drops data. Idempotent.
        """
        with self._lock:
            if self._feed_closing:
                return
            self._feed_closing = True
            ready = self._reading == 0
        if ready:
            self._enqueue_end_of_feed()

    def _enqueue_end_of_feed(self) -> None:
        with self._lock:
            if self._end_queued:
                return
            self._end_queued = True

        def _put_markers() -> None:
            for name, q in self.queues.items():
                deadline = Deadline(self.data_timeout_s, f"room for the end-of-feed marker on queue {name!r}")
                while not (self._closing or self.aborted or name in self.terminated or deadline.expired()):
                    try:
                        q.put(END_OF_FEED, timeout=0.5)
                        break
                    except queue.Full:
                        continue

        t = threading.Thread(target=_put_markers, name="tfos-end-of-feed", daemon=True)
        self._marker_thread = t
        t.start()

    def close(self, state: FeedState = FeedState.MAIN_FUN_RETURNED, reason: str = "") -> None:
        """Closes the data server (TF process exit): tells open feed tasks why.

        Args:
            state: ``FeedState.MAIN_FUN_RETURNED`` or ``FeedState.MAIN_FUN_FAILED``.
            reason: Text for the feed tasks' logs/errors.
        """
        with self._lock:
            self.state = state
            self._closing = True
            conns = list(self._conns)
            self._conns.clear()
        self.gate.close()
        for c in conns:
            c.send_json(FrameType.ERROR, {"state": state, "message": reason, "rows": c.rows_taken, "pending": c.pending})
            c.close()
        for listener in (self._listener, self._unix):
            if listener is None:
                continue
            try:
                listener.shutdown(socket.SHUT_RDWR)  # wakes the accept loop
            except OSError:
                pass
            try:
                listener.close()
            except OSError:
                pass
        if self._unix is not None:
            try:  # a feed task arriving now gets ENOENT and uses TCP, which says main_fun returned
                st = os.lstat(self.path)
                if (st.st_dev, st.st_ino) == self._sock_id:
                    os.unlink(self.path)
            except OSError:
                pass
        _local.remove_socket_dir(self._own_dir)
        with self._lock:
            pending = list(self._pending)
        for sock in pending:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _refusal(hub: FeedHub, qname: str, q: Optional[queue.Queue], feed_key: tuple[str, int]) -> Optional[dict]:
    """The status answering a feed connection the node does not take, or None when it takes
    it (called under the hub's lock)."""
    if q is None:
        return {"state": FeedState.REFUSED, "message": f"node {hub.node_name} has no queue {qname!r}; declare it with TFCluster.run(queues=[...])"}
    if hub.aborted:
        return {"state": FeedState.MAIN_FUN_FAILED, "message": f"node {hub.node_name}: the cluster aborted ({hub.aborted})"}
    if qname in hub.terminated:
        return {"state": FeedState.TERMINATED}
    if hub.state != FeedState.OK or hub._closing:
        return {"state": hub.state if hub.state != FeedState.OK else FeedState.MAIN_FUN_RETURNED}
    if feed_key[0] and feed_key in hub.delivered:
        return {"state": FeedState.REFUSED, "message": (
            f"node {hub.node_name} already received partition index {feed_key[1]} of this feed; "
            "Spark re-ran its feed task (a task retry or a stage resubmission), and tfos never feeds "
            "a partition twice because its rows would be trained on again. Fix the cause of the "
            "first failure (see the executor log), then run train() again"
        )}
    return None


def _report_progress(hub: FeedHub, conn: FeedConnection) -> None:
    """While ``conn``'s partition waits in the queue after its END, tells its feed task
    every ``min(feed_timeout / 4, PROGRESS_EVERY_S)`` s in which main_fun took rows
    (PROGRESS frame). Returns when the connection is closed (ACK, results end, error),
    the hub closes, or main_fun took no row for ``feed_timeout`` (the task has given up
    by then). Runs on the connection's own thread (TF process)."""
    if not conn.end_received:
        return  # the reader stopped early (abort, hub closing): nothing waits in the queue
    every = min(conn.feed_timeout_s / 4.0, PROGRESS_EVERY_S)
    rows_seen, last_progress = hub.rows_taken, time.monotonic()
    next_check = last_progress + every
    while not conn.closed and not hub._closing and not hub.aborted:
        now = time.monotonic()
        if now - last_progress > conn.feed_timeout_s:
            return
        if now < next_check:
            time.sleep(min(0.25, next_check - now))
            continue
        next_check = now + every
        rows = hub.rows_taken
        if rows != rows_seen:
            rows_seen, last_progress = rows, now
            if not conn.send_json(FrameType.PROGRESS, {"rows": conn.rows_taken}):
                return


def _close_quietly(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass
