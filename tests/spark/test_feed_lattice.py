"""C24, property-based: over generated DataFrames spanning the Spark SQL type lattice (every
integer width, float/double with NaN/inf/-0.0, decimals of every precision, strings, binary
(under both values of ``spark.sql.execution.pyspark.binaryAsBytes``), booleans, dates, timestamps
with and without time zone, day-time intervals, ``NullType``, Spark ML vectors, arrays of arrays,
structs, maps, nulls at every level where the schema allows them, empty DataFrames and empty
partitions), the rows a node decodes from ``train(df)``'s Arrow chunks equal ``df.rdd``'s
rows exactly: same Python types (``Row`` with the same field names, ``dict``, ``bytearray``,
``Decimal`` with the same exponent, ``DenseVector`` vs ``SparseVector``...) and same values
(floats bit for bit but NaN). The one documented exception: a top-level column of numeric
arrays of one shape per chunk arrives as a numpy array of that shape and of the Spark
element type's dtype; it is compared by dtype and ``tolist()``.

Two layers (shared ``local-cluster[2,1,1024]``):
 - ``test_arrow_chunks_decode_to_df_rdd_rows``: many examples; each DataFrame goes through
   Spark's own Arrow conversion (``mapInArrow``, as ``train(df)`` does) and the feed's chunk
   encoding (``arrow_slices`` with small targets, the Spark schema metadata for UDTs, IPC
   streams), the chunks come back to the driver and are decoded with the node's decoder
   (``arrow_codec.arrow_rows``) in this process. Two Spark jobs per example, no TF cluster.
 - ``test_train_df_delivers_df_rdd_rows``: two examples of a fixed wide schema (one column of
   every kind) through a real ``TFCluster.run`` + ``train(df)``; the nodes pickle what they read.

``TFOS_EXHAUSTIVE=1 python -m pytest -m exhaustive tests/spark/test_feed_lattice.py`` runs the
slow variant (many more and larger examples); the default run skips it.
"""

from __future__ import annotations

import datetime
import decimal
import json
import math
import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from pyspark.ml.linalg import DenseVector, SparseVector, VectorUDT  # noqa: E402
from pyspark.sql.types import (  # noqa: E402
    ArrayType, BinaryType, BooleanType, ByteType, DataType, DateType, DayTimeIntervalType, DecimalType, DoubleType,
    FloatType, IntegerType, LongType, MapType, NullType, ShortType, StringType, StructField, StructType,
    TimestampNTZType, TimestampType,
)

from tfos._data.arrow_chunks import arrow_slices  # noqa: E402
from tfos._data.arrow_codec import arrow_rows, binary_as_bytes, feed_schema_json  # noqa: E402
from tfos._data.arrow_views import SPARK_SCHEMA_KEY  # noqa: E402

pytestmark = [pytest.mark.spark]

# ------------------------------------------------------------------ the type lattice

BINARY_CONF = "spark.sql.execution.pyspark.binaryAsBytes"
INT_RANGES = {ByteType: 7, ShortType: 15, IntegerType: 31, LongType: 63}
NUMPY_DTYPES = {ByteType: np.int8, ShortType: np.int16, IntegerType: np.int32, LongType: np.int64,
                FloatType: np.float32, DoubleType: np.float64}
SIMPLE_TYPES = [ByteType(), ShortType(), IntegerType(), LongType(), FloatType(), DoubleType(), StringType(),
                BinaryType(), BooleanType(), DateType(), TimestampType(), TimestampNTZType(), DayTimeIntervalType(),
                NullType()]
#: Map keys: hashable in df.rdd (binary keys would be bytearrays) and without NaN.
KEY_TYPES = [ByteType(), ShortType(), IntegerType(), LongType(), StringType(), BooleanType(), DateType()]
#: Timestamps: Spark's range, a day inside it so local-time conversions stay in range.
TS_MIN, TS_MAX = datetime.datetime(1, 1, 2), datetime.datetime(9999, 12, 30, 23, 59, 59, 999999)


