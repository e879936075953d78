"""A fake feed task for unit tests of the node side of the data plane (no Spark).

``Feeder`` opens a socketpair, runs the real mutual handshake of :mod:`tfos._common.wire` over it,
registers the server end with a real :class:`~tfos._data.feed_hub.FeedHub` as one partition's
:class:`~tfos._data.feed_connection.FeedConnection`, and reads the node's authenticated frames from the
peer end.
"""

from __future__ import annotations

import json
import pickle
import socket
import threading

from tfos._common import wire as _wire
from tfos._data.framing import FrameType, recv_frame
from tfos._common.deadline import Deadline
from tfos._data.feed_connection import Chunk, FeedConnection, PartitionEnd
from tfos._data.feed_hub import FeedHub


class Feeder:
    """One fake feed task: a FeedConnection whose peer end the test reads."""

    def __init__(self, hub: FeedHub, key: bytes, partition: int, mode: str = "train", epoch: int = 0, kind: str = "pickled_batch",
                 first_epoch: int = 0, feed_id: str = "", index: int = -1, parts_per_epoch: int = 0, feed_timeout: float = 10.0,
                 last_epoch: int = -1):
        self.hub = hub
        a, self.peer = socket.socketpair()
        # the real mutual handshake over the pair: frames both ways are authenticated
        out: dict = {}
        t = threading.Thread(target=lambda: out.setdefault("s", _wire.client_handshake(self.peer, key, Deadline(10))))
        t.start()
        server = _wire.server_handshake(a, key, Deadline(10))
        t.join(10)
        self.session = out["s"]
        header = {"partition": partition, "epoch": epoch, "mode": mode, "kind": kind, "qname": "input", "feed_timeout_s": feed_timeout,
                  "first_epoch": first_epoch, "feed_id": feed_id, "index": index, "parts_per_epoch": parts_per_epoch,
                  "last_epoch": last_epoch}
        self.conn = FeedConnection(a, server, header)
        with hub._lock:
            hub._conns.add(self.conn)

    def chunk(self, rows: list) -> None:
        """Queues one pickled batch of ``rows``."""
        self.hub.queues["input"].put_nowait(Chunk(self.conn, bytearray(pickle.dumps(rows))))

    def arrow(self, batch) -> None:
        """Queues one Arrow record batch (IPC stream bytes)."""
        import pyarrow as pa

        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, batch.schema) as w:
            w.write_batch(batch)
        self.hub.queues["input"].put_nowait(Chunk(self.conn, bytearray(sink.getvalue().to_pybytes())))

    def end(self) -> None:
        """Queues the end-of-partition marker."""
        self.hub.queues["input"].put_nowait(PartitionEnd(self.conn))

    def frame(self) -> tuple[FrameType, object]:
        """The next authenticated frame from the node: (type, decoded payload)."""
        ftype, payload = recv_frame(self.peer, self.session, Deadline(10, "a frame from the node"))
        if ftype in (FrameType.RESULTS,):
            return ftype, pickle.loads(payload)
        return ftype, json.loads(bytes(payload)) if payload else None

    def no_frame_yet(self) -> bool:
        """True when the node sent nothing within 0.2 s."""
        self.peer.settimeout(0.2)
        try:
            return len(self.peer.recv(1, socket.MSG_PEEK)) == 0 and False
        except socket.timeout:
            return True
        finally:
            self.peer.settimeout(None)

    def closed(self) -> bool:
        """True when the node closed the connection (waits up to 10 s)."""
        self.peer.settimeout(10)
        return self.peer.recv(1) == b""
