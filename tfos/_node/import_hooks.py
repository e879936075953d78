"""Run a function on a module as soon as it is imported (TF process).

:func:`when_imported` applies at once when the module is already imported, else registers a
``sys.meta_path`` finder that wraps the module's loader, so the function runs right after
the module's own code, before anything else uses it. Nothing is imported here: a
``main_fun`` that never imports the module pays nothing. A function that raises is logged
and the import goes on unchanged.
"""

from __future__ import annotations

import importlib.abc
import logging
import sys
import threading
from typing import Any, Callable

log = logging.getLogger(__name__)

_lock = threading.Lock()
_pending: dict[str, list[Callable[[Any], None]]] = {}


def _run(name: str, module: Any, function: Callable[[Any], None]) -> None:
    try:
        function(module)
    except Exception:  # noqa: BLE001 - never break the user's import
        log.warning("tfos: could not adjust %s (it runs unchanged)", name, exc_info=True)


def waiting(name: str) -> bool:
    """Whether functions wait for module ``name`` to be imported."""
    with _lock:
        return bool(_pending.get(name))


def when_imported(name: str, function: Callable[[Any], None]) -> None:
    """Calls ``function(module)`` once module ``name`` is imported (now, if it is)."""
    module = sys.modules.get(name)
    if module is not None:
        _run(name, module, function)
        return
    with _lock:
        functions = _pending.setdefault(name, [])
        if function not in functions:  # installed twice: applied once
            functions.append(function)
        if not any(isinstance(f, _Finder) for f in sys.meta_path):
            sys.meta_path.insert(0, _Finder())


class _Loader(importlib.abc.Loader):
    def __init__(self, loader: Any, name: str) -> None:
        self._loader, self._name = loader, name

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        with _lock:
            functions = _pending.pop(self._name, [])
        for function in functions:
            _run(self._name, module, function)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... for inspect and linecache
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, fullname)
                return spec
        return None
