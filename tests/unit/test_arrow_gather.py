"""DataFrame feed chunks sent without re-serialising the Arrow data (issue 12).

The feed task writes each Arrow slice as an IPC stream whose data buffers are the batch's
own memory (``arrow_ipc_parts``) and sends them as one authenticated frame
(``send_frame_parts``). These tests pin that the payload is exactly the IPC stream
pyarrow writes into one buffer, that the ciphertext and tag are the ones ``seal`` gives
the joined payload (the receiver is unchanged), and that the big buffers are not copied
before the encryption reads them.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import socket
import threading

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")

from tfos._common.deadline import Deadline  # noqa: E402
from tfos._common.wire import DataAuthError, DataSession  # noqa: E402
from tfos._data.arrow_chunks import arrow_ipc_parts, arrow_slices  # noqa: E402
from tfos._data.arrow_codec import arrow_rows  # noqa: E402
from tfos._data.arrow_views import SPARK_SCHEMA_KEY  # noqa: E402
from tfos._data.framing import FrameType, recv_frame, send_frame_parts  # noqa: E402


def _joined_stream(batch, schema=None):
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema if schema is not None else batch.schema) as w:
        w.write_batch(batch)
    return sink.getvalue().to_pybytes()


def _mixed_batch(n=3000):
    rng = np.random.default_rng(7)
    imgs = rng.random((n, 2, 3), dtype=np.float32)
    img = pa.array([[list(r) for r in im] for im in imgs.tolist()], pa.list_(pa.list_(pa.float32())))
    ints = pa.array([[1152921504606846977, None] if i % 7 == 0 else [i] for i in range(n)], pa.list_(pa.int64()))
    st = pa.array([{"a": float(i), "b": None if i % 5 == 0 else str(i)} for i in range(n)],
                  pa.struct([("a", pa.float64()), ("b", pa.string())]))
    big = pa.ListArray.from_arrays(pa.array(np.arange(0, (n + 1) * 784, 784, dtype=np.int32)),
                                   pa.array(rng.random(n * 784, dtype=np.float32)))
    ts = pa.array([_dt.datetime(2020, 1, 1) + _dt.timedelta(seconds=i) for i in range(n)], pa.timestamp("us", tz="UTC"))
    return pa.RecordBatch.from_arrays([img, ints, st, big, ts, pa.array(np.arange(n))],
                                      ["img", "ints", "st", "big", "ts", "label"])


@pytest.mark.parametrize("start,length", [(0, 3000), (0, 1000), (1000, 1000), (2999, 1), (17, 0)])
def test_ipc_parts_are_exactly_the_ipc_stream(start, length):
    b = _mixed_batch().slice(start, length)
    schema = b.schema.with_metadata({SPARK_SCHEMA_KEY: b'{"type":"struct","fields":[]}'})
    for sch in (None, schema):
        parts = arrow_ipc_parts(b, sch)
        assert b"".join(bytes(memoryview(p)) for p in parts) == _joined_stream(b, sch)


def test_ipc_parts_do_not_copy_the_data_buffers():
    """The 784-float image values of a slice reach the sink as views of the batch's memory."""
    b = _mixed_batch()
    values = b.column(3).values
    lo = values.buffers()[1].address
    hi = lo + values.buffers()[1].size
    for piece in arrow_slices(b, 1 << 20):
        shared = [p for p in arrow_ipc_parts(piece) if isinstance(p, pa.Buffer) and lo <= p.address < hi]
        assert sum(p.size for p in shared) >= piece.num_rows * 784 * 4


def _roundtrip(parts, sndbuf=None):
    a, b = socket.socketpair()
    if sndbuf:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    k1, k2 = b"1" * 32, b"2" * 32
    got: dict = {}

    def read():
        try:
            got["frame"] = recv_frame(b, DataSession(k2, k1), Deadline(30, "frame"))
        except BaseException as exc:  # noqa: BLE001 - asserted below
            got["error"] = exc

    t = threading.Thread(target=read)
    t.start()
    try:
        send_frame_parts(a, DataSession(k1, k2), FrameType.DATA, parts)
        t.join(30)
    finally:
        a.close()
        b.close()
    return got


