"""Spark DataFrame <-> TFRecord (``tf.train.Example``) conversion utilities.

This is the TensorFlowOnSpark-compatible ``dfutil`` module.  TensorFlowOnSpark
read and wrote TFRecords through the ``tensorflow-hadoop`` jar and Hadoop input
and output formats; ``tfos`` instead reads and writes them with TensorFlow's own
APIs (``tf.io.TFRecordWriter``, ``tf.data.TFRecordDataset``, ``tf.io.gfile`` and
``tf.train.Example``) inside Spark tasks, so no extra jar is needed and every
file system TensorFlow supports (local, ``file://``, and ``hdfs://``/``gs://``
where the TensorFlow build has that support) works.

Type mapping (TensorFlowOnSpark's, with two differences: ``FloatList`` features
are inferred as ``FloatType`` -- TensorFlowOnSpark used ``DoubleType`` -- since
they only hold float32 values, and arrays of strings/binaries are supported):

=======================================  ==========================  ===================================
Spark SQL column type                    ``tf.train.Feature`` kind   type inferred back by ``infer_schema``
=======================================  ==========================  ===================================
boolean, tinyint, smallint, int, bigint  ``Int64List`` (1 value)     ``LongType``
float, double                            ``FloatList`` (1 value)     ``FloatType`` (float32 precision)
string                                   ``BytesList`` (utf-8)       ``StringType``
binary                                   ``BytesList``               ``BinaryType`` if in ``binary_features``
array<one of the above>                  list of the same kind       ``ArrayType`` of the above, when the
                                                                     first record has more than one value
=======================================  ==========================  ===================================

Null handling: a null scalar or null array is written as an empty list of the
column's kind.  :func:`loadTFRecords` reads an empty list back as ``None`` for
scalar columns and as ``[]`` for array columns (so a null array becomes ``[]``);
the schema-less :func:`fromTFExample` returns ``None`` for any empty list.  Null
elements inside arrays are rejected.

TensorFlow is imported lazily, only inside the functions that run in Spark
tasks, so this module imports (and the driver runs) without TensorFlow.
Driver-side file-system work (checking the output directory, writing the
``_SUCCESS`` marker, listing input files) is also done in small Spark tasks, so
that paths are resolved by the same TensorFlow file systems that read and write
the data.  Relative local paths are made absolute on the driver first.

These functions need a classic (JVM-backed) SparkContext; Spark Connect sessions
have no RDD API.
"""

from __future__ import annotations

import logging
import operator
import os
import re
import uuid
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, NamedTuple, Sequence

from pyspark.sql import DataFrame, Row, SparkSession
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    DataType,
    FloatType,
    LongType,
    StringType,
    StructField,
    StructType,
)

if TYPE_CHECKING:  # pragma: no cover - typing only
    from pyspark import SparkContext

logger = logging.getLogger(__name__)

__all__ = [
    "loadedDF",
    "isLoadedDF",
    "saveAsTFRecords",
    "loadTFRecords",
    "toTFExample",
    "infer_schema",
    "fromTFExample",
]

#: Registry of DataFrames created by :func:`loadTFRecords`, mapping each DataFrame
#: to the TFRecord path it was loaded from (TensorFlowOnSpark's ``loadedDF``).
#: Keys are held weakly, so registered DataFrames can still be garbage collected.
loadedDF: "weakref.WeakKeyDictionary[DataFrame, str]" = weakref.WeakKeyDictionary()

# Feature kinds, named after the ``tf.train.Feature`` oneof fields.
_INT64 = "int64_list"
_FLOAT = "float_list"
_BYTES = "bytes_list"

_INT64_DTYPES = frozenset({"boolean", "tinyint", "smallint", "int", "bigint", "byte", "short", "integer", "long"})
_FLOAT_DTYPES = frozenset({"float", "double", "real"})
_STRING_DTYPE_RE = re.compile(r"^(string(\s+collate\s+\S+)?|(var)?char\(\d+\))$")

