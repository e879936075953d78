"""A node's live figures: counters the TF process keeps for the driver (TF process side).

The feed and Keras's patched trainer add to them; the TF process's control thread sends a
snapshot with every long-poll (:class:`tfos._control.messages.WaitEvent`'s ``counters``),
so the driver holds each node's figures at most one poll old. Names are flat strings and
values integers (rows, steps, milliseconds, bytes: the unit is in the name), so they cross
the control channel as JSON unchanged. See docs/architecture.md, "Control plane".
"""

from __future__ import annotations

import threading


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
