"""The clusters open in this process, and what SIGTERM and interpreter exit do to them (driver).

A cluster's controller (:mod:`tfos._driver.lifecycle`) is open from the moment ``run()``
starts forming it until its teardown after closed or failed ended, so a cluster between two
attempts (restarting) stays open. While any is open, tfos's SIGTERM handler is installed
(only over SIGTERM's default disposition; see :func:`install_sigterm`), and interpreter exit
tears down whatever is still open.
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
    """Interpreter exit with clusters still open: tear them down, bounded (driver)."""
    for controller in OPEN.snapshot():
        try:
            controller.at_exit()
        except Exception as exc:  # noqa: BLE001 - best effort at exit
            log.warning("teardown of %s at exit failed: %s", controller.cluster_id, exc)