_PART_FILE_FORMAT = "part-r-%05d"
_SUCCESS_FILE = "_SUCCESS"
_TEMPORARY_DIR = "_temporary"
_GLOB_CHARS = frozenset("*?[")


class _ColumnSpec(NamedTuple):
    """How one DataFrame column is encoded as a ``tf.train.Feature``.

    Attributes:
        name: Column name, used as the feature key.
        dtype: The column's Spark SQL type string, as in ``DataFrame.dtypes``.
        kind: Feature kind: ``"int64_list"``, ``"float_list"`` or ``"bytes_list"``.
        is_array: True for ``array<...>`` columns.
        is_string: True for (arrays of) strings, which are utf-8 encoded.
    """

    name: str
    dtype: str
    kind: str
    is_array: bool
    is_string: bool


class _FieldSpec(NamedTuple):
    """How one feature is decoded into a DataFrame column of a known schema.

    Attributes:
        name: Feature key and column name.
        kind: Expected feature kind (``"int64_list"``, ``"float_list"`` or ``"bytes_list"``).
        is_array: True when the column is an ``ArrayType``.
        is_binary: True when bytes are kept as ``bytearray`` instead of decoded as utf-8.
    """

    name: str
    kind: str
    is_array: bool
    is_binary: bool


# --------------------------------------------------------------------------- #
# Public API
# --------------------------------------------------------------------------- #


def isLoadedDF(df: DataFrame) -> bool:
    """Tells whether a DataFrame was created by :func:`loadTFRecords`.

    Runs on the driver.  The TFRecord path of a loaded DataFrame is
    ``loadedDF[df]``; this lets callers (e.g. a pipeline that needs TFRecords)
    reuse the files instead of writing the DataFrame out again.

    Args:
        df: Any Spark DataFrame.

    Returns:
        True if ``df`` is the very DataFrame object returned by
        :func:`loadTFRecords` (derived DataFrames are not registered).
    """
    try:
        return df in loadedDF
    except TypeError:  # not weak-referenceable, so it cannot have been registered
        return False


def saveAsTFRecords(df: DataFrame, output_dir: str) -> None:
    """Saves a DataFrame as TFRecord files of serialized ``tf.train.Example``.

    Runs on the driver and launches Spark jobs; the conversion and the writes
    run in Spark tasks with TensorFlow.  Partition ``i`` of ``df`` is written to
    ``<output_dir>/part-r-<i:05d>`` (an empty file for an empty partition), one
    ``tf.train.Example`` per row with one feature per column, as described in
    the module docstring.  Each task writes under ``<output_dir>/_temporary``
    and renames its file into place, so a retried task does not leave partial
    output; after all tasks succeed an empty ``_SUCCESS`` marker is written and
    ``_temporary`` is removed.

    Args:
        df: DataFrame whose columns all have supported types (see module
            docstring).
        output_dir: Destination directory: a local path (relative paths are
            resolved against the driver's working directory), a ``file://`` URI,
            or any URI that TensorFlow's ``tf.io.gfile`` supports (e.g.
            ``hdfs://`` when TensorFlow has HDFS support).  It must not exist or
            must be empty.

    Raises:
        TypeError: If a column has an unsupported type (raised on the driver,
            before any job runs; the message names the column and its type).
        FileExistsError: If ``output_dir`` exists and is not empty.
        pyspark.errors.PythonException: If a task fails, e.g. because an array
            column contains a null element.
    """
    to_example = toTFExample(df.dtypes)  # validates the column types on the driver
    output_dir = _normalize_path(output_dir)
    sc = df.sparkSession.sparkContext

    status = _run_in_task(sc, _prepare_output_dir, output_dir)
    if status == "not-empty":
        raise FileExistsError(f"output directory {output_dir!r} already exists and is not empty")

    def _write_partition(index: int, rows: Iterable[Any]) -> Iterator[tuple[str, int]]:
        return _write_tfrecord_partition(output_dir, index, to_example(rows))

    try:
        written = df.rdd.mapPartitionsWithIndex(_write_partition).collect()
    except BaseException:
        try:
            _run_in_task(sc, _remove_temporary_dir, output_dir)
        except Exception:  # best effort; keep the original error
            logger.warning("could not remove %s/_temporary after a failed save", output_dir, exc_info=True)
        raise
    _run_in_task(sc, _commit_output_dir, output_dir)
    logger.info(
        "saved %d rows as %d TFRecord files in %s",
        sum(count for _, count in written),
        len(written),
        output_dir,
    )


