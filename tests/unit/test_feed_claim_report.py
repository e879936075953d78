"""A feed task that cannot record its partition with the driver (the control port flooded,
say) reports that cause to the driver before failing, so the driver's error names it and not
only Spark's refused retry of the task (attacker trial, session 17)."""
from __future__ import annotations

import pytest

from tfos._data import feed_link
from tfos._data.feed_plan import FeedPlan
from tfos.cluster_template import NodeInfo
from tfos.errors import FeedError


def test_claim_failure_is_reported_with_its_cause(monkeypatch):
    node = NodeInfo(1, "worker", 0, "10.0.0.2", 2222, 3333, 42, "10.0.0.2/1")
    plan = FeedPlan("tfos-unit-claim", b"k" * 32, "10.0.0.1", 4000, (node,), "input", "train", None, feed_id="f1")
    reported = []

    def no_driver(plan):
        raise TimeoutError("timed out after 10 s waiting for a connection to the tfos driver at 10.0.0.1:4000")

    monkeypatch.setattr(feed_link, "driver_client", no_driver)
    monkeypatch.setattr(feed_link, "report", lambda plan, node, msg, error_type="FeedError": reported.append((node.name, msg, error_type)))
    where = "partition 9 (epoch 0) -> " + node.name
    with pytest.raises(FeedError) as info:
        feed_link.claim(plan, node, 9, where)
    expected = (f"{where}: could not record the partition with the tfos driver: timed out after 10 s waiting for a "
                "connection to the tfos driver at 10.0.0.1:4000")
    assert str(info.value) == expected
    assert reported == [(node.name, expected, "FeedError")]
