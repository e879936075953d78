"""Data-plane framing and chunk decoding (pure; used by Spark feed tasks and the TF process).

A data connection goes from one Spark feed task to one node's TF process. After the
mutual handshake (:func:`tfos._common.wire.server_handshake`), every frame in both directions is::

    type (1 byte) | payload length (uint64, big-endian) | header tag (16 bytes)
        | encrypted payload | tag (16 bytes)

where the payload is encrypted with AES-GCM and the tag authenticates type, length,
payload and the frame's sequence number under the connection's session key for that
direction (:class:`tfos._common.data_session.DataSession`). The header tag authenticates
type, length and sequence number alone: a receiver checks it before it allocates anything
for the announced length, so a forged length (a man in the middle of an unencrypted
network) closes the connection at the cost of 25 bytes. A receiver acts on a frame (decodes
JSON, queues a chunk that will be unpickled, yields a result) only after its tag checked.

Client -> server: ``H`` header (JSON), ``D`` data chunk, ``E`` end of partition.
Server -> client: ``S`` status (JSON, right after the handshake), ``A`` partition consumed
(JSON), ``R`` results chunk (a pickled list), ``F`` end of results (JSON), ``T`` the node
terminated the feed, ``X`` error (JSON).

Chunks are never one row per frame: a ``D`` frame carries a whole Spark batch of pickled
rows, one UTF-8 line, or one Arrow record batch.
"""

from __future__ import annotations

import enum
import json
import pickle
import socket
import struct
from typing import Any, Union

from tfos._common.data_session import DataSession
from tfos._common.deadline import Deadline
from tfos._common.wire import loads_strict, recv_into
from tfos._data.arrow_codec import arrow_rows

__all__ = [
    "FrameType", "FeedState", "ChunkKind", "send_frame", "send_frame_parts", "recv_frame", "send_json", "recv_json", "decode_chunk",
    "MAX_DATA_FRAME_BYTES", "MAX_CONTROL_DATA_FRAME_BYTES",
]

_HEAD = struct.Struct(">BQ")
_TAG = DataSession.TAG_BYTES
#: A single data frame may not exceed this many bytes (a Spark batch is far smaller).
MAX_DATA_FRAME_BYTES = (1 << 31) - 1
#: Cap on JSON frames (header, status, acks): read before anything is allocated.
MAX_CONTROL_DATA_FRAME_BYTES = 1 << 16


class FrameType(bytes, enum.Enum):
    """The one-byte frame types of a data connection."""

    HEADER = b"H"
    DATA = b"D"
    END = b"E"
    STATUS = b"S"
    ACK = b"A"
    RESULTS = b"R"
    RESULTS_END = b"F"
    TERMINATED = b"T"
    ERROR = b"X"
    #: Node -> feed task, after the task's END: main_fun is still taking rows (of any
    #: partition) while this partition waits in the queue; the task's ``feed_timeout``
    #: clock starts again. JSON ``{"rows": rows of this partition taken so far}``.
    PROGRESS = b"P"


class FeedState(enum.StrEnum):
    """What a node's data server says of one feed connection (the ``state`` of its STATUS
    and ERROR frames) and a train feed task's outcome per partition. Not a node's state
    (that is :class:`tfos._control.messages.NodeState`).

    Attributes:
        OK: The node takes (or took) the partition.
        TERMINATED: ``DataFeed.terminate()`` was called on the queue: the partition is skipped.
        MAIN_FUN_RETURNED: main_fun returned; the node reads no more.
        MAIN_FUN_FAILED: main_fun failed, the cluster aborted or a result was wrong.
        REFUSED: The node refuses this connection (no such queue, partition already delivered).
        SKIPPED: A feed task's outcome: the node's main_fun had returned before the partition.
    """

    OK = "ok"
    TERMINATED = "terminated"
    MAIN_FUN_RETURNED = "main_fun_returned"
    MAIN_FUN_FAILED = "main_fun_failed"
    REFUSED = "refused"
    SKIPPED = "skipped"