def loadTFRecords(sc: "SparkContext", input_dir: str, binary_features: Iterable[str] = ()) -> DataFrame:
    """Loads TFRecord files of serialized ``tf.train.Example`` as a DataFrame.

    Runs on the driver and launches Spark jobs; the reads and the parsing run in
    Spark tasks with TensorFlow, one task per file.  Files whose names start
    with ``_`` or ``.`` (such as ``_SUCCESS``) and sub-directories are skipped;
    files ending in ``.gz`` are read as GZIP-compressed TFRecords.  The schema
    is inferred with :func:`infer_schema` from the first record of the first
    non-empty file (in sorted path order), with columns sorted by feature name.
    The DataFrame is registered in :data:`loadedDF` (see :func:`isLoadedDF`).

    Args:
        sc: The active SparkContext.
        input_dir: A directory of TFRecord files, a single TFRecord file, a glob
            pattern, or a comma-separated list of those.  Local paths (relative
            ones are resolved against the driver's working directory),
            ``file://`` URIs and other ``tf.io.gfile`` URIs are supported.
        binary_features: Names of ``BytesList`` features to load as
            ``BinaryType`` (``bytearray`` values) instead of utf-8 decoded
            ``StringType``.

    Returns:
        A DataFrame with one row per ``tf.train.Example``.  Features missing from
        a record are null; features not present in the first record are dropped.
        ``loadedDF[df]`` holds the normalized input path(s) (absolute local
        paths, comma-joined when several were given).

    Raises:
        FileNotFoundError: If a path in ``input_dir`` does not exist.
        ValueError: If no TFRecord files are found, if they contain no records,
            or if ``binary_features`` names a non-bytes feature.
        pyspark.errors.PythonException: From a task, when a later record does
            not fit the schema inferred from the first one (for example a
            feature with several values whose first record had only one).
    """
    binary_names = _as_name_set(binary_features)
    input_paths = [_normalize_path(p) for p in input_dir.split(",") if p.strip()]
    if not input_paths:
        raise ValueError(f"no input path given: {input_dir!r}")

    status, payload = _run_in_task(sc, _list_tfrecord_files, input_paths)
    if status == "missing":
        raise FileNotFoundError(f"TFRecord input path {payload!r} does not exist")
    files: list[str] = payload
    if not files:
        raise ValueError(f"no TFRecord files found in {input_dir!r} (names starting with '_' or '.' are skipped)")
    logger.info("loading %d TFRecord files from %s", len(files), input_dir)

    records = sc.parallelize(files, len(files)).mapPartitions(_read_tfrecord_files)

    def _infer_first(serialized: Iterable[bytes]) -> Iterator[tuple[str, Any]]:
        for record in serialized:
            yield _infer_schema_in_task(record, binary_names)
            return

    first = records.mapPartitions(_infer_first).take(1)
    if not first:
        raise ValueError(f"the TFRecord files in {input_dir!r} contain no records; cannot infer a schema")
    outcome, value = first[0]
    if outcome == "error":
        raise ValueError(value)
    schema: StructType = value
    logger.debug("inferred schema from first record: %s", schema.simpleString())

    fields = _field_specs(schema)

    def _to_tuples(serialized: Iterable[bytes]) -> Iterator[tuple[Any, ...]]:
        return _examples_to_tuples(serialized, fields)

    spark = SparkSession.getActiveSession() or SparkSession.builder.getOrCreate()
    # The tuples are built to match ``schema`` exactly, so per-row verification is skipped.
    df = spark.createDataFrame(records.mapPartitions(_to_tuples), schema, verifySchema=False)
    loadedDF[df] = ",".join(input_paths)
    return df


