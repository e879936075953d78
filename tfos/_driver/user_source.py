"""Remote tracebacks that name the user's file (driver wraps, TF process unwraps).

cloudpickle ships functions of the driver's script (``__main__``, a notebook, a test module
it cannot import on executors) by value and sets their code's ``co_filename`` to
``"<dynamic-code>"``, so a traceback from ``main_fun`` on a node shows line numbers but
neither the file name nor the source lines. :func:`with_source` wraps ``main_fun`` with its
file name and source text (read on the driver when that file exists); when the wrapper
is unpickled in the TF process it gives the shipped functions their file name back and
registers the source with :mod:`linecache`, so tracebacks print
``File "/home/me/train.py", line 12, in main_fun`` and the line itself.
"""

from __future__ import annotations

import linecache
import os
import types
from typing import Any, Callable, Optional

__all__ = ["with_source", "SourcedFunction"]

#: Source files larger than this are not shipped (bytes).
MAX_SOURCE_BYTES = 2 * 1024 * 1024
_DYNAMIC = "<dynamic-code>"


class SourcedFunction:
    """``main_fun`` plus the file name and source text of its module (picklable).

    Calling it calls the function. Built on the driver by :func:`with_source`; unpickled
    in the TF process, where ``__setstate__`` restores the file names (see module doc).
    """

    def __init__(self, fn: Callable[..., Any], filename: str, source: Optional[str]):
        self.fn = fn
        self.filename = filename
        self.source = source

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __getstate__(self) -> dict:
        return {"fn": self.fn, "filename": self.filename, "source": self.source}

    def __setstate__(self, state: dict) -> None:
        self.fn = state["fn"]
        self.filename = state["filename"]
        self.source = state["source"]
        try:
            restore_filenames(self.fn, self.filename, self.source)
        except Exception:  # noqa: BLE001 - nicer tracebacks only; never fail the node for them
            pass


def with_source(fn: Callable[..., Any]) -> Any:
    """Wraps ``fn`` with its module's file name and source (driver); ``fn`` when not needed.

    Args:
        fn: The user's ``main_fun``.

    Returns:
        A :class:`SourcedFunction`, or ``fn`` itself when it is no plain Python function or
        its code has neither a real file nor source in :mod:`linecache` (a notebook cell's
        has the latter; then there is nothing to restore).
    """
    code = getattr(fn, "__code__", None)
    if not isinstance(code, types.CodeType):
        return fn
    filename = code.co_filename
    if not filename or filename == _DYNAMIC:
        return fn
    source: Optional[str] = None
    try:
        if os.path.getsize(filename) <= MAX_SOURCE_BYTES:
            with open(filename, encoding="utf-8", errors="replace") as f:
                source = f.read()
    except OSError:
        # A notebook cell (ipykernel's /tmp/ipykernel_PID/N.py, IPython's <ipython-input-N-...>)
        # has no file: IPython keeps its source in linecache.
        lines = linecache.cache.get(filename)
        text = "".join(lines[2]) if lines and len(lines) >= 3 and isinstance(lines[2], list) else ""
        source = text if text and len(text) <= MAX_SOURCE_BYTES else None
    if source is None and filename.startswith("<"):
        return fn
    return SourcedFunction(fn, filename, source)


def _relabel(code: types.CodeType, filename: str) -> types.CodeType:
    consts = tuple(_relabel(c, filename) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    if code.co_filename == _DYNAMIC:
        return code.replace(co_filename=filename, co_consts=consts)
    return code.replace(co_consts=consts) if consts != code.co_consts else code


def restore_filenames(fn: Callable[..., Any], filename: str, source: Optional[str]) -> None:
    """Gives ``fn`` and the functions of its module shipped with it their file name back
    (TF process), and registers ``source`` for ``filename`` in :mod:`linecache`.

    Only functions whose ``__module__`` is ``fn``'s and whose code is labelled
    ``"<dynamic-code>"`` (cloudpickle's by-value marker) are changed.
    """
    module = getattr(fn, "__module__", None)
    seen: set[int] = set()
    todo: list[Any] = [fn]
    todo.extend(v for v in getattr(fn, "__globals__", {}).values() if isinstance(v, types.FunctionType))
    while todo:
        f = todo.pop()
        if id(f) in seen or not isinstance(f, types.FunctionType) or f.__module__ != module:
            continue
        seen.add(id(f))
        f.__code__ = _relabel(f.__code__, filename)
        for cell in f.__closure__ or ():
            try:
                if isinstance(cell.cell_contents, types.FunctionType):
                    todo.append(cell.cell_contents)
            except ValueError:  # empty cell
                pass
    if source is not None and not os.path.isfile(filename):
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
