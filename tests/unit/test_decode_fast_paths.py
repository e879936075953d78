"""The column-wise decoders of ``framing`` (struct columns into Rows, ML vector columns,
the cached Spark schema) give exactly the values and Python types of the row-by-row
reference path (``Array.to_pylist()`` and ``_converter``), which mirrors ``df.rdd``.
Arrow arrays are built here, no Spark (pyspark is imported for ``Row`` and the ML types)."""

from __future__ import annotations

import datetime
import decimal
import json
import random

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")

from pyspark.ml.linalg import DenseVector, SparseVector, VectorUDT  # noqa: E402
from pyspark.sql import Row  # noqa: E402
from pyspark.sql.types import (  # noqa: E402
    ArrayType, BinaryType, DecimalType, DoubleType, LongType, MapType, StringType, StructField, StructType, TimestampType,
)

from tfos._data import arrow_codec as codec  # noqa: E402
from tfos._data.arrow_codec import arrow_rows, feed_schema_json  # noqa: E402
from tfos._data.arrow_vectors import arrow_vector_ndarray, vector_values  # noqa: E402
from tfos._data.arrow_views import SPARK_SCHEMA_KEY  # noqa: E402

VEC_ARROW = pa.struct([
    pa.field("type", pa.int8(), nullable=False), pa.field("size", pa.int32()),
    pa.field("indices", pa.list_(pa.field("element", pa.int32(), nullable=False))),
    pa.field("values", pa.list_(pa.field("element", pa.float64(), nullable=False))),
])


def _reference(arr, spark_type, as_bytes=False) -> list:
    """The row-by-row path: to_pylist() and the per-value converter."""
    conv = codec._converter(arr.type, spark_type, as_bytes)
    values = arr.to_pylist()
    return values if conv is None else [conv(v) for v in values]


def _same(got, want) -> bool:
    """Equal values of identical Python types, Row field names and vector arrays included."""
    if type(got) is not type(want):
        return False
    if isinstance(want, Row):
        return got.__fields__ == want.__fields__ and len(got) == len(want) and all(
            _same(g, w) for g, w in zip(got, want))
    if isinstance(want, (list, tuple)):
        return len(got) == len(want) and all(_same(g, w) for g, w in zip(got, want))
    if isinstance(want, dict):
        return list(got) == list(want) and all(_same(got[k], want[k]) for k in want)
    if isinstance(want, DenseVector):
        return (got.array.dtype == want.array.dtype == np.float64 and got.array.shape == want.array.shape
                and np.array_equal(got.array, want.array, equal_nan=True))
    if isinstance(want, SparseVector):
        return (type(got.size) is int and got.size == want.size and got.indices.dtype == want.indices.dtype == np.int32
                and got.values.dtype == want.values.dtype == np.float64
                and np.array_equal(got.indices, want.indices) and np.array_equal(got.values, want.values))
    if isinstance(want, float) and want != want:
        return got != got
    if isinstance(want, decimal.Decimal):
        return got.as_tuple() == want.as_tuple()
    return bool(got == want)


def _vectors(rng: random.Random, n: int) -> list:
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.15:
            out.append(None)
        elif r < 0.55:
            out.append(DenseVector([rng.uniform(-1e9, 1e9) for _ in range(rng.randrange(0, 5))]))
        else:
            size = rng.randrange(1, 40)
            idx = sorted(rng.sample(range(size), rng.randrange(0, min(size, 6) + 1)))
            out.append(SparseVector(size, idx, [rng.uniform(-5, 5) for _ in idx]))
    return out


def _vector_array(vectors: list):
    udt = VectorUDT()
    return pa.array([None if v is None else dict(zip(("type", "size", "indices", "values"), udt.serialize(v)))
                     for v in vectors], VEC_ARROW)


@pytest.mark.parametrize("seed", range(6))
def test_vector_columns_equal_the_row_by_row_path_and_the_vectors(seed):
    rng = random.Random(seed)
    vectors = _vectors(rng, 60)
    arr = _vector_array(vectors)
    for piece in (arr, arr.slice(7, 31), arr.slice(59)):
        fast = vector_values(piece, VectorUDT())
        assert fast is not None
        want = _reference(piece, VectorUDT())
        assert len(fast) == len(want) and all(_same(g, w) for g, w in zip(fast, want))
        start = 0 if piece is arr else (7 if len(piece) == 31 else 59)
        assert all(_same(g, w) for g, w in zip(fast, vectors[start:start + len(piece)]))


