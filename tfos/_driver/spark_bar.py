"""Spark's console progress bar, off while a tfos cluster lives (driver).

Spark draws its stage bar (``spark.ui.showConsoleProgress=true``, which ``pyspark`` and
``spark-submit`` turn on when the log level is WARN) on the driver JVM's stderr as a line
without a newline, redrawn after a carriage return every 200 ms: ``\\r[Stage 3:=>  (1 + 2) / 4]\\r``.
A tfos cluster keeps a Spark job running for its whole life (the node tasks), so that bar
would be drawn the whole time, between the nodes' forwarded lines: on a terminal a node line
would land on the end of the bar's line, and in a file or a pipe (a CI log, ``| tee``) every
node line written after a bar frame ends up on the same line as that frame
(``[Stage 10:==>  (11 + 2) / 15][chief:0] 47/47 ...``).

So while at least one tfos cluster of a SparkContext is open, Spark's bar is off: the
SparkContext's ``ConsoleProgressBar`` is stopped and detached (Spark checks for none before
each use), tfos shows its own progress bar during ``train()`` and ``inference()`` (on a
terminal; elsewhere whole lines every 10 s), and, when the bar had drawn and stderr is not a
terminal, a newline ends the bar's last frame so the next line starts on a line of its own.
When the last cluster is torn down and no stage of its Spark jobs is active any more (the
tasks of a cancelled feed job can run on for seconds after a failure), a new
``ConsoleProgressBar`` is attached, as Spark made it; until then a watcher thread polls
(every 0.5 s, at most :data:`RESUME_WAIT_S`, after which the bar stays off), and a stopped
SparkContext gets none.
When the JVM refuses (another Spark version's internals), Spark's bar stays and tfos falls
back to showing none of its own, erasing the bar's line before node lines on a terminal
(:func:`tfos._node.output.note_spark_bar`). See docs/api.md "Node output".
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable

from tfos._node.output import spark_shows_progress as _conf_on

__all__ = ["pause", "resume", "showing"]

log = logging.getLogger(__name__)

_lock = threading.Lock()
#: id(SparkContext) -> open clusters that paused its bar.
_paused: dict[int, int] = {}
#: id(SparkContext) -> the closed clusters' "a stage of my jobs is still active" checks.
_running: dict[int, list] = {}
#: Longest wait, in seconds, for a torn-down cluster's Spark stages to end before the bar
#: comes back; past it the bar stays off (never glued to the lines of tasks still running).
RESUME_WAIT_S = 600.0
POLL_S = 0.5


def _field(sc: Any, cls_name: str, name: str) -> Any:
    jcls = sc._jvm.java.lang.Class.forName(cls_name)
    field = jcls.getDeclaredField(name)
    field.setAccessible(True)
    return field


def _stderr_is_terminal() -> bool:
    try:
        return os.isatty(2)  # the driver JVM's stderr: PySpark starts it with the program's descriptors
    except OSError:
        return False


def _detach(sc: Any) -> None:
    """Stops and detaches the SparkContext's console bar; ends its last frame with a newline
    when stderr is not a terminal and the bar drew (py4j calls; raises what py4j raises)."""
    jsc = sc._jsc.sc()
    current = jsc.progressBar()
    if not current.isDefined():
        return
    bar = current.get()
    try:
        drew = int(_field(sc, "org.apache.spark.ui.ConsoleProgressBar", "lastUpdateTime").get(bar)) > 0
    except Exception:  # noqa: BLE001 - another Spark's fields: assume it drew
        drew = True
    bar.stop()
    bar.clear()
    _field(sc, "org.apache.spark.SparkContext", "_progressBar").set(jsc, sc._jvm.scala.Option.apply(None))
    if drew and not _stderr_is_terminal():
        err = sc._jvm.java.lang.System.err
        err.println()
        err.flush()


def pause(sc: Any) -> None:
    """Turns Spark's console bar off for one more open cluster of ``sc`` (driver, at ``run()``).

    Does nothing when the bar is not on (``spark.ui.showConsoleProgress``) or ``sc`` is not
    a classic SparkContext; when the JVM refuses, logs at DEBUG and leaves the bar on
    (:func:`showing` then stays True).
    """
    if not _conf_on(sc) or getattr(sc, "_jsc", None) is None:
        return
    with _lock:
        key = id(sc)
        if _paused.get(key):
            _paused[key] += 1
            return
        try:
            _detach(sc)
        except Exception as exc:  # noqa: BLE001 - py4j errors: keep Spark's bar, tfos shows none
            log.debug("could not turn Spark's console progress bar off: %s", exc)
            return
        _paused[key] = 1


def resume(sc: Any, running: Callable[[], bool] = lambda: False) -> None:
    """Ends one open cluster's pause (driver, after the cluster's teardown). When it was the
    last, a new Spark console bar is attached once no closed cluster's job of ``sc`` has an
    active stage any more (``running()`` False for each), by a watcher thread when one still
    has (at most :data:`RESUME_WAIT_S`). Best effort: a stopped SparkContext gets none.

    Args:
        sc: The SparkContext.
        running: True while a stage of this cluster's Spark jobs is active (its tasks
            still run, e.g. cancelled feed tasks); must not raise.
    """
    with _lock:
        key = id(sc)
        if not _paused.get(key):
            return
        _paused[key] -= 1
        _running.setdefault(key, []).append(running)
        if _paused[key]:
            return
        del _paused[key]
        if not _busy(key):
            _running.pop(key, None)
            _attach(sc)
            return
    threading.Thread(target=_attach_when_idle, args=(sc, key), name="tfos-spark-bar", daemon=True).start()


def _busy(key: int) -> bool:
    checks = _running.get(key, [])
    checks[:] = [c for c in checks if c()]
    return bool(checks)


def _attach_when_idle(sc: Any, key: int) -> None:
    deadline = time.monotonic() + RESUME_WAIT_S
    while time.monotonic() < deadline:
        time.sleep(POLL_S)
        with _lock:
            if _paused.get(key):  # a new cluster paused it again: its own resume decides
                return
            if _stopped(sc):
                _running.pop(key, None)
                return
            if not _busy(key):
                _running.pop(key, None)
                _attach(sc)
                return
    with _lock:
        _running.pop(key, None)
    log.debug("Spark's console progress bar stays off: stages of a tfos job still active after %g s", RESUME_WAIT_S)


def _stopped(sc: Any) -> bool:
    try:
        return bool(sc._jsc.sc().isStopped())
    except Exception:  # noqa: BLE001 - a gateway gone: as good as stopped
        return True


def _attach(sc: Any) -> None:
    """Attaches a new ConsoleProgressBar unless the context is stopped or has one (lock held)."""
    try:
        jsc = sc._jsc.sc()
        if jsc.isStopped() or jsc.progressBar().isDefined():
            return
        bar = sc._jvm.org.apache.spark.ui.ConsoleProgressBar(jsc)
        _field(sc, "org.apache.spark.SparkContext", "_progressBar").set(jsc, sc._jvm.scala.Some(bar))
    except Exception as exc:  # noqa: BLE001 - a stopped context or gateway: nothing to draw on
        log.debug("could not turn Spark's console progress bar back on: %s", exc)


def showing(sc: Any) -> bool:
    """Whether Spark draws its console bar now (driver): on in the configuration and not
    paused by an open tfos cluster. tfos shows its own bar only when this is False."""
    with _lock:
        paused = bool(_paused.get(id(sc)))
    return _conf_on(sc) and not paused
