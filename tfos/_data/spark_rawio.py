"""Zero-copy access to PySpark's serialized RDD records.

PySpark moves RDD data between the JVM and its Python workers as a stream of
length-prefixed *records* (PySpark's ``FramedSerializer`` calls them frames; in
tfos a *frame* is only an authenticated unit on a tfos connection). For most
RDDs each record is the pickle of a *list* of rows
(``BatchedSerializer``/``AutoBatchedSerializer`` over ``CPickleSerializer``);
for ``sc.textFile`` each record is the UTF-8 text of one line. A normal
``mapPartitions`` function sees rows only after the worker has unpickled every
record, and forwarding those rows to the TensorFlow process means pickling them
again. This module lets a Spark task see the records themselves, so they can be
forwarded untouched and unpickled exactly once, in the TensorFlow process, and
it does the same in the other direction for inference output.

Where each piece runs:

* :func:`raw_records`, :func:`union_raw_records`, :func:`raw_output_rdd` and
  :func:`record_kind` run on the **driver** (they only build RDDs).
* The callable that :func:`raw_output_rdd` ships runs in **Spark tasks** (the
  Python worker).
* The TF process decodes the records it is fed with
  :func:`tfos._data.framing.decode_chunk` (:class:`RecordKind` values are its
  :class:`~tfos._data.framing.ChunkKind` values), without importing pyspark.

PySpark internals relied upon (checked against the pyspark 4.3 source; all but
``allowed_names``, which is read with a default, are long-standing):
``RDD._jrdd``, ``RDD._jrdd_deserializer``, ``PipelinedRDD._bypass_serializer``
(PySpark's own ``partitionBy`` and ``saveAsTextFile`` use it), the serializer
classes in :mod:`pyspark.serializers` and their ``serializer``,
``use_unicode`` and ``allowed_names`` attributes, and the Python worker's
habit of writing the output of ``func`` with the PipelinedRDD's output
serializer (a :class:`~pyspark.serializers.NoOpSerializer` writes each
``bytes`` object as one record, verbatim).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pyspark import RDD
from pyspark.serializers import (
    AutoBatchedSerializer,
    BatchedSerializer,
    CloudPickleSerializer,
    CPickleSerializer,
    NoOpSerializer,
    PickleSerializer,
    Serializer,
    UTF8Deserializer,
)

__all__ = [
    "MAX_RECORD_BYTES",
    "RecordKind",
    "RawRecords",
    "record_kind",
    "raw_records",
    "raw_output_rdd",
    "union_raw_records",
]

logger = logging.getLogger(__name__)

#: Largest record that can travel through Spark. The JVM reads the record length
#: as a signed 32-bit int and stores the record in one ``byte[]``; JVMs refuse
#: arrays a few elements short of ``Integer.MAX_VALUE``, so Spark itself caps
#: arrays at ``Integer.MAX_VALUE - 15``. In practice records should be far
#: smaller (kilobytes to a few megabytes): every record is held in executor
#: memory in one piece.
MAX_RECORD_BYTES: int = 2**31 - 1 - 15


_JAVA_RDD_CLASS = "org.apache.spark.api.java.JavaRDD"


class RecordKind(enum.StrEnum):
    """What one raw record holds, and so how to turn it back into rows.

    The values are plain strings, so a kind can be sent to another process as
    text.
    """

    #: The pickle of a list (or, for records written by the JVM, a tuple) of
    #: rows.
    PICKLED_BATCH = "pickled_batch"
    #: The pickle of a single row.
    PICKLED_ROW = "pickled_row"
    #: The UTF-8 text of a single ``str`` row (for example a line from
    #: ``sc.textFile``).
    UTF8 = "utf8"
    #: A single ``bytes`` row, used verbatim (for example from
    #: ``sc.textFile(..., use_unicode=False)``, or from an RDD that
    #: :func:`raw_records` already returned).
    BYTES = "bytes"


@dataclass(frozen=True)
class RawRecords:
    """An RDD of raw records, plus how to decode them.

    Attributes:
        rdd: An RDD over the same JVM RDD as the source, whose elements are the
            records. Each one is a ``bytes`` object (a ``memoryview`` is also
            possible; treat records as read-only buffers). For the per-row kinds
            a record may be ``None``, which stands for a JVM ``null`` row. The
            partitioning and the order of records are those of the source RDD.
        kind: How each record decodes to rows (:class:`RecordKind`).
    """

    rdd: RDD
    kind: RecordKind


def _is_plain_pickle(ser: Any) -> bool:
    """Tells whether ``ser`` reads records with a plain ``pickle.loads``.

    Runs on the driver. Subclasses are rejected because they may change
    ``loads``. A ``CloudPickleSerializer`` with ``allowed_names`` set limits
    what may be unpickled, which the TF process's plain unpickling would not enforce, so it
    is rejected too.

    Args:
        ser: A PySpark serializer.

    Returns:
        True if every record ``ser`` reads is ``pickle.loads(record,
        encoding="bytes")``.
    """
    if type(ser) is PickleSerializer:
        return True
    if type(ser) is CloudPickleSerializer:
        return getattr(ser, "allowed_names", None) is None
    return False


def record_kind(deserializer: Serializer) -> RecordKind | None:
    """Works out the record format that an RDD deserializer reads.

    Runs on the driver. Matching is by exact class, so subclasses such as
    ``FlattenedValuesSerializer`` (a ``BatchedSerializer`` that does not
    flatten) are not mistaken for the classes they extend.

    Args:
        deserializer: An RDD's ``_jrdd_deserializer``.

    Returns:
        The kind of each record, or None if the format is not understood
        (``PairDeserializer``, ``CartesianDeserializer``, marshal, compressed,
        Arrow, restricted unpicklers, custom classes, and so on).
    """
    ser_type = type(deserializer)
    if ser_type in (BatchedSerializer, AutoBatchedSerializer):
        inner = getattr(deserializer, "serializer", None)
        return RecordKind.PICKLED_BATCH if _is_plain_pickle(inner) else None
    if _is_plain_pickle(deserializer):
        return RecordKind.PICKLED_ROW
    if ser_type is UTF8Deserializer:
        if getattr(deserializer, "use_unicode", True):
            return RecordKind.UTF8
        return RecordKind.BYTES
    if ser_type is NoOpSerializer:
        return RecordKind.BYTES
    return None


def _is_java_rdd(rdd: RDD, jrdd: Any) -> bool:
    """Tells whether ``jrdd`` is a plain ``JavaRDD``.

    Runs on the driver. A ``JavaPairRDD`` writes each element as two records,
    which none of the supported kinds describe.

    Args:
        rdd: The Python RDD that owns ``jrdd``.
        jrdd: Its JVM RDD (a py4j object).

    Returns:
        True if ``jrdd`` is a ``JavaRDD``, or if that cannot be checked.
    """
    gateway = getattr(rdd.context, "_gateway", None)
    if gateway is None:
        return True
    from py4j.java_gateway import is_instance_of

    return bool(is_instance_of(gateway, jrdd, _JAVA_RDD_CLASS))


def raw_records(rdd: RDD) -> RawRecords | None:
    """Gives an RDD of the serialized records behind ``rdd``, without decoding.

    Runs on the driver. The returned RDD reads the same JVM RDD (and so any
    cached copy of it) as ``rdd``, but its deserializer is a
    :class:`~pyspark.serializers.NoOpSerializer`, so a ``mapPartitions``
    function over it receives each record as ``bytes`` instead of rows.

    If ``rdd`` is a ``PipelinedRDD`` (for example the result of ``map``), this
    materializes its JVM RDD. Its Python function then runs in a worker of its
    own and that worker pickles the results (``AutoBatchedSerializer`` records).
    Without raw records, Spark would run the function in the same worker as the
    next ``mapPartitions``.

    Support is decided by the deserializer (see :func:`record_kind`), not by
    how the RDD was made. Tested: ``sc.parallelize`` (tuples, numpy arrays),
    ``sc.range``, ``map``/``filter``/``flatMap`` results, ``rdd.union`` and
    ``sc.union`` (same or different source formats), ``coalesce``,
    ``partitionBy``, ``df.rdd``, ``sc.textFile`` (with and without
    ``use_unicode``), cached RDDs, and the RDDs this function returns. By the
    same rule, ``groupByKey``, ``sc.pickleFile`` and checkpointed RDDs are
    covered too.

    Args:
        rdd: Any PySpark RDD.

    Returns:
        The records and their kind, or None if the record format of ``rdd`` is not
        understood (for example ``rdd.zip``, ``rdd.cartesian``,
        ``sc.wholeTextFiles``, or a SparkContext built with
        ``MarshalSerializer``). In that case the caller should iterate ``rdd``
        normally.
    """
    # Read _jrdd first: a PipelinedRDD may change its _jrdd_deserializer
    # (to NoOpSerializer when _bypass_serializer is set) as it materializes.
    jrdd = rdd._jrdd
    deserializer = rdd._jrdd_deserializer
    kind = record_kind(deserializer)
    if kind is None:
        logger.debug("raw_records: no raw access for deserializer %r", deserializer)
        return None
    if not _is_java_rdd(rdd, jrdd):
        logger.debug("raw_records: JVM RDD is not a JavaRDD; no raw access")
        return None
    logger.debug("raw_records: deserializer %r -> records of kind %s", deserializer, kind)
    return RawRecords(RDD(jrdd, rdd.context, NoOpSerializer()), kind)


def union_raw_records(parts: Sequence[RawRecords]) -> RawRecords:
    """Unions several :class:`RawRecords` of the same kind.

    Runs on the driver. All raw RDDs share the ``NoOpSerializer``, so Spark
    unions them as they are, without the unpickle/re-pickle pass that
    ``sc.union`` adds to RDDs with different batch sizes. Records of different
    kinds cannot be mixed. Call :func:`raw_records` on ``sc.union(...)`` of the
    source RDDs instead, which lets PySpark bring them to one format.

    Args:
        parts: One or more :class:`RawRecords`, all of the same kind and from
            the same SparkContext.

    Returns:
        The records of all parts, in the order of ``parts``.

    Raises:
        ValueError: If ``parts`` is empty or the parts differ in kind or
            SparkContext.
    """
    if not parts:
        raise ValueError("union_raw_records needs at least one RawRecords")
    kind = parts[0].kind
    ctx = parts[0].rdd.context
    for part in parts[1:]:
        if part.kind != kind:
            raise ValueError(
                f"cannot union raw records of kind {part.kind} with {kind}; "
                "union the source RDDs and call raw_records on the result instead"
            )
        if part.rdd.context is not ctx:
            raise ValueError("cannot union raw records from different SparkContexts")
    if len(parts) == 1:
        return parts[0]
    union = ctx.union([part.rdd for part in parts])
    if type(union._jrdd_deserializer) is not NoOpSerializer:  # pragma: no cover
        # Would mean PySpark reserialized raw records; they are no longer raw.
        raise ValueError(f"union changed the record format to {union._jrdd_deserializer!r}")
    return RawRecords(union, kind)


def _check_output_record(record: Any, partition: int, position: int) -> bytes | bytearray | memoryview:
    """Checks one output record before the worker writes it verbatim.

    Runs in a Spark task.

    Args:
        record: An object yielded by the user function.
        partition: The partition index, for error messages.
        position: The record's position within the partition, for error
            messages.

    Returns:
        The record, as a buffer whose ``len`` is its size in bytes.

    Raises:
        TypeError: If ``record`` is not a bytes-like object.
        ValueError: If ``record`` is empty or larger than
            :data:`MAX_RECORD_BYTES`.
    """
    where = f"output record {position} of partition {partition}"
    if isinstance(record, memoryview):
        if record.ndim != 1 or record.itemsize != 1:
            record = record.cast("B")
    elif not isinstance(record, (bytes, bytearray)):
        raise TypeError(f"{where} must be bytes (a pickled list), not {type(record).__name__}")
    size = len(record)
    if size == 0:
        # PySpark reads an empty pickle as EOFError, which silently ends the
        # partition: refuse it rather than lose the rest of the data.
        raise ValueError(f"{where} is empty; yield the pickle of [] or nothing instead")
    if size > MAX_RECORD_BYTES:
        raise ValueError(f"{where} is {size} bytes; the limit is {MAX_RECORD_BYTES}")
    return record


class _OutputRecordTask:
    """The partition function that :func:`raw_output_rdd` ships to tasks.

    Constructed on the driver, called in Spark tasks. It is a module-level
    class so that it pickles by reference (``tfos`` must be importable on the
    executors, as for every tfos task).

    Attributes:
        func: The user function, ``(partition_index, rows) -> records``.
    """

    def __init__(self, func: Callable[[int, Iterable[Any]], Iterable[Any]]) -> None:
        self.func = func

    def __call__(
        self, partition: int, iterator: Iterable[Any]
    ) -> Iterator[bytes | bytearray | memoryview]:
        """Runs the user function over one partition and checks its records.

        Runs in a Spark task.

        Args:
            partition: The partition index.
            iterator: The partition's input (rows, or raw records if the input
                RDD came from :func:`raw_records`).

        Yields:
            The user function's records, unchanged.

        Raises:
            TypeError, ValueError: As :func:`_check_output_record`.
        """
        records = self.func(partition, iterator)
        try:
            for position, record in enumerate(records):
                yield _check_output_record(record, partition, position)
        finally:
            # Let the user function release its resources (e.g. a socket to
            # the TF process) even if the task stops early.
            close = getattr(records, "close", None)
            if close is not None:
                close()


def raw_output_rdd(
    rdd: RDD,
    func: Callable[[int, Iterable[Any]], Iterable[bytes | bytearray | memoryview]],
) -> RDD:
    """Maps partitions to pre-pickled result batches, without re-pickling.

    Runs on the driver; ``func`` runs in Spark tasks. ``func(partition_index,
    iterator)`` receives the partition as ``rdd`` would give it (rows, or raw
    records if ``rdd`` came from :func:`raw_records`) and yields ``bytes``
    records, each the pickle of a **list** of results (as
    :func:`tfos._data.results.result_frames` makes them). The Python worker writes each record verbatim, and
    the returned RDD reads the records as PySpark batches, so its elements are
    the results themselves, flattened in order. The returned RDD is a plain
    RDD and supports every RDD operation (``collect``, ``count``, ``map``,
    ``persist``, ``saveAsTextFile``, ``union`` and so on). Like any RDD, it is
    computed again, running ``func`` again, for each action unless persisted.

    Args:
        rdd: The input RDD.
        func: The partition function. A tuple instead of a list also works,
            but a record holding any other object is iterated as if it were a
            batch.

    Returns:
        An RDD of the results, with the partitions of ``rdd``.

    Raises:
        TypeError: In the task (so surfacing from the action as a Spark job
            failure) if ``func`` yields something that is not bytes-like.
        ValueError: In the task if a record is empty or larger than
            :data:`MAX_RECORD_BYTES`.
    """
    ctx = rdd.context
    out = rdd.mapPartitionsWithIndex(_OutputRecordTask(func))
    # The output serializer is fixed when the PipelinedRDD builds its JVM RDD,
    # so it must be switched before _jrdd is first read. _bypass_serializer is
    # how PySpark's own saveAsTextFile does it; setting the serializer as well
    # covers versions that lack the flag.
    out._bypass_serializer = True  # type: ignore[attr-defined]
    out._jrdd_deserializer = NoOpSerializer()
    jrdd = out._jrdd
    if type(out._jrdd_deserializer) is not NoOpSerializer:  # pragma: no cover
        raise RuntimeError(
            f"could not switch the output serializer (got {out._jrdd_deserializer!r}); "
            "this PySpark version is not supported"
        )
    # Records are pickled lists of any length: exactly what an
    # AutoBatchedSerializer reads. It also equals the default ctx.serializer,
    # so unions with ordinary RDDs need no reserialization.
    return RDD(jrdd, ctx, AutoBatchedSerializer(CPickleSerializer()))
