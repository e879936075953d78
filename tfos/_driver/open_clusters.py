"""The clusters open in this process, and what SIGTERM and interpreter exit do to them (driver).

A cluster's controller (:mod:`tfos._driver.lifecycle`) is open from the moment ``run()``
starts forming it until its teardown after closed or failed ended, so a cluster between two
attempts (restarting) stays open. While any is open, tfos's SIGTERM handler is installed
(only over SIGTERM's default disposition; see :func:`install_sigterm`), and interpreter exit
tears down whatever is still open.

Then, at interpreter exit, the SparkContexts a tfos cluster ran on with a
``local-cluster[...]`` master are stopped unless the program stopped them. Without it the
driver JVM's shutdown hooks kill the executors of the Workers it hosts before the
SparkContext's own stop hook ends the application, so the Master relaunches executors
during the JVM's shutdown and each relaunch fails: hundreds of ``ERROR Worker: Failed to
launch executor ... Shutdown hooks cannot be modified during shutdown`` lines and ``ERROR
Master: Application ... failed N times; removing it`` after the program's own traceback
(plain PySpark does the same on local-cluster). Stopping the context first is what Spark's
stop hook would do, only earlier; other masters' executors run in processes of their own
and are left to Spark (docs/reliability.md "Interpreter exit").
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
from typing import Any, Protocol

__all__ = ["OPEN", "any_open", "install_sigterm"]

log = logging.getLogger(__name__)


class _Controller(Protocol):
    @property
    def cluster_id(self) -> str: ...

    @property
    def state(self) -> Any: ...

    def at_exit(self) -> None: ...


class _OpenClusters:
    """The controllers of this process whose cluster is not yet torn down (driver)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.controllers: dict[int, _Controller] = {}
        #: id(SparkContext) -> the SparkContexts tfos clusters ran on.
        self.contexts: dict[int, Any] = {}
        #: True while tfos's SIGTERM handler is installed.
        self.sigterm_installed = False

    def add(self, controller: _Controller) -> None:
        with self.lock:
            self.controllers[id(controller)] = controller

    def discard(self, controller: _Controller) -> None:
        with self.lock:
            self.controllers.pop(id(controller), None)
            empty = not self.controllers
        if empty and threading.current_thread() is threading.main_thread():
            _remove_sigterm()

    def note_context(self, sc: Any) -> None:
        """Remembers the SparkContext a cluster runs on (for :func:`_teardown_at_exit`)."""
        with self.lock:
            self.contexts[id(sc)] = sc

    def snapshot(self) -> list[_Controller]:
        with self.lock:
            return list(self.controllers.values())


OPEN = _OpenClusters()


def any_open() -> bool:
    """True while a cluster of this process is open (forming, running, restarting, shutting
    down, or still being torn down)."""
    return bool(OPEN.snapshot())


def _on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM handler installed by :func:`install_sigterm` (driver main thread)."""
    open_now = OPEN.snapshot()
    if not open_now:  # every cluster is gone: behave as if tfos had never been here
        _remove_sigterm()
        os.kill(os.getpid(), signal.SIGTERM)
        return
    ids = [c.cluster_id + (" (between attempts)" if c.state.value == "restarting" else "") for c in open_now]
    log.error("tfos: the driver received SIGTERM; tearing down cluster(s) %s as for Ctrl-C, then exiting", ", ".join(ids))
    _remove_sigterm()  # a second SIGTERM ends the driver at once
    raise SystemExit(128 + signal.SIGTERM)


def install_sigterm(enabled: bool) -> None:
    """Chains the cluster teardown to SIGTERM, only where nobody else handles it (driver).

    Installed only when ``enabled``, in the main thread, and when SIGTERM still has its
    default disposition (the user and their framework did not install a handler), and
    removed again when the last cluster is torn down. The handler raises ``SystemExit``
    in the main thread, which runs the same teardown as Ctrl-C (the controller's handling
    of an interrupted call, the context manager, or the interpreter-exit hook).
    """
    if not enabled or threading.current_thread() is not threading.main_thread():
        return
    with OPEN.lock:
        if OPEN.sigterm_installed or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return
        signal.signal(signal.SIGTERM, _on_sigterm)
        OPEN.sigterm_installed = True


def _remove_sigterm() -> None:
    with OPEN.lock:
        if OPEN.sigterm_installed and signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        OPEN.sigterm_installed = False


@atexit.register
def _teardown_at_exit() -> None:
    """Interpreter exit: tears down the clusters still open, bounded, then stops the
    local-cluster SparkContexts they ran on (driver)."""
    for controller in OPEN.snapshot():
        try:
            controller.at_exit()
        except Exception as exc:  # noqa: BLE001 - best effort at exit
            log.warning("teardown of %s at exit failed: %s", controller.cluster_id, exc)
    _stop_local_cluster_contexts()


def _stop_local_cluster_contexts() -> None:
    """Stops the ``local-cluster[...]`` SparkContexts tfos clusters ran on that are still
    running, before the JVM's shutdown hooks kill their executors (driver, interpreter exit;
    see the module docstring)."""
    with OPEN.lock:
        contexts = list(OPEN.contexts.values())
        OPEN.contexts.clear()
    for sc in contexts:
        try:
            if not str(sc.master).startswith("local-cluster") or sc._jsc is None or sc._jsc.sc().isStopped():
                continue
            sc.stop()
        except Exception as exc:  # noqa: BLE001 - best effort at exit: the JVM's hook stops it then
            log.debug("could not stop the SparkContext at interpreter exit: %s", exc)
