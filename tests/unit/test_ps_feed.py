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