@st.composite
def decimal_types(draw) -> DecimalType:
    precision = draw(st.integers(1, 38))
    return DecimalType(precision, draw(st.integers(0, precision)))


leaf_types = st.one_of(st.sampled_from(SIMPLE_TYPES), decimal_types(), st.just(VectorUDT()))


def _may_hold_null(t: DataType, nullable: bool) -> bool:
    """NullType's only value is None: a field, element or map value of that type must be
    nullable, or createDataFrame rejects the row (FIELD_NOT_NULLABLE) before any feed."""
    return nullable or isinstance(t, NullType)


def _extend(children):
    return st.one_of(
        st.tuples(children, st.booleans()).map(lambda tn: ArrayType(tn[0], _may_hold_null(*tn))),
        st.lists(st.tuples(children, st.booleans()), min_size=1, max_size=3).map(
            lambda fs: StructType([StructField(f"f{i}", t, _may_hold_null(t, n)) for i, (t, n) in enumerate(fs)])),
        st.tuples(st.sampled_from(KEY_TYPES), children, st.booleans()).map(
            lambda ktn: MapType(ktn[0], ktn[1], _may_hold_null(ktn[1], ktn[2]))),
    )


def data_types(max_leaves: int = 5):
    return st.recursive(leaf_types, _extend, max_leaves=max_leaves)


@st.composite
def sparse_vectors(draw) -> SparseVector:
    size = draw(st.integers(0, 5))
    indices = sorted(draw(st.sets(st.integers(0, size - 1), max_size=size))) if size else []
    vals = draw(st.lists(st.floats(), min_size=len(indices), max_size=len(indices)))
    return SparseVector(size, indices, vals)


def values(t: DataType, nullable: bool):
    """A strategy of Python values ``createDataFrame`` accepts for ``t`` (None when nullable)."""
    strat = _non_null_values(t)
    return st.one_of(st.none(), strat) if nullable else strat


def _non_null_values(t: DataType):
    if type(t) in INT_RANGES:
        bits = INT_RANGES[type(t)]
        return st.integers(-(2**bits), 2**bits - 1)
    if isinstance(t, FloatType):
        return st.floats(width=32)
    if isinstance(t, DoubleType):
        return st.floats()
    if isinstance(t, DecimalType):
        # From an integer of at most `precision` digits, made exact by the string constructor:
        # st.decimals rounds in the context's 28 digits and once drew -10**30 for DECIMAL(30,0).
        bound = 10**t.precision - 1
        return st.integers(-bound, bound).map(lambda i, s=t.scale: decimal.Decimal(f"{i}E-{s}"))
    if isinstance(t, StringType):
        return st.text(max_size=8)
    if isinstance(t, BinaryType):
        return st.binary(max_size=8)
    if isinstance(t, BooleanType):
        return st.booleans()
    if isinstance(t, DateType):
        return st.dates()
    if isinstance(t, (TimestampType, TimestampNTZType)):
        return st.datetimes(TS_MIN, TS_MAX)
    if isinstance(t, DayTimeIntervalType):
        return st.timedeltas(datetime.timedelta(days=-10**6), datetime.timedelta(days=10**6))
    if isinstance(t, NullType):
        return st.none()
    if isinstance(t, VectorUDT):
        return st.one_of(st.lists(st.floats(), max_size=4).map(DenseVector), sparse_vectors())
    if isinstance(t, ArrayType):
        return st.lists(values(t.elementType, t.containsNull), max_size=4)
    if isinstance(t, StructType):
        return st.tuples(*[values(f.dataType, f.nullable) for f in t.fields])
    if isinstance(t, MapType):
        return st.dictionaries(_non_null_values(t.keyType), values(t.valueType, t.valueContainsNull), max_size=3)
    raise AssertionError(f"no values for {t}")


