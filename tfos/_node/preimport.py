"""Start-up imports of a fed node, in the background while it registers (TF process)."""

from __future__ import annotations

import logging
import threading
from typing import Optional

__all__ = ["FEED_MODULES", "PREIMPORT_WAIT_S", "await_preimport", "preimport_async"]

log = logging.getLogger(__name__)

#: Modules decoding the first fed chunk imports (numpy for pickled batches, pyarrow for Arrow
#: chunks of DataFrame feeds); a fed node imports them in the background during start-up,
#: so the first chunk does not wait.
FEED_MODULES = ("numpy", "pyarrow")

#: Longest wait, in seconds, for the start-up imports to finish before ``main_fun`` starts.
PREIMPORT_WAIT_S = 60.0


def preimport_async(modules: tuple[str, ...], node_name: str) -> threading.Thread:
    """Imports ``modules`` in a daemon thread while the node registers (TF process).

    Overlaps the imports with registration and the wait for the full cluster, so the first
    ``next_batch``/``as_dataset`` does not pay for them (pyarrow: about 0.3 s of CPU cold and
    +27 MB RSS, see docs/performance.md). A module that is not installed is skipped (the
    feed of such an input fails later with its own error); a failing import is logged.
    Returns the thread; ``await_preimport`` joins it before ``main_fun`` starts.
    """
    import importlib
    import importlib.util

    def _run() -> None:
        for name in modules:
            try:
                if importlib.util.find_spec(name) is not None:
                    importlib.import_module(name)
            except Exception as exc:  # noqa: BLE001 - only a head start; decoding imports again
                log.debug("tfos node %s: pre-import of %s failed: %s", node_name, name, exc)

    thread = threading.Thread(target=_run, name="tfos-preimport", daemon=True)
    thread.start()
    return thread


def await_preimport(thread: Optional[threading.Thread], node_name: str, timeout_s: float = PREIMPORT_WAIT_S) -> None:
    """Waits at most ``timeout_s`` for the start-up imports to finish (TF process).

    Importing numpy or pyarrow calls the C library's ``setenv``, which may move the process's
    ``environ`` array. A ``main_fun`` (or the TensorBoard start) that starts a subprocess
    (``subprocess.Popen`` without ``env=``: vfork, then ``execv`` with ``environ``) in the same
    moment could hand the kernel the freed array and fail with ``OSError: [Errno 14] Bad
    address``; seen once in a stress run. So the imports end once the cluster is complete,
    before any subprocess or user code starts. If they take longer than ``timeout_s``, this
    logs a warning and the node goes on.
    """
    if thread is None:
        return
    thread.join(timeout_s)
    if thread.is_alive():
        log.warning("tfos node %s: start-up imports of %s still running after %.0f s; starting main_fun anyway",
                    node_name, ", ".join(FEED_MODULES), timeout_s)
