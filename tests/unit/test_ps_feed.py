"""InputMode.SPARK under ParameterServerStrategy: who is fed, and a worker's rows trained."""

from __future__ import annotations

import pytest

from tfos._data.figures import NodeFigures
from tfos._data.row_count import RowCount
from tfos._driver.backend import fed_nodes
from tfos.cluster_template import NodeInfo
from tfos.errors import ConfigurationError


def _nodes(*jobs):
    index: dict = {}
    out = []
    for eid, job in enumerate(jobs):
        out.append(NodeInfo(eid, job, index.setdefault(job, 0), "127.0.0.1", 2000 + eid))
        index[job] += 1
    return out


def test_the_coordinating_chief_is_not_fed_and_its_share_goes_to_the_workers():
    nodes = _nodes("ps", "ps", "chief", "worker", "worker")
    assert [n.job_name for n in fed_nodes(nodes)] == ["chief", "worker", "worker"]  # TFoS: the chief reads its feed
    assert [(n.job_name, n.task_index) for n in fed_nodes(nodes, feed_chief=False)] == [("worker", 0), ("worker", 1)]
    assert [n.job_name for n in fed_nodes(_nodes("ps", "master", "worker"), feed_chief=False)] == ["master", "worker"]
    with pytest.raises(ConfigurationError, match="feed_chief=False"):
        fed_nodes(_nodes("ps", "chief"), feed_chief=False)


def test_a_workers_rows_trained_counted_in_python_close_each_epoch():
    figures = NodeFigures()
    rows = RowCount(figures)
    rows.enable()
    rows.count_in_python()
    rows.handed("f", 0, 64)
    rows.handed("f", 0, 64)
    rows.add_trained(64)
    rows.handed("f", 1, 64)  # epoch 0 closes: 64 of its 128 rows trained so far
    rows.add_trained(128)
    rows.close()
    snap = figures.snapshot()
    assert snap["rows_fed/f/0"] == 128 and snap["rows_trained/f/0"] == 64 and snap["rows_gap/f/0"] == 64
    assert snap["rows_trained/f/1"] == 128 and snap["rows_gap/f/1"] == 0 and snap["rows_trained"] == 192


class _Hub:
    node_name = "chief:0 (executor 2, host h)"

    def __init__(self, queued):
        import queue

        self.queues = {"input": queue.Queue()}
        for _ in range(queued):
            self.queues["input"].put(object())


class _Feed:
    qname_in = "input"

    def __init__(self, queued):
        self._hub, self.done_feeding, self.terminated = _Hub(queued), False, 0

    def terminate(self):
        self.terminated += 1
        self.done_feeding = True


def test_a_chief_fed_by_mistake_is_named_and_its_feed_ended(caplog):
    """train() without feed_chief=False under a coordinating chief: its partitions wait unread;
    at the fit's end the chief says so (WARNING naming it and the setting) and ends its feed,
    so train() does not wait feed_timeout for it."""
    import logging

    from tfos._node import ps_feed

    quiet, fed = _Feed(0), _Feed(2)
    with caplog.at_level(logging.WARNING, logger="tfos._node.ps_feed"):
        ps_feed._end_chief_feed(quiet)
        assert quiet.terminated == 1 and not caplog.records
        ps_feed._end_chief_feed(fed)
    assert fed.terminated == 1
    (record,) = caplog.records
    assert "chief:0 (executor 2, host h)" in record.getMessage() and "feed_chief=False" in record.getMessage()
    ps_feed._end_chief_feed(fed)  # idempotent: already ended
    assert fed.terminated == 1


def test_per_epoch_is_refused_in_a_fit_over_the_workers_feeds():
    from tfos._data import worker_feeds

    state = type("S", (), {"fed": False, "chief_feed": None})()
    with worker_feeds.building(state):
        assert worker_feeds.building_state() is state
        with pytest.raises(ValueError, match="steps_per_epoch"):
            worker_feeds.workers_dataset(_Feed(0), 64, None, True)
    assert worker_feeds.building_state() is None and not state.fed