@st.composite
def dataframes(draw, max_columns: int = 4, max_rows: int = 8, max_leaves: int = 5):
    """``(schema, rows, partitions)``: rows may be fewer than partitions (empty partitions)."""
    cols = draw(st.lists(st.tuples(data_types(max_leaves), st.booleans()), min_size=1, max_size=max_columns))
    schema = StructType([StructField(f"c{i}", t, _may_hold_null(t, n)) for i, (t, n) in enumerate(cols)])
    rows = draw(st.lists(st.tuples(*[values(f.dataType, f.nullable) for f in schema.fields]), max_size=max_rows))
    return schema, rows, draw(st.integers(1, 4))


# ------------------------------------------------------------------ exact comparison


def assert_same(got, want, t: DataType, where: str, top: bool = False) -> None:
    """``got`` (decoded from Arrow) is exactly ``want`` (from ``df.rdd``), recursively."""
    if isinstance(got, np.ndarray) and top:
        # The numpy fast path: numeric arrays (nested) of one shape per chunk, no nulls.
        leaf = t
        while isinstance(leaf, ArrayType):
            leaf = leaf.elementType
        assert got.dtype == NUMPY_DTYPES[type(leaf)], f"{where}: dtype {got.dtype} for {leaf}"
        assert not got.flags.writeable, where
        got = got.tolist()
    assert type(got) is type(want), f"{where}: {type(got).__name__} {got!r} != {type(want).__name__} {want!r} ({t})"
    if want is None:
        return
    if isinstance(t, VectorUDT):
        if isinstance(want, SparseVector):
            assert got.size == want.size and got.indices.tolist() == want.indices.tolist(), where
        _same_floats(got.values.tolist() if isinstance(got, SparseVector) else got.toArray().tolist(),
                     want.values.tolist() if isinstance(want, SparseVector) else want.toArray().tolist(), where)
    elif isinstance(t, StructType):
        assert got.__fields__ == want.__fields__ == t.names, where
        for f, g, w in zip(t.fields, got, want):
            assert_same(g, w, f.dataType, f"{where}.{f.name}")
    elif isinstance(t, ArrayType):
        assert len(got) == len(want), f"{where}: {got!r} != {want!r}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, t.elementType, f"{where}[{i}]")
    elif isinstance(t, MapType):
        assert got.keys() == want.keys(), f"{where}: {got!r} != {want!r}"
        for k in want:
            assert_same(got[k], want[k], t.valueType, f"{where}[{k!r}]")
    elif isinstance(t, (FloatType, DoubleType)):
        _same_floats([got], [want], where)
    elif isinstance(t, DecimalType):
        assert got.as_tuple() == want.as_tuple(), f"{where}: {got!r} != {want!r}"
    elif isinstance(t, (TimestampType, TimestampNTZType)):
        assert got == want and got.tzinfo is None is want.tzinfo, f"{where}: {got!r} != {want!r}"
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def _same_floats(got: list, want: list, where: str) -> None:
    assert len(got) == len(want), where
    for g, w in zip(got, want):
        assert type(g) is float and type(w) is float, where
        if math.isnan(w):
            assert math.isnan(g), f"{where}: {g!r} != {w!r}"
        else:  # bit for bit (-0.0 is not 0.0)
            assert struct.pack("<d", g) == struct.pack("<d", w), f"{where}: {g!r} != {w!r}"


def assert_rows_equal(got_rows: list, want_rows: list, schema: StructType) -> None:
    assert len(got_rows) == len(want_rows), (len(got_rows), len(want_rows))
    for n, (got, want) in enumerate(zip(got_rows, want_rows)):
        assert type(got) is tuple and len(got) == len(schema.fields), got
        for f, g, w in zip(schema.fields, got, want):
            assert_same(g, w, f.dataType, f"row {n} {f.name}", top=True)


# ------------------------------------------------------------------ in-process layer


