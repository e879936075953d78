"""tfos chains its teardown to SIGTERM only where nobody else handles it (issue 10, C23)."""

from __future__ import annotations

import signal
import threading

import pytest

import tfos._driver.runtime as cl


@pytest.fixture
def default_sigterm():
    old = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    cl._sigterm_installed = False
    yield
    signal.signal(signal.SIGTERM, old)
    cl._sigterm_installed = False


class _FakeCluster:
    cluster_id = "tfos-fake"


def test_installed_only_over_the_default_and_removed_with_the_last_cluster(default_sigterm):
    fake = _FakeCluster()
    cl._open_clusters.add(fake)  # type: ignore[arg-type]
    cl.install_sigterm(True)
    assert signal.getsignal(signal.SIGTERM) is cl._on_sigterm
    with pytest.raises(SystemExit) as ei:
        cl._on_sigterm(signal.SIGTERM, None)
    assert ei.value.code == 143
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # a second SIGTERM ends the driver at once
    cl.install_sigterm(True)
    cl._forget(fake)  # type: ignore[arg-type]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_user_handler_is_never_replaced(default_sigterm):
    def mine(signum, frame):
        pass

    signal.signal(signal.SIGTERM, mine)
    cl.install_sigterm(True)
    assert signal.getsignal(signal.SIGTERM) is mine


def test_not_installed_when_disabled_or_off_the_main_thread(default_sigterm):
    cl.install_sigterm(False)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    t = threading.Thread(target=cl.install_sigterm, args=(True,))
    t.start()
    t.join()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_sigterm_between_two_attempts_still_ends_the_driver_as_ctrl_c(default_sigterm, caplog):
    """max_restarts: the failed attempt's teardown forgets its runtime (no cluster open) while
    the driver waits for a replacement executor; SIGTERM then must still log and raise
    SystemExit(143), not kill the driver with the default disposition (a bug found by a
    restart chaos run)."""
    fake = _FakeCluster()
    cl._open_clusters.add(fake)  # type: ignore[arg-type]
    cl.install_sigterm(True)
    cl.restarting("tfos-base", True, True)
    try:
        cl._forget(fake)  # the failed attempt's teardown
        assert signal.getsignal(signal.SIGTERM) is cl._on_sigterm  # kept between attempts
        with caplog.at_level("ERROR", logger="tfos.cluster"), pytest.raises(SystemExit) as ei:
            cl._on_sigterm(signal.SIGTERM, None)
        assert ei.value.code == 143
        assert "tfos-base (between attempts)" in caplog.text
    finally:
        cl.restarting("tfos-base", False, True)
    assert not cl._restarting
    cl.install_sigterm(True)
    cl.restarting("tfos-other", True, True)
    cl.restarting("tfos-other", False, True)  # no attempt open any more: the default again
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_restart_reinstalls_a_handler_the_teardown_removed(default_sigterm):
    cl.restarting("tfos-base", True, True)
    try:
        assert signal.getsignal(signal.SIGTERM) is cl._on_sigterm
    finally:
        cl.restarting("tfos-base", False, True)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_spark_error_text_keeps_sparks_reason_after_py4js_first_line():
    text = ("An error occurred while calling z:org.apache.spark.api.python.PythonRDD.collectAndServe.\n"
            ": org.apache.spark.SparkException: Job aborted due to stage failure: Task 1 in stage 0.0 failed 1 times, "
            "most recent failure: Lost task 1.0 in stage 0.0 (TID 1) (127.0.0.1 executor 1): ExecutorLostFailure "
            "(executor 1 exited caused by one of the running tasks) Reason: Command exited with code 137\n"
            "\tat org.apache.spark.scheduler.DAGScheduler.failJobAndIndependentStages(DAGScheduler.scala:2935)\n")
    got = cl.spark_error_text(RuntimeError(text))
    assert got.startswith("org.apache.spark.SparkException: Job aborted") or got.startswith(": org.apache.spark.SparkException")
    assert "ExecutorLostFailure (executor 1 exited" in got and "127.0.0.1 executor 1" in got
    assert cl.spark_error_text(RuntimeError("plain first line\nsecond")) == "plain first line"
