"""A restart never waits past the caller's own deadline (shutdown(timeout=...)): found by a
chaos run where a foreign job held the slots during a restart and shutdown(timeout=8)
raised only after 95 s."""

from __future__ import annotations

import time

import tfos._driver.attempts as at
from tfos._common.deadline import Deadline


class _Sc:
    master = "local-cluster[2,1,1024]"


def _launcher(**kw):
    base = dict(sc=_Sc(), base_id="tfos-x", roles=(), template={}, spark_ids=(0, 1), input_mode=at.InputMode.SPARK,
                payload=b"", executor_wait_s=60.0, reservation_timeout_s=600.0)
    base.update(kw)
    return at._Launcher(**base)


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
    _launcher(executor_wait_s=0.4).await_executors()
    assert time.monotonic() - t0 < 30.0