def _arrow_chunks_fn(spark_schema_json, target_bytes: int):
    """The feed's chunk encoding (as ``make_arrow_feed_fn`` does), returning the chunks."""
    meta = {SPARK_SCHEMA_KEY: spark_schema_json.encode("utf-8")} if spark_schema_json else None

    def fn(batches):
        import pyarrow as pa
        from pyspark import TaskContext

        index = TaskContext.get().partitionId()
        seq = 0
        for b in batches:
            for piece in arrow_slices(b, target_bytes):
                if meta is not None:
                    piece = piece.replace_schema_metadata(meta)
                sink = pa.BufferOutputStream()
                with pa.ipc.new_stream(sink, piece.schema) as w:
                    w.write_batch(piece)
                yield pa.RecordBatch.from_pydict({
                    "p": pa.array([index], pa.int64()), "seq": pa.array([seq], pa.int64()),
                    "ipc": pa.array([sink.getvalue().to_pybytes()], pa.binary()),
                })
                seq += 1

    return fn


def _check_in_process(spark, schema: StructType, rows: list, partitions: int, target_bytes: int) -> None:
    df = spark.createDataFrame(spark.sparkContext.parallelize(rows, partitions), schema)
    want = [tuple(r) for r in df.rdd.collect()]
    chunks = df.mapInArrow(_arrow_chunks_fn(feed_schema_json(df.schema, binary_as_bytes(spark)), target_bytes),
                           "p long, seq long, ipc binary").collect()
    got = []
    for c in sorted(chunks, key=lambda c: (c.p, c.seq)):
        decoded = arrow_rows(c.ipc)
        assert list(decoded.column_names) == schema.names
        got.extend(decoded)
    assert_rows_equal(got, want, schema)