def test_gathered_frame_authenticates_and_decodes_to_the_same_rows():
    b = _mixed_batch()
    for piece in arrow_slices(b, 1 << 20):
        parts = arrow_ipc_parts(piece)
        got = _roundtrip(parts, sndbuf=8192)
        ftype, payload = got["frame"]
        assert ftype is FrameType.DATA
        assert bytes(payload) == _joined_stream(piece)
        rows = arrow_rows(payload)
        assert len(rows) == piece.num_rows
        assert [r[5] for r in rows] == piece.column(5).to_pylist()
        assert [r[1] for r in rows] == piece.column(1).to_pylist()  # exact int64 with nulls


def test_seal_parts_equals_seal_of_the_joined_payload():
    parts = [b"ab", pa.py_buffer(b"c" * 70000), b"", memoryview(b"de"), np.arange(5, dtype=np.float32)]
    joined = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
    head = bytes(9)
    s1, s2 = DataSession(b"k" * 32, b"r" * 32), DataSession(b"k" * 32, b"r" * 32)
    for _ in range(3):  # the sequence numbers advance alike
        whole = bytes(s1.seal(ord("D"), head, joined))
        assert whole == bytes(s2.seal_parts(ord("D"), head, parts, len(joined)))
        assert b"c" * 64 not in whole  # encrypted


def test_gathered_frame_with_many_small_parts_and_a_tampered_tag():
    parts = [bytes([i % 256]) * (i % 300) for i in range(3000)] + [pa.py_buffer(b"z" * 200000)] * 3
    got = _roundtrip(parts)
    assert bytes(got["frame"][1]) == b"".join(bytes(memoryview(p)) for p in parts)
    # A frame sealed under another key fails the receiver's check before anything is parsed
    # (its header's tag, read before the payload: the sender may find the socket closed).
    a, b = socket.socketpair()

    def send_foreign():
        with contextlib.suppress(OSError):
            send_frame_parts(a, DataSession(b"x" * 32, b"y" * 32), FrameType.DATA, parts[-3:])

    sender = threading.Thread(target=send_foreign, daemon=True)
    sender.start()
    try:
        with pytest.raises(DataAuthError):
            recv_frame(b, DataSession(b"2" * 32, b"1" * 32), Deadline(30, "frame"))
    finally:
        a.close()
        b.close()


# ---------------------------------------------------- column names mapInArrow cannot resolve
class _Frame:
    """The two DataFrame members arrow_safe_dataframe uses."""

    def __init__(self, columns):
        self.columns = list(columns)

    def toDF(self, *names):
        return _Frame(names)


@pytest.mark.parametrize("columns, renamed", [
    (["id", "x", "label"], False),
    (["id", "a b", "étiquette"], False),
    (["id", "feature.x"], True),          # read as a nested field
    (["id", "a`b"], True),                # breaks the name parser
    (["id", "id"], True),                 # a join's columns
    (["id", "ID"], True),                 # one name to Spark's case-insensitive resolver
])
def test_arrow_safe_dataframe_renames_only_names_mapinarrow_cannot_resolve(columns, renamed):
    from tfos._data.feed_tasks import arrow_safe_dataframe

    df = _Frame(columns)
    safe, names = arrow_safe_dataframe(df)
    if renamed:
        assert safe.columns == [f"_c{i}" for i in range(len(columns))] and names == columns
    else:
        assert safe is df and names is None


def test_rename_columns_puts_the_names_back_without_copying():
    from tfos._data.arrow_chunks import rename_columns

    b = pa.RecordBatch.from_arrays([pa.array([1, 2]), pa.array(["a", "b"])], ["_c0", "_c1"])
    b = b.replace_schema_metadata({b"k": b"v"})
    r = rename_columns(b, ["id", "id"])
    assert r.schema.names == ["id", "id"] and r.schema.metadata == {b"k": b"v"}
    assert r.column(1).to_pylist() == ["a", "b"] and r.column(0).buffers()[1].address == b.column(0).buffers()[1].address
    assert rename_columns(b, None) is b