def toTFExample(dtypes: Sequence[tuple[str, str]]) -> Callable[[Iterable[Any]], Iterator[bytes]]:
    """Makes a function that converts Rows to serialized ``tf.train.Example``.

    Call it on the driver (the column types are checked here); the returned
    function runs in Spark tasks, typically via
    ``df.rdd.mapPartitions(toTFExample(df.dtypes))``, and imports TensorFlow.

    Args:
        dtypes: ``(column name, Spark SQL type string)`` pairs, as returned by
            ``DataFrame.dtypes``.  Supported types: boolean, tinyint, smallint,
            int, bigint (-> ``Int64List``), float, double (-> ``FloatList``,
            stored as float32), string (-> utf-8 ``BytesList``), binary
            (-> ``BytesList``) and ``array<...>`` of any of these.

    Returns:
        A function taking an iterable of Rows (or any objects indexable by
        column name, such as dicts) and yielding one serialized
        ``tf.train.Example`` (``bytes``) per row, with one feature per column.
        Null values become empty lists of the column's kind.  It raises
        ``ValueError`` for a null element inside an array and ``TypeError`` for
        a value that does not match its column type, naming the column.

    Raises:
        TypeError: If a column type is not supported (the message names the
            column and its type).
    """
    specs = [_column_spec(name, dtype) for name, dtype in dtypes]

    def _toTFExample(rows: Iterable[Any]) -> Iterator[bytes]:
        import tensorflow as tf

        names = [spec.name for spec in specs]
        row_fields: Any = None
        positions: list[int] = []
        for row in rows:
            fields = getattr(row, "__fields__", None)
            if fields is None:  # dict-like row: look values up by name
                values = [row[name] for name in names]
            else:  # pyspark Row: map names to positions once per distinct field list
                if fields is not row_fields and fields != row_fields:
                    positions = [_field_position(fields, name) for name in names]
                    row_fields = fields
                values = [row[i] for i in positions]
            example = tf.train.Example()
            feature_map = example.features.feature
            for spec, value in zip(specs, values):
                _fill_feature(feature_map[spec.name], spec, value)
            yield example.SerializeToString()

    return _toTFExample


def infer_schema(example: Any, binary_features: Iterable[str] = ()) -> StructType:
    """Infers a Spark SQL schema from one ``tf.train.Example``.

    Pure function; runs wherever it is called (driver or Spark task) and needs
    no TensorFlow import itself, only the ``tf.train.Example`` message.

    Args:
        example: A ``tf.train.Example`` message.
        binary_features: Names of ``BytesList`` features to type as
            ``BinaryType`` instead of ``StringType``.

    Returns:
        A ``StructType`` with one nullable field per feature, sorted by name:
        ``Int64List`` -> ``LongType``, ``FloatList`` -> ``FloatType``,
        ``BytesList`` -> ``StringType`` (``BinaryType`` for ``binary_features``),
        each wrapped in ``ArrayType`` when the feature holds more than one value.
        A feature with no kind set is typed ``StringType`` (as in
        TensorFlowOnSpark).

    Raises:
        ValueError: If ``binary_features`` names a feature that is not a
            ``BytesList``.
    """
    binary = _as_name_set(binary_features)
    fields = []
    for name, feature in sorted(example.features.feature.items()):
        kind = feature.WhichOneof("kind")
        if kind == _INT64:
            base: DataType = LongType()
        elif kind == _FLOAT:
            base = FloatType()
        else:
            base = StringType()
        if name in binary:
            if kind not in (_BYTES, None):
                raise ValueError(f"binary feature {name!r} is a {kind}, not a bytes_list")
            base = BinaryType()
        num_values = len(getattr(feature, kind).value) if kind else 0
        sql_type = ArrayType(base) if num_values > 1 else base
        fields.append(StructField(name, sql_type, nullable=True))
    return StructType(fields)