def _run_in_process(sc, max_examples: int, **sizes) -> None:
    from pyspark.sql import SparkSession

    spark = SparkSession(sc)
    conf_key = "spark.sql.execution.arrow.maxRecordsPerBatch"
    old = spark.conf.get(conf_key)
    spark.conf.set(conf_key, "3")  # several Arrow batches per partition

    @settings(max_examples=max_examples, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(case=dataframes(**sizes), target_bytes=st.sampled_from([1, 200, 1 << 20]), as_bytes=st.booleans())
    def check(case, target_bytes, as_bytes):
        schema, rows, partitions = case
        # df.rdd gives binary as bytes or bytearray by this conf; the feed must follow it.
        spark.conf.set(BINARY_CONF, str(as_bytes).lower())
        assert binary_as_bytes(spark) is as_bytes
        _check_in_process(spark, schema, rows, partitions, target_bytes)

    old_binary = spark.conf.get(BINARY_CONF)
    try:
        check()
    finally:
        spark.conf.set(conf_key, old)
        spark.conf.set(BINARY_CONF, old_binary)


@pytest.mark.timeout(600)
def test_arrow_chunks_decode_to_df_rdd_rows(sc):
    _run_in_process(sc, max_examples=int(os.environ.get("TFOS_LATTICE_EXAMPLES", "40")))


@pytest.mark.exhaustive
@pytest.mark.slow
@pytest.mark.timeout(7200)
@pytest.mark.skipif(os.environ.get("TFOS_EXHAUSTIVE") != "1", reason="set TFOS_EXHAUSTIVE=1 (slow exhaustive variant)")
def test_arrow_chunks_decode_to_df_rdd_rows_exhaustive(sc):
    _run_in_process(sc, max_examples=1000, max_columns=8, max_rows=40, max_leaves=10)


# ------------------------------------------------------------------ real cluster layer

#: One column of every kind, nullable, nested both ways.
WIDE = StructType([StructField(f"c{i}", t, True) for i, t in enumerate([
    *SIMPLE_TYPES, DecimalType(38, 18), DecimalType(5, 0), VectorUDT(),
    ArrayType(ArrayType(FloatType(), True), True), ArrayType(ArrayType(LongType(), False), False),
    StructType([StructField("a", DoubleType(), True), StructField("b", ArrayType(StringType(), True), True),
                StructField("v", VectorUDT(), True)]),
    MapType(StringType(), StructType([StructField("x", LongType(), True)]), True),
    ArrayType(MapType(IntegerType(), BinaryType(), True), True),
])])


def lattice_rows_fun(args, ctx):
    """Reads the whole feed and pickles the rows to ``<out>/<node>.pkl`` (TF process)."""
    import pickle as _pickle

    from tfos import TFNode

    feed = TFNode.DataFeed(ctx.mgr, train_mode=True)
    rows: list = []
    while not feed.should_stop():
        rows.extend(feed.next_batch(7))
    # Pickling loses numpy's read-only flag (non-contiguous arrays come back writable even
    # with protocol 5): record it per value, re-applied by the driver before comparing.
    read_only = [[bool(getattr(v, "flags", None) is not None and not v.flags.writeable) for v in row] for row in rows]
    with open(f"{args['out']}/{ctx.job_name}{ctx.task_index}.pkl", "wb") as f:
        _pickle.dump((rows, read_only), f)


@pytest.mark.timeout(900)
def test_train_df_delivers_df_rdd_rows(sc, tmp_path: Path, no_leftovers):
    from pyspark.sql import SparkSession

    from tfos import TFCluster

    spark = SparkSession(sc)
    runs = []

    @settings(max_examples=2, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(rows=st.lists(values(WIDE, False), min_size=3, max_size=12), partitions=st.integers(2, 5))
    def check(rows, partitions):
        out = tmp_path / f"run{len(runs)}"
        out.mkdir()
        runs.append(out)
        # An id column (not part of the lattice) to match rows across nodes.
        schema = StructType([StructField("id", LongType(), False), *WIDE.fields])
        df = spark.createDataFrame(sc.parallelize([(i, *r) for i, r in enumerate(rows)], partitions), schema)
        want = {r[0]: tuple(r) for r in df.rdd.collect()}
        cluster = TFCluster.run(sc, lattice_rows_fun, {"out": str(out)}, 2, 0, input_mode=TFCluster.InputMode.SPARK)
        cluster.train(df, num_epochs=1, feed_timeout=300)
        cluster.shutdown(timeout=300)
        got = []
        for p in sorted(out.glob("*.pkl")):
            node_rows, read_only = pickle.loads(p.read_bytes())
            for row, flags in zip(node_rows, read_only):
                for v, ro in zip(row, flags):
                    if ro:
                        v.setflags(write=False)
                got.append(row)
        assert sorted(row[0] for row in got) == sorted(want)
        got.sort(key=lambda row: row[0])
        assert_rows_equal(got, [want[row[0]] for row in got], schema)

    check()
    assert len(runs) == 2


@pytest.mark.timeout(600)
def test_train_df_with_dotted_backticked_and_repeated_column_names(sc, tmp_path: Path, no_leftovers):
    """PySpark's mapInArrow resolves its input columns by name, so train(df) failed in Spark's
    analysis for such names (AMBIGUOUS_REFERENCE after a join, INVALID_ATTRIBUTE_NAME_SYNTAX
    for a backtick; a dotted name read as a nested field). The nodes now get df.rdd's rows,
    with df.rdd's field names (found by the break helper)."""
    from pyspark.sql import SparkSession

    from tfos import TFCluster

    spark = SparkSession(sc)
    a = spark.range(0, 40, 1, 3).selectExpr("id", "id * 3 AS v")
    b = spark.range(0, 40, 1, 2).selectExpr("id", "id * 5 AS v")
    df = a.alias("a").join(b.alias("b"), "id").selectExpr("a.id", "b.id", "a.v", "b.v * 2", "'x' || b.id")
    df = df.toDF("id", "ID", "feature.x", "a`b", "s")  # 'id' and 'ID' are one name to Spark's default resolver
    want = sorted(tuple(r) for r in df.rdd.collect())
    assert len(want) == 40 and df.rdd.first().__fields__ == ["id", "ID", "feature.x", "a`b", "s"]
    cluster = TFCluster.run(sc, lattice_rows_fun, {"out": str(tmp_path)}, 2, 0, input_mode=TFCluster.InputMode.SPARK)
    cluster.train(df, num_epochs=2, feed_timeout=300)
    cluster.shutdown(timeout=300)
    got = [row for p in sorted(tmp_path.glob("*.pkl")) for row in pickle.loads(p.read_bytes())[0]]
    assert sorted(tuple(r) for r in got) == sorted(want * 2)
    # input_mapping pairs by the names df.rdd has (the feed task puts them back on the chunks)
    out = tmp_path / "mapped"
    out.mkdir()
    cluster = TFCluster.run(sc, mapped_sums_fun, {"out": str(out), "mapping": {"s": "s", "a`b": "ab", "feature.x": "fx"}},
                            2, 0, input_mode=TFCluster.InputMode.SPARK)
    cluster.train(df, num_epochs=1, feed_timeout=300)
    cluster.shutdown(timeout=300)
    sums = [json.loads(p.read_text()) for p in out.glob("*.json")]
    assert sum(x["rows"] for x in sums) == 40
    assert sum(x["fx"] for x in sums) == sum(3 * i for i in range(40))
    assert sum(x["ab"] for x in sums) == sum(10 * i for i in range(40))
    assert sorted(s for x in sums for s in x["s"]) == sorted(f"x{i}" for i in range(40))


@pytest.mark.timeout(600)
def test_train_df_strings_that_are_not_utf8_arrive_as_df_rdd_gives_them(sc, tmp_path: Path, no_leftovers):
    """Spark does not check that a string is UTF-8 (CAST(binary AS STRING), text files in
    another encoding). df.rdd decodes such strings through Java, with U+FFFD for each invalid
    sequence; train(df) raised UnicodeDecodeError in main_fun's next_batch (found by the break
    helper). Top level, in an array, a struct and a map."""
    from pyspark.sql import SparkSession

    from tfos import TFCluster

    spark = SparkSession(sc)
    bad = ["FF41", "E282", "C0AF", "EDA080", "F4908080", "41E282AC42", "C3A9"]  # the last two are valid
    cases = " ".join(f"WHEN {i} THEN '{h}'" for i, h in enumerate(bad))
    df = spark.sql(f"SELECT id, CAST(unhex(CASE id % {len(bad)} {cases} END) AS STRING) AS s FROM range(0, 28, 1, 3)")
    df = df.selectExpr("id", "s", "array(s, 'x', NULL) AS arr", "named_struct('t', s, 'n', id) AS st", "map('k', s) AS m")
    want = {r[0]: tuple(r) for r in df.rdd.collect()}
    assert want[0][1] == "\ufffdA" and want[6][1] == "é"
    cluster = TFCluster.run(sc, lattice_rows_fun, {"out": str(tmp_path)}, 2, 0, input_mode=TFCluster.InputMode.SPARK)
    cluster.train(df, num_epochs=1, feed_timeout=300)
    cluster.shutdown(timeout=300)
    got = [row for p in sorted(tmp_path.glob("*.pkl")) for row in pickle.loads(p.read_bytes())[0]]
    assert sorted(r[0] for r in got) == list(range(28))
    for r in got:
        assert tuple(r) == want[r[0]], (r, want[r[0]])


@pytest.mark.timeout(600)
def test_train_df_with_a_struct_that_repeats_a_field_name(sc, tmp_path: Path, no_leftovers):
    """Spark's Arrow path refuses a struct with a field name twice
    (DUPLICATED_FIELD_NAME_IN_ARROW_STRUCT: train(df) failed, found by the break helper);
    such a DataFrame is fed through df.rdd's rows, which are the same."""
    from pyspark.sql import SparkSession

    from tfos import TFCluster

    spark = SparkSession(sc)
    df = spark.range(0, 30, 1, 3).selectExpr("id", "named_struct('a', id, 'a', id * 2) AS s", "array(named_struct('b', 1, 'b', id)) AS arr")
    want = sorted((r[0], tuple(r[1]), tuple(tuple(x) for x in r[2])) for r in df.rdd.collect())
    assert want[5] == (5, (5, 10), ((1, 5),))
    cluster = TFCluster.run(sc, lattice_rows_fun, {"out": str(tmp_path)}, 2, 0, input_mode=TFCluster.InputMode.SPARK)
    cluster.train(df, num_epochs=1, feed_timeout=300)
    cluster.shutdown(timeout=300)
    got = [row for p in sorted(tmp_path.glob("*.pkl")) for row in pickle.loads(p.read_bytes())[0]]
    assert sorted((r[0], tuple(r[1]), tuple(tuple(x) for x in r[2])) for r in got) == want
    assert {tuple(r[1].__fields__) for r in got} == {("a", "a")}


def mapped_sums_fun(args, ctx):
    """Reads its feed with ``input_mapping`` and writes the rows and the sums per tensor."""
    import json as _json

    from tfos import TFNode

    feed = TFNode.DataFeed(ctx.mgr, train_mode=True, input_mapping=args["mapping"])
    rows, fx, ab, s = 0, 0, 0, []
    while not feed.should_stop():
        batch = feed.next_batch(9)
        rows += len(batch.get("fx", []))
        fx += sum(int(v) for v in batch.get("fx", []))
        ab += sum(int(v) for v in batch.get("ab", []))
        s.extend(str(v) for v in batch.get("s", []))
    with open(f"{args['out']}/{ctx.job_name}{ctx.task_index}.json", "w") as f:
        _json.dump({"rows": rows, "fx": fx, "ab": ab, "s": s}, f)


def _plain(v):
    """A value with every VariantVal and Row spelled out, for equality (VariantVal has no __eq__)."""
    from pyspark.sql import Row
    from pyspark.sql.types import VariantVal

    if isinstance(v, VariantVal):
        return ("VariantVal", type(v.value).__name__, bytes(v.value), type(v.metadata).__name__, bytes(v.metadata))
    if isinstance(v, Row):
        return ("Row", tuple(v.__fields__), tuple(_plain(x) for x in v))
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


def test_variant_columns_decode_to_df_rdd_rows(sc):
    """VariantType columns (top level, null, in an array, in a struct) decode to df.rdd's
    VariantVal values; they came out as Row(value=..., metadata=...) before (found by a
    new-user trial)."""
    from pyspark.sql import SparkSession
    from pyspark.sql.types import VariantVal

    spark = SparkSession(sc)
    df = spark.range(0, 7, 1, 3).selectExpr(
        "id",
        """parse_json(concat('{"a": ', id, ', "s": "x', id, '"}')) AS v""",
        "IF(id % 3 = 0, NULL, parse_json('[1, \"two\", 3.5]')) AS n",
        "array(parse_json(CAST(id AS STRING)), parse_json('null')) AS arr",
        "named_struct('flag', parse_json(IF(id % 2 = 0, 'true', 'false')), 'k', id) AS st",
    )
    want = [tuple(r) for r in df.rdd.collect()]
    assert isinstance(want[1][1], VariantVal) and want[1][1].toPython() == {"a": 1, "s": "x1"}
    chunks = df.mapInArrow(_arrow_chunks_fn(feed_schema_json(df.schema, binary_as_bytes(spark)), 1 << 20),
                           "p long, seq long, ipc binary").collect()
    got = []
    for c in sorted(chunks, key=lambda c: (c.p, c.seq)):
        got.extend(arrow_rows(c.ipc))
    assert len(got) == 7
    assert [_plain(r) for r in got] == [_plain(r) for r in want]
    assert got[1][1].toPython() == {"a": 1, "s": "x1"} and got[0][2] is None and got[1][2].toPython() == [1, "two", 3.5]
