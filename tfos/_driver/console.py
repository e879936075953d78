"""The driver's progress bar beside log lines: the two never share a line (driver).

A tqdm bar on a terminal is a line without a newline that tqdm redraws in place; a log
record written to the same terminal meanwhile would start at the end of the bar's line
(``...4,118 rows/s]2026-12-05 02:56:30,524 INFO tfos._control.host: ...``). So while a bar
is shown (:class:`BarConsole`):

- on a terminal, the console handlers of the program's logging (``StreamHandler`` to
  ``sys.stdout`` / ``sys.stderr``, on any logger, and ``logging.lastResort``, which prints
  WARNINGs when the program configured no logging) write through
  ``tqdm.external_write_mode``: the bar is cleared, the record printed, the bar redrawn
  below it, as tqdm's ``logging_redirect_tqdm`` does. Unlike that helper, nothing is added
  to or removed from any logger: each handler keeps its level, filters and formatter, and
  only its stream is wrapped for the bar's lifetime, then given back (unless the program
  replaced it meanwhile);
- elsewhere (a pipe, a file: ``run_mnist.sh``'s ``| tee``, a CI log) the bar is written as
  whole lines, at most one per ``interval_s`` plus its final state, so log lines and bar
  lines alternate and ``grep``/``^`` anchors still work on both.

tfos's own node output already writes through ``tqdm.external_write_mode``
(:mod:`tfos._node.output`).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any, Optional

__all__ = ["BarConsole", "WholeLines", "BarAwareStream", "console_handlers"]


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, OSError, ValueError):
        return False


class WholeLines:
    """A file for tqdm on a stream that is not a terminal: each shown state of the bar becomes
    one line, at most one per ``interval_s`` seconds, and the bar's final state (when it
    closes with ``leave=True``) always (driver).

    tqdm writes ``"\\r" + bar + padding`` for each refresh, ``"\\r" + spaces + "\\r"`` to
    clear, and ``"\\n"`` after the last refresh of a bar that stays.
    """

    def __init__(self, stream: Any, interval_s: float = 10.0):
        self._stream = stream
        self._interval_s = interval_s
        self._pending = ""
        self._shown = ""
        self._shown_at = -float("inf")
        self._lock = threading.Lock()

    def write(self, s: str) -> int:
        text = s.replace("\r", "").strip()
        with self._lock:
            if text:
                self._pending = text
                if time.monotonic() - self._shown_at >= self._interval_s:
                    self._show()
            elif "\n" in s and self._pending != self._shown:  # the bar closed: its final state
                self._show()
        return len(s)

    def _show(self) -> None:
        self._stream.write(self._pending + "\n")
        self._stream.flush()
        self._shown, self._shown_at = self._pending, time.monotonic()

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        return False


class BarAwareStream:
    """Wraps a console stream so that every write clears the tqdm bars on the terminal first
    and redraws them after (``tqdm.external_write_mode``; driver)."""

    def __init__(self, stream: Any):
        self.wrapped = stream

    def write(self, s: str) -> int:
        from tqdm import tqdm

        with tqdm.external_write_mode(file=self.wrapped):
            n = self.wrapped.write(s)
            self.wrapped.flush()
        return n

    def flush(self) -> None:
        self.wrapped.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.wrapped, name)


class _LastResort(logging.Handler):
    """``logging.lastResort`` while a bar is shown: the same WARNING-level, message-only
    output to ``sys.stderr`` (as looked up at each record), through :class:`BarAwareStream`."""

    def __init__(self, level: int):
        super().__init__(level)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            BarAwareStream(sys.stderr).write(self.format(record) + "\n")
        except Exception:  # noqa: BLE001 - as logging does: a record never breaks the caller
            self.handleError(record)


def _console_streams() -> tuple:
    return tuple(s for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__) if s is not None)


def console_handlers() -> list[logging.StreamHandler]:
    """The handlers of every logger (the root logger included) that write to the console:
    ``StreamHandler`` (not ``FileHandler``) whose stream is ``sys.stdout`` or ``sys.stderr``."""
    streams = _console_streams()
    loggers: list = [logging.getLogger()] + [lg for lg in list(logging.Logger.manager.loggerDict.values())
                                             if isinstance(lg, logging.Logger)]
    found: list[logging.StreamHandler] = []
    for lg in loggers:
        for h in list(lg.handlers):
            if (isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
                    and not isinstance(getattr(type(h), "stream", None), property)  # e.g. logging's _StderrHandler
                    and any(getattr(h, "stream", None) is s for s in streams) and h not in found):
                found.append(h)
    return found


class BarConsole:
    """Makes one tqdm bar and the program's console logging take turns (driver).

    Usage: ``console = BarConsole(sys.stderr)``; give tqdm ``file=console.bar_file``; call
    :meth:`start` once the bar exists and :meth:`stop` after it closed.
    """

    def __init__(self, stream: Any, interval_s: float = 10.0):
        self.terminal = _isatty(stream)
        self.bar_file: Any = stream if self.terminal else WholeLines(stream, interval_s)
        self._wrapped: list[tuple[logging.StreamHandler, BarAwareStream]] = []
        self._last_resort: Optional[tuple[Optional[logging.Handler], _LastResort]] = None

    def start(self) -> None:
        """Routes the console handlers through the bar (a terminal only; else nothing to do)."""
        if not self.terminal or self._wrapped or self._last_resort:
            return
        for h in console_handlers():
            wrapper = BarAwareStream(h.stream)
            h.setStream(wrapper)  # type: ignore[arg-type]
            self._wrapped.append((h, wrapper))
        previous = logging.lastResort
        if previous is not None:
            mine = _LastResort(previous.level)
            logging.lastResort = mine
            self._last_resort = (previous, mine)

    def stop(self) -> None:
        """Gives every handler its stream back, unless the program replaced it meanwhile."""
        for h, wrapper in self._wrapped:
            if h.stream is wrapper:
                h.setStream(wrapper.wrapped)
        self._wrapped = []
        if self._last_resort is not None:
            previous, mine = self._last_resort
            if logging.lastResort is mine:
                logging.lastResort = previous
            self._last_resort = None