def fromTFExample(iter: Iterable[Any], binary_features: Iterable[str] = ()) -> Iterator[Row]:  # noqa: A002
    """Converts serialized ``tf.train.Example`` records to Rows.

    Runs in Spark tasks (e.g. via ``rdd.mapPartitions``) or anywhere else with
    TensorFlow installed; TensorFlow is imported on first use.  Each record is
    decoded on its own, without a schema (TensorFlowOnSpark semantics): a
    feature with more than one value becomes a list, one value becomes a
    scalar, and no value becomes ``None``.  :func:`loadTFRecords` instead
    decodes against the inferred schema, so its array columns are always lists.

    Args:
        iter: Iterable of records, each serialized ``tf.train.Example`` bytes
            (``bytes``/``bytearray``), a ``(bytes, None)`` pair as produced by
            the Hadoop TFRecord input format, or a ``tf.train.Example``.
        binary_features: Names of ``BytesList`` features whose values are kept
            as ``bytearray`` instead of being decoded as utf-8 strings.

    Yields:
        One ``Row`` per record, with fields sorted by feature name: ``int``
        for ``Int64List``, ``float`` for ``FloatList``, ``str`` (or
        ``bytearray`` for binary features) for ``BytesList``.

    Raises:
        TypeError: If a record is not one of the accepted forms.
        ValueError: If a non-binary ``BytesList`` value is not valid utf-8.
    """
    import tensorflow as tf

    binary = _as_name_set(binary_features)
    for record in iter:
        example = _parse_example(tf, record)
        values = {}
        for name, feature in sorted(example.features.feature.items()):
            kind = feature.WhichOneof("kind")
            raw = list(getattr(feature, kind).value) if kind else []
            if kind == _BYTES:
                raw = [bytearray(v) if name in binary else _decode_utf8(name, v) for v in raw]
            values[name] = raw if len(raw) > 1 else (raw[0] if raw else None)
        yield Row(**values)


# --------------------------------------------------------------------------- #
# Encoding helpers (run in Spark tasks)
# --------------------------------------------------------------------------- #


def _column_spec(name: str, dtype: str) -> _ColumnSpec:
    """Maps a ``DataFrame.dtypes`` entry to its feature encoding.

    Args:
        name: Column name.
        dtype: Spark SQL type string, e.g. ``"int"`` or ``"array<float>"``.

    Returns:
        The column's ``_ColumnSpec``.

    Raises:
        TypeError: If the type is not supported.
    """
    normalized = dtype.strip().lower()
    is_array = normalized.startswith("array<") and normalized.endswith(">")
    element = normalized[len("array<") : -1].strip() if is_array else normalized
    if element in _INT64_DTYPES:
        return _ColumnSpec(name, dtype, _INT64, is_array, False)
    if element in _FLOAT_DTYPES:
        return _ColumnSpec(name, dtype, _FLOAT, is_array, False)
    if element == "binary":
        return _ColumnSpec(name, dtype, _BYTES, is_array, False)
    if _STRING_DTYPE_RE.match(element):
        return _ColumnSpec(name, dtype, _BYTES, is_array, True)
    raise TypeError(
        f"column {name!r} has unsupported type {dtype!r} for tf.train.Example; supported: "
        "boolean, tinyint, smallint, int, bigint, float, double, string, binary and arrays of these"
    )


def _field_position(fields: Sequence[str], name: str) -> int:
    """Returns the position of column ``name`` in a Row's field list.

    Raises:
        KeyError: If the Row has no such column.
    """
    try:
        return list(fields).index(name)
    except ValueError:
        raise KeyError(f"row has no column {name!r}; its columns are {list(fields)}") from None


