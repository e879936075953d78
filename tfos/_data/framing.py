"""Data-plane framing and chunk decoding (pure; used by Spark feed tasks and the TF process).

A data connection goes from one Spark feed task to one node's TF process. After the
mutual handshake (:func:`tfos._common.wire.server_handshake`), every frame in both directions is::

    type (1 byte) | payload length (uint64, big-endian) | payload | tag (16 bytes)

where the tag authenticates type, length, payload and the frame's sequence number under
the connection's session key for that direction (:class:`tfos._common.wire.DataSession`). A
receiver acts on a frame (decodes JSON, queues a chunk that will be unpickled, yields a
result) only after its tag checked.

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
import socket
import struct
from typing import Any, Optional, Union

from tfos._common.deadline import Deadline
from tfos._common.wire import DataSession, loads_strict, recv_into

__all__ = [
    "FrameType", "ChunkKind", "send_frame", "recv_frame", "send_json", "recv_json", "decode_chunk",
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


class ChunkKind(str, enum.Enum):
    """How the payload of a ``D`` frame encodes rows.

    Attributes:
        PICKLED_BATCH: A pickled list of rows (PySpark's own batch format, forwarded raw).
        PICKLED_ROW: One pickled row.
        UTF8: One row of UTF-8 text (e.g. ``sc.textFile``).
        ARROW: An Arrow IPC stream holding one record batch (DataFrames).
    """

    PICKLED_BATCH = "pickled_batch"
    PICKLED_ROW = "pickled_row"
    UTF8 = "utf8"
    ARROW = "arrow"


def send_frame(
    sock: socket.socket, session: DataSession, ftype: FrameType, payload: Union[bytes, bytearray, memoryview] = b""
) -> None:
    """Sends one authenticated frame (blocking; the socket's timeout bounds it).

    Frames of one direction must be sent one at a time, in order (the caller serialises).
    """
    head = _HEAD.pack(ftype.value[0], len(payload))
    tag = session.seal(ftype.value[0], payload)
    if len(payload) < 65536:
        sock.sendall(b"".join((head, payload, tag)))
    else:
        sock.sendall(head)
        sock.sendall(payload)
        sock.sendall(tag)


def send_json(sock: socket.socket, session: DataSession, ftype: FrameType, obj: Any) -> None:
    """Sends one authenticated frame whose payload is compact JSON."""
    send_frame(sock, session, ftype, json.dumps(obj, separators=(",", ":"), allow_nan=False).encode("utf-8"))


def recv_frame(
    sock: socket.socket, session: DataSession, deadline: Deadline, max_bytes: int = MAX_DATA_FRAME_BYTES
) -> tuple[FrameType, bytearray]:
    """Receives one frame and checks its tag before returning it.

    Args:
        sock: The connected socket.
        session: The connection's session (from the handshake).
        deadline: When the whole frame must have arrived.
        max_bytes: Cap on the announced length, checked before anything is allocated.

    Returns:
        ``(frame type, payload)``, authenticated.

    Raises:
        ConnectionError: The peer closed the connection, sent an unknown frame type or an
            oversize length.
        DataAuthError: The tag is wrong (see :meth:`DataSession.check`).
        DeadlineExceededError: The frame did not arrive in time.
    """
    head = bytearray(_HEAD.size)
    recv_into(sock, memoryview(head), deadline)
    code, n = _HEAD.unpack(head)
    try:
        ftype = FrameType(bytes([code]))
    except ValueError:
        raise ConnectionError(f"unknown data frame type {code!r}") from None
    if n > max_bytes:
        raise ConnectionError(f"{ftype.name} data frame of {n} bytes exceeds the cap of {max_bytes} bytes")
    payload = bytearray(n + _TAG)
    recv_into(sock, memoryview(payload), deadline)
    tag = bytes(memoryview(payload)[n:])
    del payload[n:]  # truncating a bytearray in place does not copy the payload
    session.check(code, payload, tag)
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
        The rows. Arrow chunks become tuples, one per row, with list columns of equal
        length turned into numpy arrays of shape ``(length,)``.

    Raises:
        ValueError: For a payload that does not decode as announced.
    """
    if kind is ChunkKind.ARROW:
        return arrow_rows(payload)
    if kind in (ChunkKind.PICKLED_BATCH, ChunkKind.PICKLED_ROW, ChunkKind.UTF8):
        # PySpark's own frame formats: one decoder for them, in _spark_rawio.
        from tfos._data.spark_rawio import decode_frame

        return decode_frame(kind.value, payload)
    raise ValueError(f"unknown chunk kind {kind!r}")


def arrow_rows(payload: Union[bytes, bytearray]) -> list:
    """Decodes an Arrow IPC stream chunk into a list of row tuples (TF process side)."""
    import pyarrow as pa

    reader = pa.ipc.open_stream(pa.py_buffer(payload))
    batches = list(reader)
    if not batches:
        return []
    if len(batches) == 1:
        # Zero copy: the columns are views of ``payload`` (combine_chunks() would copy them
        # into Arrow's allocator, which keeps the freed memory mapped).
        columns = list(batches[0].columns)
    else:
        columns = [col.combine_chunks() for col in pa.Table.from_batches(batches).itercolumns()]
    cols = []
    for arr in columns:
        t = arr.type
        if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
            rows = _equal_length_rows(arr) if arr.null_count == 0 else None
            cols.append(rows if rows is not None else arr.to_pylist())
        elif pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t):
            view = _numeric_view(arr, 0, len(arr))
            cols.append(view.tolist() if view is not None else arr.to_pylist())
        else:
            cols.append(arr.to_pylist())
    return list(zip(*cols)) if cols else []


def _numeric_view(arr: Any, start: int, stop: int) -> Any:
    """A zero-copy, read-only numpy view of ``arr[start:stop]`` (pure; TF process).

    Only for integer and floating-point Arrow arrays without nulls; reads the data buffer
    directly (``Array.to_numpy()`` would import pandas, ~50 MB, on first use).

    Returns:
        The numpy array, or None when ``arr`` is of another type or has nulls.
    """
    import numpy as np
    import pyarrow as pa

    t = arr.type
    if arr.null_count or not (pa.types.is_integer(t) or pa.types.is_floating(t)):
        return None
    kind = "f" if pa.types.is_floating(t) else ("i" if pa.types.is_signed_integer(t) else "u")
    dtype = np.dtype(f"<{kind}{t.bit_width // 8}")
    if stop <= start:
        return np.empty(0, dtype)
    return np.frombuffer(arr.buffers()[1], dtype=dtype, count=stop - start, offset=(arr.offset + start) * dtype.itemsize)


def _equal_length_rows(arr: Any) -> Optional[list]:
    """Rows of a list column as numpy arrays when every list has the same length (pure).

    Args:
        arr: An Arrow list, large list or fixed-size list array without nulls.

    Returns:
        One numpy array of shape ``(length,)`` per row (views of the chunk's buffer where
        possible), or None when the lists differ in length.
    """
    import pyarrow as pa

    n = len(arr)
    if n == 0:
        return []
    if pa.types.is_fixed_size_list(arr.type):
        width = arr.type.list_size
        start = arr.offset * width
    else:
        offsets = _numeric_view(arr.offsets, 0, n + 1)
        if offsets is None:  # pragma: no cover - offsets never have nulls
            offsets = arr.offsets.to_numpy(zero_copy_only=False)
        if not _equal_steps(offsets):
            return None
        start = int(offsets[0])
        width = int(offsets[1] - offsets[0])
    flat = _numeric_view(arr.values, start, start + n * width)
    if flat is None:
        flat = arr.flatten().to_numpy(zero_copy_only=False)
    return list(flat.reshape(n, width))


def _equal_steps(offsets: Any) -> bool:
    """True when every list of an Arrow list column has the same length (pure)."""
    import numpy as np

    if len(offsets) < 3:
        return True
    steps = np.diff(offsets)
    return bool((steps == steps[0]).all())
