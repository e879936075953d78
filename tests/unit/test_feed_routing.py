"""Unit tests of tfos._data.feed_plan.choose_node and FeedPlan (pure: no Spark)."""

from __future__ import annotations

from collections import Counter

import pytest

from tfos._data.feed_plan import FEED_TIMEOUT_S, FeedPlan, choose_node
from tfos.cluster_template import NodeInfo
from tfos.errors import TFOSError

KEY = b"\xaa" * 32


def _n(eid: int, host: str, ekey: str, job: str = "worker", idx: int = 0) -> NodeInfo:
    return NodeInfo(eid, job, idx, host, 2000 + eid, data_port=3000 + eid, pid=eid, executor_key=ekey)


# local-cluster / standalone: one node per executor, two hosts
CLUSTER = (
    _n(1, "hostA", "hostA/101", "chief", 0),
    _n(2, "hostA", "hostA/102", "worker", 0),
    _n(3, "hostB", "hostB/103", "worker", 1),
)


def test_same_executor_first():
    for index in range(6):
        assert choose_node(CLUSTER, index, "hostA/102", "hostA") == (CLUSTER[1], "executor")
        assert choose_node(CLUSTER, index, "hostB/103", "hostB") == (CLUSTER[2], "executor")


def test_local_mode_spreads_partitions_over_nodes_by_index():
    # under local[N] every node lives in the one executor JVM
    nodes = tuple(_n(i, "127.0.0.1", "127.0.0.1/5555", idx=i) for i in range(3))
    chosen = [choose_node(nodes, i, "127.0.0.1/5555", "127.0.0.1") for i in range(9)]
    assert all(how == "executor" for _, how in chosen)
    assert [n.executor_id for n, _ in chosen] == [0, 1, 2, 0, 1, 2, 0, 1, 2]


def test_same_host_when_executor_hosts_no_node():
    # C06/C07: the task runs on an executor with no feedable node (a ps or a spare executor)
    picks = [choose_node(CLUSTER, i, "hostA/999", "hostA") for i in range(4)]
    assert [how for _, how in picks] == ["host"] * 4
    assert [n.executor_id for n, _ in picks] == [1, 2, 1, 2]


def test_remote_when_host_has_no_node():
    picks = [choose_node(CLUSTER, i, "hostC/1", "hostC") for i in range(6)]
    assert {how for _, how in picks} == {"remote"}
    assert Counter(n.executor_id for n, _ in picks) == {1: 2, 2: 2, 3: 2}


def test_no_nodes():
    with pytest.raises(TFOSError, match="no node to feed"):
        choose_node((), 0, "h/1", "h")


def test_feed_plan_validation_and_repr():
    plan = FeedPlan("c1", KEY, "127.0.0.1", 5000, CLUSTER)
    assert " key=" not in repr(plan) and "(key=" not in repr(plan)
    assert KEY.hex() not in repr(plan) and repr(KEY) not in repr(plan)
    with pytest.raises(TFOSError, match="no chief/master/worker node to feed"):
        FeedPlan("c1", KEY, nodes=())
    with pytest.raises(ValueError, match="bad feed mode 'predict'"):
        FeedPlan("c1", KEY, nodes=CLUSTER, mode="predict")
    with pytest.raises(ValueError, match=r"FeedPlan.feed_timeout_s must be a finite number of seconds > 0, got 0"):
        FeedPlan("c1", KEY, nodes=CLUSTER, feed_timeout_s=0)
    assert FeedPlan("c1", KEY, nodes=CLUSTER).feed_timeout_s == FEED_TIMEOUT_S == 600.0


def test_a_skipped_partition_reads_its_input_to_the_end_within_the_budget(monkeypatch):
    """A feed task that skips its partition (terminate(), main_fun returned) reads and
    drops the rest of its input, so that Spark reuses its Python worker (one that leaves
    input unread exits after the task; skipping the rest of a 60-partition feed after
    terminate() took 9.2 s against 3.1 s to feed it, and 2.1 s with this); a fed partition
    is read by the feed itself; an expensive input is cut off at the budget, and an error
    of the RDD's own code while dropping rows is not raised."""
    import itertools
    import time

    from tfos._data import feed_tasks

    plan = FeedPlan("c1", KEY, "127.0.0.1", 5000, CLUSTER, feed_id="f")
    for outcome, left in (("terminated", 0), ("skipped", 0)):
        monkeypatch.setattr(feed_tasks, "_feed_partition", lambda plan, index, frames, o=outcome: (index, o))
        rows = iter(range(10_000))
        assert list(feed_tasks.make_feed_fn(plan)(3, rows)) == [(3, outcome)]
        assert len(list(rows)) == left, outcome
    monkeypatch.setattr(feed_tasks, "_feed_partition", lambda plan, index, frames: (index, "ok"))
    rows = iter(range(100))
    assert list(feed_tasks.make_feed_fn(plan)(3, rows)) == [(3, "ok")]
    assert len(list(rows)) == 100  # here the fake feed read nothing; the real one reads all

    def slow():
        for i in itertools.count():
            time.sleep(0.001)
            yield i

    t0 = time.monotonic()
    assert feed_tasks._drain(slow(), budget_s=0.2) is False
    assert time.monotonic() - t0 < 5.0

    def corrupt():
        yield 1
        raise ValueError("corrupt record nobody asked for")

    assert feed_tasks._drain(corrupt()) is False
    assert feed_tasks._drain(iter(range(1000))) is True


@pytest.mark.parametrize("mode", ["train", "inference"])
def test_a_refused_retry_of_an_inference_task_names_recomputed_results(monkeypatch, mode):
    """After inference() returned, a lost result partition makes Spark re-run its inference
    task; the refusal said only "after an earlier attempt failed ... trained on again"
    (break helper). For inference it now names that case too."""
    import pyspark

    import tfos._data.feed_link as ft
    from tfos.errors import FeedError

    class _Task:
        def attemptNumber(self):
            return 3

    reports: list = []
    monkeypatch.setattr(pyspark.TaskContext, "get", classmethod(lambda cls: _Task()))
    monkeypatch.setattr(ft, "report", lambda plan, node, msg, *a: reports.append(msg))
    plan = FeedPlan("c1", KEY, "127.0.0.1", 5000, CLUSTER, mode=mode)
    with pytest.raises(FeedError) as info:
        ft.refuse_retry(plan, CLUSTER[0], 2, 0)
    text = str(info.value)
    assert text.startswith(f"partition 2 (epoch 0) -> {CLUSTER[0].name}: Spark retried the feed task (attempt 4)")
    assert ("a result partition was lost with its executor and Spark recomputes it" in text) == (mode == "inference")
    assert reports == [text]


def test_repeated_struct_fields_are_found_at_any_depth():
    from pyspark.sql.types import ArrayType, LongType, MapType, StringType, StructField, StructType

    from tfos._driver.classic import _repeated_struct_fields

    def st(*names):
        return StructType([StructField(n, LongType()) for n in names])

    assert not _repeated_struct_fields(StructType([StructField("id", LongType()), StructField("s", st("a", "b"))]))
    assert not _repeated_struct_fields(st("id", "id"))  # top-level names: renamed for mapInArrow instead
    assert _repeated_struct_fields(StructType([StructField("s", st("a", "a"))]))
    assert _repeated_struct_fields(StructType([StructField("s", ArrayType(st("a", "a")))]))
    assert _repeated_struct_fields(StructType([StructField("m", MapType(StringType(), StructType([StructField("x", st("b", "b"))])))]))
