"""Static checks of tfos/'s source (pure: no import of tfos's modules but the loggers'):

* no import cycle among tfos's modules, lazy (function-level) imports included;
* no ticket ids ("C12", "issue 16") in comments, docstrings or messages: they mean nothing to
  a user; a pointer to a docs section says the same and leads somewhere;
* every module logs through ``logging.getLogger(__name__)``, but for the few public logger
  names that docs/api.md and docs/migration.md document;
* ``ruff check tfos`` (rules in ruff.toml) is clean.
"""

from __future__ import annotations

import ast
import importlib.util
import logging
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "tfos"


def _modules() -> dict[str, tuple[Path, bool]]:
    """``{dotted module name: (path, is a package)}`` of every module under tfos/."""
    mods = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        mods[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return mods


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: module level, in functions and classes, in
    ``try``/``with``/loops; not those under ``if TYPE_CHECKING:`` (they never run)."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append(child)
            elif isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(ast.Module(body=[sub], type_ignores=[]))
            else:
                visit(child)

    visit(tree)
    return found


def import_graph() -> dict[str, set[str]]:
    """``{module: tfos modules it imports}``. ``from a import b`` counts as an import of
    ``a.b`` when that is a module, else of ``a``. The parent packages Python runs first are
    not counted (every module would import ``tfos``)."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, (path, is_pkg) in mods.items():
        package = name if is_pkg else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in _imports(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name in mods}
                continue
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                if f"{source}.{alias.name}" in mods:
                    targets.add(f"{source}.{alias.name}")
                elif source in mods:
                    targets.add(source)
        targets.discard(name)
        graph[name] = targets
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected component of two or more."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def strongconnect(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    cycles = []
    for comp in components:  # a shortest way from the component's first module back to it
        start, members = comp[0], set(comp)
        paths = {start: [start]}
        queue = [start]
        for v in queue:  # breadth first; the queue grows while it is read
            if start in graph[v]:
                cycles.append(paths[v] + [start])
                break
            for w in sorted(graph[v] & members):
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    queue.append(w)
    return cycles


def test_the_cycle_finder_finds_a_lazy_import_cycle_and_ignores_type_checking():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    # a package-level cycle through a public module: the planes see it
    graph = {"tfos._node.tf_process": {"tfos.node_context"}, "tfos.node_context": {"tfos.tf_server"},
             "tfos.tf_server": {"tfos._node.sharding"}, "tfos._node.sharding": set()}
    planes: dict[str, set[str]] = {}
    for mod, targets in graph.items():
        planes.setdefault(_plane(mod), set()).update(_plane(t) for t in targets if _plane(t) != _plane(mod))
    assert find_cycles(graph) == [] and find_cycles(planes) == [["tfos._node", "tfos.node_context", "tfos.tf_server",
                                                                  "tfos._node"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import x\nelse:\n    import y\n"
                     "def f():\n    import z\n")
    assert sorted(a.name for n in _imports(tree) for a in n.names) == ["TYPE_CHECKING", "y", "z"]


def test_no_import_cycle_among_tfos_modules():
    """A cycle hidden behind a lazy import is still a cycle: the two modules cannot be
    understood, tested or moved apart. Break it by moving the shared piece to a module
    below both."""
    graph = import_graph()
    assert len(graph) > 50 and "tfos._control.host" in graph["tfos._connect.control_host"]  # the finder sees imports
    assert find_cycles(graph) == []


def _plane(module: str) -> str:
    """The plane package of a module (``tfos._driver``), or the module itself at the top."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or (len(parts) == 2 and parts[1].startswith("_")) else module


def test_folders_follow_processes_no_plane_imports_another_that_imports_it():
    """Packages follow processes (docs/architecture.md "Package layout"): no two plane
    packages import each other, function-local imports included, so the layers read
    _common <- _control <- _data <- _node <- _connect <- _driver; executor code imports
    nothing from the driver's package; streaming stops through the control server (no
    _legacy import); _legacy is imported only by the TFoS shim modules."""
    graph = import_graph()
    planes: dict[str, set[str]] = {}
    for mod, targets in graph.items():
        planes.setdefault(_plane(mod), set()).update(_plane(t) for t in targets if _plane(t) != _plane(mod))
    # every plane and public module as one node: a cycle through a public module
    # (tfos._node -> tfos.node_context -> tfos._node) is a package-level cycle too
    assert find_cycles(planes) == []
    private = {p: {t for t in ts if t.startswith("tfos._")} for p, ts in planes.items() if p.startswith("tfos._")}
    assert find_cycles(private) == []
    for executor_side in ("tfos._node", "tfos._data", "tfos._connect", "tfos._control", "tfos._common"):
        assert "tfos._driver" not in planes[executor_side], executor_side
    assert not {t for t in graph["tfos._driver.streaming"] if t.startswith("tfos._legacy")}
    users = {m for m, ts in graph.items() if any(t.startswith("tfos._legacy") for t in ts) and not m.startswith("tfos._legacy")}
    # datafeed's TFManager queue feed is the one path left to a TFoS runtime piece
    assert users <= {"tfos.TFManager", "tfos.TFSparkNode", "tfos.reservation", "tfos.marker", "tfos.datafeed"}, users


# Ticket ids of the project's issue tracker and failure-case list (C01-C26), as written in
# comments: "C12", "(C11)", "issue 16", "issue #9", "i17". A reference to a public tracker
# ("keras-team/keras#20585") names where to read and is kept.
TICKET_ID = re.compile(r"\b(?:C\d{1,2}|[Ii]ssues? #?\d+|i\d{2})\b")


def test_the_ticket_id_pattern_has_no_false_positives_on_what_tfos_writes():
    hits = ["see C12", "(C11, C02)", "issue 16", "Issue #9", "i17 (C24)"]
    misses = ["keras-team/keras#20585", "C++ INFO lines", "0xC3", "SIGTERM", "int32", "TC12x", "issues",
              "float64", "Python 3.11", "section C", "uint8", "iter12"]
    assert all(TICKET_ID.search(s) for s in hits)
    assert not [s for s in misses if TICKET_ID.search(s)]


def test_no_ticket_ids_in_tfos_comments_docstrings_or_messages():
    found = []
    for path in sorted(PKG.rglob("*.py")):
        with open(path, "rb") as f:
            for tok in tokenize.tokenize(f.readline):
                if tok.type in (tokenize.COMMENT, tokenize.STRING) or tok.type == getattr(tokenize, "FSTRING_MIDDLE", -1):
                    found += [f"{path.relative_to(ROOT)}:{tok.start[0]}: {m.group(0)}"
                              for m in TICKET_ID.finditer(tok.string)]
    assert found == [], "point to the docs section instead (docs/NAME.md \"Section\"), or drop it"


# getLogger() names other than __name__, each documented.
PUBLIC_LOGGERS = {
    "tfos": "the package logger: the node processes' handler for the executor log (tfos._node.start_task)",
    "tfos._driver": "TFCluster.logger and TFParallel.logger, the parent of tfos._driver.*'s loggers (docs/migration.md)",
    "tfos.node": "the forwarded node output lines on the driver (docs/api.md \"Node output\")",
    "tfos.TFSparkNode": "TFoS's module name: tfos.TFSparkNode.logger (tests/unit/test_tfos_public_names.py)",
    "tfos.reservation": "TFoS's module name: tfos.reservation.logger (tests/unit/test_tfos_public_names.py)",
}


def test_every_module_logger_is_named_after_its_module():
    wrong = []
    for name, (path, _) in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "getLogger"
                    and node.args):
                continue
            arg = node.args[0]
            if isinstance(arg, ast.Name) and arg.id == "__name__":
                continue
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value not in PUBLIC_LOGGERS:
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: getLogger({arg.value!r}) in {name}")
    assert wrong == [], "use logging.getLogger(__name__)"


