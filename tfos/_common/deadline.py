"""The one deadline helper of tfos (pure; used everywhere a wait happens).

Every wait in tfos is bounded. A :class:`Deadline` is created from a timeout in seconds
on the monotonic clock, and a wait that runs out raises
:class:`~tfos.errors.DeadlineExceededError` with a message that says what was awaited and
the likely causes.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Optional, Type

from tfos.errors import DeadlineExceededError, TFOSError

__all__ = ["Deadline"]


class Deadline:
    """A point in time on the monotonic clock, ``timeout_s`` seconds from creation.

    Args:
        timeout_s: Seconds from now; ``None`` or ``math.inf`` means no deadline (used only
            where the user explicitly asked for an unbounded wait).
        what: What is being awaited, for error messages, e.g. "all 3 nodes to register".
        causes: Likely causes, appended to the error message.

    Raises:
        ValueError: When ``timeout_s`` is negative or NaN.
    """

    __slots__ = ("_end", "timeout_s", "what", "causes")

    def __init__(self, timeout_s: Optional[float], what: str = "", causes: str = ""):
        if timeout_s is None:
            timeout_s = math.inf
        if math.isnan(timeout_s) or timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        self._end = time.monotonic() + self.timeout_s
        self.what = what
        self.causes = causes

    def remaining(self) -> float:
        """Seconds left (>= 0; ``math.inf`` for no deadline)."""
        return max(0.0, self._end - time.monotonic())

    def expired(self) -> bool:
        """True once the deadline has passed."""
        return time.monotonic() >= self._end

    def slice(self, max_s: float) -> float:
        """The time to wait in one step of a polling loop: ``min(remaining, max_s)``."""
        return min(self.remaining(), max_s)

    def error(self, cls: Type[TFOSError] = DeadlineExceededError, extra: str = "") -> TFOSError:
        """The error to raise when this deadline has expired.

        Args:
            cls: The error class (a :class:`TFOSError` subclass taking one message).
            extra: More detail to add, e.g. the list of nodes still missing.
        """
        msg = f"timed out after {self.timeout_s:g} s waiting for {self.what or 'an event'}"
        if extra:
            msg += f"; {extra}"
        if self.causes:
            msg += f". Likely causes: {self.causes}"
        return cls(msg)

    def check(self, cls: Type[TFOSError] = DeadlineExceededError, extra: str = "") -> None:
        """Raises :meth:`error` if the deadline has expired.

        Raises:
            TFOSError: ``cls``, when expired.
        """
        if self.expired():
            raise self.error(cls, extra)

    def wait_for(
        self,
        predicate: Callable[[], bool],
        poll_s: float = 0.05,
        cls: Type[TFOSError] = DeadlineExceededError,
        extra: Optional[Callable[[], str]] = None,
    ) -> None:
        """Waits until ``predicate()`` is true, polling every ``poll_s`` seconds.

        Args:
            predicate: Checked at least once, and after every poll interval.
            poll_s: Seconds between checks.
            cls: The error class to raise on expiry.
            extra: Called on expiry to add detail to the message.

        Raises:
            TFOSError: ``cls``, when the deadline expires first.
        """
        while not predicate():
            if self.expired():
                raise self.error(cls, extra() if extra else "")
            time.sleep(self.slice(poll_s))