def _encode_value(spec: _ColumnSpec, value: Any) -> Any:
    """Converts one Python value to the element type of its feature list.

    Args:
        spec: The column's encoding.
        value: A non-null scalar value of the column (or element of an array).

    Returns:
        ``int`` for int64 features, ``float`` for float features, ``bytes`` for
        bytes features.

    Raises:
        TypeError: If the value's Python type does not fit the feature kind.
    """
    if spec.kind == _INT64:
        return operator.index(value)  # ints, bools and numpy integers; not floats or strings
    if spec.kind == _FLOAT:
        if isinstance(value, (str, bytes, bytearray)):
            raise TypeError("expected a number")
        return float(value)
    if spec.is_string:
        return value.encode("utf-8") if isinstance(value, str) else str(value).encode("utf-8")
    return bytes(value)


def _fill_feature(feature: Any, spec: _ColumnSpec, value: Any) -> None:
    """Stores one column value into an (empty) ``tf.train.Feature``.

    Args:
        feature: The ``tf.train.Feature`` message to fill.
        spec: The column's encoding.
        value: The column value of one row (``None``, a scalar, or a list).

    Raises:
        ValueError: If an array contains a null element.
        TypeError: If the value does not match the column type.
    """
    values = getattr(feature, spec.kind)
    values.SetInParent()  # keep the kind even when the list is empty (null value)
    if value is None:
        return
    try:
        if spec.is_array:
            for element in value:
                if element is None:
                    raise ValueError(f"column {spec.name!r} ({spec.dtype}) has a null array element, "
                                     "which tf.train.Example cannot represent")
                values.value.append(_encode_value(spec, element))
        else:
            values.value.append(_encode_value(spec, value))
    except (TypeError, AttributeError, OverflowError) as exc:
        raise TypeError(f"column {spec.name!r} ({spec.dtype}): cannot encode {type(value).__name__} "
                        f"value as {spec.kind}: {exc}") from exc


def _write_tfrecord_partition(output_dir: str, index: int, serialized: Iterable[bytes]) -> Iterator[tuple[str, int]]:
    """Writes one partition's records to ``<output_dir>/part-r-<index:05d>``.

    Runs in a Spark task.  Records go to a uniquely named file under
    ``<output_dir>/_temporary`` which is then renamed over the final name.

    Args:
        output_dir: Absolute path or URI of the output directory.
        index: Partition index.
        serialized: Serialized records to write.

    Yields:
        One ``(final path, number of records)`` pair.
    """
    import tensorflow as tf

    name = _PART_FILE_FORMAT % index
    final_path = _join(output_dir, name)
    temp_path = _join(output_dir, _TEMPORARY_DIR, f"{name}.{uuid.uuid4().hex}")
    count = 0
    try:
        with tf.io.TFRecordWriter(temp_path) as writer:
            for record in serialized:
                writer.write(record)
                count += 1
        tf.io.gfile.rename(temp_path, final_path, overwrite=True)
    except BaseException:
        if tf.io.gfile.exists(temp_path):
            tf.io.gfile.remove(temp_path)
        raise
    yield final_path, count


# --------------------------------------------------------------------------- #
# Decoding helpers (run in Spark tasks)
# --------------------------------------------------------------------------- #


def _parse_example(tf: Any, record: Any) -> Any:
    """Parses one record into a ``tf.train.Example``.

    Args:
        tf: The imported ``tensorflow`` module.
        record: Serialized bytes, a ``(bytes, ...)`` pair, or an Example.

    Returns:
        A ``tf.train.Example``.

    Raises:
        TypeError: If ``record`` is none of the accepted forms.
    """
    if isinstance(record, tf.train.Example):
        return record
    if isinstance(record, (tuple, list)) and record:
        record = record[0]
    if not isinstance(record, (bytes, bytearray, memoryview)):
        raise TypeError(f"expected serialized tf.train.Example bytes, got {type(record).__name__}")
    example = tf.train.Example()
    example.ParseFromString(bytes(record))
    return example


