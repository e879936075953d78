"""tfos chains its teardown to SIGTERM only where nobody else handles it, while a cluster is
open (tfos._driver.open_clusters; docs/reliability.md)."""

from __future__ import annotations

import signal
import threading

import pytest

import tfos._driver.runtime as rt
from fake_backends import FakeLauncher, default_sigterm, plan  # noqa: F401 - default_sigterm: autouse
from tfos._common.deadline import Deadline
from tfos._driver import open_clusters
from tfos._driver.lifecycle import Controller, Lifecycle


def _controller(max_restarts: int = 1) -> Controller:
    return Controller(FakeLauncher(plan()), max_restarts)


def test_sigterm_handler_lives_while_a_cluster_is_open_even_between_attempts(caplog):
    """max_restarts: between attempts no attempt runs, but the cluster is open: SIGTERM
    then must still log and raise SystemExit(143), not kill the driver by default (found
    by a restart chaos run)."""
    ctl = _controller(max_restarts=1)
    ctl.start()
    assert signal.getsignal(signal.SIGTERM) is open_clusters._on_sigterm
    ctl.state = Lifecycle.RESTARTING  # as while the next attempt forms
    with caplog.at_level("ERROR", logger="tfos._driver"), pytest.raises(SystemExit) as info:
        open_clusters._on_sigterm(signal.SIGTERM, None)
    assert info.value.code == 143 and "tfos-fake (between attempts)" in caplog.text
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # a second SIGTERM ends the driver at once
    ctl.state = Lifecycle.RUNNING
    open_clusters.install_sigterm(True)
    ctl.shutdown(Deadline(30.0, "shutdown"), 0.0)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the last cluster closed: removed


def test_a_user_handler_is_never_replaced_and_nothing_off_the_main_thread():
    def mine(signum, frame):
        pass

    signal.signal(signal.SIGTERM, mine)
    open_clusters.install_sigterm(True)
    assert signal.getsignal(signal.SIGTERM) is mine
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    open_clusters.install_sigterm(False)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    t = threading.Thread(target=open_clusters.install_sigterm, args=(True,))
    t.start()
    t.join()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_spark_error_text_keeps_sparks_reason_after_py4js_first_line():
    text = ("An error occurred while calling z:org.apache.spark.api.python.PythonRDD.collectAndServe.\n"
            ": org.apache.spark.SparkException: Job aborted due to stage failure: Task 1 in stage 0.0 failed 1 times, "
            "most recent failure: Lost task 1.0 in stage 0.0 (TID 1) (127.0.0.1 executor 1): ExecutorLostFailure "
            "(executor 1 exited caused by one of the running tasks) Reason: Command exited with code 137\n"
            "\tat org.apache.spark.scheduler.DAGScheduler.failJobAndIndependentStages(DAGScheduler.scala:2935)\n")
    got = rt.spark_error_text(RuntimeError(text))
    assert got.startswith("org.apache.spark.SparkException: Job aborted") or got.startswith(": org.apache.spark.SparkException")
    assert "ExecutorLostFailure (executor 1 exited" in got and "127.0.0.1 executor 1" in got
    assert rt.spark_error_text(RuntimeError("plain first line\nsecond")) == "plain first line"
