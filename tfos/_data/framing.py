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

import codecs
import datetime
import enum
import functools
import json
import pickle
import socket
import struct
from typing import Any, Optional, Union

from tfos._common.data_session import DataSession
from tfos._common.deadline import Deadline
from tfos._common.wire import loads_strict, recv_into

__all__ = [
    "FrameType", "ChunkKind", "send_frame", "send_frame_parts", "recv_frame", "send_json", "recv_json", "decode_chunk",
    "MAX_DATA_FRAME_BYTES", "MAX_CONTROL_DATA_FRAME_BYTES",
    "arrow_rows", "arrow_ndarray", "arrow_vector_ndarray", "ArrowRows", "SPARK_SCHEMA_KEY", "feed_schema_json",
    "binary_as_bytes",
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
    # PySpark's own frame formats, decoded as _spark_rawio.decode_frame does, without
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


#: Arrow schema metadata key under which a DataFrame feed task puts the DataFrame's Spark
#: schema (JSON) when a column needs it to decode (Spark ML vectors and other UDTs: Spark's
#: Arrow batches carry a UDT as its bare SQL struct, without metadata).
SPARK_SCHEMA_KEY = b"tfos.spark_schema"

#: Key of the Spark schema JSON (:data:`SPARK_SCHEMA_KEY`) saying whether ``df.rdd`` gives
#: binary values as ``bytes`` (Spark's ``spark.sql.execution.pyspark.binaryAsBytes``, true
#: by default since Spark 4.1) or ``bytearray`` (false, and Spark before 4.1). A chunk
#: without it decodes binary as ``bytearray``.
BINARY_AS_BYTES_KEY = "tfos.binaryAsBytes"
_BINARY_CONF = "spark.sql.execution.pyspark.binaryAsBytes"


def binary_as_bytes(spark: Any) -> bool:
    """True when ``df.rdd`` gives ``BinaryType`` values as ``bytes`` in this session (driver).

    Reads ``spark.sql.execution.pyspark.binaryAsBytes``; a Spark without that conf gives
    ``bytearray`` (False). Works with classic and Connect sessions.
    """
    try:
        # No default argument: conf.get(key, default) returns that default, not Spark's,
        # when the conf was not set explicitly.
        value = spark.conf.get(_BINARY_CONF)
    except Exception:  # noqa: BLE001 - a Spark without the conf raises (type varies: classic/Connect)
        return False
    return value is not None and str(value).strip().lower() == "true"


def feed_schema_json(schema: Any, as_bytes: bool) -> Optional[str]:
    """The Spark schema JSON a DataFrame feed puts into every Arrow chunk, or None (driver; pure).

    Needed when the schema has a user-defined type (``VectorUDT``...: Spark's Arrow form is a
    bare struct) or a ``BinaryType`` (``bytes`` or ``bytearray``, as ``df.rdd`` in the session:
    see :func:`binary_as_bytes`) at any depth; every other type decodes from its Arrow type.

    Args:
        schema: The DataFrame's ``StructType``.
        as_bytes: :func:`binary_as_bytes` of the session.

    Raises:
        ConfigurationError: A ``CalendarIntervalType`` or ``YearMonthIntervalType`` at any
            depth: ``df.rdd`` has no Python value for it (PySpark raises), so neither has the
            feed; the message names the column.
    """
    from pyspark.sql.types import ArrayType, BinaryType, MapType, StructType, UserDefinedType

    _refuse_unfeedable(schema)

    def needs(t: Any) -> bool:
        if isinstance(t, (UserDefinedType, BinaryType)):
            return True
        if isinstance(t, StructType):
            return any(needs(f.dataType) for f in t.fields)
        if isinstance(t, ArrayType):
            return needs(t.elementType)
        if isinstance(t, MapType):
            return needs(t.keyType) or needs(t.valueType)
        return False

    if not needs(schema):
        return None
    obj = schema.jsonValue()
    obj[BINARY_AS_BYTES_KEY] = bool(as_bytes)
    return json.dumps(obj, separators=(",", ":"))


def _refuse_unfeedable(schema: Any) -> None:
    """Raises ConfigurationError for a column ``df.rdd`` cannot give to Python (driver; pure)."""
    from pyspark.sql import types as T

    from tfos.errors import ConfigurationError

    interval = getattr(T, "CalendarIntervalType", None)  # not in every PySpark version
    year_month = getattr(T, "YearMonthIntervalType", None)
    ArrayType, MapType, StructType = T.ArrayType, T.MapType, T.StructType

    def walk(t: Any, path: str) -> None:
        if interval is not None and isinstance(t, interval):
            raise ConfigurationError(
                f"train(df): column {path!r} is a CalendarIntervalType (INTERVAL with months), which df.rdd "
                "cannot convert to Python either; cast it (e.g. to a string or a number of days) or drop it")
        if year_month is not None and isinstance(t, year_month):
            # df.rdd raises NOT_IMPLEMENTED (no fromInternal), and Spark's Arrow batches of it
            # cannot reach Python either (mapInArrow fails in the Spark task).
            raise ConfigurationError(
                f"train(df): column {path!r} is a YearMonthIntervalType ({t.simpleString()}, e.g. INTERVAL 1 MONTH), "
                "which neither df.rdd nor Spark's Arrow batches can convert to Python; cast it to a number of months "
                f"(col({path.split('.')[0].split('[')[0].split('{')[0]!r}).cast('int')) or to a string, or drop it")
        if isinstance(t, StructType):
            for f in t.fields:
                walk(f.dataType, f"{path}.{f.name}" if path else f.name)
        elif isinstance(t, ArrayType):
            walk(t.elementType, path + "[]")
        elif isinstance(t, MapType):
            walk(t.keyType, path + "{key}")
            walk(t.valueType, path + "{value}")

    walk(schema, "")


class ArrowRows(list):
    """The rows of one Arrow chunk (a list of tuples) with the chunk's column names."""

    column_names: tuple = ()


def arrow_rows(payload: Union[bytes, bytearray]) -> list:
    """Decodes an Arrow IPC stream chunk into a list of row tuples (TF process side).

    Every value is the Python value the same row of ``df.rdd`` holds (see the table in
    docs/datafeed.md): exact integers, ``None`` for nulls, ``Row`` for structs, ``dict``
    for maps, ``bytes`` or ``bytearray`` for binary (as the schema metadata says, see
    :func:`feed_schema_json`; ``bytearray`` without it), naive local ``datetime`` for timestamps,
    ``DenseVector``/``SparseVector`` (or the value of any other UDT) when the chunk's
    schema metadata names the column's UDT (:data:`SPARK_SCHEMA_KEY`). One exception,
    for speed: a column of numeric arrays (nested to any depth) without nulls at any
    level whose arrays all have the same shape in the chunk gives each row as a
    read-only numpy array of that shape and of the Arrow dtype (a zero-copy view of
    ``payload``; the same numbers, none converted).

    Returns:
        An :class:`ArrowRows` list of tuples, one per row.

    Raises:
        ValueError: For a payload that is not an Arrow IPC stream.
    """
    import pyarrow as pa

    reader = pa.ipc.open_stream(pa.py_buffer(payload))
    batches = list(reader)
    out = ArrowRows()
    out.column_names = tuple(reader.schema.names)
    if not batches:
        return out
    if len(batches) == 1:
        # Zero copy: the columns are views of ``payload`` (combine_chunks() would copy them
        # into Arrow's allocator, which keeps the freed memory mapped).
        columns = list(batches[0].columns)
    else:
        columns = [col.combine_chunks() for col in pa.Table.from_batches(batches).itercolumns()]
    spark_types, as_bytes = _spark_types(reader.schema)
    cols = []
    for i, arr in enumerate(columns):
        spark_type = spark_types[i] if spark_types is not None else None
        cols.append(_column_values(arr, spark_type, as_bytes))
    out.extend(zip(*cols))
    return out


def _spark_types(schema: Any) -> tuple:
    """``(Spark DataType of every column or None, binary as bytes)`` from the chunk's schema
    metadata (``(None, False)`` without it)."""
    meta = schema.metadata or {}
    text = meta.get(SPARK_SCHEMA_KEY)
    if not text:
        return None, False
    types, as_bytes = _parse_spark_schema(bytes(text))
    if len(types) != len(schema.names):
        raise ValueError(
            f"the Arrow chunk has {len(schema.names)} columns but its Spark schema has {len(types)}"
        )
    return list(types), as_bytes


@functools.lru_cache(maxsize=32)
def _parse_spark_schema(text: bytes) -> tuple:
    """``(tuple of the columns' Spark DataTypes, binary as bytes)`` of a Spark schema JSON (pure).

    Cached per JSON text (every chunk of a feed carries the same one; at most 32 texts are
    kept): parsing it builds the UDT objects, which costs a chunk more than decoding its rows.
    """
    from pyspark.sql.types import StructType

    obj = json.loads(text)
    st = StructType.fromJson(obj)
    return tuple(f.dataType for f in st.fields), bool(obj.get(BINARY_AS_BYTES_KEY, False))


def _column_values(arr: Any, spark_type: Any, as_bytes: bool = False) -> list:
    """One column of an Arrow chunk as the list of its rows' Python values (pure)."""
    import pyarrow as pa

    t = arr.type
    if spark_type is None or not _is_udt(spark_type):
        if pa.types.is_integer(t) or pa.types.is_floating(t):
            view = _numeric_view(arr, 0, len(arr))
            if view is not None:
                return view.tolist()
        elif _is_list_type(t):
            nd = arrow_ndarray(arr)
            if nd is not None:
                return list(nd)
    return _exact_values(arr, spark_type, as_bytes)


def _exact_values(arr: Any, spark_type: Any, as_bytes: bool) -> list:
    """One column as the list of the values ``df.rdd`` holds, without numpy views (pure).

    The same values as ``[conv(v) for v in arr.to_pylist()]`` with :func:`_converter`, built
    column-wise where that is faster: ML vector columns (:func:`_vector_values`), struct
    columns (:func:`_struct_values`), numeric columns without nulls.
    """
    import pyarrow as pa

    t = arr.type
    if spark_type is not None and _is_udt(spark_type):
        fast = _vector_values(arr, spark_type)
        if fast is not None:
            return fast
    elif _is_variant(t):
        return [_variant_value(v) for v in arr.to_pylist()]
    elif pa.types.is_struct(t):
        return _struct_values(arr, spark_type, as_bytes)
    elif (pa.types.is_integer(t) or pa.types.is_floating(t)) and not pa.types.is_float16(t):
        view = _numeric_view(arr, 0, len(arr))
        if view is not None:
            return view.tolist()  # the same Python ints and floats as to_pylist()
    try:
        values = arr.to_pylist()
    except UnicodeDecodeError:  # a string that is not valid UTF-8 (e.g. CAST(binary AS STRING))
        values = _replacing_pylist(arr)
    conv = _converter(t, spark_type, as_bytes)
    return values if conv is None else [conv(v) for v in values]


def _strings_as_binary(t: Any) -> Any:
    """Arrow type ``t`` with every string type in it (also nested) made the binary type of
    the same offsets (pure)."""
    import pyarrow as pa

    if pa.types.is_string(t):
        return pa.binary()
    if pa.types.is_large_string(t):
        return pa.large_binary()
    if pa.types.is_list(t):
        return pa.list_(t.value_field.with_type(_strings_as_binary(t.value_type)))
    if pa.types.is_large_list(t):
        return pa.large_list(t.value_field.with_type(_strings_as_binary(t.value_type)))
    if pa.types.is_fixed_size_list(t):
        return pa.list_(t.value_field.with_type(_strings_as_binary(t.value_type)), t.list_size)
    if pa.types.is_struct(t):
        return pa.struct([t.field(i).with_type(_strings_as_binary(t.field(i).type)) for i in range(t.num_fields)])
    if pa.types.is_map(t):
        return pa.map_(t.key_field.with_type(_strings_as_binary(t.key_type)),
                       t.item_field.with_type(_strings_as_binary(t.item_type)), t.keys_sorted)
    return t


def _java_replace(exc: UnicodeError) -> tuple[str, int]:
    """A codec error handler: U+FFFD for each invalid UTF-8 sequence, cut as Java's UTF-8
    decoder cuts it, so a decoded string equals the one ``df.rdd`` gets through the JVM (pure).

    Python's ``"replace"`` and Java agree on every sequence but an encoded surrogate (``ED``
    followed by ``A0``-``BF``): Java takes ``ED A0``-``BF`` and one continuation byte as one
    invalid sequence (one U+FFFD for ``ED A0 80``, where Python puts three).
    """
    if not isinstance(exc, UnicodeDecodeError):
        raise exc
    b, i = exc.object, exc.start
    if b[i] == 0xED and i + 1 < len(b) and 0xA0 <= b[i + 1] <= 0xBF:
        return "\ufffd", i + 3 if i + 2 < len(b) and 0x80 <= b[i + 2] <= 0xBF else i + 2
    return "\ufffd", exc.end


_JAVA_REPLACE = "tfos.java_replace"
codecs.register_error(_JAVA_REPLACE, _java_replace)


def _replace_invalid_utf8(v: Any, t: Any) -> Any:
    """A ``to_pylist()`` value of ``_strings_as_binary(t)`` with its strings decoded as
    ``df.rdd`` decodes them: invalid UTF-8 becomes U+FFFD (pure)."""
    import pyarrow as pa

    if v is None:
        return None
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return str(v, "utf-8", _JAVA_REPLACE)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return [_replace_invalid_utf8(x, t.value_type) for x in v]
    if pa.types.is_struct(t):
        return {t.field(i).name: _replace_invalid_utf8(x, t.field(i).type) for i, x in enumerate(v.values())}
    if pa.types.is_map(t):
        return [(_replace_invalid_utf8(k, t.key_type), _replace_invalid_utf8(x, t.item_type)) for k, x in v]
    return v


def _replacing_pylist(arr: Any) -> list:
    """``arr.to_pylist()`` for a column holding a string that is not valid UTF-8 (pure).

    Spark does not check that its strings are UTF-8 (``CAST(binary AS STRING)``, text files in
    another encoding); ``df.rdd`` decodes them through Java, which puts U+FFFD for each
    invalid sequence, where ``to_pylist()`` raises ``UnicodeDecodeError``. The column is read
    with its strings as bytes and decoded as Java does (:func:`_java_replace`).
    """
    raw = arr.cast(_strings_as_binary(arr.type)).to_pylist()
    return [_replace_invalid_utf8(v, arr.type) for v in raw]


def _valid_list(arr: Any) -> Optional[list]:
    """``[bool]`` per row of ``arr`` (True = not null), or None when it has no nulls (pure)."""
    return arr.is_valid().to_pylist() if arr.null_count else None


def _struct_values(arr: Any, spark_type: Any, as_bytes: bool) -> list:
    """A struct column as ``df.rdd``'s ``Row`` objects (None for a null struct), built field-wise (pure).

    Every field is converted as a column (:func:`_exact_values`) and each row's values
    become a ``Row`` as PySpark builds them for ``df.rdd`` (``_create_row``: a tuple of the
    values with ``__fields__``, the field names, one list shared by the rows of a chunk).
    """
    from pyspark.sql import Row

    t = arr.type
    names = [t.field(i).name for i in range(t.num_fields)]
    fields = getattr(spark_type, "fields", None)
    fields = fields if fields is not None and len(fields) == len(names) else None
    # flatten(): the fields of the struct's rows, null where the struct is null.
    cols = [_exact_values(child, fields[i].dataType if fields else None, as_bytes)
            for i, child in enumerate(arr.flatten())]
    tuples: Any = zip(*cols) if cols else [()] * len(arr)
    # Row(*vals) then row.__fields__ = names, without Row's Python-level __new__/__setattr__.
    rows = list(map(functools.partial(tuple.__new__, Row), tuples))
    setattr_ = object.__setattr__
    for row in rows:
        setattr_(row, "__fields__", names)
    valid = _valid_list(arr)
    if valid is None:
        return rows
    return [row if ok else None for ok, row in zip(valid, rows)]


_VECTOR_FIELDS = ("type", "size", "indices", "values")


def _vector_values(arr: Any, udt: Any) -> Optional[list]:
    """A column of Spark ML vectors as ``DenseVector``/``SparseVector`` objects, or None (pure).

    The values ``udt.deserialize`` gives row by row (the generic path), built from one
    float64 (and one int32 indices) copy of the chunk's vector values: each vector's array
    is a slice of that copy (writable, not a view of the received chunk). None (use the
    generic path) when the UDT is not ``pyspark.ml.linalg.VectorUDT``, the Arrow type is
    not its struct, or a value is not what Spark writes for a valid vector (a null field
    of a vector, a null element, an unknown type code, sparse indices not strictly
    increasing within ``[0, size)``, index and value counts that differ): the generic
    path then gives (or raises) what ``deserialize`` does.
    """
    import numpy as np
    import pyarrow as pa

    cls = type(udt)
    if cls.__name__ != "VectorUDT" or cls.__module__ != "pyspark.ml.linalg":
        return None
    t = arr.type
    if not pa.types.is_struct(t) or tuple(t.field(i).name for i in range(t.num_fields)) != _VECTOR_FIELDS:
        return None
    kinds_a, sizes_a, idx_a, vals_a = arr.flatten()
    if not (pa.types.is_integer(kinds_a.type) and pa.types.is_integer(sizes_a.type)
            and pa.types.is_list(idx_a.type) and pa.types.is_list(vals_a.type)
            and pa.types.is_int32(idx_a.type.value_type) and pa.types.is_float64(vals_a.type.value_type)):
        return None
    n = len(arr)
    valid = _valid_list(arr)
    kinds = kinds_a.to_pylist()
    sizes = sizes_a.to_pylist()
    vals_ok = _valid_list(vals_a)
    idx_ok = _valid_list(idx_a)
    voffs = _numeric_view(vals_a.offsets, 0, n + 1)
    ioffs = _numeric_view(idx_a.offsets, 0, n + 1)
    vleaf, ileaf = vals_a.values, idx_a.values
    if voffs is None or ioffs is None or vleaf.null_count or ileaf.null_count:
        return None
    vlo, vhi, ilo, ihi = int(voffs[0]), int(voffs[-1]), int(ioffs[0]), int(ioffs[-1])
    vflat = np.array(_numeric_view(vleaf, vlo, vhi))  # one writable copy per chunk
    iflat = np.array(_numeric_view(ileaf, ilo, ihi))
    from pyspark.ml.linalg import DenseVector, SparseVector

    new_dense, new_sparse = DenseVector.__new__, SparseVector.__new__
    kind_view = _numeric_view(kinds_a, 0, n)
    if (valid is None and vals_ok is None and not len(iflat) and kind_view is not None
            and bool((kind_view == 1).all()) and n and _equal_steps(voffs)):
        # Only dense vectors of one size (VectorAssembler's output): rows of one matrix.
        dense: list = []
        for row in vflat.reshape(n, (vhi - vlo) // n):
            dv = new_dense(DenseVector)
            dv.array = row
            dense.append(dv)
        return dense
    vo = (voffs - vlo).tolist()
    io = (ioffs - ilo).tolist()
    # Which rows are dense, sparse or null; anything else goes to the generic path.
    is_sparse = np.zeros(n, dtype=bool)
    for i in range(n):
        if valid is not None and not valid[i]:
            continue
        k = kinds[i]
        if k == 1:
            if vals_ok is not None and not vals_ok[i]:
                return None
        elif k == 0:
            if sizes[i] is None or (vals_ok is not None and not vals_ok[i]) or (idx_ok is not None and not idx_ok[i]):
                return None
            if io[i + 1] - io[i] != vo[i + 1] - vo[i]:
                return None
            is_sparse[i] = True
        else:
            return None
    if len(iflat):
        # Every index belongs to a sparse row, lies in [0, size) and exceeds its predecessor in the row.
        lengths = np.diff(np.asarray(io))
        row_of = np.repeat(np.arange(n), lengths)
        if not is_sparse[row_of].all():
            return None
        size_of = np.asarray([s if s is not None else 0 for s in sizes], dtype=np.int64)[row_of]
        if (iflat < 0).any() or (iflat >= size_of).any():
            return None
        if len(iflat) > 1 and ((np.diff(iflat) <= 0) & (row_of[1:] == row_of[:-1])).any():
            return None
    # The attributes DenseVector(values) and SparseVector(size, indices, values) set (the
    # float64 and int32 arrays they would keep as given), from the checked slices.
    out: list = []
    append = out.append
    for i in range(n):
        if valid is not None and not valid[i]:
            append(None)
        elif is_sparse[i]:
            sv = new_sparse(SparseVector)
            sv.size = int(sizes[i])
            sv.indices = iflat[io[i] : io[i + 1]]
            sv.values = vflat[vo[i] : vo[i + 1]]
            append(sv)
        else:
            dv = new_dense(DenseVector)
            dv.array = vflat[vo[i] : vo[i + 1]]
            append(dv)
    return out


def _is_list_type(t: Any) -> bool:
    import pyarrow as pa

    return bool(pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t))


def _is_udt(spark_type: Any) -> bool:
    return hasattr(spark_type, "deserialize") and hasattr(spark_type, "sqlType")


def _is_variant(t: Any) -> bool:
    """True for Spark's Arrow form of a ``VariantType`` value (pure): a struct of binary
    ``value`` and ``metadata`` whose ``metadata`` field is tagged ``variant: true`` (the
    test PySpark's own Arrow conversion uses)."""
    import pyarrow as pa

    if not pa.types.is_struct(t) or t.num_fields != 2:
        return False
    names = {t.field(i).name: t.field(i) for i in range(2)}
    meta = names.get("metadata")
    return "value" in names and meta is not None and (meta.metadata or {}).get(b"variant") == b"true"


def _variant_value(v: Any) -> Any:
    """A ``to_pylist()`` variant struct as ``df.rdd`` gives it: ``VariantVal`` of two
    ``bytearray`` (PySpark 4), None for a null (pure)."""
    if v is None:
        return None
    from pyspark.sql.types import VariantVal

    # bytearray, as df.rdd holds them (PySpark's annotation says bytes)
    return VariantVal(bytearray(v["value"]), bytearray(v["metadata"]))  # type: ignore[arg-type]


def _converter(t: Any, spark_type: Any = None, as_bytes: bool = False) -> Optional[Any]:
    """A function from ``Array.to_pylist()`` values of Arrow type ``t`` to the values of
    ``df.rdd`` (None when they are already the same; pure).

    Args:
        t: The Arrow type.
        spark_type: The Spark ``DataType`` of the same value when known (needed for UDTs).
        as_bytes: Binary values stay ``bytes`` (else become ``bytearray``).
    """
    import pyarrow as pa

    if spark_type is not None and _is_udt(spark_type):
        udt = spark_type
        inner = _converter(t, udt.sqlType(), as_bytes)

        def convert_udt(v: Any) -> Any:
            return None if v is None else udt.deserialize(inner(v) if inner is not None else v)

        return convert_udt
    if _is_variant(t):
        return _variant_value
    if pa.types.is_struct(t):
        from pyspark.sql import Row

        names = [t.field(i).name for i in range(t.num_fields)]
        fields = getattr(spark_type, "fields", None)
        fields = fields if fields is not None and len(fields) == len(names) else None
        convs = [_converter(t.field(i).type, fields[i].dataType if fields else None, as_bytes) for i in range(t.num_fields)]

        def convert_struct(v: Any) -> Any:
            if v is None:
                return None
            vals = list(v.values()) if len(v) == len(names) else [v.get(n) for n in names]
            # As PySpark builds the Rows of df.rdd (Row(*values), then __fields__), without
            # Row's Python-level __new__ and __setattr__.
            row = tuple.__new__(Row, [x if c is None else c(x) for c, x in zip(convs, vals)])
            object.__setattr__(row, "__fields__", names)
            return row

        return convert_struct
    if _is_list_type(t):
        elem = _converter(t.value_type, getattr(spark_type, "elementType", None), as_bytes)
        if elem is None:
            return None
        return lambda v: None if v is None else [elem(x) for x in v]
    if pa.types.is_map(t):
        kc = _converter(t.key_type, getattr(spark_type, "keyType", None), as_bytes)
        vc = _converter(t.item_type, getattr(spark_type, "valueType", None), as_bytes)

        def convert_map(v: Any) -> Any:
            if v is None:
                return None
            return {(k if kc is None else kc(k)): (x if vc is None else vc(x)) for k, x in v}

        return convert_map
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        if as_bytes:
            return None  # to_pylist() gives bytes
        return lambda v: None if v is None else bytearray(v)
    if pa.types.is_decimal(t):
        return _rdd_decimal
    if pa.types.is_timestamp(t) and t.tz is not None:
        return _rdd_timestamp
    return None


_EPOCH_UTC = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
_ONE_US = datetime.timedelta(microseconds=1)


def _rdd_timestamp(v: Any) -> Any:
    """The naive local ``datetime`` ``df.rdd`` gives for a Spark ``TimestampType`` value (pure).

    ``v`` is the zone-aware ``datetime`` Arrow gives. The result is built as PySpark's
    ``TimestampType.fromInternal`` builds it, from the instant's whole microseconds since the
    epoch through ``datetime.fromtimestamp`` in the process's local time zone, so a time in the
    hour a daylight-saving change repeats keeps its ``fold`` (``.timestamp()`` gives the same
    instant back). ``v.astimezone().replace(tzinfo=None)`` would drop it and move the instant
    of the repeated hour one hour earlier.
    """
    if v is None:
        return None
    us = (v - _EPOCH_UTC) // _ONE_US
    return datetime.datetime.fromtimestamp(us // 1_000_000).replace(microsecond=us % 1_000_000)


def _rdd_decimal(v: Any) -> Any:
    """The ``Decimal`` ``df.rdd`` gives for a Spark decimal read from Arrow (pure).

    Same value; the exponent as Spark's JVM pickler (Pyrolite) writes it: through Java's
    ``BigDecimal.toEngineeringString``, whose exponent is a multiple of 3 in scientific
    form (scale > 0 and adjusted exponent < -6), padding the coefficient with zeros when it
    has fewer digits than that needs: unscaled 1 at scale 19 gives ``Decimal('1.00E-19')``
    (exponent -21), where Arrow gives ``Decimal('1E-19')``.
    """
    if v is None:
        return None
    sign, digits, exp = v.as_tuple()
    if not isinstance(exp, int) or exp >= 0 or not any(digits):
        return v
    adjusted = exp + len(digits) - 1
    if adjusted >= -6:
        return v
    sig = adjusted % 3 + 1  # digits before the point in engineering notation
    pad = sig - len(digits)
    if pad <= 0:
        return v
    import decimal

    return decimal.Decimal((sign, digits + (0,) * pad, exp - pad))


def arrow_vector_ndarray(arr: Any, schema: Any, index: int) -> Any:
    """A zero-copy ``(n, size)`` float64 view of a column of dense Spark ML vectors, or None (pure).

    Args:
        arr: Column ``index`` of an Arrow chunk: the ``VectorUDT`` struct
            ``{type, size, indices, values}`` Spark sends.
        schema: The chunk's Arrow schema; its metadata (:data:`SPARK_SCHEMA_KEY`) must name
            the column's type ``pyspark.ml.linalg.VectorUDT``.
        index: The column's index.

    Returns:
        The view, or None when the column is not a vector column, or holds a null, a sparse
        vector or vectors of different sizes.
    """
    import numpy as np
    import pyarrow as pa

    if not pa.types.is_struct(arr.type) or arr.null_count or len(arr) == 0:
        return None
    text = (schema.metadata or {}).get(SPARK_SCHEMA_KEY)
    if not text:
        return None
    classes = _udt_classes(bytes(text))
    if index >= len(classes) or classes[index] != "pyspark.ml.linalg.VectorUDT":
        return None
    kinds, _size, _indices, values = arr.flatten()
    kind = _numeric_view(kinds, 0, len(kinds))
    if kind is None or not bool((kind == 1).all()):
        return None
    view = arrow_ndarray(values)
    return None if view is None or view.dtype != np.float64 else view


@functools.lru_cache(maxsize=32)
def _udt_classes(text: bytes) -> tuple:
    """The ``pyClass`` of each top-level column's UDT in a Spark schema JSON (None for
    other types); cached per JSON text, at most 32 kept (pure)."""
    out = []
    for field in json.loads(text).get("fields", []):
        ftype = field.get("type") if isinstance(field, dict) else None
        out.append(ftype.get("pyClass") if isinstance(ftype, dict) else None)
    return tuple(out)


def arrow_ndarray(arr: Any) -> Any:
    """A zero-copy numpy view of a (nested) list column of numbers, or None (pure).

    Args:
        arr: An Arrow array of ``n`` rows: list, large list or fixed-size list, nested
            to any depth, with integer or floating-point leaves.

    Returns:
        A read-only array of shape ``(n, d1, ..., dk)`` and the leaves' dtype, or None when
        a list or leaf is null at any level, the lists of one level differ in length, the
        leaves are not numbers, or a level below an empty list has no length to read.
    """
    shape = [len(arr)]
    cur, lo, hi = arr, 0, len(arr)
    while _is_list_type(cur.type):
        if cur.null_count:
            return None
        count = hi - lo
        if hasattr(cur.type, "list_size"):
            width = cur.type.list_size
            base = cur.offset + lo
            lo, hi = base * width, (base + count) * width
        else:
            if count == 0:
                return None
            offsets = _numeric_view(cur.offsets, lo, hi + 1)
            if offsets is None or not _equal_steps(offsets):  # pragma: no cover - offsets never have nulls
                return None
            width = int(offsets[1] - offsets[0])
            lo, hi = int(offsets[0]), int(offsets[-1])
        shape.append(width)
        cur = cur.values
    flat = _numeric_view(cur, lo, hi)
    if flat is None:
        return None
    return flat.reshape(shape)


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
        empty = np.empty(0, dtype)
        empty.flags.writeable = False  # read-only like every view of a chunk
        return empty
    return np.frombuffer(arr.buffers()[1], dtype=dtype, count=stop - start, offset=(arr.offset + start) * dtype.itemsize)


def _equal_steps(offsets: Any) -> bool:
    """True when every list of an Arrow list column has the same length (pure)."""
    import numpy as np

    if len(offsets) < 3:
        return True
    steps = np.diff(offsets)
    return bool((steps == steps[0]).all())
