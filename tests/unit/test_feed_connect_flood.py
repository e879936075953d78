"""A feed task that cannot open its data connection to a running node names the node's data
port and a flood or a firewall as the likely cause (docs/reliability.md "Floods")."""

import types

import pytest

from tfos._data import feed_link
from tfos.errors import FeedError


class _Once:
    def __init__(self, *args):
        self.n = 0

    def expired(self):
        self.n += 1
        return self.n > 1


def _plan_node(monkeypatch, state):
    reports = []

    class _Client:
        def call(self, msg, timeout_s):
            return dict(state)

        def close(self):
            pass

    monkeypatch.setattr(feed_link, "driver_client", lambda plan: _Client())
    monkeypatch.setattr(feed_link, "Deadline", _Once)
    monkeypatch.setattr(feed_link, "report", lambda plan, node, msg, *a: reports.append(msg))
    plan = types.SimpleNamespace(qname="input")
    node = types.SimpleNamespace(executor_id=1, host="10.0.0.7", data_port=41234, name="worker:1 (executor 1, host 10.0.0.7)")
    return plan, node, reports


def test_connect_timeout_to_a_running_node_names_its_port_and_a_flood(monkeypatch):
    plan, node, reports = _plan_node(monkeypatch, {"state": "running"})
    with pytest.raises(FeedError) as ei:
        feed_link.node_gone(plan, node, "partition 3 (epoch 0) -> worker:1", TimeoutError("timed out"), connecting=True)
    text = str(ei.value)
    assert text.startswith("could not open a data connection for partition 3 (epoch 0) -> worker:1 at 10.0.0.7:41234")
    assert "TimeoutError: timed out" in text and "flood" in text and "spark.authenticate" in text
    assert reports == [text]


def test_a_failed_node_keeps_its_own_failure_as_the_cause(monkeypatch):
    plan, node, _ = _plan_node(monkeypatch, {"state": "failed", "failure": "RuntimeError: boom in main_fun"})
    with pytest.raises(FeedError) as ei:
        feed_link.node_gone(plan, node, "partition 3 (epoch 0) -> worker:1", ConnectionRefusedError(111, "refused"), connecting=True)
    assert str(ei.value) == "lost the data connection while feeding partition 3 (epoch 0) -> worker:1: RuntimeError: boom in main_fun"
