"""The node's data server and bounded queues (runs in the TF process, InputMode.SPARK).

Spark feed tasks connect here, authenticate with the cluster key, announce a partition
and stream its chunks. A reader thread per connection puts chunks on the named queue,
which is bounded in chunks, so a slow TensorFlow consumer pushes back through TCP to
the feed task. :class:`~tfos.datafeed.DataFeed` takes chunks off the queue in the main
thread, decodes them, and answers each partition (consumed / results) on its connection.
"""

from __future__ import annotations

import json
import logging
import queue
import socket
import threading
from typing import Optional

from . import _wire
from ._data_plane import ChunkKind, FrameType, recv_frame, send_frame, send_json
from ._deadline import Deadline
from .errors import ControlProtocolError, DeadlineExceededError

__all__ = ["FeedHub", "FeedConnection", "Chunk", "PartitionEnd", "END_OF_FEED"]

log = logging.getLogger(__name__)

_HANDSHAKE_TIMEOUT_S = 10.0


class _EndOfFeed:
    def __repr__(self) -> str:
        return "END_OF_FEED"


#: Queue marker: the driver closed the feed (``cluster.shutdown()``); no more data.
END_OF_FEED = _EndOfFeed()


class FeedConnection:
    """Server side of one feed task's connection: one partition of one epoch.

    Attributes:
        partition: Partition index within the epoch.
        epoch: 0-based epoch.
        mode: 'train' or 'inference'.
        kind: The :class:`ChunkKind` of the data frames.
        rows_taken: Rows of this partition handed to ``main_fun`` so far.
        pending: Inference batches handed out and not yet answered.
        ended: The end-of-partition marker was consumed.
    """

    def __init__(self, sock: socket.socket, header: dict, feed_timeout_s: float):
        self.sock = sock
        self.partition = int(header["partition"])
        self.epoch = int(header.get("epoch", 0))
        self.mode = str(header["mode"])
        self.kind = ChunkKind(header["kind"])
        self.qname = str(header["qname"])
        self.feed_timeout_s = feed_timeout_s
        self.rows_taken = 0
        self.pending = 0
        self.ended = False
        self.closed = False
        self._send_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"partition {self.partition} (epoch {self.epoch})"

    def send(self, ftype: FrameType, payload: bytes = b"") -> bool:
        """Sends a frame to the feed task; False when the connection is gone."""
        with self._send_lock:
            if self.closed:
                return False
            try:
                self.sock.settimeout(self.feed_timeout_s)
                send_frame(self.sock, ftype, payload)
                return True
            except OSError:
                self._close_locked()
                return False

    def send_json(self, ftype: FrameType, obj: dict) -> bool:
        """Sends a JSON frame; False when the connection is gone."""
        return self.send(ftype, json.dumps(obj).encode("utf-8"))

    def close(self) -> None:
        """Closes the connection (idempotent)."""
        with self._send_lock:
            self._close_locked()

    def _close_locked(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.sock.close()


class Chunk:
    """One data frame on a queue: its connection and undecoded payload."""

    __slots__ = ("conn", "payload")

    def __init__(self, conn: FeedConnection, payload: bytearray):
        self.conn = conn
        self.payload = payload


class PartitionEnd:
    """Queue marker: the end of one connection's partition."""

    __slots__ = ("conn",)

    def __init__(self, conn: FeedConnection):
        self.conn = conn


class FeedHub:
    """A node's data server and its bounded queues (TF process, InputMode.SPARK).

    Args:
        host: Address to listen on (the node's host address).
        key: The cluster key; feed connections must prove they hold it.
        queues: Names of the queues to create (e.g. 'input', 'output', 'error').
        queue_chunks: Bound of each queue, in chunks.
        node_name: For log and error messages.

    Attributes:
        port: The listening port.
        rows_taken: Rows handed to ``main_fun`` (all queues), reported to the driver.
    """

    def __init__(self, host: str, key: bytes, queues: tuple[str, ...], queue_chunks: int, node_name: str):
        self._key = key
        self.node_name = node_name
        self.queues: dict[str, queue.Queue] = {q: queue.Queue(maxsize=queue_chunks) for q in queues}
        self.terminated: set[str] = set()
        self.state = "ok"  # or 'finished' once main_fun returned
        self.rows_taken = 0
        self._conns: set[FeedConnection] = set()
        self._lock = threading.Lock()
        self._closing = False
        self._reading = 0  # connections still receiving a partition
        self._feed_closing = False
        self._end_queued = False
        #: Longest wait for the next chunk in DataFeed (and for queue room for END_OF_FEED).
        self.data_timeout_s = 3600.0
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind((host, 0))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        self._accept_thread = threading.Thread(target=self._accept_loop, name="tfos-feed-accept", daemon=True)
        self._accept_thread.start()

    # -------------------------------------------------------------- accepting
    def _accept_loop(self) -> None:
        while not self._closing:
            try:
                sock, peer = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock, peer), name="tfos-feed-conn", daemon=True).start()

    def _serve(self, sock: socket.socket, peer: tuple) -> None:
        conn: Optional[FeedConnection] = None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hs = Deadline(_HANDSHAKE_TIMEOUT_S, "the data-connection handshake")
            _wire.serve_challenge(sock, self._key, hs)
            ftype, payload = recv_frame(sock, hs)
            if ftype is not FrameType.HEADER:
                raise ConnectionError("first data frame is not a header")
            header = json.loads(bytes(payload).decode("utf-8"))
            qname = str(header["qname"])
            q = self.queues.get(qname)
            with self._lock:
                if q is None:
                    status = {"state": "error", "message": f"node {self.node_name} has no queue {qname!r}; declare it with TFCluster.run(queues=[...])"}
                elif qname in self.terminated:
                    status = {"state": "terminated"}
                elif self.state != "ok" or self._closing:
                    status = {"state": self.state if self.state != "ok" else "finished"}
                else:
                    status = {"state": "ok"}
                    conn = FeedConnection(sock, header, float(header.get("feed_timeout", 600.0)))
                    self._conns.add(conn)
                    self._reading += 1
            if conn is None or q is None:
                send_json(sock, FrameType.STATUS, status)
                sock.close()
                return
            try:
                send_json(sock, FrameType.STATUS, status)
                self._read_partition(conn, q)
            finally:
                with self._lock:
                    self._reading -= 1
                    last = self._feed_closing and self._reading == 0
                if last:
                    self._enqueue_end_of_feed()
        except (ControlProtocolError, DeadlineExceededError, ConnectionError, OSError, ValueError, KeyError) as exc:
            if conn is None:
                log.warning("rejected a data connection from %s:%s: %s", peer[0], peer[1], exc)
                try:
                    sock.close()
                except OSError:
                    pass
            elif not conn.closed:
                if conn.qname in self.terminated:
                    log.debug("feed task of %r closed after terminate(): %s", conn, exc)
                else:
                    log.warning("data connection for %r broke: %s", conn, exc)
                conn.close()
        finally:
            if conn is not None and conn.closed:
                with self._lock:
                    self._conns.discard(conn)

    def _put(self, q: queue.Queue, conn: FeedConnection, item: object) -> bool:
        while True:
            if self._closing or conn.closed or conn.qname in self.terminated:
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
            ftype, payload = recv_frame(conn.sock, Deadline(conn.feed_timeout_s, f"data for {conn!r}"))
            if ftype is FrameType.DATA:
                if not discard and not self._put(q, conn, Chunk(conn, payload)):
                    if self._closing or conn.closed:
                        return
                    # Terminated: keep reading (and dropping) until the task, told by the T
                    # frame, stops sending; closing now could break its pipe mid-send.
                    discard = True
            elif ftype is FrameType.END:
                if discard:
                    conn.close()
                else:
                    self._put(q, conn, PartitionEnd(conn))
                return
            else:
                raise ConnectionError(f"unexpected {ftype.name} frame from a feed task")

    # ------------------------------------------------------------ consumer API
    def finish_connection(self, conn: FeedConnection, ftype: FrameType, info: dict) -> None:
        """Sends the final frame of a partition and closes its connection."""
        conn.send_json(ftype, info)
        conn.close()
        with self._lock:
            self._conns.discard(conn)

    def terminate(self, qname: str) -> None:
        """Stops feeding ``qname`` (``DataFeed.terminate()``): feed tasks skip the rest.

        Open connections get a ``T`` frame and are closed; later connections are refused
        with 'terminated'; queued chunks are dropped.
        """
        with self._lock:
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
                while not (self._closing or name in self.terminated or deadline.expired()):
                    try:
                        q.put(END_OF_FEED, timeout=0.5)
                        break
                    except queue.Full:
                        continue

        threading.Thread(target=_put_markers, name="tfos-end-of-feed", daemon=True).start()

    def close(self, state: str = "finished", reason: str = "") -> None:
        """Closes the data server (TF process exit): tells open feed tasks why.

        Args:
            state: 'finished' (main_fun returned) or 'failed'.
            reason: Text for the feed tasks' logs/errors.
        """
        with self._lock:
            self.state = state
            self._closing = True
            conns = list(self._conns)
            self._conns.clear()
        for c in conns:
            c.send_json(FrameType.ERROR, {"state": state, "message": reason, "rows": c.rows_taken, "pending": c.pending})
            c.close()
        try:
            self._listener.close()
        except OSError:
            pass
