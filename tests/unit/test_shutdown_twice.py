"""A second shutdown() does nothing (docs/api.md): inside `with TFCluster.run(...)` the
exit's own shutdown() neither waits again nor logs the summary line twice."""

import logging
from types import SimpleNamespace

from tfos._driver import cluster as cluster_mod
from tfos._driver.cluster import TFCluster


class _Ctl:
    def __init__(self):
        self.calls = 0
        self.launcher = SimpleNamespace(sc=None, spark=None, working_dir="/tmp", streams=[])
        self.plan = SimpleNamespace(input_mode=0, roles=[], template={}, settings=SimpleNamespace(queues=[]), progress=None)
        self.backend = SimpleNamespace(config=SimpleNamespace(default_fs="file://"), runtime=SimpleNamespace(monitor=object()))
        self.cluster_id = "c1"

    def shutdown(self, deadline, grace_s):
        self.calls += 1


def test_shutdown_inside_with_logs_the_summary_once(monkeypatch, caplog):
    monkeypatch.setattr(cluster_mod, "summary_text", lambda s: "tfos cluster c1 summary: 2 nodes")
    monkeypatch.setattr(TFCluster, "summary", lambda self: {})
    ctl = _Ctl()
    caplog.set_level(logging.INFO, logger=cluster_mod.__name__)
    with TFCluster(ctl) as cluster:
        cluster.shutdown()
    cluster.shutdown()
    assert ctl.calls == 1
    assert [r.getMessage() for r in caplog.records].count("tfos cluster c1 summary: 2 nodes") == 1
