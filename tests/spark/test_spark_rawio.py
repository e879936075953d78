"""Tests for tfos._data.spark_rawio on a real local-cluster SparkContext.

Uses the shared ``local-cluster[2,1,1024]`` context (two executor JVMs with one core
each); tfos is installed in the venv the executors use.
"""

from __future__ import annotations

import glob
import hashlib
import pickle

import numpy as np
import pytest

from pyspark.serializers import (  # noqa: E402
    AutoBatchedSerializer,
    BatchedSerializer,
    CloudPickleSerializer,
    CompressedSerializer,
    CPickleSerializer,
    FlattenedValuesSerializer,
    MarshalSerializer,
    NoOpSerializer,
    PairDeserializer,
    PickleSerializer,
    UTF8Deserializer,
)

from tfos._data.spark_rawio import (  # noqa: E402
    MAX_RECORD_BYTES,
    RecordKind,
    RawRecords,
    record_kind,
    raw_records,
    raw_output_rdd,
    union_raw_records,
)

pytestmark = pytest.mark.spark


def decode_record(kind, record) -> list:
    """The rows of one raw record, as the TF process's decode_chunk gives them (the
    per-row kinds take None, a JVM null, as [None]; BYTES records are rows as they are)."""
    from tfos._data.framing import ChunkKind, decode_chunk

    kind = RecordKind(kind)
    if kind is RecordKind.PICKLED_BATCH and record is None:
        raise ValueError("a PICKLED_BATCH record cannot be None")
    if record is None:
        return [None]
    if kind is RecordKind.BYTES:
        return [bytes(record)]
    return decode_chunk(ChunkKind(kind.value), record)


def iter_rows(kind, records):
    for record in records:
        yield from decode_record(kind, record)


def encode_batch(rows) -> bytes:
    """One output record: the pickle of a list of results, as raw_output_rdd expects."""
    return pickle.dumps(list(rows), protocol=pickle.HIGHEST_PROTOCOL)

# --------------------------------------------------------------------------
# Pure functions (no Spark needed)
# --------------------------------------------------------------------------


def _has_allowed_names() -> bool:
    try:
        CloudPickleSerializer(allowed_names=[])
        return True
    except TypeError:
        return False


_HAS_ALLOWED_NAMES = _has_allowed_names()


@pytest.mark.parametrize(
    ("deserializer", "expected"),
    [
        (AutoBatchedSerializer(CPickleSerializer()), RecordKind.PICKLED_BATCH),
        (BatchedSerializer(CPickleSerializer(), 7), RecordKind.PICKLED_BATCH),
        (BatchedSerializer(CPickleSerializer(), -1), RecordKind.PICKLED_BATCH),
        (BatchedSerializer(PickleSerializer(), 3), RecordKind.PICKLED_BATCH),
        (CloudPickleSerializer(), RecordKind.PICKLED_ROW),
        (PickleSerializer(), RecordKind.PICKLED_ROW),
        (UTF8Deserializer(), RecordKind.UTF8),
        (UTF8Deserializer(use_unicode=False), RecordKind.BYTES),
        (NoOpSerializer(), RecordKind.BYTES),
        (MarshalSerializer(), None),
        (BatchedSerializer(MarshalSerializer(), 10), None),
        (AutoBatchedSerializer(CompressedSerializer(CPickleSerializer())), None),
        (FlattenedValuesSerializer(CPickleSerializer(), 10), None),
        (BatchedSerializer(BatchedSerializer(CPickleSerializer(), 2), 2), None),
        (PairDeserializer(UTF8Deserializer(), UTF8Deserializer()), None),
    ] + ([
        # allowed_names (restricted unpickling) exists from PySpark 4.0 on
        (CloudPickleSerializer(allowed_names=[("pstats", "Stats")]), None),
        (AutoBatchedSerializer(CloudPickleSerializer(allowed_names=[])), None),
    ] if _HAS_ALLOWED_NAMES else []),
    ids=repr,
)
def test_record_kind(deserializer, expected):
    assert record_kind(deserializer) == expected


def test_decode_frame_all_kinds():
    rows = [(1, "a", b"b"), (2, None, 3.5)]
    batch = pickle.dumps(rows, protocol=pickle.HIGHEST_PROTOCOL)
    assert decode_record(RecordKind.PICKLED_BATCH, batch) == rows
    assert decode_record("pickled_batch", memoryview(batch)) == rows
    assert decode_record(RecordKind.PICKLED_BATCH, bytearray(batch)) == rows
    # The JVM pickles batches as tuples (df.rdd): still a list of rows.
    assert decode_record(RecordKind.PICKLED_BATCH, pickle.dumps(tuple(rows), 2)) == rows
    assert decode_record(RecordKind.PICKLED_ROW, pickle.dumps(rows[0])) == [rows[0]]
    assert decode_record(RecordKind.UTF8, "héllo".encode()) == ["héllo"]
    assert decode_record(RecordKind.UTF8, memoryview("ü".encode())) == ["ü"]
    assert decode_record(RecordKind.UTF8, b"") == [""]
    assert decode_record(RecordKind.BYTES, memoryview(b"\x00\xff")) == [b"\x00\xff"]
    for kind in (RecordKind.PICKLED_ROW, RecordKind.UTF8, RecordKind.BYTES):
        assert decode_record(kind, None) == [None]
    assert list(iter_rows(RecordKind.PICKLED_BATCH, [batch, encode_batch([]), batch])) == rows + rows


