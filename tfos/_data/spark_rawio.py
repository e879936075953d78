"""Zero-copy access to PySpark's serialized RDD frames.

PySpark moves RDD data between the JVM and its Python workers as a stream of
length-prefixed *frames*. For most RDDs each frame is the pickle of a *list*
of rows (``BatchedSerializer``/``AutoBatchedSerializer`` over
``CPickleSerializer``); for ``sc.textFile`` each frame is the UTF-8 text of one
line. A normal ``mapPartitions`` function sees rows only after the worker has
unpickled every frame, and forwarding those rows to the TensorFlow process
means pickling them again. This module lets a Spark task see the frames
themselves, so they can be forwarded untouched and unpickled exactly once, in
the TensorFlow process, and it does the same in the other direction for
inference output.

Where each piece runs:

* :func:`raw_frames`, :func:`union_raw_frames`, :func:`raw_output_rdd` and
  :func:`frame_kind` run on the **driver** (they only build RDDs).
* The callable that :func:`raw_output_rdd` ships runs in **Spark tasks** (the
  Python worker).
* :func:`decode_frame`, :func:`iter_rows` and :func:`encode_batch` are plain
  functions. They are meant for the **TF process**, and work in Spark tasks
  and on the driver as well.

PySpark internals relied upon (checked against the pyspark 4.3 source; all but
``allowed_names``, which is read with a default, are long-standing):
``RDD._jrdd``, ``RDD._jrdd_deserializer``, ``PipelinedRDD._bypass_serializer``
(PySpark's own ``partitionBy`` and ``saveAsTextFile`` use it), the serializer
classes in :mod:`pyspark.serializers` and their ``serializer``,
``use_unicode`` and ``allowed_names`` attributes, and the Python worker's
habit of writing the output of ``func`` with the PipelinedRDD's output
serializer (a :class:`~pyspark.serializers.NoOpSerializer` writes each
``bytes`` object as one frame, verbatim).
"""

from __future__ import annotations

import enum
import logging
import pickle
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
    "MAX_FRAME_BYTES",
    "FrameKind",
    "RawFrames",
    "decode_frame",
    "encode_batch",
    "frame_kind",
    "iter_rows",
    "raw_frames",
    "raw_output_rdd",
    "union_raw_frames",
]

logger = logging.getLogger(__name__)

#: Largest frame that can travel through Spark. The JVM reads the frame length
#: as a signed 32-bit int and stores the frame in one ``byte[]``; JVMs refuse
#: arrays a few elements short of ``Integer.MAX_VALUE``, so Spark itself caps
#: arrays at ``Integer.MAX_VALUE - 15``. In practice frames should be far
#: smaller (kilobytes to a few megabytes): every frame is held in executor
#: memory in one piece.
MAX_FRAME_BYTES: int = 2**31 - 1 - 15

# Pickle protocol used by encode_batch(); PySpark pickles with the same one.
_PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL

_JAVA_RDD_CLASS = "org.apache.spark.api.java.JavaRDD"


class FrameKind(enum.StrEnum):
    """What one raw frame holds, and so how to turn it back into rows.

    The values are plain strings, so a kind can be sent to another process as
    text.
    """

    #: The pickle of a list (or, for frames written by the JVM, a tuple) of
    #: rows.
    PICKLED_BATCH = "pickled_batch"
    #: The pickle of a single row.
    PICKLED_ROW = "pickled_row"
    #: The UTF-8 text of a single ``str`` row (for example a line from
    #: ``sc.textFile``).
    UTF8 = "utf8"
    #: A single ``bytes`` row, used verbatim (for example from
    #: ``sc.textFile(..., use_unicode=False)``, or from an RDD that
    #: :func:`raw_frames` already returned).
    BYTES = "bytes"


@dataclass(frozen=True)
class RawFrames:
    """An RDD of raw frames, plus how to decode them.

    Attributes:
        rdd: An RDD over the same JVM RDD as the source, whose elements are the
            frames. Each one is a ``bytes`` object (a ``memoryview`` is also
            possible; treat frames as read-only buffers). For the per-row kinds
            a frame may be ``None``, which stands for a JVM ``null`` row. The
            partitioning and the order of frames are those of the source RDD.
        kind: How each frame decodes to rows (see :func:`decode_frame`).
    """

    rdd: RDD
    kind: FrameKind

    def decode(self, frame: bytes | bytearray | memoryview | None) -> list[Any]:
        """Decodes one frame of this RDD into its rows.

        Runs anywhere; this just calls :func:`decode_frame`.

        Args:
            frame: A frame taken from :attr:`rdd`.

        Returns:
            The rows in the frame, in order.
        """
        return decode_frame(self.kind, frame)


