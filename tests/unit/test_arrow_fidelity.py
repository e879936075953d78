"""C24: rows decoded from Arrow chunks (``cluster.train(df)``) carry the values of ``df.rdd``;
the column paths (``rows_to_columns``, ``FeedBatches``) give n-D arrays for nested numeric
arrays and vectors and refuse nulls naming the column. Arrow tables are built here, no Spark
(pyspark is imported for ``Row`` and the ML vector types only)."""

from __future__ import annotations

import datetime
import json

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")

from pyspark.ml.linalg import DenseVector, SparseVector, VectorUDT  # noqa: E402
from pyspark.sql import Row  # noqa: E402
from pyspark.sql.types import (  # noqa: E402
    ArrayType, DoubleType, LongType, MapType, StringType, StructField, StructType,
)

from tfos._data.feed_connection import END_OF_FEED  # noqa: E402
from tfos._data.feed_hub import FeedHub  # noqa: E402
from tfos._data.arrow_codec import BINARY_AS_BYTES_KEY, arrow_rows, feed_schema_json  # noqa: E402
from tfos._data.arrow_views import SPARK_SCHEMA_KEY, arrow_ndarray  # noqa: E402
from tfos._data.chunk_columns import arrow_columns  # noqa: E402
from tfos._data.tfdata import FeedBatches  # noqa: E402
from tfos.datafeed import DataFeed, rows_to_columns  # noqa: E402
from tfos.errors import MalformedRowError  # noqa: E402
from feed_fakes import Feeder  # noqa: E402

KEY = b"k" * 32

#: The Arrow struct Spark sends for a VectorUDT column (its sqlType).
VEC_ARROW = pa.struct([
    pa.field("type", pa.int8(), nullable=False), pa.field("size", pa.int32()),
    pa.field("indices", pa.list_(pa.field("element", pa.int32(), nullable=False))),
    pa.field("values", pa.list_(pa.field("element", pa.float64(), nullable=False))),
])


def _ipc(batch) -> bytearray:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
    return bytearray(sink.getvalue().to_pybytes())


def _col(arr, name="c") -> list:
    return [r[0] for r in arrow_rows(_ipc(pa.RecordBatch.from_arrays([arr], [name])))]


