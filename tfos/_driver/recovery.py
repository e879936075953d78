"""Spark helpers for restarts: which result partitions survive, and one RDD from several
attempts' results (driver only; touches the SparkContext through py4j).

``inference()`` persists its results RDD. When a node fails part-way, the partitions whose
results were computed stay in Spark's block store (unless their executor went with the
failure); a restarted cluster computes only the others, on a new results RDD, and
:func:`assemble` returns one RDD whose partition ``i`` is read from whichever attempt's
RDD holds it, in input order.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Iterable, Sequence

__all__ = ["cached_partitions", "prune", "assemble"]

log = logging.getLogger(__name__)


def cached_partitions(rdd: Any, settle_s: float = 1.0) -> set[int]:
    """Indices of the partitions of persisted ``rdd`` whose blocks Spark holds now (driver).

    Read from Spark's status store (the same data as the UI's Storage tab), which follows
    block updates and removed executors through the listener bus: ``settle_s`` seconds are
    given for pending events to land first.

    Args:
        rdd: A persisted PySpark RDD.
        settle_s: Seconds to wait before reading (listener events are asynchronous).

    Returns:
        The partition indices with at least one stored copy (empty when none, or when the
        status store cannot be read: then everything is recomputed).
    """
    if settle_s > 0:
        time.sleep(settle_s)
    sc = rdd.context
    rid = rdd._jrdd.rdd().id()
    prefix = f"rdd_{rid}_"
    try:
        info = sc._jsc.sc().statusStore().rdd(rid)
        parts = info.partitions()
        if parts.isEmpty():
            return set()
        found: set[int] = set()
        it = parts.get().iterator()
        while it.hasNext():
            p = it.next()
            name = str(p.blockName())
            if name.startswith(prefix) and p.executors().nonEmpty():
                found.add(int(name[len(prefix):]))
        return found
    except Exception as exc:  # noqa: BLE001 - py4j errors (no such RDD yet: NoSuchElementException)
        log.debug("no storage information for RDD %d: %s", rid, exc)
        return set()


def prune(rdd: Any, keep: Iterable[int]) -> Any:
    """``rdd`` restricted to the partitions ``keep``, in their order (driver; lazy).

    Uses Spark's ``PartitionPruningRDD``: the other partitions are never computed. The
    result keeps ``rdd``'s deserializer, so its elements are ``rdd``'s.

    Raises:
        ValueError: An index outside ``rdd``'s partitions.
    """
    from pyspark.rdd import RDD

    wanted = sorted(set(keep))
    n = rdd.getNumPartitions()
    if any(not 0 <= i < n for i in wanted):
        raise ValueError(f"partitions {wanted} outside 0..{n - 1}")
    sc = rdd.context
    jvm = sc._jvm
    jset = jvm.java.util.HashSet()
    for i in wanted:
        jset.add(i)
    # A Scala Set[Int] is a Function1[Int, Boolean]: the pruning predicate.
    predicate = jvm.scala.jdk.javaapi.CollectionConverters.asScala(jset).toSet()
    pruned = jvm.org.apache.spark.rdd.PartitionPruningRDD.create(rdd._jrdd.rdd(), predicate)
    return RDD(pruned.toJavaRDD(), sc, rdd._jrdd_deserializer)


def assemble(sources: Sequence[Any], owner: Sequence[int]) -> Any:
    """One RDD whose partition ``i`` is partition ``i`` of ``sources[owner[i]]`` (driver; lazy).

    Consecutive partitions of one source become one pruned RDD; the pieces are unioned in
    partition order, so the result has ``len(owner)`` partitions in input order. Each piece
    reads the source's persisted blocks; nothing is recomputed while they are stored.

    Args:
        sources: RDDs with the same number of partitions and deserializer.
        owner: For every partition, the index of the source that holds it.

    Raises:
        ValueError: An owner index out of range or a source of another size.
    """
    if not sources:
        raise ValueError("no source RDD")
    n = len(owner)
    for s in sources:
        if s.getNumPartitions() != n:
            raise ValueError(f"a source has {s.getNumPartitions()} partitions, expected {n}")
    if any(not 0 <= o < len(sources) for o in owner):
        raise ValueError(f"owner indices {sorted(set(owner))} outside 0..{len(sources) - 1}")
    if len(set(owner)) == 1:
        return sources[owner[0]] if owner else sources[0]
    pieces = []
    start = 0
    for i in range(1, n + 1):
        if i == n or owner[i] != owner[start]:
            pieces.append(prune(sources[owner[start]], range(start, i)))
            start = i
    return sources[0].context.union(pieces)
