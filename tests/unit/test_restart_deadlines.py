"""A restart never waits past the caller's own deadline (shutdown(timeout=...)): found by a
chaos run where a foreign job held the slots during a restart and shutdown(timeout=8)
raised only after 95 s."""

from __future__ import annotations

import time

import tfos._driver.classic as at
from tfos._common.deadline import Deadline
from tfos._driver.backend import ClusterPlan
from tfos.cluster_template import InputMode


class _Sc:
    master = "local-cluster[2,1,1024]"


def _launcher(executor_wait_s: float = 60.0) -> at.ClassicLauncher:
    launcher = object.__new__(at.ClassicLauncher)  # no SparkContext: the Spark checks are not the point
    launcher.sc, launcher.spark_ids = _Sc(), (0, 1)
    launcher.plan = ClusterPlan("tfos-x", {}, (), InputMode.SPARK, b"", executor_wait_s=executor_wait_s)
    return launcher


def test_waiting_for_replacement_executors_stops_at_the_outer_deadline(monkeypatch):
    calls = []
    monkeypatch.setattr(at, "live_executors", lambda sc: calls.append(1) or 1)  # one executor short, forever
    t0 = time.monotonic()
    _launcher().await_executors(Deadline(0.6, "shutdown()"))
    took = time.monotonic() - t0
    assert took < 30.0, took  # not executor_wait_s = 60 s (a bound, loose for a loaded machine)
    assert len(calls) >= 2


def test_without_an_outer_deadline_the_executor_wait_is_its_own(monkeypatch):
    monkeypatch.setattr(at, "live_executors", lambda sc: 1)
    t0 = time.monotonic()
    _launcher(executor_wait_s=0.4).await_executors(None)
    assert time.monotonic() - t0 < 30.0