# ------------------------------------------------------------ nested numeric arrays
def test_smallest_c24_image_row_is_a_2x3_array():
    got = _col(pa.array([[[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]], pa.list_(pa.list_(pa.float32()))))
    assert len(got) == 1 and isinstance(got[0], np.ndarray)
    assert got[0].shape == (2, 3) and got[0].dtype == np.float32
    assert got[0].tolist() == [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]
    assert not got[0].flags.writeable  # a view of the received chunk
    cols = rows_to_columns([(got[0],)], [(np.float32, (2, 3))])
    assert cols[0].shape == (1, 2, 3) and cols[0].dtype == np.float32


def test_nested_views_of_a_slice_and_of_fixed_size_lists():
    imgs = np.arange(5 * 2 * 3, dtype=np.float64).reshape(5, 2, 3)
    nested = pa.array(imgs.tolist(), pa.list_(pa.list_(pa.float64())))
    batch = pa.RecordBatch.from_arrays([nested], ["img"]).slice(2, 3)
    got = [r[0] for r in arrow_rows(_ipc(batch))]
    assert [g.tolist() for g in got] == imgs[2:].tolist()
    fixed = pa.array(imgs.tolist(), pa.list_(pa.list_(pa.float64(), 3), 2))
    view = arrow_ndarray(fixed.slice(1, 3))
    assert view.shape == (3, 2, 3) and view.tolist() == imgs[1:4].tolist()
    assert arrow_ndarray(pa.array([[[1, 2]], [[3, 4]]], pa.large_list(pa.list_(pa.int64())))).dtype == np.int64


@pytest.mark.parametrize(
    ("arr", "want"),
    [
        # ragged inner lists: lists, as df.rdd
        (pa.array([[[1.0], [2.0, 3.0]], [[4.0], [5.0, 6.0]]], pa.list_(pa.list_(pa.float64()))),
         [[[1.0], [2.0, 3.0]], [[4.0], [5.0, 6.0]]]),
        # a null inner list / a null leaf: lists with None, never NaN
        (pa.array([[[1.0, 2.0], None], [[3.0, 4.0], [5.0, 6.0]]], pa.list_(pa.list_(pa.float64()))),
         [[[1.0, 2.0], None], [[3.0, 4.0], [5.0, 6.0]]]),
        (pa.array([[[1.0, None]], [[3.0, 4.0]]], pa.list_(pa.list_(pa.float64()))), [[[1.0, None]], [[3.0, 4.0]]]),
        # strings and booleans: lists
        (pa.array([[["a"]], [["b"]]], pa.list_(pa.list_(pa.string()))), [[["a"]], [["b"]]]),
        (pa.array([[True, False], [False, True]]), [[True, False], [False, True]]),
    ],
)
def test_nested_arrays_that_are_not_dense_numbers_stay_rdd_lists(arr, want):
    got = _col(arr)
    assert not any(isinstance(g, np.ndarray) for g in got)
    assert got == want


def test_int64_list_with_a_null_keeps_every_integer_exact():
    got = _col(pa.array([[2**60 + 1, None], [7, 2**63 - 1]], pa.list_(pa.int64())))
    assert got == [[1152921504606846977, None], [7, 9223372036854775807]]
    assert type(got[0][0]) is int and got[0][1] is None


# --------------------------------------------------------------- structs and maps
def test_struct_columns_are_rows_and_maps_are_dicts_as_in_df_rdd():
    struct = pa.array([{"a": 1.0, "b": 2.0}, None, {"a": None, "b": 4.0}],
                      pa.struct([("a", pa.float64()), ("b", pa.float64())]))
    nested = pa.array([{"p": {"q": 1}}, {"p": None}, None], pa.struct([("p", pa.struct([("q", pa.int64())]))]))
    m = pa.array([[("x", 1), ("y", 2)], None, []], pa.map_(pa.string(), pa.int64()))
    binary = pa.array([b"\x00\x01", None, b""], pa.binary())
    rows = arrow_rows(_ipc(pa.RecordBatch.from_arrays([struct, nested, m, binary], ["s", "n", "m", "b"])))
    assert rows.column_names == ("s", "n", "m", "b")
    s0 = rows[0][0]
    assert isinstance(s0, Row) and s0 == Row(a=1.0, b=2.0) and s0.asDict() == {"a": 1.0, "b": 2.0}
    assert s0.__fields__ == ["a", "b"] and s0.b == 2.0  # as df.rdd's Rows
    assert rows[1][0] is None and rows[2][0].a is None
    assert rows[0][1] == Row(p=Row(q=1)) and isinstance(rows[0][1].p, Row) and rows[1][1].p is None
    assert [r[2] for r in rows] == [{"x": 1, "y": 2}, None, {}]
    assert [r[3] for r in rows] == [bytearray(b"\x00\x01"), None, bytearray(b"")]
    assert type(rows[0][3]) is bytearray


@pytest.mark.parametrize("as_bytes, kind", [(True, bytes), (False, bytearray)])
def test_binary_follows_the_sessions_binary_as_bytes(as_bytes, kind):
    """df.rdd gives binary as bytes when spark.sql.execution.pyspark.binaryAsBytes is true
    (Spark 4.1+ default) and as bytearray otherwise, at every depth: the feed's schema
    metadata says which (found by tests/spark/test_feed_lattice.py)."""
    from pyspark.sql.types import BinaryType, StructType as ST

    schema = ST([StructField("b", BinaryType()), StructField("s", ST([StructField("f", BinaryType())])),
                 StructField("a", ArrayType(BinaryType())), StructField("m", MapType(StringType(), BinaryType()))])
    text = feed_schema_json(schema, as_bytes)
    assert json.loads(text)["tfos.binaryAsBytes"] is as_bytes
    arrays = [pa.array([b"\x00", None], pa.binary()),
              pa.array([{"f": b"x"}, {"f": None}], pa.struct([("f", pa.binary())])),
              pa.array([[b"y", None], []], pa.list_(pa.binary())),
              pa.array([[("k", b"z")], None], pa.map_(pa.string(), pa.binary()))]
    batch = pa.RecordBatch.from_arrays(arrays, ["b", "s", "a", "m"]).replace_schema_metadata({SPARK_SCHEMA_KEY: text.encode()})
    rows = arrow_rows(_ipc(batch))
    assert rows[0] == (kind(b"\x00"), Row(f=kind(b"x")), [kind(b"y"), None], {"k": kind(b"z")})
    assert [type(v) for v in (rows[0][0], rows[0][1].f, rows[0][2][0], rows[0][3]["k"])] == [kind] * 4
    assert rows[1] == (None, Row(f=None), [], None)


def test_empty_numeric_arrays_are_read_only_too():
    got = _col(pa.array([[], []], pa.list_(pa.int8())))
    assert [g.shape for g in got] == [(0,), (0,)] and all(g.dtype == np.int8 and not g.flags.writeable for g in got)


@pytest.mark.parametrize(
    ("scale", "unscaled", "want"),
    [
        (19, 1, "1.00E-19"), (17, 1, "1.0E-17"), (37, 1, "1.00E-37"), (18, 1, "1E-18"),  # padded to engineering form
        (19, 1500000000000, "1.500000000000E-7"), (10, -300, "-3.00E-8"), (19, 0, "0E-19"),  # enough digits / zero
        (2, 150, "1.50"), (0, 5, "5"), (6, 1, "0.000001"),  # plain notation: unchanged
    ],
)
def test_decimals_carry_df_rdds_exponent(scale, unscaled, want):
    """df.rdd's Decimals go through Java's BigDecimal.toEngineeringString (Spark's pickler):
    same value as Arrow's, but 1E-19 at scale 19 arrives as Decimal('1.00E-19'). The rule
    was checked against df.rdd on 460 random decimals of precisions 1..38 (found by
    tests/spark/test_feed_lattice.py)."""
    import decimal

    v = decimal.Decimal(unscaled).scaleb(-scale)
    (got,) = _col(pa.array([v], pa.decimal128(38, scale)))
    assert type(got) is decimal.Decimal and got == v
    assert got.as_tuple() == decimal.Decimal(want).as_tuple(), (got, want)


def test_binary_as_bytes_reads_sparks_own_default():
    class Conf:
        def __init__(self, value):
            self.value = value

        def get(self, key, *default):
            assert key == "spark.sql.execution.pyspark.binaryAsBytes" and not default
            if self.value is None:
                raise KeyError(key)  # a Spark without the conf
            return self.value

    from types import SimpleNamespace

    from tfos._data.arrow_codec import binary_as_bytes

    assert binary_as_bytes(SimpleNamespace(conf=Conf("true"))) is True
    assert binary_as_bytes(SimpleNamespace(conf=Conf("false"))) is False
    assert binary_as_bytes(SimpleNamespace(conf=Conf(None))) is False


def test_feed_schema_json_only_for_udts_and_binary():
    assert feed_schema_json(StructType([StructField("x", ArrayType(DoubleType()))]), True) is None
    udt = json.loads(feed_schema_json(StructType([StructField("v", VectorUDT())]), False))
    assert StructType.fromJson(udt).fields[0].dataType == VectorUDT() and udt["tfos.binaryAsBytes"] is False


def test_timestamps_with_a_zone_become_naive_local_datetimes():
    instant = datetime.datetime(2024, 5, 1, 12, 30, tzinfo=datetime.timezone.utc)
    got = _col(pa.array([instant, None], pa.timestamp("us", tz="UTC")))
    assert got == [instant.astimezone().replace(tzinfo=None), None] and got[0].tzinfo is None


def test_timestamps_in_the_repeated_hour_of_a_dst_change_keep_their_instant(berlin_time):
    # 2023-10-29: Berlin's clocks go from 03:00 CEST back to 02:00 CET, so 02:00-02:59 local
    # happens twice (00:00Z-00:59Z with fold 0, 01:00Z-01:59Z with fold 1).
    from pyspark.sql.types import TimestampType

    epoch_s = [1698537600 + i * 600 for i in range(12)]  # 2023-10-29 00:00Z .. 01:50Z
    instants = [datetime.datetime.fromtimestamp(s, datetime.timezone.utc).replace(microsecond=123456)
                for s in epoch_s]
    got = _col(pa.array(instants, pa.timestamp("us", tz="UTC")))
    # what df.rdd gives: PySpark's TimestampType.fromInternal of the same microseconds
    want = [TimestampType().fromInternal(s * 1_000_000 + 123456) for s in epoch_s]
    assert got == want and [d.fold for d in got] == [d.fold for d in want] == [0] * 6 + [1] * 6
    assert [d.timestamp() for d in got] == [s + 0.123456 for s in epoch_s]
    assert [d.hour for d in got] == [2] * 12 and all(d.tzinfo is None for d in got)
    # a zone other than UTC on the Arrow type (Spark writes the session time zone) changes nothing
    got_tz = _col(pa.array(instants, pa.timestamp("us", tz="America/New_York")))
    assert got_tz == want and [d.fold for d in got_tz] == [0] * 6 + [1] * 6


# ------------------------------------------------------------------- ML vectors
def _vector_batch(vectors: list):
    udt = VectorUDT()
    structs = [None if v is None else dict(zip(("type", "size", "indices", "values"), udt.serialize(v)))
               for v in vectors]
    schema = StructType([StructField("features", VectorUDT()), StructField("label", LongType())])
    batch = pa.RecordBatch.from_arrays([pa.array(structs, VEC_ARROW), pa.array(range(len(vectors)), pa.int64())],
                                       ["features", "label"])
    json_text = feed_schema_json(schema, as_bytes=True)
    assert json_text is not None and json.loads(json_text) == {**schema.jsonValue(), BINARY_AS_BYTES_KEY: True}
    return batch.replace_schema_metadata({SPARK_SCHEMA_KEY: json_text.encode()})


def test_vector_columns_are_dense_and_sparse_vectors():
    vectors = [DenseVector([0.5, 1.5, 2.5]), SparseVector(3, [1], [7.0]), None]
    rows = arrow_rows(_ipc(_vector_batch(vectors)))
    got = [r[0] for r in rows]
    assert type(got[0]) is DenseVector and got[0] == vectors[0]
    assert type(got[1]) is SparseVector and got[1] == vectors[1]
    assert got[2] is None and [r[1] for r in rows] == [0, 1, 2]
    cols = rows_to_columns(rows[:2], [(np.float32, (3,)), (np.int64, ())])
    assert cols[0].dtype == np.float32 and cols[0].tolist() == [[0.5, 1.5, 2.5], [0.0, 7.0, 0.0]]


def test_without_the_schema_a_vector_is_its_struct_as_a_row():
    batch = _vector_batch([DenseVector([1.0])]).replace_schema_metadata(None)
    (got,) = [r[0] for r in arrow_rows(_ipc(batch))]
    assert got == Row(type=1, size=None, indices=None, values=[1.0])


def test_feed_schema_is_sent_only_for_udt_and_binary_columns():
    plain = StructType([StructField("x", ArrayType(ArrayType(DoubleType()))),
                        StructField("m", MapType(StringType(), LongType()))])
    assert feed_schema_json(plain, as_bytes=True) is None
    nested = StructType([StructField("vs", ArrayType(VectorUDT()))])
    assert json.loads(feed_schema_json(nested, as_bytes=False)) == {**nested.jsonValue(), BINARY_AS_BYTES_KEY: False}


# --------------------------------------------------------------- nulls on columns
def test_rows_to_columns_refuses_nulls_naming_the_column():
    rows = arrow_rows(_ipc(pa.RecordBatch.from_arrays(
        [pa.array([[1.0, 2.0], [3.0, None]], pa.list_(pa.float64())), pa.array([1, 2], pa.int64())], ["x", "y"])))
    with pytest.raises(MalformedRowError, match=r"row 1: column 0 \('x'\): null value where a dense float32 tensor"):
        rows_to_columns(rows, [(np.float32, (2,)), (np.int64, ())], [(0, 3, 0, 0)])
    rows = arrow_rows(_ipc(pa.RecordBatch.from_arrays([pa.array([1, None], pa.int64())], ["y"])))
    with pytest.raises(MalformedRowError, match=r"partition 3 \(epoch 0\), row 1: column 0 \('y'\): null value"):
        rows_to_columns(rows, [(np.int64, ())], [(0, 3, 0, 0)])
    # a real NaN is a value, not a null
    got = rows_to_columns([(float("nan"),), (1.0,)], [(np.float64, ())])
    assert np.isnan(got[0][0]) and got[0][1] == 1.0


# --------------------------------------------------------------- FeedBatches path
@pytest.fixture
def hub():
    h = FeedHub("127.0.0.1", KEY, ("input",), 64, "worker:0 (executor 1, host 127.0.0.1)")
    yield h
    h.close()


def test_feed_batches_give_batch_2_3_float32_for_an_image_column(hub):
    imgs = np.arange(4 * 6, dtype=np.float64).reshape(4, 2, 3)
    batch = pa.RecordBatch.from_arrays(
        [pa.array(imgs.tolist(), pa.list_(pa.list_(pa.float64()))), pa.array(range(4), pa.int64())], ["img", "y"])
    f = Feeder(hub, KEY, 0, "train", 0, "arrow")
    f.arrow(batch)
    f.end()
    hub.queues["input"].put_nowait(END_OF_FEED)
    got = list(FeedBatches(DataFeed(hub, timeout_s=10), 3, [(np.float32, (2, 3)), (np.int64, ())]))
    assert [b[0].shape for b in got] == [(3, 2, 3), (1, 2, 3)]
    assert all(b[0].dtype == np.float32 for b in got)
    assert np.concatenate([b[0] for b in got]).tolist() == imgs.tolist()
    assert np.concatenate([b[1] for b in got]).tolist() == [0, 1, 2, 3]


def test_feed_batches_refuse_a_null_image_naming_the_column(hub):
    batch = pa.RecordBatch.from_arrays(
        [pa.array([[[0.0] * 3] * 2, None], pa.list_(pa.list_(pa.float64()))), pa.array([0, 1], pa.int64())],
        ["img", "y"])
    f = Feeder(hub, KEY, 5, "train", 0, "arrow")
    f.arrow(batch)
    f.end()
    hub.queues["input"].put_nowait(END_OF_FEED)
    with pytest.raises(MalformedRowError, match=r"partition 5 \(epoch 0\), row 1: column 0 \('img'\): null value"):
        list(FeedBatches(DataFeed(hub, timeout_s=10), 2, [(np.float32, (2, 3)), (np.int64, ())]))


@pytest.mark.parametrize(
    ("arr", "shape", "msg"),
    [
        (pa.array([[1.0, 2.0], [3.0, None]], pa.list_(pa.float64())), (2,), r"\(\[3.0, None\]\)"),
        (pa.array([[1.0, 2.0], None], pa.list_(pa.float64())), (2,), r"\(None\)"),
        (pa.array([1.5, None]), (), r"\(None\)"),
    ],
)
def test_single_tensorspec_null_names_the_column(hub, arr, shape, msg):
    """A single TensorSpec over a one-column DataFrame: the slow path reads the Arrow rows
    as they are (1-tuples, not wrapped again) and names the column in the null error."""
    f = Feeder(hub, KEY, 5, "train", 0, "arrow")
    f.arrow(pa.RecordBatch.from_arrays([arr], ["img"]))
    f.end()
    hub.queues["input"].put_nowait(END_OF_FEED)
    with pytest.raises(MalformedRowError, match=r"partition 5 \(epoch 0\), row 1: column 0 \('img'\): null value where a dense "
                       r"float32 tensor is asked " + msg):
        list(FeedBatches(DataFeed(hub, timeout_s=10), 2, [(np.float32, shape)], single=True))


def test_single_tensorspec_slow_path_gives_one_array(hub):
    """Ragged chunk then a dense one, single TensorSpec of shape (None,)... here (2,): the
    slow path (a null-free object chunk) and the view path give the same (n, 2) batches."""
    f = Feeder(hub, KEY, 5, "train", 0, "arrow")
    f.arrow(pa.RecordBatch.from_arrays([pa.array([[1, 2], [3, 4]], pa.list_(pa.int32()))], ["x"]))
    f.arrow(pa.RecordBatch.from_arrays([pa.array([{"a": 5, "b": 6}], pa.struct([("a", pa.int32()), ("b", pa.int32())]))], ["x"]))
    f.end()
    hub.queues["input"].put_nowait(END_OF_FEED)
    got = list(FeedBatches(DataFeed(hub, timeout_s=10), 3, [(np.float32, (2,))], single=True))
    assert len(got) == 1 and isinstance(got[0], np.ndarray) and got[0].dtype == np.float32
    assert got[0].tolist() == [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]


def test_arrow_column_path_views_nested_arrays_and_dense_vectors_without_copies(hub):
    """The tf.data reader's Arrow column path: nested lists and dense vectors are views of the chunk."""
    imgs = np.arange(3 * 6, dtype=np.float32).reshape(3, 2, 3)
    nested = pa.RecordBatch.from_arrays([pa.array(imgs.tolist(), pa.list_(pa.list_(pa.float32())))], ["img"])
    reader = FeedBatches(DataFeed(hub, timeout_s=10), 2, [(np.float32, (2, 3))])
    (img,) = arrow_columns(_ipc(nested), reader._cols)
    assert img.shape == (3, 2, 3) and img.dtype == np.float32 and img.tolist() == imgs.tolist()
    assert not img.flags.writeable and img.base is not None  # a view, not a copy

    dense = _vector_batch([DenseVector([0.5, 1.5, 2.5]), DenseVector([3.0, 4.0, 5.0])])
    reader = FeedBatches(DataFeed(hub, timeout_s=10), 2, [(np.float64, (3,)), (np.int64, ())])
    vec, label = arrow_columns(_ipc(dense), reader._cols)
    assert vec.dtype == np.float64 and vec.tolist() == [[0.5, 1.5, 2.5], [3.0, 4.0, 5.0]] and not vec.flags.writeable
    assert label.tolist() == [0, 1]
    from tfos._data.arrow_vectors import arrow_vector_ndarray

    piece = _vector_batch([DenseVector([i, i + 0.5]) for i in range(5)]).slice(2, 2)  # offset 2, as arrow_slices cuts
    assert arrow_vector_ndarray(piece.column(0), piece.schema, 0).tolist() == [[2.0, 2.5], [3.0, 3.5]]
    # sparse vectors, or vectors without the schema metadata: the row path decides
    assert arrow_columns(_ipc(_vector_batch([DenseVector([1.0, 2.0, 3.0]), SparseVector(3, [0], [1.0])])), reader._cols) is None
    assert arrow_columns(_ipc(dense.replace_schema_metadata(None)), reader._cols) is None


def test_feed_batches_densify_sparse_vectors_through_rows(hub):
    f = Feeder(hub, KEY, 0, "train", 0, "arrow")
    f.arrow(_vector_batch([DenseVector([1.0, 2.0, 3.0]), SparseVector(3, [2], [9.0]), DenseVector([4.0, 5.0, 6.0])]))
    f.end()
    hub.queues["input"].put_nowait(END_OF_FEED)
    got = list(FeedBatches(DataFeed(hub, timeout_s=10), 3, [(np.float32, (3,)), (np.int64, ())]))
    assert len(got) == 1 and got[0][0].dtype == np.float32
    assert got[0][0].tolist() == [[1.0, 2.0, 3.0], [0.0, 0.0, 9.0], [4.0, 5.0, 6.0]] and got[0][1].tolist() == [0, 1, 2]


def test_calendar_interval_columns_are_refused_before_the_feed():
    """df.rdd has no Python value for CalendarIntervalType (PySpark raises), so train(df)
    refuses it on the driver, naming the column at any depth (a new-user trial got pyarrow
    MonthDayNano objects on the node instead)."""
    T = pytest.importorskip("pyspark.sql.types")
    if not hasattr(T, "CalendarIntervalType"):
        pytest.skip("no CalendarIntervalType in this PySpark (3.5 has none in pyspark.sql.types)")
    from pyspark.sql.types import CalendarIntervalType

    from tfos.errors import ConfigurationError

    top = StructType([StructField("id", LongType()), StructField("iv", CalendarIntervalType())])
    with pytest.raises(ConfigurationError, match=r"column 'iv' is a CalendarIntervalType .* cast it"):
        feed_schema_json(top, True)
    nested = StructType([StructField("st", StructType([StructField("m", MapType(StringType(), ArrayType(CalendarIntervalType())))]))])
    with pytest.raises(ConfigurationError, match=r"column 'st\.m\{value\}\[\]'"):
        feed_schema_json(nested, False)
    assert feed_schema_json(StructType([StructField("id", LongType())]), True) is None


def test_year_month_interval_columns_are_refused_before_the_feed():
    """INTERVAL 1 MONTH is a YearMonthIntervalType: df.rdd raises NOT_IMPLEMENTED and
    mapInArrow cannot hand it to Python, so train(df) refuses it on the driver, naming the
    column (a docs audit got "KeyError: 21" from the feed task after 21 s, blamed on the
    DataFrame's own code)."""
    T = pytest.importorskip("pyspark.sql.types")
    if not hasattr(T, "YearMonthIntervalType"):
        pytest.skip("no YearMonthIntervalType in this PySpark")
    from pyspark.sql.types import DayTimeIntervalType, YearMonthIntervalType

    from tfos.errors import ConfigurationError

    top = StructType([StructField("id", LongType()), StructField("iv", YearMonthIntervalType(1, 1))])
    with pytest.raises(ConfigurationError, match=r"column 'iv' is a YearMonthIntervalType \(interval month.*col\('iv'\)\.cast\('int'\)"):
        feed_schema_json(top, True)
    nested = StructType([StructField("st", ArrayType(StructType([StructField("y", YearMonthIntervalType())])))])
    with pytest.raises(ConfigurationError, match=r"column 'st\[\]\.y' is a YearMonthIntervalType .*col\('st'\)"):
        feed_schema_json(nested, False)
    # day-time intervals convert (datetime.timedelta, as df.rdd gives them)
    assert feed_schema_json(StructType([StructField("d", DayTimeIntervalType())]), True) is None


# ------------------------------------------------------------- strings that are not UTF-8
#: (hex bytes of a Spark string, what df.rdd gives for it): printed by PySpark 4.3's
#: df.rdd for CAST(unhex(h) AS STRING) (tests/spark/test_feed_lattice.py checks a few live).
JAVA_DECODED = [
    ("FF41", "\ufffdA"), ("E282", "\ufffd"), ("C0AF", "\ufffd\ufffd"), ("EDA080", "\ufffd"), ("EDBFBF", "\ufffd"),
    ("EDA080EDB080", "\ufffd\ufffd"), ("EDA0", "\ufffd"), ("EDA041", "\ufffdA"), ("EDA0C3A9", "\ufffd\u00e9"),
    ("41EDA08042", "A\ufffdB"), ("ED9FBF", "\ud7ff"), ("EDC0", "\ufffd\ufffd"), ("F4908080", "\ufffd" * 4),
    ("E08080", "\ufffd" * 3), ("F0908D", "\ufffd"), ("C2", "\ufffd"), ("80", "\ufffd"), ("FE", "\ufffd"),
    ("FC84808080", "\ufffd" * 5), ("41E282AC42", "A\u20acB"), ("C3A9", "\u00e9"), ("EFBFBE", "\ufffe"),
]


def _string_array(raw: list):
    b = pa.array(raw, pa.binary())
    return pa.Array.from_buffers(pa.string(), len(b), b.buffers())  # Arrow does not validate here either


def test_strings_that_are_not_utf8_decode_as_df_rdd_gives_them():
    raw = [bytes.fromhex(h) for h, _ in JAVA_DECODED]
    with pytest.raises(UnicodeDecodeError):
        _string_array(raw).to_pylist()
    assert _col(_string_array(raw + [None])) == [want for _, want in JAVA_DECODED] + [None]
    # nested: a list, a struct and a map of such strings
    s = _string_array(raw[:4])
    lists = pa.ListArray.from_arrays(pa.array([0, 2, 4]), s)
    assert _col(lists) == [["\ufffdA", "\ufffd"], ["\ufffd\ufffd", "\ufffd"]]
    structs = pa.StructArray.from_arrays([s, pa.array([1, 2, 3, 4])], ["t", "n"])
    assert [tuple(r) for r in _col(structs)] == [("\ufffdA", 1), ("\ufffd", 2), ("\ufffd\ufffd", 3), ("\ufffd", 4)]
    maps = pa.MapArray.from_arrays(pa.array([0, 2, 4]), pa.array(["a", "b", "c", "d"]), s)
    assert _col(maps) == [{"a": "\ufffdA", "b": "\ufffd"}, {"c": "\ufffd\ufffd", "d": "\ufffd"}]
