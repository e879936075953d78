"""What a train() or inference() job reads, and in which Python worker (driver side).

Two ways to read an RDD's partition in a feed task:

* **Raw PySpark batches** (:func:`tfos._data.spark_rawio.raw_records`): for an RDD whose
  rows the JVM holds as PySpark pickled batches (cached RDDs, ``sc.parallelize``,
  ``df.rdd``, unions of these), the task forwards the batches without unpickling them.
* **In the upstream's own worker**: for a Python-pipelined RDD that is not cached
  (``rdd.map(decode)``, ``mapPartitions``, ``filter``... on anything), the feed function is
  pipelined onto the RDD's own Python functions, so the task reads each row as the
  upstream code yields it and pickles rows in chunks itself. Fed as raw batches instead,
  such an RDD would run in a Python worker of its own that writes its output through
  PySpark's ``AutoBatchedSerializer`` (batches of 1, 2, 4... rows, growing to about
  64 KB) into a 64 KB buffered stream (``spark.buffer.size``), which the JVM then writes
  to the feed task's worker through another such buffer: a slow producer's rows (an
  upstream decoder, a remote read) reached the feed task only when those buffers filled,
  for small rows at the end of the partition (measured: every row of a 2 s partition
  arrived after 2 s). Reading in the same worker also saves the JVM hop and a pickle
  pass.

Where it runs: the driver (it only builds RDDs); the functions it wraps run in Spark tasks.
See docs/datafeed.md "Latency: the linger time".
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Optional

from tfos._data.framing import ChunkKind

__all__ = ["FeedSource", "pipelinable"]


def pipelinable(rdd: Any) -> bool:
    """True when a function mapped over ``rdd`` runs in the same Python worker as ``rdd``'s
    own Python code (driver): a PySpark ``PipelinedRDD`` that is not cached, checkpointed,
    in a barrier stage or under a resource profile (PySpark's own rule,
    ``PipelinedRDD._is_pipelinable``)."""
    from pyspark.rdd import PipelinedRDD

    if not isinstance(rdd, PipelinedRDD):
        return False
    is_pipelinable = getattr(rdd, "_is_pipelinable", None)
    is_barrier = getattr(rdd, "_is_barrier", None)
    return bool(is_pipelinable is not None and is_pipelinable() and not (is_barrier is not None and is_barrier()))


def _shifted(fn: Callable[[int, Iterable[Any]], Iterable[Any]], offset: int) -> Callable[[int, Iterable[Any]], Iterable[Any]]:
    """``fn`` called with ``index + offset`` (the job's partition index of an epoch)."""

    def _call(index: int, items: Iterable[Any]) -> Iterable[Any]:
        return fn(index + offset, items)

    return _call


@dataclasses.dataclass(frozen=True)
class FeedSource:
    """The RDD a feed job reads and how its items are encoded (driver).

    Attributes:
        rdd: The RDD of one epoch: its raw batches (``kind`` PICKLED_BATCHES), or the
            input itself (kind None: rows, pipelined into its worker when
            :attr:`pipelined`).
        kind: The chunk kind of the items a feed task reads.
        epochs: Epochs fed back to back in one job.
        pipelined: The feed function runs in the input's own Python worker.
    """

    rdd: Any
    kind: Optional[ChunkKind]
    epochs: int = 1
    pipelined: bool = False

    @classmethod
    def of(cls, rdd: Any, epochs: int = 1) -> "FeedSource":
        """How to feed ``rdd`` for ``epochs`` epochs (driver; see the module docstring).

        RDDs stored as PySpark pickled batches are fed as raw batches (the feed task packs
        them into data frames of about 1 MiB without unpickling them); a pipelinable RDD
        (:func:`pipelinable`) row by row in its own worker; any other RDD row by row.
        """
        from tfos._data.spark_rawio import RecordKind, raw_records

        if pipelinable(rdd):
            return cls(rdd, None, epochs, pipelined=True)
        raw = raw_records(rdd)
        if raw is None or raw.kind != RecordKind.PICKLED_BATCH:
            return cls(rdd, None, epochs)
        return cls(raw.rdd, ChunkKind.PICKLED_BATCHES, epochs)

    def feed(self, fn: Callable[[int, Iterable[Any]], Iterable[Any]]) -> Any:
        """The RDD whose action runs ``fn(job partition index, items)`` over every partition
        of every epoch (driver). Epoch ``e``'s partition ``i`` has job index ``e x
        partitions + i``."""
        if self.epochs == 1:
            return self.rdd.mapPartitionsWithIndex(fn)
        if self.kind is ChunkKind.PICKLED_BATCHES:
            from tfos._data.spark_rawio import RawRecords, RecordKind, union_raw_records

            raw = RawRecords(self.rdd, RecordKind.PICKLED_BATCH)
            return union_raw_records([raw] * self.epochs).rdd.mapPartitionsWithIndex(fn)
        if not self.pipelined:
            return self.rdd.context.union([self.rdd] * self.epochs).mapPartitionsWithIndex(fn)
        parts = self.rdd.getNumPartitions()
        # One pipelined RDD per epoch: a union of the input itself would run the input's
        # Python code in workers of its own (the union's JVM RDD reads it through the JVM).
        return self.rdd.context.union(
            [self.rdd.mapPartitionsWithIndex(_shifted(fn, e * parts)) for e in range(self.epochs)]
        )
