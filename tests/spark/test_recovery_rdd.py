"""Spark helpers of restarts (issue 14): cached result partitions, pruning, assembling one
RDD from several attempts' results."""

from __future__ import annotations

import pytest

from tfos._driver.recovery import assemble, cached_partitions, prune

pytestmark = pytest.mark.spark


def _fail_on(bad):
    def f(i, it):
        if i in bad:
            raise RuntimeError(f"partition {i} must not be computed")
        return it

    return f


def test_cached_partitions_follow_what_was_computed(sc):
    from pyspark import StorageLevel

    rdd = sc.parallelize(range(40), 4).map(lambda x: x * 10)
    rdd.persist(StorageLevel.MEMORY_AND_DISK_DESER)
    try:
        assert cached_partitions(rdd, settle_s=0) == set()
        assert sc.runJob(rdd, lambda it: [sum(1 for _ in it)], partitions=[0, 2]) == [10, 10]
        assert cached_partitions(rdd) == {0, 2}
    finally:
        rdd.unpersist()


def test_prune_computes_only_kept_partitions(sc):
    rdd = sc.parallelize(range(40), 4).mapPartitionsWithIndex(_fail_on({1}))
    pruned = prune(rdd, [3, 0, 2])
    assert pruned.getNumPartitions() == 3
    assert pruned.glom().collect() == [list(range(0, 10)), list(range(20, 30)), list(range(30, 40))]
    with pytest.raises(ValueError):
        prune(rdd, [4])


def test_assemble_takes_each_partition_from_its_owner_in_order(sc):
    from pyspark import StorageLevel

    first = sc.parallelize(range(40), 4).mapPartitionsWithIndex(lambda i, it: (("a", i, x) for x in it))
    second = sc.parallelize(range(40), 4).mapPartitionsWithIndex(lambda i, it: (("b", i, x) for x in it))
    first = first.mapPartitionsWithIndex(_fail_on({1, 3}))  # the "failed attempt" lacks 1 and 3
    owner = [0, 1, 0, 1]
    out = assemble([first, second], owner)
    assert out.getNumPartitions() == 4
    parts = out.glom().collect()
    assert [p[0][:2] for p in parts] == [("a", 0), ("b", 1), ("a", 2), ("b", 3)]
    assert [x for p in parts for (_, _, x) in p] == list(range(40))
    assert assemble([second], [0, 0, 0, 0]) is second
    second.persist(StorageLevel.MEMORY_ONLY)
    second.unpersist()