def test_vector_arrays_are_writable_copies_not_views_of_the_chunk():
    vectors = [DenseVector([1.0, 2.0]), SparseVector(4, [1, 3], [5.0, 6.0])]
    got = vector_values(_vector_array(vectors), VectorUDT())
    assert got[0].array.flags.writeable and got[1].values.flags.writeable and got[1].indices.flags.writeable
    got[0].array[0] = 9.0
    got[1].values[0] = 7.0
    assert got[0].array.tolist() == [9.0, 2.0] and got[1].values.tolist() == [7.0, 6.0]


@pytest.mark.parametrize(
    "bad",
    [
        {"type": 0, "size": 3, "indices": [2, 1], "values": [1.0, 2.0]},  # not increasing
        {"type": 0, "size": 3, "indices": [1, 1], "values": [1.0, 2.0]},  # repeated
        {"type": 0, "size": 2, "indices": [0, 2], "values": [1.0, 2.0]},  # out of range
        {"type": 0, "size": 3, "indices": [-1], "values": [1.0]},  # negative
        {"type": 0, "size": 3, "indices": [0, 1], "values": [1.0]},  # counts differ
        {"type": 0, "size": None, "indices": [0], "values": [1.0]},  # no size
        {"type": 1, "size": None, "indices": [0], "values": [1.0]},  # dense with indices
        {"type": 1, "size": None, "indices": None, "values": None},  # dense without values
        {"type": 2, "size": None, "indices": None, "values": [1.0]},  # unknown type
    ],
)
def test_vector_values_not_written_by_spark_take_the_row_by_row_path(bad):
    arr = pa.array([{"type": 1, "size": None, "indices": None, "values": [0.5]}, bad], VEC_ARROW)
    assert vector_values(arr, VectorUDT()) is None
    batch = pa.RecordBatch.from_arrays([arr], ["v"]).replace_schema_metadata(
        {SPARK_SCHEMA_KEY: feed_schema_json(StructType([StructField("v", VectorUDT())]), False).encode()})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
    try:
        want = ("ok", _reference(arr, VectorUDT()))
    except Exception as exc:  # noqa: BLE001 - the reference's own error, whatever it is
        want = ("raised", type(exc))
    try:
        got = ("ok", [r[0] for r in arrow_rows(bytearray(sink.getvalue().to_pybytes()))])
    except Exception as exc:  # noqa: BLE001
        got = ("raised", type(exc))
    assert got[0] == want[0]
    if got[0] == "ok":
        assert all(_same(g, w) for g, w in zip(got[1], want[1]))
    else:
        assert got[1] is want[1]


def _struct_case(rng: random.Random, n: int):
    tz = datetime.timezone.utc
    inner_t = pa.struct([("x", pa.int64()), ("y", pa.list_(pa.float32()))])
    t = pa.struct([
        ("a", pa.float64()), ("b", pa.int64()), ("s", pa.string()), ("bin", pa.binary()),
        ("d", pa.decimal128(38, 19)), ("ts", pa.timestamp("us", tz="UTC")), ("inner", inner_t),
        ("arr", pa.list_(pa.int64())), ("m", pa.map_(pa.string(), pa.int64())), ("v", VEC_ARROW),
        ("vs", pa.list_(VEC_ARROW)),
    ])
    udt = VectorUDT()
    spark = StructType([
        StructField("a", DoubleType()), StructField("b", LongType()), StructField("s", StringType()),
        StructField("bin", BinaryType()), StructField("d", DecimalType(38, 19)), StructField("ts", TimestampType()),
        StructField("inner", StructType([StructField("x", LongType()), StructField("y", ArrayType(DoubleType()))])),
        StructField("arr", ArrayType(LongType())), StructField("m", MapType(StringType(), LongType())), StructField("v", VectorUDT()),
        StructField("vs", ArrayType(VectorUDT())),
    ])

    def maybe(x):
        return None if rng.random() < 0.2 else x

    rows = []
    for _ in range(n):
        if rng.random() < 0.15:
            rows.append(None)
            continue
        vs = _vectors(rng, rng.randrange(0, 3))
        rows.append({
            "a": maybe(rng.uniform(-1, 1)), "b": maybe(rng.randrange(-2**63, 2**63)), "s": maybe("é" * rng.randrange(4)),
            "bin": maybe(bytes([rng.randrange(256)])), "d": maybe(decimal.Decimal(rng.randrange(1, 10)).scaleb(-19)),
            "ts": maybe(datetime.datetime(2024, 1, 1, tzinfo=tz) + datetime.timedelta(seconds=rng.randrange(10**8))),
            "inner": maybe({"x": maybe(rng.randrange(2**60)), "y": maybe([maybe(0.5), 1.5])}),
            "arr": maybe([maybe(2**53 + 1), 3]), "m": maybe([("k", maybe(1))]),
            "v": maybe(dict(zip(("type", "size", "indices", "values"), udt.serialize(_vectors(rng, 1)[0] or DenseVector([1.0]))))),
            "vs": maybe([None if v is None else dict(zip(("type", "size", "indices", "values"), udt.serialize(v))) for v in vs]),
        })
    return pa.array(rows, t), spark


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("as_bytes", [False, True])
def test_struct_columns_equal_the_row_by_row_path(seed, as_bytes):
    rng = random.Random(seed)
    arr, spark = _struct_case(rng, 50)
    for piece in (arr, arr.slice(5, 30), arr.slice(50)):
        for st in (spark, None):  # with the Spark type, and without (no schema metadata)
            got = codec._struct_values(piece, st, as_bytes)
            want = _reference(piece, st, as_bytes)
            assert len(got) == len(want) and all(_same(g, w) for g, w in zip(got, want))
            assert all(g is None or type(g) is Row for g in got)


