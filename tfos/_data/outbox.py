"""The time-bounded buffer between a feed task's input and its data connection (pure).

A feed task packs what it reads from its partition (PySpark's pickled batches, rows, Arrow
slices) into data frames, because every frame costs a tag, a send, a receive and a queue
hand-over on top of its bytes (``scripts/bench_frame_hop.py``). Packing must never hold a
row for long: a slow producer (an upstream decoder, a remote read) would otherwise keep
the node idle and hide a failure of ``main_fun`` until the partition ends. So the task's
thread that reads the partition puts each item into an :class:`Outbox`, and a sender
thread takes them out as one frame when

* they fill a frame (``limit``: bytes of batches, or rows), or
* the oldest of them has waited ``linger_s`` (default 50 ms, :data:`LINGER_ENV`), or
* the input ended.

The two threads overlap: the reader fills the next frame while the sender sends the last
one, and the reader waits while a full frame is still unsent (the node pushes back).

Where it runs: Spark feed and inference tasks (:mod:`tfos._data.feed_tasks`);
:func:`feed_linger_s` on the driver, when it plans a feed. See docs/datafeed.md
"Latency: the linger time".
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Optional

from tfos.errors import ConfigurationError

__all__ = ["Outbox", "InputFailed", "feed_linger_s", "DEFAULT_LINGER_S", "LINGER_ENV"]

#: Longest time a row waits in a feed task before it is sent, in seconds.
DEFAULT_LINGER_S = 0.05
#: Environment variable of the driver that sets the linger time, in milliseconds
#: (0 to 60000; 0 sends every item as it comes).
LINGER_ENV = "TFOS_FEED_LINGER_MS"
_MAX_LINGER_MS = 60_000.0


def feed_linger_s() -> float:
    """The linger time of feeds planned now, in seconds (driver; read at each ``train()`` /
    ``inference()``): :data:`LINGER_ENV` in milliseconds, else :data:`DEFAULT_LINGER_S`.

    Raises:
        ConfigurationError: The variable is not a number of milliseconds from 0 to 60000.
    """
    text = os.environ.get(LINGER_ENV, "").strip()
    if not text:
        return DEFAULT_LINGER_S
    try:
        ms = float(text)
    except ValueError:
        ms = -1.0
    if not 0.0 <= ms <= _MAX_LINGER_MS:  # also refuses NaN
        raise ConfigurationError(
            f"{LINGER_ENV}={text!r}: the feed linger time must be a number of milliseconds from 0 to "
            f"{_MAX_LINGER_MS:g} (default {DEFAULT_LINGER_S * 1000:g})"
        )
    return ms / 1000.0


class InputFailed(Exception):
    """Raised by :meth:`Outbox.take` once the reader failed: the partition was not read to
    its end, so no end-of-partition marker may be sent."""


class Outbox:
    """Items between a reader thread and a sender thread, each held at most ``linger_s``
    (pure; thread-safe; one reader, one sender).

    Args:
        limit: A frame's worth, in the unit of the sizes given to :meth:`put` (bytes of
            batches, or rows). A taken frame holds at least this much unless the oldest
            item lingered or the input ended, and at most this plus one item.
        linger_s: Longest time the oldest item waits for more, in seconds (>= 0).
        max_size: Most a frame may hold (a frame never grows past it by one more item;
            an item larger on its own still makes a frame of its own).

    Raises:
        ValueError: ``limit`` < 1, ``linger_s`` < 0 or ``max_size`` < 1.
    """

    def __init__(self, limit: int, linger_s: float, max_size: Optional[int] = None):
        if limit < 1 or not linger_s >= 0 or (max_size is not None and max_size < 1):
            raise ValueError(f"bad Outbox(limit={limit!r}, linger_s={linger_s!r}, max_size={max_size!r})")
        self._cond = threading.Condition(threading.Lock())
        self._limit = limit
        self._linger_s = float(linger_s)
        self._max = max_size if max_size is not None else float("inf")
        self._items: list = []
        self._size = 0
        self._since = 0.0  # monotonic time of the oldest item held
        self._full = False  # the reader waits for room: the frame is due
        self._ended = False
        self._failed = False
        self._stopped = False

    @property
    def limit(self) -> int:
        """A frame's worth (see the class docstring)."""
        return self._limit

    def set_limit(self, limit: int) -> None:
        """Changes a frame's worth (at least 1), for frames from now on."""
        with self._cond:
            self._limit = max(1, int(limit))
            self._cond.notify_all()

    # ------------------------------------------------------------------ reader
    def put(self, item: Any, size: int) -> bool:
        """Adds ``item`` of ``size`` (reader thread). Waits while a full frame is unsent.

        Returns:
            False once the sender stopped (:meth:`stop`): read no further.
        """
        with self._cond:
            while self._items and (self._size >= self._limit or self._size + size > self._max) and not self._stopped:
                self._full = True  # also when the item does not fit: the frame is due now
                self._cond.notify_all()
                self._cond.wait()
            if self._stopped:
                return False
            if not self._items:
                self._since = time.monotonic()
                self._cond.notify_all()  # the sender now waits for the linger deadline
            self._items.append(item)
            self._size += size
            if self._size >= self._limit:
                self._cond.notify_all()
            return True

    def end(self) -> None:
        """The input ended (reader thread): the sender sends what is left, then the end."""
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    def fail(self) -> None:
        """Reading the input raised (reader thread): the sender stops and sends no end."""
        with self._cond:
            self._failed = True
            self._cond.notify_all()

    # ------------------------------------------------------------------ sender
    def take(self, timeout_s: Optional[float] = None) -> Optional[list]:
        """The next frame's items, in order (sender thread).

        Args:
            timeout_s: Longest wait for a frame, in seconds (None: until one is due).

        Returns:
            A non-empty list of items, or None once the input ended and everything was
            taken (or ``timeout_s`` passed with no frame due: check :attr:`done`).

        Raises:
            InputFailed: The reader failed (:meth:`fail`).
        """
        end = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while True:
                if self._failed:
                    raise InputFailed("reading the partition failed")
                now = time.monotonic()
                if self._items and (self._ended or self._full or self._size >= self._limit
                                    or now >= self._since + self._linger_s):
                    items, self._items, self._size, self._full = self._items, [], 0, False
                    self._cond.notify_all()  # room for the reader
                    return items
                if self._ended and not self._items:
                    return None
                wait = None if not self._items else self._since + self._linger_s - now
                if end is not None:
                    if now >= end:
                        return None
                    wait = end - now if wait is None else min(wait, end - now)
                self._cond.wait(wait)

    @property
    def done(self) -> bool:
        """True once the input ended and everything was taken."""
        with self._cond:
            return self._ended and not self._items

    def stop(self) -> None:
        """The sender stopped (an error, or the node asked to stop): :meth:`put` returns
        False from now on and no waiting reader stays blocked."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