def _is_plain_pickle(ser: Any) -> bool:
    """Tells whether ``ser`` reads frames with a plain ``pickle.loads``.

    Runs on the driver. Subclasses are rejected because they may change
    ``loads``. A ``CloudPickleSerializer`` with ``allowed_names`` set limits
    what may be unpickled, which :func:`decode_frame` would not enforce, so it
    is rejected too.

    Args:
        ser: A PySpark serializer.

    Returns:
        True if every frame ``ser`` reads is ``pickle.loads(frame,
        encoding="bytes")``.
    """
    if type(ser) is PickleSerializer:
        return True
    if type(ser) is CloudPickleSerializer:
        return getattr(ser, "allowed_names", None) is None
    return False


def frame_kind(deserializer: Serializer) -> FrameKind | None:
    """Works out the frame format that an RDD deserializer reads.

    Runs on the driver. Matching is by exact class, so subclasses such as
    ``FlattenedValuesSerializer`` (a ``BatchedSerializer`` that does not
    flatten) are not mistaken for the classes they extend.

    Args:
        deserializer: An RDD's ``_jrdd_deserializer``.

    Returns:
        The kind of each frame, or None if the format is not understood
        (``PairDeserializer``, ``CartesianDeserializer``, marshal, compressed,
        Arrow, restricted unpicklers, custom classes, and so on).
    """
    ser_type = type(deserializer)
    if ser_type in (BatchedSerializer, AutoBatchedSerializer):
        inner = getattr(deserializer, "serializer", None)
        return FrameKind.PICKLED_BATCH if _is_plain_pickle(inner) else None
    if _is_plain_pickle(deserializer):
        return FrameKind.PICKLED_ROW
    if ser_type is UTF8Deserializer:
        if getattr(deserializer, "use_unicode", True):
            return FrameKind.UTF8
        return FrameKind.BYTES
    if ser_type is NoOpSerializer:
        return FrameKind.BYTES
    return None