def test_struct_rows_behave_as_df_rdd_rows():
    arr = pa.array([{"a": 1.0, "b": 2}, None, {"a": None, "b": 3}], pa.struct([("a", pa.float64()), ("b", pa.int64())]))
    got = codec._struct_values(arr, None, False)
    assert got == [Row(a=1.0, b=2), None, Row(a=None, b=3)]
    assert got[0].b == 2 and got[0]["a"] == 1.0 and got[0].asDict() == {"a": 1.0, "b": 2}
    assert repr(got[2]) == "Row(a=None, b=3)" and "a" in got[0]
    assert codec._struct_values(pa.array([{}, None], pa.struct([])), None, False) == [Row(), None]


def test_spark_schema_is_parsed_once_per_text():
    schema = StructType([StructField("v", VectorUDT()), StructField("b", BinaryType())])
    text = feed_schema_json(schema, True).encode()
    meta = pa.schema([("v", VEC_ARROW), ("b", pa.binary())], metadata={SPARK_SCHEMA_KEY: text})
    codec._parse_spark_schema.cache_clear()
    first = codec._spark_types(meta)
    second = codec._spark_types(meta)
    assert first == second == ([VectorUDT(), BinaryType()], True)
    info = codec._parse_spark_schema.cache_info()
    assert (info.hits, info.misses) == (1, 1) and info.maxsize is not None
    with pytest.raises(ValueError, match="the Arrow chunk has 1 columns but its Spark schema has 2"):
        codec._spark_types(pa.schema([("v", VEC_ARROW)], metadata={SPARK_SCHEMA_KEY: text}))
    arr = _vector_array([DenseVector([1.0, 2.0]), DenseVector([3.0, 4.0])])
    view = arrow_vector_ndarray(arr, meta, 0)
    assert view.tolist() == [[1.0, 2.0], [3.0, 4.0]] and arrow_vector_ndarray(arr, meta, 1) is None
    assert json.loads(text)["tfos.binaryAsBytes"] is True


@pytest.mark.parametrize("width", [0, 1, 4])
def test_dense_vectors_of_one_size_equal_the_row_by_row_path(width):
    vectors = [DenseVector([float(i * 10 + j) for j in range(width)]) for i in range(9)]
    arr = _vector_array(vectors)
    for piece, start in ((arr, 0), (arr.slice(3, 5), 3), (arr.slice(8), 8)):
        fast = vector_values(piece, VectorUDT())
        want = _reference(piece, VectorUDT())
        assert all(_same(g, w) for g, w in zip(fast, want)) and len(fast) == len(want) == len(piece)
        assert all(_same(g, w) for g, w in zip(fast, vectors[start:]))
    got = vector_values(arr, VectorUDT())
    if width:
        got[0].array[0] = -1.0  # writable, and no other vector changes
        assert got[0].array[0] == -1.0 and got[1] == vectors[1]
