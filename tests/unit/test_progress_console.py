"""The driver's progress bar and log lines never share a line (tfos._driver.console, used by
Progress): on a terminal the program's console handlers clear and redraw the bar around each
record; on a pipe or file the bar is written as whole lines. The program's logging set-up is
given back unchanged."""

from __future__ import annotations

import io
import logging
import sys

import pytest

from tfos._driver import console
from tfos._driver.runtime import Progress


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class FakePipe(io.StringIO):
    def isatty(self) -> bool:
        return False


def render(raw: str) -> list[str]:
    """What a terminal shows for ``raw`` (carriage returns overwrite the line; no escapes)."""
    lines, line, col = [], [], 0
    for ch in raw:
        if ch == "\r":
            col = 0
        elif ch == "\n":
            lines.append("".join(line).rstrip())
            line, col = [], 0
        else:
            if col < len(line):
                line[col] = ch
            else:
                line.append(ch)
            col += 1
    lines.append("".join(line).rstrip())
    return lines


class Tracker:
    def getJobIdsForGroup(self, group):
        return []


class State:
    """A stand-in for the control host: its core's row count and its counter wait."""

    rows = 0

    @property
    def core(self) -> "State":
        return self

    def rows_consumed(self) -> int:
        return self.rows

    def wait_for_counters(self, nodes, timeout_s) -> bool:
        return True


@pytest.fixture
def program_logging(monkeypatch):
    """A program's logging.basicConfig(stream=sys.stdout) with stdout and stderr on one terminal
    (or one pipe): returns (stream, handler, logger)."""

    def make(stream_cls):
        stream = stream_cls()
        monkeypatch.setattr(sys, "stdout", stream)
        monkeypatch.setattr(sys, "stderr", stream)
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        handler.setLevel(logging.INFO)
        root = logging.getLogger()
        monkeypatch.setattr(root, "handlers", [handler])
        monkeypatch.setattr(root, "level", logging.INFO)
        # Loggers cache isEnabledFor() per level; only setLevel() clears it. A logger that an
        # earlier test asked while the root was at WARNING would drop the INFO records here.
        root.manager._clear_cache()
        return stream, handler, logging.getLogger("tfos._driver.runtime")

    yield make
    logging.getLogger().manager._clear_cache()


def test_on_a_terminal_a_log_record_clears_the_bar_and_the_bar_comes_back_below(program_logging):
    term, handler, log = program_logging(FakeTerminal)
    filters, formatter, level, handlers = list(handler.filters), handler.formatter, handler.level, list(logging.getLogger().handlers)
    state = State()
    progress = Progress(Tracker(), state, "g", 8, 4, 2, "tfos train")
    state.rows = 4118
    progress._show(3)
    log.info("node worker:1 reported its counters")
    log.debug("not shown: below the handler's level")
    progress._show(5)
    progress.finish([0, 1])
    shown = [ln for ln in render(term.getvalue()) if ln]
    # the record stands alone on its line, the bar is drawn again after it, and ends at 100 %
    assert "INFO tfos._driver.runtime: node worker:1 reported its counters" in shown, shown
    assert all(ln == "INFO tfos._driver.runtime: node worker:1 reported its counters" or ln.startswith("tfos train:")
               for ln in shown), shown
    assert shown.index("INFO tfos._driver.runtime: node worker:1 reported its counters") < len(shown) - 1
    assert "100%" in shown[-1] and "epoch 2/2" in shown[-1], shown
    assert "not shown" not in term.getvalue()
    # the program's logging is as it was: same handler objects, stream, level, filters, formatter
    assert logging.getLogger().handlers == handlers and handler.stream is term
    assert (list(handler.filters), handler.formatter, handler.level) == (filters, formatter, level)


def test_on_a_pipe_the_bar_is_whole_lines_between_the_log_lines(program_logging):
    pipe, handler, log = program_logging(FakePipe)
    state = State()
    progress = Progress(Tracker(), state, "g", 4, 4, 1, "tfos inference")
    log.warning("a record while the bar runs")
    state.rows = 900
    progress._show(2)  # within 10 s of the first line: not written
    progress.finish([0])
    raw = pipe.getvalue()
    assert "\r" not in raw, raw
    lines = raw.splitlines()
    assert lines[0].startswith("tfos inference:   0%") and lines[1] == "WARNING tfos._driver.runtime: a record while the bar runs"
    assert len(lines) == 3 and lines[2].startswith("tfos inference: 100%") and "900 rows" in lines[2], lines
    assert handler.stream is pipe  # never wrapped: nothing to clear on a pipe


def test_an_abandoned_bar_leaves_no_line_on_a_pipe(program_logging):
    pipe, _, _ = program_logging(FakePipe)
    progress = Progress(Tracker(), State(), "g", 4, 4, 1, "tfos train")
    first = pipe.getvalue()
    progress._show(2)
    progress.abandon()
    assert pipe.getvalue() == first  # only the first state, no stale later line


def test_without_logging_set_up_warnings_of_last_resort_get_their_own_line(monkeypatch):
    """A program with no logging configuration (the quick start): tfos's WARNINGs reach
    logging.lastResort, which writes to sys.stderr; it too clears the bar first."""
    term = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", term)
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    before = logging.lastResort
    progress = Progress(Tracker(), State(), "g", 2, 2, 1, "tfos train")
    logging.getLogger("tfos.test_console").warning("a node is slow")
    progress.finish([0])
    shown = [ln for ln in render(term.getvalue()) if ln]
    assert "a node is slow" in shown and shown[-1].startswith("tfos train: 100%"), shown
    assert logging.lastResort is before


def test_a_stream_the_program_replaced_meanwhile_is_kept(program_logging):
    term, handler, _ = program_logging(FakeTerminal)
    bar = console.BarConsole(sys.stderr)
    bar.start()
    assert isinstance(handler.stream, console.BarAwareStream)
    other = FakeTerminal()
    handler.setStream(other)
    bar.stop()
    assert handler.stream is other


def test_file_handlers_and_other_streams_are_not_touched(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "stderr", FakeTerminal())
    file_handler = logging.FileHandler(tmp_path / "log.txt")
    buffer_handler = logging.StreamHandler(io.StringIO())
    lg = logging.getLogger("tfos.test_console_files")
    monkeypatch.setattr(lg, "handlers", [file_handler, buffer_handler])
    try:
        assert file_handler not in console.console_handlers() and buffer_handler not in console.console_handlers()
    finally:
        file_handler.close()