def _is_java_rdd(rdd: RDD, jrdd: Any) -> bool:
    """Tells whether ``jrdd`` is a plain ``JavaRDD``.

    Runs on the driver. A ``JavaPairRDD`` writes each element as two frames,
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


def raw_frames(rdd: RDD) -> RawFrames | None:
    """Gives an RDD of the serialized frames behind ``rdd``, without decoding.

    Runs on the driver. The returned RDD reads the same JVM RDD (and so any
    cached copy of it) as ``rdd``, but its deserializer is a
    :class:`~pyspark.serializers.NoOpSerializer`, so a ``mapPartitions``
    function over it receives each frame as ``bytes`` instead of rows.

    If ``rdd`` is a ``PipelinedRDD`` (for example the result of ``map``), this
    materializes its JVM RDD. Its Python function then runs in a worker of its
    own and that worker pickles the results (``AutoBatchedSerializer`` frames).
    Without raw frames, Spark would run the function in the same worker as the
    next ``mapPartitions``.

    Support is decided by the deserializer (see :func:`frame_kind`), not by
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
        The frames and their kind, or None if the frame format of ``rdd`` is not
        understood (for example ``rdd.zip``, ``rdd.cartesian``,
        ``sc.wholeTextFiles``, or a SparkContext built with
        ``MarshalSerializer``). In that case the caller should iterate ``rdd``
        normally.
    """
    # Read _jrdd first: a PipelinedRDD may change its _jrdd_deserializer
    # (to NoOpSerializer when _bypass_serializer is set) as it materializes.
    jrdd = rdd._jrdd
    deserializer = rdd._jrdd_deserializer
    kind = frame_kind(deserializer)
    if kind is None:
        logger.debug("raw_frames: no raw access for deserializer %r", deserializer)
        return None
    if not _is_java_rdd(rdd, jrdd):
        logger.debug("raw_frames: JVM RDD is not a JavaRDD; no raw access")
        return None
    logger.debug("raw_frames: deserializer %r -> frames of kind %s", deserializer, kind)
    return RawFrames(RDD(jrdd, rdd.context, NoOpSerializer()), kind)


def union_raw_frames(parts: Sequence[RawFrames]) -> RawFrames:
    """Unions several :class:`RawFrames` of the same kind.

    Runs on the driver. All raw RDDs share the ``NoOpSerializer``, so Spark
    unions them as they are, without the unpickle/re-pickle pass that
    ``sc.union`` adds to RDDs with different batch sizes. Frames of different
    kinds cannot be mixed. Call :func:`raw_frames` on ``sc.union(...)`` of the
    source RDDs instead, which lets PySpark bring them to one format.

    Args:
        parts: One or more :class:`RawFrames`, all of the same kind and from
            the same SparkContext.

    Returns:
        The frames of all parts, in the order of ``parts``.

    Raises:
        ValueError: If ``parts`` is empty or the parts differ in kind or
            SparkContext.
    """
    if not parts:
        raise ValueError("union_raw_frames needs at least one RawFrames")
    kind = parts[0].kind
    ctx = parts[0].rdd.context
    for part in parts[1:]:
        if part.kind != kind:
            raise ValueError(
                f"cannot union raw frames of kind {part.kind} with {kind}; "
                "union the source RDDs and call raw_frames on the result instead"
            )
        if part.rdd.context is not ctx:
            raise ValueError("cannot union raw frames from different SparkContexts")
    if len(parts) == 1:
        return parts[0]
    union = ctx.union([part.rdd for part in parts])
    if type(union._jrdd_deserializer) is not NoOpSerializer:  # pragma: no cover
        # Would mean PySpark reserialized raw frames; they are no longer raw.
        raise ValueError(f"union changed the frame format to {union._jrdd_deserializer!r}")
    return RawFrames(union, kind)


def decode_frame(kind: FrameKind | str, frame: bytes | bytearray | memoryview | None) -> list[Any]:
    """Turns one raw frame into the rows it holds.

    Runs in the TF process (or anywhere). Pickles are loaded with
    ``encoding="bytes"``, like PySpark's ``CPickleSerializer.loads``. Rows of
    ``df.rdd`` unpickle to ``pyspark.sql.Row`` and rows pickled by value need
    ``pyspark.cloudpickle``, so the TF process must be able to import
    ``pyspark``. Numpy rows need ``numpy``.

    Args:
        kind: The :class:`FrameKind` of the frame, or its string value.
        frame: One frame. ``None`` (a JVM ``null``) is accepted for the
            per-row kinds and decodes to ``[None]``.

    Returns:
        The rows of the frame, in order. For ``PICKLED_BATCH`` this is the
        unpickled list itself when it is a list (a tuple written by the JVM is
        converted).

    Raises:
        ValueError: If ``kind`` is unknown, or a ``PICKLED_BATCH`` frame is
            ``None``.
        TypeError: If a ``PICKLED_BATCH`` frame does not unpickle to a list or
            tuple.
        pickle.UnpicklingError, UnicodeDecodeError: If the frame is corrupt.
    """
    kind = FrameKind(kind)
    if kind is FrameKind.PICKLED_BATCH:
        if frame is None:
            raise ValueError("a PICKLED_BATCH frame cannot be None")
        rows = pickle.loads(frame, encoding="bytes")
        if type(rows) is list:
            return rows
        if isinstance(rows, (list, tuple)):
            return list(rows)
        raise TypeError(
            f"a PICKLED_BATCH frame must hold a list of rows, not {type(rows).__name__}"
        )
    if frame is None:
        return [None]
    if kind is FrameKind.PICKLED_ROW:
        return [pickle.loads(frame, encoding="bytes")]
    if kind is FrameKind.UTF8:
        return [str(frame, "utf-8")]
    # FrameKind.BYTES
    return [frame if type(frame) is bytes else bytes(frame)]


def iter_rows(
    kind: FrameKind | str, frames: Iterable[bytes | bytearray | memoryview | None]
) -> Iterator[Any]:
    """Decodes a stream of frames into a stream of rows.

    Runs in the TF process (or in a Spark task, or on the driver).

    Args:
        kind: The :class:`FrameKind` of every frame.
        frames: Frames in order.

    Yields:
        The rows of every frame, in order.

    Raises:
        ValueError, TypeError: As :func:`decode_frame`.
    """
    kind = FrameKind(kind)
    for frame in frames:
        yield from decode_frame(kind, frame)


def encode_batch(rows: Iterable[Any]) -> bytes:
    """Pickles a batch of result rows into one output frame.

    Runs in the TF process (or in a Spark task). This is the frame format that
    :func:`raw_output_rdd` expects, and the same as a ``PICKLED_BATCH`` input
    frame.

    Args:
        rows: The results, in order. Anything other than a list is copied into
            one.

    Returns:
        The pickle of the list of rows.

    Raises:
        pickle.PicklingError: If a row cannot be pickled.
    """
    batch = rows if type(rows) is list else list(rows)
    return pickle.dumps(batch, protocol=_PICKLE_PROTOCOL)


def _check_output_frame(
    frame: Any, partition: int, position: int, validate: bool
) -> bytes | bytearray | memoryview:
    """Checks one output frame before the worker writes it verbatim.

    Runs in a Spark task.

    Args:
        frame: An object yielded by the user function.
        partition: The partition index, for error messages.
        position: The frame's position within the partition, for error
            messages.
        validate: Whether to also unpickle the frame and check that it holds a
            list or tuple.

    Returns:
        The frame, as a buffer whose ``len`` is its size in bytes.

    Raises:
        TypeError: If ``frame`` is not a bytes-like object, or (with
            ``validate``) does not unpickle to a list or tuple.
        ValueError: If ``frame`` is empty or larger than
            :data:`MAX_FRAME_BYTES`.
    """
    where = f"output frame {position} of partition {partition}"
    if isinstance(frame, memoryview):
        if frame.ndim != 1 or frame.itemsize != 1:
            frame = frame.cast("B")
    elif not isinstance(frame, (bytes, bytearray)):
        raise TypeError(f"{where} must be bytes (a pickled list), not {type(frame).__name__}")
    size = len(frame)
    if size == 0:
        # PySpark reads an empty pickle as EOFError, which silently ends the
        # partition: refuse it rather than lose the rest of the data.
        raise ValueError(f"{where} is empty; yield encode_batch([]) or nothing instead")
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"{where} is {size} bytes; the limit is {MAX_FRAME_BYTES}")
    if validate:
        rows = pickle.loads(frame, encoding="bytes")
        if not isinstance(rows, (list, tuple)):
            raise TypeError(f"{where} holds a {type(rows).__name__}, not a list of results")
    return frame


class _OutputFrameTask:
    """The partition function that :func:`raw_output_rdd` ships to tasks.

    Constructed on the driver, called in Spark tasks. It is a module-level
    class so that it pickles by reference (``tfos`` must be importable on the
    executors, as for every tfos task).

    Attributes:
        func: The user function, ``(partition_index, rows) -> frames``.
        validate: Whether every frame is unpickled and checked.
    """

    def __init__(self, func: Callable[[int, Iterable[Any]], Iterable[Any]], validate: bool) -> None:
        """Stores the user function.

        Args:
            func: The user function.
            validate: Whether every frame is unpickled and checked.
        """
        self.func = func
        self.validate = validate

    def __call__(
        self, partition: int, iterator: Iterable[Any]
    ) -> Iterator[bytes | bytearray | memoryview]:
        """Runs the user function over one partition and checks its frames.

        Runs in a Spark task.

        Args:
            partition: The partition index.
            iterator: The partition's input (rows, or raw frames if the input
                RDD came from :func:`raw_frames`).

        Yields:
            The user function's frames, unchanged.

        Raises:
            TypeError, ValueError: As :func:`_check_output_frame`.
        """
        frames = self.func(partition, iterator)
        try:
            for position, frame in enumerate(frames):
                yield _check_output_frame(frame, partition, position, self.validate)
        finally:
            # Let the user function release its resources (e.g. a socket to
            # the TF process) even if the task stops early.
            close = getattr(frames, "close", None)
            if close is not None:
                close()


def raw_output_rdd(
    rdd: RDD,
    func: Callable[[int, Iterable[Any]], Iterable[bytes | bytearray | memoryview]],
    *,
    validate: bool = False,
) -> RDD:
    """Maps partitions to pre-pickled result batches, without re-pickling.

    Runs on the driver; ``func`` runs in Spark tasks. ``func(partition_index,
    iterator)`` receives the partition as ``rdd`` would give it (rows, or raw
    frames if ``rdd`` came from :func:`raw_frames`) and yields ``bytes``
    frames, each the pickle of a **list** of results (see
    :func:`encode_batch`). The Python worker writes each frame verbatim, and
    the returned RDD reads the frames as PySpark batches, so its elements are
    the results themselves, flattened in order. The returned RDD is a plain
    RDD and supports every RDD operation (``collect``, ``count``, ``map``,
    ``persist``, ``saveAsTextFile``, ``union`` and so on). Like any RDD, it is
    computed again, running ``func`` again, for each action unless persisted.

    Args:
        rdd: The input RDD.
        func: The partition function. A tuple instead of a list also works,
            but a frame holding any other object is iterated as if it were a
            batch, so ``validate`` is worth using in tests.
        validate: If True, each frame is unpickled in the task and checked to
            hold a list or tuple. This costs an unpickle per frame, so it is
            meant for debugging.

    Returns:
        An RDD of the results, with the partitions of ``rdd``.

    Raises:
        TypeError: In the task (so surfacing from the action as a Spark job
            failure) if ``func`` yields something that is not bytes-like.
        ValueError: In the task if a frame is empty or larger than
            :data:`MAX_FRAME_BYTES`.
    """
    ctx = rdd.context
    out = rdd.mapPartitionsWithIndex(_OutputFrameTask(func, validate))
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
    # Frames are pickled lists of any length: exactly what an
    # AutoBatchedSerializer reads. It also equals the default ctx.serializer,
    # so unions with ordinary RDDs need no reserialization.
    return RDD(jrdd, ctx, AutoBatchedSerializer(CPickleSerializer()))
