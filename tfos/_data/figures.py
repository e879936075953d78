"""A node's live figures: counters the TF process keeps for the driver (TF process side).

The feed and Keras's patched trainer add to them; the TF process's control thread sends a
snapshot with every long-poll (:class:`tfos._control.messages.WaitEvent`'s ``counters``),
so the driver holds each node's figures at most one poll old. Names are flat strings and
values integers (rows, steps, milliseconds, bytes: the unit is in the name), so they cross
the control channel as JSON unchanged. See docs/architecture.md, "Control plane".
"""

from __future__ import annotations

import threading
import time
from typing import Any, Optional

from tfos._common.admission import DATA_FLOOD


class NodeFigures:
    """Thread-safe integer counters of one TF process (TF process).

    Writers are ``main_fun``'s threads (the feed, the Keras trainer); the reader is the
    control thread. Every call takes one lock for a dictionary update: cheap next to a
    batch of rows or a training step.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, int] = {}

    def add(self, name: str, amount: int = 1) -> None:
        """Adds ``amount`` to counter ``name`` (created at 0)."""
        with self._lock:
            self._values[name] = self._values.get(name, 0) + int(amount)

    def set(self, name: str, value: int) -> None:
        """Sets counter ``name`` to ``value``."""
        with self._lock:
            self._values[name] = int(value)

    def get(self, name: str, default: int = 0) -> int:
        """Counter ``name``, or ``default`` when it was never set."""
        with self._lock:
            return self._values.get(name, default)

    def wait_begin(self, name: str) -> None:
        """Marks the start of a wait: ``<name>_since_ms`` = now (monotonic ms), so the
        driver sees a wait that never ends (a feed that stopped) as it grows."""
        now = int(time.monotonic() * 1000)
        with self._lock:
            self._values[name + "_since_ms"] = now

    def wait_end(self, name: str) -> None:
        """Ends the wait :meth:`wait_begin` marked: adds its milliseconds to
        ``<name>_ms`` and sets ``<name>_since_ms`` back to 0."""
        now = int(time.monotonic() * 1000)
        with self._lock:
            since = self._values.get(name + "_since_ms", 0)
            if since:
                self._values[name + "_ms"] = self._values.get(name + "_ms", 0) + now - since
                self._values[name + "_since_ms"] = 0

    def snapshot(self) -> dict[str, int]:
        """A copy of every counter, for one control message."""
        with self._lock:
            return dict(self._values)

    def clear(self) -> None:
        """Forgets every counter (tests; a TF process runs one ``main_fun``)."""
        with self._lock:
            self._values.clear()


#: The TF process's figures (one ``main_fun`` per process).
FIGURES = NodeFigures()


def live_snapshot(hub: Optional[Any] = None) -> dict[str, int]:
    """:data:`FIGURES` plus the gauges sampled now, for one long-poll (TF process).

    Added: ``clock_ms`` (this process's monotonic clock, so the driver computes rates
    over the node's own time), ``cpu_ms`` (CPU time of every thread of the TF process),
    and with a data server ``rows`` (rows handed to main_fun), ``queue_chunks`` (chunks
    waiting in the fullest input queue now), ``queue_capacity`` (its bound) and, once its
    data port turned connections without the key away, their counts and sources
    (:data:`DATA_FLOOD`).
    """
    out = FIGURES.snapshot()
    out["clock_ms"] = int(time.monotonic() * 1000)
    out["cpu_ms"] = int(time.process_time() * 1000)
    if hub is not None:
        out["rows"] = int(hub.rows_taken)
        gate = getattr(hub, "gate", None)
        if gate is not None:  # connections without the key turned away at the node's data port
            out.update(gate.flood.counters(DATA_FLOOD))
        queues = list(getattr(hub, "queues", {}).values())
        out["queue_chunks"] = max((q.qsize() for q in queues), default=0)
        out["queue_capacity"] = max((q.maxsize for q in queues), default=0)
    else:
        out["rows"] = 0
    return out


def report_now(client: Any, executor_id: int, hub: Optional[Any] = None) -> None:
    """Sends the figures at once, in a long-poll that does not wait (TF process): the
    driver's summary then holds main_fun's last rows and steps even when the process ends
    before its next poll. A failed send is left to the next poll (or lost with the process).
    """
    from tfos._control import messages as _msg

    try:
        client.call(_msg.WaitEvent(executor_id=executor_id, counters=live_snapshot(hub), poll_s=0.0), timeout_s=5.0)
    except Exception:  # noqa: BLE001 - figures are best effort; the node's own report follows
        pass
