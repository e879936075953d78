"""The node processes' log handler once the executor log's reader (the JVM) is gone."""

from __future__ import annotations

import logging
import os

from tfos._node.start_task import ExecutorLogHandler


def _dead_pipe_stream():
    r, w = os.pipe()
    os.close(r)  # the executor JVM, which read this pipe, died
    return os.fdopen(w, "w", buffering=1, encoding="utf-8")


def _logger(name: str, handler: logging.Handler) -> logging.Logger:
    log = logging.getLogger(name)
    log.handlers[:] = [handler]
    log.propagate = False
    log.setLevel(logging.INFO)
    return log


def test_plain_stream_handler_prints_a_logging_error_on_a_dead_pipe(capfd):
    # The behaviour being fixed: two tracebacks on stderr, which the TF process forwards
    # to the driver next to the real failure.
    stream = _dead_pipe_stream()
    _logger("tfos-test-plain", logging.StreamHandler(stream)).error("tfos node %s failed", "worker:1")
    err = capfd.readouterr().err
    assert "--- Logging error ---" in err
    assert "BrokenPipeError" in err


def test_executor_log_handler_drops_records_quietly_and_counts_them(capfd):
    stream = _dead_pipe_stream()
    handler = ExecutorLogHandler(stream)
    log = _logger("tfos-test-executor-log", handler)
    log.error("tfos node %s failed", "worker:1")
    log.warning("second record")
    assert capfd.readouterr().err == ""
    assert handler.dropped == 2


def test_executor_log_handler_still_reports_other_errors(capfd):
    r, w = os.pipe()
    try:
        stream = os.fdopen(w, "w", buffering=1, encoding="utf-8")
        handler = ExecutorLogHandler(stream)
        _logger("tfos-test-executor-log-bad", handler).error("%d rows", "not a number")
        err = capfd.readouterr().err
        assert "--- Logging error ---" in err
        assert "TypeError" in err
        assert handler.dropped == 0
        stream.close()
    finally:
        os.close(r)


def test_executor_log_handler_writes_while_the_reader_lives():
    r, w = os.pipe()
    stream = os.fdopen(w, "w", buffering=1, encoding="utf-8")
    handler = ExecutorLogHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    _logger("tfos-test-executor-log-live", handler).info("fed %d rows", 25000)
    stream.close()
    with os.fdopen(r, "rb") as f:
        assert f.read() == b"INFO fed 25000 rows\n"
    assert handler.dropped == 0
