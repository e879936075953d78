"""One feed connection on a node and the items its reader puts on the node's queues (TF
process): :class:`FeedConnection` (a partition's authenticated connection from its feed
task), :class:`Chunk`, :class:`PartitionEnd` and :data:`END_OF_FEED`."""

from __future__ import annotations

import json
import socket
import threading

from tfos._common.data_session import DataSession
from tfos._data.feed_plan import check_feed_timeout
from tfos._data.framing import ChunkKind, FrameType, send_frame

__all__ = ["FeedConnection", "Chunk", "PartitionEnd", "END_OF_FEED", "PROGRESS_EVERY_S"]

#: After a partition's END, while its feed task waits for the ACK, the node sends the task
#: a PROGRESS frame every ``min(feed_timeout / 4, PROGRESS_EVERY_S)`` seconds in which
#: main_fun took rows, so ``feed_timeout`` bounds a stall of the node, not the time it
#: takes to work through the chunks already queued.
PROGRESS_EVERY_S = 30.0


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
        first_epoch: The first epoch of the feed job this partition belongs to (> 0 when
            a restarted ``train()`` resumed its feed there; 0 otherwise).
        mode: 'train' or 'inference'.
        kind: The :class:`ChunkKind` of the data frames.
        rows_taken: Rows of this partition handed to ``main_fun`` so far.
        pending: Inference batches handed out and not yet answered.
        ended: The end-of-partition marker was consumed.
    """

    def __init__(self, sock: socket.socket, session: DataSession, header: dict):
        self.sock = sock
        self.session = session
        self.partition = int(header["partition"])
        self.epoch = int(header.get("epoch", 0))
        self.first_epoch = int(header.get("first_epoch", 0))
        if not 0 <= self.first_epoch <= self.epoch:
            raise ValueError(f"bad feed header: first_epoch {self.first_epoch!r} for epoch {self.epoch!r}")
        self.mode = str(header["mode"])
        self.kind = ChunkKind(header["kind"])
        self.qname = str(header["qname"])
        if self.mode not in ("train", "inference"):
            raise ValueError(f"bad feed header: mode {self.mode!r}")
        self.feed_timeout_s = check_feed_timeout(header.get("feed_timeout_s"), "bad feed header: feed_timeout_s")
        #: The feed (one train()/inference() job) and the job's partition index of this
        #: connection (the hub refuses a header without them; "" and -1 only in tests that
        #: build a connection directly).
        self.feed_id = str(header.get("feed_id", ""))
        self.index = int(header.get("index", -1))
        #: Partitions in one epoch of the feed job (0: not sent); job index = (epoch -
        #: first_epoch) x parts_per_epoch + partition.
        self.parts_per_epoch = int(header.get("parts_per_epoch", 0))
        #: The feed job's last epoch (-1: not sent/not known).
        self.last_epoch = int(header.get("last_epoch", -1))
        if self.last_epoch != -1 and self.last_epoch < self.epoch:
            raise ValueError(f"bad feed header: last_epoch {self.last_epoch!r} for epoch {self.epoch!r}")
        self.rows_taken = 0
        self.pending = 0
        self.ended = False
        self.closed = False
        #: The feed task sent END: it now waits for the ACK (or results) only.
        self.end_received = False
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
                send_frame(self.sock, self.session, ftype, payload)
                return True
            except OSError:
                self._close_locked()
                return False

    def send_json(self, ftype: FrameType, obj: dict) -> bool:
        """Sends a JSON frame; False when the connection is gone."""
        return self.send(ftype, json.dumps(obj, allow_nan=False).encode("utf-8"))

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