class ChunkKind(str, enum.Enum):
    """How the payload of a ``D`` frame encodes rows.

    Attributes:
        PICKLED_BATCH: A pickled list of rows (PySpark's own batch format, forwarded raw).
        PICKLED_ROW: One pickled row.
        UTF8: One row of UTF-8 text (e.g. ``sc.textFile``).
        ARROW: An Arrow IPC stream holding one record batch (DataFrames).
        PICKLED_BATCHES: Several ``PICKLED_BATCH`` payloads, each preceded by its length
            (uint32, big-endian): a feed task packs PySpark's batches of an RDD (about 64 to
            100 KB each) into frames of about 1 MiB (``feed_tasks.PACK_BYTES``), so a frame's
            fixed costs (tag, send, receive, queue hand-over) are paid once per ~10 batches.
    """

    PICKLED_BATCH = "pickled_batch"
    PICKLED_BATCHES = "pickled_batches"
    PICKLED_ROW = "pickled_row"
    UTF8 = "utf8"
    ARROW = "arrow"


def send_frame(
    sock: socket.socket, session: DataSession, ftype: FrameType, payload: Union[bytes, bytearray, memoryview] = b""
) -> None:
    """Sends one encrypted, authenticated frame (blocking; the socket's timeout bounds it).

    Frames of one direction must be sent one at a time, in order (the caller serialises).
    """
    head = _HEAD.pack(ftype.value[0], memoryview(payload).nbytes)
    head += session.seal_head(ftype.value[0], head)
    sealed = session.seal(ftype.value[0], head[:_HEAD.size], payload)
    if len(sealed) < _GATHER_MIN_BYTES or not hasattr(sock, "sendmsg"):
        sock.sendall(head + sealed)
    else:
        # Header, ciphertext and tag in one system call (gather write, no join).
        _sendall_parts(sock, [memoryview(head), sealed])


def seal_frame(session: DataSession, ftype: FrameType, payload: Union[bytes, bytearray, memoryview]) -> bytes:
    """One encrypted, authenticated frame as bytes (header, ciphertext, tag), for callers
    that send it themselves under their own deadline (pure; advances ``session``'s send
    counter).

    Raises:
        ValueError: The payload exceeds :data:`MAX_DATA_FRAME_BYTES`.
    """
    n = memoryview(payload).nbytes
    if n > MAX_DATA_FRAME_BYTES:
        raise ValueError(f"a {ftype.name} frame of {n} bytes exceeds the cap of {MAX_DATA_FRAME_BYTES} bytes")
    head = _HEAD.pack(ftype.value[0], n)
    return head + session.seal_head(ftype.value[0], head) + bytes(session.seal(ftype.value[0], head, payload))


#: Frames smaller than this are sent with one ``sendall`` of a joined copy (header,
#: ciphertext and tag); larger ones with one gathering ``sendmsg``.
_GATHER_MIN_BYTES = 1 << 16
#: Most buffers handed to one ``sendmsg`` call (below every platform's IOV_MAX of 1024).
_GATHER_MAX_PARTS = 512


def send_frame_parts(sock: socket.socket, session: DataSession, ftype: FrameType, parts: list) -> None:
    """Sends one encrypted, authenticated frame whose payload is the concatenation of
    ``parts``.

    On the wire and for the receiver it is the same frame as ``send_frame(sock, session,
    ftype, b"".join(parts))``, but the parts are never joined: they are encrypted one
    after the other into the session's send buffer (:meth:`DataSession.seal_parts`), the
    only pass over their bytes before the kernel's copy (blocking; the socket's timeout
    bounds it).

    Args:
        parts: Bytes-like objects (``bytes``, ``pyarrow.Buffer``, memoryviews...), in order.
    """
    views = [v for v in (_bytes_view(part) for part in parts) if len(v)]
    n = sum(len(v) for v in views)
    if n > MAX_DATA_FRAME_BYTES:
        raise ValueError(f"a {ftype.name} frame of {n} bytes exceeds the cap of {MAX_DATA_FRAME_BYTES} bytes")
    head = _HEAD.pack(ftype.value[0], n)
    head += session.seal_head(ftype.value[0], head)
    sealed = session.seal_parts(ftype.value[0], head[:_HEAD.size], views, n)
    if not hasattr(sock, "sendmsg"):
        sock.sendall(head + sealed)
        return
    _sendall_parts(sock, [memoryview(head), sealed])


