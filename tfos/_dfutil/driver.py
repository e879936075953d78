"""saveAsTFRecords / loadTFRecords: the driver side, which launches the Spark jobs."""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.types import StructType

from tfos._dfutil.decode import _examples_to_tuples, _infer_schema_in_task
from tfos._dfutil.encode import toTFExample
from tfos._dfutil.files import (
    _commit_output_dir,
    _list_tfrecord_files,
    _normalize_path,
    _prepare_output_dir,
    _read_tfrecord_files,
    _remove_temporary_dir,
    _run_in_task,
    _write_tfrecord_partition,
)
from tfos._dfutil.schema import _as_name_set, _field_specs

if TYPE_CHECKING:  # pragma: no cover - typing only
    from pyspark import SparkContext

logger = logging.getLogger(__name__)


#: Registry of DataFrames created by :func:`loadTFRecords`, mapping each DataFrame
#: to the TFRecord path it was loaded from (TensorFlowOnSpark's ``loadedDF``).
#: Keys are held weakly, so registered DataFrames can still be garbage collected.
loadedDF: "weakref.WeakKeyDictionary[DataFrame, str]" = weakref.WeakKeyDictionary()


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
