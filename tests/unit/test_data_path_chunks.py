"""Unit tests of the data-path chunking helpers (no Spark, no TensorFlow): Arrow chunk
slicing in feed tasks, zero-copy Arrow decoding in the TF process, and the splitting of
inference results into bounded frames (see docs/performance.md)."""

from __future__ import annotations

import pickle
import subprocess
import sys

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")

from tfos._data.arrow_codec import arrow_rows  # noqa: E402
from tfos._data.arrow_chunks import arrow_slices  # noqa: E402
from tfos._data.results import result_frames  # noqa: E402


def _mnist_batch(n: int) -> "pa.RecordBatch":
    imgs = np.arange(n * 784, dtype=np.float32).reshape(n, 784)
    offsets = pa.array(np.arange(0, (n + 1) * 784, 784, dtype=np.int32))
    image = pa.ListArray.from_arrays(offsets, pa.array(imgs.reshape(-1)))
    return pa.RecordBatch.from_arrays([image, pa.array(np.arange(n, dtype=np.int64))], ["image", "label"])


def _ipc(batch) -> bytearray:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
    return bytearray(sink.getvalue().to_pybytes())


# ---------------------------------------------------------------------- arrow_slices
def test_arrow_slices_bound_the_chunk_size_and_keep_every_row():
    batch = _mnist_batch(1000)  # ~3.1 MB
    pieces = arrow_slices(batch, 1 << 20)
    assert len(pieces) == 4
    assert [p.num_rows for p in pieces] == [333, 333, 333, 1]
    assert pa.Table.from_batches(pieces).column("label").to_pylist() == list(range(1000))
    assert max(len(_ipc(p)) for p in pieces) < 1.1 * (1 << 20)


def test_arrow_slices_small_and_empty_batches():
    small = _mnist_batch(3)
    assert arrow_slices(small, 1 << 20) == [small]
    assert arrow_slices(_mnist_batch(0), 1 << 20) == []
    assert [p.num_rows for p in arrow_slices(_mnist_batch(3), 10)] == [1, 1, 1]  # one row at least


# ------------------------------------------------------------------------ arrow_rows
def test_arrow_rows_of_a_slice_are_exact_numpy_rows():
    piece = arrow_slices(_mnist_batch(700), 1 << 20)[1]  # rows 333..665
    rows = arrow_rows(_ipc(piece))
    assert len(rows) == 333
    img, label = rows[0]
    assert label == 333 and isinstance(label, int)
    assert img.dtype == np.float32 and img.shape == (784,)
    assert img[0] == 333 * 784 and img[-1] == 334 * 784 - 1
    assert not img.flags.writeable  # a view of the received chunk, as before


@pytest.mark.parametrize(
    ("arr", "as_numpy", "want"),
    [
        (pa.array([[1.0, 2.0], [3.0]], pa.list_(pa.float64())), False, [[1.0, 2.0], [3.0]]),
        (pa.array([[1.0], None], pa.list_(pa.float32())), False, [[1.0], None]),
        (pa.array([["a"], ["b"]], pa.list_(pa.string())), False, [["a"], ["b"]]),  # lists, as df.rdd
        (pa.array([[1.0, 2.0], [3.0, 4.0]], pa.list_(pa.float32(), 2)), True, [[1.0, 2.0], [3.0, 4.0]]),
        (pa.array([[5, 6], [7, 8]], pa.large_list(pa.int16())), True, [[5, 6], [7, 8]]),
        (pa.array([[], []], pa.list_(pa.float32())), True, [[], []]),
        (pa.array([1, None], pa.int8()), False, [1, None]),
        (pa.array([True, False]), False, [True, False]),
        (pa.array([2**64 - 1, 0], pa.uint64()), False, [2**64 - 1, 0]),
        (pa.array([0.5, None], pa.float64()), False, [0.5, None]),
        (pa.array(["x", None]), False, ["x", None]),
    ],
)
def test_arrow_rows_other_column_types(arr, as_numpy, want):
    got = [r[0] for r in arrow_rows(_ipc(pa.RecordBatch.from_arrays([arr], ["c"])))]
    assert [isinstance(g, np.ndarray) for g in got if g is not None] == [as_numpy] * sum(g is not None for g in got)
    assert [g.tolist() if isinstance(g, np.ndarray) else g for g in got] == want


def test_arrow_rows_int_lists_with_a_null_stay_exact_python_lists():
    """C24: one null used to turn the whole chunk into float64 (2^60+1 -> 2^60, None -> NaN)."""
    arr = pa.array([[2**60 + 1, None], [3, 4]], pa.list_(pa.int64()))
    got = [r[0] for r in arrow_rows(_ipc(pa.RecordBatch.from_arrays([arr], ["c"])))]
    assert got == [[2**60 + 1, None], [3, 4]]
    assert all(type(x) is int for x in (got[0][0], got[1][0], got[1][1]))