def _bytes_view(payload: Any) -> memoryview:
    view = memoryview(payload)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _sendall_parts(sock: socket.socket, parts: list) -> None:
    """``sendall`` of several buffers with ``sendmsg`` (partial sends resumed; blocking)."""
    while parts:
        sent = sock.sendmsg(parts[:_GATHER_MAX_PARTS])
        while sent:
            first = len(parts[0])
            if sent >= first:
                sent -= first
                parts.pop(0)
            else:
                parts[0] = parts[0][sent:]
                sent = 0
        while parts and not len(parts[0]):
            parts.pop(0)


def send_json(sock: socket.socket, session: DataSession, ftype: FrameType, obj: Any) -> None:
    """Sends one authenticated frame whose payload is compact JSON."""
    send_frame(sock, session, ftype, json.dumps(obj, separators=(",", ":"), allow_nan=False).encode("utf-8"))


def recv_frame(
    sock: socket.socket, session: DataSession, deadline: Deadline, max_bytes: int = MAX_DATA_FRAME_BYTES
) -> tuple[FrameType, bytearray]:
    """Receives one frame, checks its tag and decrypts it before returning it.

    Args:
        sock: The connected socket.
        session: The connection's session (from the handshake).
        deadline: When the whole frame must have arrived.
        max_bytes: Cap on the announced length, checked (after the header's own tag)
            before anything is allocated.

    Returns:
        ``(frame type, payload)``, authenticated and decrypted (in the receive buffer).

    Raises:
        ConnectionError: The peer closed the connection, sent an unknown frame type or an
            oversize length.
        DataAuthError: The header's tag or the frame's tag is wrong (a forged length is
            refused before anything is allocated for it; see :meth:`DataSession.open`).
        DeadlineExceededError: The frame did not arrive in time.
    """
    wire_head = bytearray(_HEAD.size + _TAG)
    recv_into(sock, memoryview(wire_head), deadline)
    head = bytes(wire_head[:_HEAD.size])
    code, n = _HEAD.unpack(head)
    session.check_head(code, head, wire_head[_HEAD.size:])  # nothing sized by n before this
    try:
        ftype = FrameType(bytes([code]))
    except ValueError:
        raise ConnectionError(f"unknown data frame type {code!r}") from None
    if n > max_bytes:
        raise ConnectionError(f"{ftype.name} data frame of {n} bytes exceeds the cap of {max_bytes} bytes")
    payload = bytearray(n + _TAG)
    recv_into(sock, memoryview(payload), deadline)
    session.open(code, head, payload)  # decrypted in place, tag checked, then truncated
    return ftype, payload


def recv_json(sock: socket.socket, session: DataSession, deadline: Deadline) -> tuple[FrameType, dict]:
    """Receives one authenticated JSON frame (at most :data:`MAX_CONTROL_DATA_FRAME_BYTES`).

    Returns:
        ``(frame type, decoded object)``; an empty payload decodes to ``{}``.

    Raises:
        ConnectionError: As :func:`recv_frame`, or the payload is not a JSON object.
        DataAuthError, DeadlineExceededError: As :func:`recv_frame`.
    """
    ftype, payload = recv_frame(sock, session, deadline, MAX_CONTROL_DATA_FRAME_BYTES)
    return ftype, parse_json(ftype, payload)