def test_decode_record_errors():
    with pytest.raises(ValueError):
        decode_record("no_such_kind", b"x")
    with pytest.raises(ValueError):
        decode_record(RecordKind.PICKLED_BATCH, None)
    with pytest.raises(TypeError):
        decode_record(RecordKind.PICKLED_BATCH, pickle.dumps({"a": 1}))
    with pytest.raises(UnicodeDecodeError):
        decode_record(RecordKind.UTF8, b"\xff")


def test_encode_batch_round_trip():
    rows = [np.arange(5, dtype=np.float32), 7, "x"]
    decoded = decode_record(RecordKind.PICKLED_BATCH, encode_batch(iter(rows)))
    assert np.array_equal(decoded[0], rows[0]) and decoded[1:] == rows[1:]
    assert pickle.loads(encode_batch([])) == []
    assert MAX_RECORD_BYTES < 2**31


def test_output_task_checks_and_closes_without_spark():
    from tfos._data.spark_rawio import _OutputRecordTask

    closed = []

    def func(index, rows):
        try:
            data = encode_batch([index, *rows])
            # A 4-byte-item view: len() would count items, not bytes, unless cast.
            # (pickle ignores the zero padding after its STOP opcode.)
            yield memoryview(data + b"\0" * (-len(data) % 4)).cast("I")
            yield b""
        finally:
            closed.append(index)

    frames = _OutputRecordTask(func)(3, iter([1, 2]))
    first = next(frames)
    assert isinstance(first, memoryview) and first.format == "B"
    assert decode_record(RecordKind.PICKLED_BATCH, first) == [3, 1, 2]
    with pytest.raises(ValueError, match="empty"):
        next(frames)
    assert closed == [3]
    # Closing the task early closes the user's generator too.
    frames = _OutputRecordTask(func)(4, iter([]))
    next(frames)
    frames.close()
    assert closed == [3, 4]


# --------------------------------------------------------------------------
# Spark
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sc(spark_manager):
    """The shared local-cluster[2,1,1024] context (two executor JVMs)."""
    return spark_manager.get()


@pytest.fixture(scope="module")
def spark(sc):
    from pyspark.sql import SparkSession

    return SparkSession(sc)


def _decoded_partitions(raw: RawRecords) -> list[list]:
    """Decodes raw frames on the driver, partition by partition."""
    parts = raw.rdd.glom().collect()
    for part in parts:
        for frame in part:
            assert frame is None or isinstance(frame, bytes)
    return [[row for frame in part for row in decode_record(raw.kind, frame)] for part in parts]


def _assert_raw_matches(
    rdd, expected_kind: RecordKind, in_tasks: bool = False
) -> tuple[RawRecords, list]:
    """Raw frames of ``rdd`` decode to exactly rdd's partitions, in order.

    Runs three Spark jobs at most: the reference ``glom``, the raw frames
    decoded on the driver, and (if ``in_tasks``) the raw frames decoded in the
    executors' Python workers.

    Returns:
        The raw frames and the rows they decode to, flattened.
    """
    raw = raw_records(rdd)
    assert raw is not None
    assert raw.kind is expected_kind
    assert raw.rdd.getNumPartitions() == rdd.getNumPartitions()
    expected = rdd.glom().collect()
    decoded_parts = _decoded_partitions(raw)
    assert decoded_parts == expected
    if in_tasks:
        kind = raw.kind
        decoded = raw.rdd.mapPartitions(lambda frames: [list(iter_rows(kind, frames))]).collect()
        assert decoded == expected
    return raw, [row for part in decoded_parts for row in part]


def test_parallelize_tuples(sc):
    rows = [(i, f"s{i}", i / 3.0) for i in range(103)]
    rdd = sc.parallelize(rows, 4)
    raw, decoded = _assert_raw_matches(rdd, RecordKind.PICKLED_BATCH, in_tasks=True)
    assert decoded == rows
    # In the tasks: sc.parallelize batches rows (fewer frames than rows), and
    # the rows counted from the frames add up.
    kind = raw.kind

    def count(frames):
        n_frames = n_rows = 0
        for frame in frames:
            n_frames += 1
            n_rows += len(decode_record(kind, frame))
        yield n_frames, n_rows

    counts = raw.rdd.mapPartitions(count).collect()
    assert len(counts) == 4
    assert sum(c[1] for c in counts) == len(rows)
    assert len(rows) > sum(c[0] for c in counts) >= 4