def test_entry_modules_log_under_the_tfos_logger_when_run_with_dash_m():
    # ``python -m tfos._node.tf_process`` runs the module as "__main__": a plain
    # getLogger(__name__) there is the "__main__" logger, outside 'tfos' and its handler.
    wrong = []
    for name, (path, _) in _modules().items():
        text = path.read_text(encoding="utf-8")
        if 'if __name__ == "__main__"' in text and "getLogger(__name__)" in text:
            wrong.append(f"{path.relative_to(ROOT)}: getLogger(__name__) in a module run with python -m")
    assert wrong == [], "use getLogger(__spec__.name if __name__ == '__main__' and __spec__ is not None else __name__)"


def test_the_driver_modules_log_under_tfcluster_logger():
    from tfos import TFCluster
    from tfos._driver import runtime
    from tfos._driver import streaming as stream_feeds

    package = logging.getLogger("tfos")  # made now if no module asked for it yet
    assert TFCluster.logger is logging.getLogger("tfos._driver") and TFCluster.logger.parent is package
    for mod in (runtime, stream_feeds):
        assert mod.log.name == mod.__name__ and mod.log.parent is TFCluster.logger


def test_ruff_check_tfos_is_clean():
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is not installed: pip install -e '.[test]' (setup.py's test extra) installs it")
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "tfos"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