def _read_tfrecord_files(paths: Iterable[str]) -> Iterator[bytes]:
    """Reads the raw records of TFRecord files.

    Runs in a Spark task.  Files ending in ``.gz`` are read as GZIP-compressed.

    Args:
        paths: File paths or URIs.

    Yields:
        Each serialized record (``bytes``), file by file, in file order.
    """
    import tensorflow as tf

    for path in paths:
        compression = "GZIP" if path.endswith(".gz") else ""
        dataset = tf.data.TFRecordDataset(path, compression_type=compression)
        for record in dataset.as_numpy_iterator():
            yield record


def _infer_schema_in_task(record: bytes, binary_features: frozenset[str]) -> tuple[str, Any]:
    """Infers the schema from one serialized record; runs in a Spark task.

    Returns:
        ``("ok", StructType)`` or ``("error", message)``, so the driver can raise
        a ``ValueError`` instead of a wrapped task exception.
    """
    import tensorflow as tf

    try:
        return "ok", infer_schema(_parse_example(tf, record), binary_features)
    except ValueError as exc:
        return "error", str(exc)


def _field_specs(schema: StructType) -> list[_FieldSpec]:
    """Derives per-column decoding rules from an inferred schema.

    Args:
        schema: Schema produced by :func:`infer_schema`.

    Returns:
        One ``_FieldSpec`` per field, in schema order.
    """
    specs = []
    for field in schema.fields:
        data_type = field.dataType
        is_array = isinstance(data_type, ArrayType)
        base = data_type.elementType if isinstance(data_type, ArrayType) else data_type
        if isinstance(base, LongType):
            kind = _INT64
        elif isinstance(base, FloatType):
            kind = _FLOAT
        else:
            kind = _BYTES
        specs.append(_FieldSpec(field.name, kind, is_array, isinstance(base, BinaryType)))
    return specs


def _decode_feature(feature: Any, spec: _FieldSpec) -> Any:
    """Decodes one feature into a value of its schema column.

    Args:
        feature: A ``tf.train.Feature``.
        spec: The column's decoding rule.

    Returns:
        A list for array columns (``[]`` when empty); for scalar columns the
        single value, or ``None`` when the list is empty.

    Raises:
        ValueError: If the feature's kind or value count does not fit the schema,
            or a string value is not valid utf-8.
    """
    kind = feature.WhichOneof("kind")
    raw = getattr(feature, kind).value if kind else ()
    if not raw:
        return [] if spec.is_array else None
    if kind != spec.kind:
        raise ValueError(f"feature {spec.name!r} is a {kind} but the schema inferred from the first "
                         f"record expects a {spec.kind}")
    if spec.kind == _BYTES:
        values = [bytearray(v) if spec.is_binary else _decode_utf8(spec.name, v) for v in raw]
    else:
        values = list(raw)
    if spec.is_array:
        return values
    if len(values) > 1:
        raise ValueError(f"feature {spec.name!r} has {len(values)} values but the schema inferred from "
                         "the first record (which had one value) is scalar")
    return values[0]


def _decode_utf8(name: str, value: bytes) -> str:
    """Decodes one ``BytesList`` value of feature ``name`` as utf-8.

    Raises:
        ValueError: If it is not valid utf-8 (naming the feature and the fix).
    """
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"bytes feature {name!r} is not valid utf-8 ({exc}); "
                         "pass it in binary_features to load it as binary") from None


def _examples_to_tuples(serialized: Iterable[Any], fields: Sequence[_FieldSpec]) -> Iterator[tuple[Any, ...]]:
    """Decodes serialized Examples into tuples ordered like ``fields``.

    Runs in a Spark task.

    Args:
        serialized: Serialized ``tf.train.Example`` records.
        fields: Decoding rules, in schema order.

    Yields:
        One tuple per record; missing features are ``None``.
    """
    import tensorflow as tf

    for record in serialized:
        feature_map = _parse_example(tf, record).features.feature
        yield tuple(
            _decode_feature(feature_map[spec.name], spec) if spec.name in feature_map else None
            for spec in fields
        )


# --------------------------------------------------------------------------- #
# File-system helpers
# --------------------------------------------------------------------------- #