def test_parallelize_numpy_mnist_rows(sc):
    rng = np.random.default_rng(0)
    rows = [(rng.random(784, dtype=np.float32), int(i % 10)) for i in range(64)]
    rdd = sc.parallelize(rows, 3)
    raw = raw_records(rdd)
    assert raw is not None and raw.kind is RecordKind.PICKLED_BATCH
    parts = _decoded_partitions(raw)
    assert [len(p) for p in parts] == [len(p) for p in rdd.glom().collect()]
    flat = [r for p in parts for r in p]
    assert len(flat) == len(rows)
    for (image, label), (want_image, want_label) in zip(flat, rows):
        assert image.dtype == np.float32 and image.shape == (784,)
        assert np.array_equal(image, want_image)
        assert type(label) is int and label == want_label
    # The same check inside the tasks, exact to the byte.
    kind = raw.kind

    def digests(frames):
        for image, label in iter_rows(kind, frames):
            yield hashlib.sha1(image.tobytes()).hexdigest(), image.dtype.str, image.shape, label

    want = [(hashlib.sha1(i.tobytes()).hexdigest(), "<f4", (784,), label) for i, label in rows]
    assert raw.rdd.mapPartitions(digests).collect() == want


def test_mapped_filtered_and_range(sc):
    base = sc.parallelize(range(200), 5)
    _assert_raw_matches(base.map(lambda x: (x, x * x)), RecordKind.PICKLED_BATCH, in_tasks=True)
    filtered = base.filter(lambda x: x % 3 == 0).flatMap(lambda x: [x, -x])
    _assert_raw_matches(filtered, RecordKind.PICKLED_BATCH)
    _assert_raw_matches(sc.range(0, 50, 2, numSlices=3), RecordKind.PICKLED_BATCH)
    _assert_raw_matches(sc.parallelize([], 3), RecordKind.PICKLED_BATCH)


def test_unions(sc):
    a = sc.parallelize([(i, "a") for i in range(30)], 3)
    b = sc.parallelize([(i, "b") for i in range(30)], 3)  # same batch size as a
    c = sc.parallelize([(i, "c") for i in range(100)], 2)  # different batch size
    same = a.union(b)
    assert same._jrdd_deserializer == a._jrdd_deserializer  # kept as is
    _assert_raw_matches(same, RecordKind.PICKLED_BATCH, in_tasks=True)
    mixed = a.union(c)
    assert isinstance(mixed._jrdd_deserializer, AutoBatchedSerializer)  # reserialized
    _assert_raw_matches(mixed, RecordKind.PICKLED_BATCH)
    _assert_raw_matches(sc.union([a, b, c]), RecordKind.PICKLED_BATCH)


def test_union_raw_frames(sc, tmp_path):
    a = sc.parallelize([(i, "a") for i in range(30)], 3)
    c = sc.parallelize([(i, "c") for i in range(100)], 2)
    raw = union_raw_records([raw_records(a), raw_records(c)])
    assert raw.kind is RecordKind.PICKLED_BATCH
    assert isinstance(raw.rdd._jrdd_deserializer, NoOpSerializer)  # not reserialized
    assert raw.rdd.getNumPartitions() == 5
    assert [r for p in _decoded_partitions(raw) for r in p] == a.collect() + c.collect()

    text_file = tmp_path / "t.txt"
    text_file.write_text("x\ny\n")
    with pytest.raises(ValueError):
        union_raw_records([raw_records(a), raw_records(sc.textFile(str(text_file)))])
    with pytest.raises(ValueError):
        union_raw_records([])


def test_dataframe_rdd(sc, spark):
    from pyspark.sql import Row

    df = spark.createDataFrame([(i, f"n{i}", float(i) / 2) for i in range(40)], ["id", "name", "x"])
    rdd = df.rdd
    _, decoded = _assert_raw_matches(rdd, RecordKind.PICKLED_BATCH, in_tasks=True)
    assert all(isinstance(row, Row) for row in decoded)
    assert [row.asDict() for row in decoded] == [
        {"id": i, "name": f"n{i}", "x": float(i) / 2} for i in range(40)
    ]


def test_text_file(sc, tmp_path):
    lines = ["héllo wörld", "", "line 3", "日本語", "  spaces  "]
    path = tmp_path / "text.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    rdd = sc.textFile(str(path), minPartitions=2)
    _, decoded = _assert_raw_matches(rdd, RecordKind.UTF8, in_tasks=True)
    assert decoded == lines
    _, decoded = _assert_raw_matches(sc.textFile(str(path), use_unicode=False), RecordKind.BYTES)
    assert decoded == [s.encode() for s in lines]