def parse_json(ftype: FrameType, payload: Union[bytes, bytearray]) -> dict:
    """Decodes the JSON payload of an authenticated frame (``{}`` when empty).

    Raises:
        ConnectionError: Not a JSON object, or a non-finite number (a protocol error).
    """
    if not payload:
        return {}
    try:
        obj = loads_strict(payload)
    except ValueError as exc:
        raise ConnectionError(f"bad JSON in a {ftype.name} data frame: {exc}") from None
    if not isinstance(obj, dict):
        raise ConnectionError(f"the {ftype.name} data frame is not a JSON object")
    return obj


def decode_chunk(kind: ChunkKind, payload: Union[bytes, bytearray]) -> list:
    """Turns one ``D`` payload into its list of rows (TF process side).

    Pickled payloads are only decoded after the connection authenticated with the
    cluster key (the feed task that sent them is part of this cluster's Spark job).

    Args:
        kind: The chunk encoding announced in the connection header.
        payload: The frame payload.

    Returns:
        The rows. Arrow chunks become tuples, one per row, holding the values of
        ``df.rdd`` (see :func:`arrow_rows`; numeric array columns of one shape per chunk
        become numpy arrays).

    Raises:
        ValueError: For a payload that does not decode as announced.
    """
    if kind is ChunkKind.ARROW:
        return arrow_rows(payload)
    # PySpark's own record formats, decoded as spark_rawio.decode_record does, without
    # importing that module: it imports pyspark, which costs the TF process seconds of CPU
    # on its first chunk (from pyspark.zip, pyspark is compiled from source on import).
    # Rows that need pyspark (``df.rdd`` Rows, rows pickled by value) import it when
    # unpickled.
    if kind is ChunkKind.PICKLED_BATCHES:
        return _unpack_batches(payload)
    if kind is ChunkKind.PICKLED_BATCH:
        rows = pickle.loads(payload, encoding="bytes")
        if type(rows) is list:
            return rows
        if isinstance(rows, (list, tuple)):
            return list(rows)
        raise TypeError(f"a PICKLED_BATCH frame must hold a list of rows, not {type(rows).__name__}")
    if kind is ChunkKind.PICKLED_ROW:
        return [pickle.loads(payload, encoding="bytes")]
    if kind is ChunkKind.UTF8:
        return [str(payload, "utf-8")]
    raise ValueError(f"unknown chunk kind {kind!r}")


def _unpack_batches(payload: Union[bytes, bytearray, memoryview]) -> list:
    """The rows of a ``PICKLED_BATCHES`` payload, in order (TF process side; see
    :class:`ChunkKind`). Each batch is unpickled from a view of the payload (no copy).

    Raises:
        ValueError: The payload ends inside a length prefix or inside a batch, or holds an
            empty batch.
        TypeError: A batch does not unpickle to a list or tuple of rows.
    """
    view = memoryview(payload)
    end = len(view)
    out: list = []
    at = 0
    while at < end:
        if at + 4 > end:
            raise ValueError(f"a PICKLED_BATCHES frame of {end} bytes ends inside a length prefix at byte {at}")
        size = _BATCH_LEN.unpack_from(view, at)[0]
        at += 4
        if at + size > end:
            raise ValueError(f"a PICKLED_BATCHES frame of {end} bytes ends inside a batch of {size} bytes at byte {at}")
        if size == 0:
            raise ValueError(f"a PICKLED_BATCHES frame of {end} bytes holds an empty batch at byte {at}")
        rows = pickle.loads(view[at : at + size], encoding="bytes")
        if isinstance(rows, (list, tuple)):
            out.extend(rows)
        else:
            raise TypeError(f"a PICKLED_BATCHES frame must hold lists of rows, not {type(rows).__name__}")
        at += size
    return out


#: The length prefix of each batch in a ``PICKLED_BATCHES`` payload.
_BATCH_LEN = struct.Struct(">I")