def _as_name_set(names: Iterable[str] | None) -> frozenset[str]:
    """Returns feature names as a frozenset (``None`` -> empty)."""
    if names is None:
        return frozenset()
    if isinstance(names, str):
        return frozenset([names])
    return frozenset(names)


def _normalize_path(path: str) -> str:
    """Makes a scheme-less local path absolute (on the driver); URIs are unchanged.

    Args:
        path: Local path or URI.

    Returns:
        The path without trailing slashes, absolute when it was a relative local path.
    """
    path = path.strip()
    if "://" not in path:
        path = os.path.abspath(os.path.expanduser(path))
    return path.rstrip("/") or "/"


def _join(directory: str, *names: str) -> str:
    """Joins a directory path or URI with child names using '/'."""
    return "/".join([directory.rstrip("/"), *names])


def _run_in_task(sc: "SparkContext", func: Callable[..., Any], *args: Any) -> Any:
    """Runs ``func(*args)`` once in a single Spark task and returns its result.

    Used for small file-system operations so they run where TensorFlow is
    installed (the executors), not on the driver.

    Args:
        sc: The active SparkContext.
        func: Picklable function; its return value must be picklable.
        *args: Picklable arguments.

    Returns:
        ``func(*args)``.
    """
    return sc.parallelize([0], 1).map(lambda _: func(*args)).collect()[0]


def _prepare_output_dir(output_dir: str) -> str:
    """Creates the output directory if needed; runs in a Spark task.

    Returns:
        ``"ok"``, or ``"not-empty"`` if it already holds files.
    """
    import tensorflow as tf

    if tf.io.gfile.exists(output_dir):
        if tf.io.gfile.listdir(output_dir):
            return "not-empty"
    else:
        tf.io.gfile.makedirs(output_dir)
    tf.io.gfile.makedirs(_join(output_dir, _TEMPORARY_DIR))
    return "ok"


def _remove_temporary_dir(output_dir: str) -> None:
    """Deletes ``<output_dir>/_temporary`` if present; runs in a Spark task."""
    import tensorflow as tf

    temporary = _join(output_dir, _TEMPORARY_DIR)
    if tf.io.gfile.exists(temporary):
        tf.io.gfile.rmtree(temporary)


def _commit_output_dir(output_dir: str) -> None:
    """Writes the ``_SUCCESS`` marker and removes ``_temporary``; runs in a Spark task."""
    import tensorflow as tf

    _remove_temporary_dir(output_dir)
    with tf.io.gfile.GFile(_join(output_dir, _SUCCESS_FILE), "w") as marker:
        marker.write("")  # GFile only creates the file on the first write


def _is_data_file_name(name: str) -> bool:
    """True for names that are not hidden/marker files (leading ``_`` or ``.``)."""
    return not name.startswith(("_", "."))


def _list_tfrecord_files(paths: Sequence[str]) -> tuple[str, Any]:
    """Lists the TFRecord data files under the given paths; runs in a Spark task.

    Directories are listed non-recursively; glob patterns are expanded (matched
    directories are listed too); hidden and marker files are skipped.

    Args:
        paths: Absolute paths, URIs or glob patterns.

    Returns:
        ``("ok", sorted list of file paths)`` or ``("missing", path)`` for a
        path that does not exist.
    """
    import tensorflow as tf

    files: set[str] = set()
    for path in paths:
        if _GLOB_CHARS & set(path):
            matches = tf.io.gfile.glob(path)
        elif tf.io.gfile.exists(path):
            matches = [path]
        else:
            return "missing", path
        for match in matches:
            if tf.io.gfile.isdir(match):
                for name in tf.io.gfile.listdir(match):
                    child = _join(match, name.rstrip("/"))
                    if _is_data_file_name(name) and not tf.io.gfile.isdir(child):
                        files.add(child)
            elif _is_data_file_name(match.rstrip("/").rsplit("/", 1)[-1]):
                files.add(match)
    return "ok", sorted(files)