def test_cached_coalesced_partitioned(sc):
    cached = sc.parallelize(range(500), 4).map(lambda x: (x % 7, x)).cache()
    assert cached.count() == 500
    _assert_raw_matches(cached, RecordKind.PICKLED_BATCH, in_tasks=True)
    _assert_raw_matches(cached.coalesce(2), RecordKind.PICKLED_BATCH)
    # Shuffle output order varies between runs: cache it so every read agrees.
    partitioned = cached.partitionBy(3).persist()
    assert partitioned.count() == 500
    _assert_raw_matches(partitioned, RecordKind.PICKLED_BATCH)
    partitioned.unpersist()
    # A raw RDD is itself an RDD of bytes rows.
    raw = raw_records(cached)
    _assert_raw_matches(raw.rdd, RecordKind.BYTES)


def test_unsupported_kinds_return_none(sc, tmp_path):
    a = sc.parallelize(range(10), 2)
    b = sc.parallelize(range(100, 110), 2)
    assert raw_records(a.zip(b)) is None
    assert raw_records(a.cartesian(b)) is None
    (tmp_path / "f.txt").write_text("abc")
    assert raw_records(sc.wholeTextFiles(str(tmp_path))) is None
    # The fallback still works normally.
    assert a.zip(b).collect()[:2] == [(0, 100), (1, 101)]


# --------------------------------------------------------------------------
# raw_output_rdd
# --------------------------------------------------------------------------


def _square_batches(kind: RecordKind, chunk: int, calls=None):
    """Task function: decode raw input frames, yield x*x in batches of ``chunk``.

    ``calls``, an optional accumulator, counts the partitions processed.
    """

    def func(index, frames):
        if calls is not None:
            calls.add(1)
        batch = []
        for x in iter_rows(kind, frames):
            batch.append(x * x)
            if len(batch) == chunk:
                yield encode_batch(batch)
                batch = []
        if batch:
            yield encode_batch(batch)

    return func


def test_raw_output_round_trip(sc, tmp_path):
    n = 1000
    source = sc.parallelize(range(n), 10)
    raw = raw_records(source)
    calls = sc.accumulator(0)
    out = raw_output_rdd(raw.rdd, _square_batches(raw.kind, chunk=7, calls=calls))
    expected = [x * x for x in range(n)]

    assert out.getNumPartitions() == 10
    collected = out.collect()
    assert collected == expected  # values and order
    assert sum(collected) == sum(x * x for x in range(n)) == 332_833_500
    assert out.count() == n
    assert out.map(lambda y: y + 1).collect() == [y + 1 for y in expected]
    assert calls.value == 30  # three actions so far, ten partitions each

    out.persist()
    assert out.count() == n
    assert out.count() == n
    per_partition = [[x * x for x in range(p * 100, (p + 1) * 100)] for p in range(10)]
    assert out.glom().collect() == per_partition
    # Same deserializer as ordinary RDDs: the union needs no reserialization.
    both = out.union(sc.parallelize([-1], 1))
    assert both._jrdd_deserializer == sc.serializer
    assert both.count() == n + 1

    dest = tmp_path / "squares"
    out.saveAsTextFile(str(dest))
    lines = []
    for part in sorted(glob.glob(str(dest / "part-*"))):
        with open(part, encoding="utf-8") as fh:
            lines.extend(line.rstrip("\n") for line in fh)
    assert lines == [str(y) for y in expected]
    assert calls.value == 40  # computed once more, then always served from the cache
    out.unpersist()


def test_raw_output_from_plain_rows_and_odd_frames(sc):
    # Input as ordinary rows (not raw), output frames of varying shapes:
    # an empty list, a tuple, a memoryview and a bytearray.
    def func(index, rows):
        rows = list(rows)
        yield encode_batch([])
        yield memoryview(pickle.dumps(tuple((index, r) for r in rows[:2])))
        yield bytearray(encode_batch([(index, r) for r in rows[2:]]))

    out = raw_output_rdd(sc.parallelize(range(12), 3).map(lambda x: x * 10), func)
    assert out.collect() == [(i // 4, i * 10) for i in range(12)]
    empty = raw_output_rdd(sc.parallelize([], 2), lambda i, it: iter(()))
    assert empty.collect() == [] and empty.count() == 0


@pytest.mark.parametrize(
    ("bad_frame", "message"),
    [(b"", "is empty"), ("text", "must be bytes")],
    ids=["empty", "str"],
)
def test_raw_output_rejects_bad_frames(sc, bad_frame, message):
    out = raw_output_rdd(sc.parallelize([1], 1), lambda i, it: iter([bad_frame]))
    with pytest.raises(Exception, match=message):
        out.collect()