def test_arrow_rows_does_not_import_pandas():
    """``Array.to_numpy()`` imports pandas (~50 MB of RSS) on first use; arrow_rows avoids it."""
    payload = _ipc(_mnist_batch(3))
    code = (
        "import sys\n"
        "from tfos._data.arrow_codec import arrow_rows\n"
        "rows = arrow_rows(bytearray(sys.stdin.buffer.read()))\n"
        "assert rows[2][1] == 2 and rows[1][0][0] == 784.0\n"
        "print('pandas' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], input=bytes(payload), capture_output=True, timeout=120, check=True)
    assert out.stdout.decode().strip() == "False"


# --------------------------------------------------------------------- result_frames
def test_result_frames_split_big_answers_in_order():
    items = [(np.full(784, i, np.float32), i) for i in range(1000)]
    frames = result_frames(items, 256 * 1024)
    assert len(frames) > 1
    assert max(len(f) for f in frames) <= 300 * 1024
    back = [x for f in frames for x in pickle.loads(f)]
    assert [b[1] for b in back] == list(range(1000))
    assert all(float(b[0][0]) == b[1] for b in back)


def test_result_frames_small_answers_stay_one_frame():
    assert [pickle.loads(f) for f in result_frames(list(range(500)))] == [list(range(500))]
    assert [pickle.loads(f) for f in result_frames([])] == [[]]
    big = [b"x" * 1_000_000]
    assert [pickle.loads(f) for f in result_frames(big, 1024)] == [big]


def test_send_frame_gathers_large_payloads_and_resumes_partial_sends():
    """A large frame goes out with sendmsg (header, payload, tag) and arrives intact even
    when the kernel takes it in pieces."""
    import socket as _socket
    import threading

    from tfos._data.framing import FrameType as _FT, recv_frame, send_frame
    from tfos._common.deadline import Deadline
    from tfos._common.wire import DataSession

    a, b = _socket.socketpair()
    a.setsockopt(_socket.SOL_SOCKET, _socket.SO_SNDBUF, 8192)
    payload = bytes(range(256)) * 8192  # 2 MB: many partial sends through a small buffer
    k1, k2 = b"1" * 32, b"2" * 32
    got = {}
    reader = threading.Thread(target=lambda: got.update(frame=recv_frame(b, DataSession(k2, k1), Deadline(30, "frame"))))
    reader.start()
    send_frame(a, DataSession(k1, k2), _FT.DATA, memoryview(bytearray(payload)))
    reader.join(30)
    a.close()
    b.close()
    ftype, data = got["frame"]
    assert ftype is _FT.DATA and bytes(data) == payload


# ----------------------------------------------------------- packed pickled batches
def _pyspark_batches(n_batches: int, rows_per_batch: int) -> list:
    """PySpark-style pickled batches of (float32[784] image, label) rows; labels count up."""
    out, label = [], 0
    for _ in range(n_batches):
        rows = []
        for _ in range(rows_per_batch):
            rows.append((np.full(784, label, dtype=np.float32), label))
            label += 1
        out.append(pickle.dumps(rows, protocol=5))
    return out


def _packed(batches: list, limit: int = 0, linger_s: float = 60.0) -> list:
    """The frames (lists of parts) a feed task makes of ``batches``: its reader thread puts
    them into the Outbox, a sender thread takes frames out (as ``feed_tasks._stream`` does)."""
    import threading

    from tfos._data import feed_tasks
    from tfos._data.framing import ChunkKind

    packing = feed_tasks._Packing(ChunkKind.PICKLED_BATCHES)
    if limit:
        packing.limit = limit
    outbox = packing.outbox(linger_s)
    frames: list = []

    def _send() -> None:
        while (items := outbox.take()) is not None:
            frames.append(packing.payload(items, outbox))

    sender = threading.Thread(target=_send)
    sender.start()
    try:
        for b in batches:
            assert outbox.put(b, packing.size(b))
    finally:
        outbox.end()
        sender.join(30)
    return frames


def test_packed_frames_close_at_the_limit_and_keep_every_batch():
    from tfos._data.framing import ChunkKind, decode_chunk

    batches = _pyspark_batches(8, 5)
    size = len(batches[0])
    frames = _packed(batches, limit=3 * size)
    # a frame closes once it holds >= limit bytes: 3 + 3 + 2 batches, each with a 4-byte prefix
    assert [len(f) // 2 for f in frames] == [3, 3, 2]
    assert all(f[i] is batches[j] for f, js in zip(frames, ([0, 1, 2], [3, 4, 5], [6, 7])) for i, j in zip(range(1, 7, 2), js))
    rows = [r for f in frames for r in decode_chunk(ChunkKind.PICKLED_BATCHES, b"".join(f))]
    assert [r[1] for r in rows] == list(range(40))
    assert all(float(r[0][0]) == r[1] and r[0].dtype == np.float32 and r[0].shape == (784,) for r in rows)
    assert _packed([]) == []


def test_packed_frames_sent_gathered_arrive_as_one_authenticated_frame():
    """A packed frame goes out as parts (4-byte prefixes and the batches, not joined) and
    the node decodes the exact rows from the one frame it receives."""
    import socket as _socket
    import threading

    from tfos._common.deadline import Deadline
    from tfos._common.wire import DataSession
    from tfos._data.feed_tasks import PACK_BYTES
    from tfos._data.framing import ChunkKind, FrameType as _FT, decode_chunk, recv_frame, send_frame_parts

    batches = _pyspark_batches(40, 32)  # about 100 KB each, as PySpark batches MNIST rows
    frames = _packed(batches)
    assert len(frames) == 4 and all(sum(len(p) for p in f) >= PACK_BYTES for f in frames[:-1])
    a, b = _socket.socketpair()
    k1, k2 = b"1" * 32, b"2" * 32
    got: list = []

    def _read() -> None:
        rx = DataSession(k2, k1)
        for _ in frames:
            got.append(recv_frame(b, rx, Deadline(30, "frame")))

    reader = threading.Thread(target=_read)
    reader.start()
    tx = DataSession(k1, k2)
    for f in frames:
        send_frame_parts(a, tx, _FT.DATA, f)
    reader.join(30)
    a.close()
    b.close()
    assert len(got) == 4 and all(t is _FT.DATA for t, _ in got)
    labels = [r[1] for _, p in got for r in decode_chunk(ChunkKind.PICKLED_BATCHES, p)]
    assert labels == list(range(40 * 32))


def test_packed_batches_malformed_payloads_are_refused():
    from tfos._data.framing import ChunkKind, decode_chunk

    one = (3).to_bytes(4, "big") + pickle.dumps([1])[:3]
    good = len(pickle.dumps([1, 2])).to_bytes(4, "big") + pickle.dumps([1, 2])
    assert decode_chunk(ChunkKind.PICKLED_BATCHES, good + good) == [1, 2, 1, 2]
    with pytest.raises(ValueError, match="ends inside a length prefix at byte"):
        decode_chunk(ChunkKind.PICKLED_BATCHES, good + b"\x00\x00")
    with pytest.raises(ValueError, match="ends inside a batch of 1000 bytes"):
        decode_chunk(ChunkKind.PICKLED_BATCHES, good + (1000).to_bytes(4, "big") + b"x")
    with pytest.raises(TypeError, match="must hold lists of rows, not dict"):
        decode_chunk(ChunkKind.PICKLED_BATCHES, len(pickle.dumps({})).to_bytes(4, "big") + pickle.dumps({}))
    with pytest.raises(Exception):
        decode_chunk(ChunkKind.PICKLED_BATCHES, one)
    assert decode_chunk(ChunkKind.PICKLED_BATCHES, b"") == []
    with pytest.raises(ValueError, match="holds an empty batch at byte 4"):
        decode_chunk(ChunkKind.PICKLED_BATCHES, (0).to_bytes(4, "big") + good)


def test_packed_frames_never_exceed_the_frame_cap(monkeypatch):
    """Packing must not push a frame past MAX_DATA_FRAME_BYTES (2 GiB - 1): a batch that
    would starts the next frame, and a batch too large on its own is refused with the
    limit named (found by a helper: the message said 4 GiB, the cap is 2 GiB - 1)."""
    from tfos._data import feed_tasks

    monkeypatch.setattr(feed_tasks, "MAX_DATA_FRAME_BYTES", 100)
    batches = [b"a" * 40, b"b" * 40, b"c" * 8, b"d" * 90]  # 44 + 44 + 12 = 100 fits
    frames = _packed(batches, limit=1000)
    assert [[p for p in f[1::2]] for f in frames] == [[b"a" * 40, b"b" * 40, b"c" * 8], [b"d" * 90]]
    assert all(sum(len(p) for p in f) <= 100 for f in frames)
    with pytest.raises(ValueError, match="a PySpark batch of 97 bytes is too large to feed .a data frame holds at most 100 bytes"):
        _packed([b"e" * 97], limit=1000)
