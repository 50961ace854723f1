"""docs/architecture.md's claims about imports, checked on the source: no import circles among
meshrun's modules, nor between its subsystems (top-level packages and modules), counting the
lazy imports inside functions too (they close a circle as surely, only later)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "meshrun"
ROOT = SRC.parents[1]

# The one known exception, named in docs/architecture.md: `meshrun scale-test` lives in
# monitor/ but starts jobs through launch/local.py, which imports monitor/watchdog.py. When it
# moves up a layer, remove it here and in the docs (the test below fails until both agree).
KNOWN_UPWARD = {("meshrun.monitor.scale", "meshrun.launch.local")}


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in SRC.rglob("*.py")}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement that can run, at any depth; ``if TYPE_CHECKING:`` bodies never do."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            yield from (i for n in node.orelse for i in _imports_in(n))
            continue
        yield from _imports_in(node)


def _imports_in(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    else:
        yield from _imports(node)


def _lazy_names(package: str) -> dict[str, str]:
    """A package's lazy exports (PEP 562, meshrun/_lazy.py): the names its ``TYPE_CHECKING``
    block imports, each from the module that ``__getattr__`` will import."""
    tree = ast.parse(MODULES[package].read_text())
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            for sub in node.body:
                if isinstance(sub, ast.ImportFrom) and sub.module in MODULES:
                    out |= {a.asname or a.name: sub.module for a in sub.names}
    return out


def _base(name: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join([*parts, *([node.module] if node.module else [])])


def _targets(name: str, node: ast.Import | ast.ImportFrom) -> Iterator[str]:
    if isinstance(node, ast.Import):
        for alias in node.names:
            parts = alias.name.split(".")
            found = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
            yield from [m for m in found if m in MODULES][:1]
        return
    base = _base(name, node)
    if base not in MODULES:
        return
    lazy = _lazy_names(base) if MODULES[base].name == "__init__.py" else {}
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        yield sub if sub in MODULES else lazy.get(alias.name, base)


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        deps = {t for node in _imports(tree) for t in _targets(name, node)}
        # A module's own package __init__ runs before it anyway: not an edge of its own.
        graph[name] = {d for d in deps if d != name and not name.startswith(d + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                comp.append(w)
            comp.append(v)
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def subsystem(name: str) -> str:
    """``meshrun.monitor.step`` -> ``meshrun.monitor``; top-level modules stand alone."""
    return ".".join(name.split(".")[:2])


def subsystem_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for a, deps in graph.items():
        for b in deps:
            if (a, b) not in KNOWN_UPWARD and subsystem(a) != subsystem(b):
                out.setdefault(subsystem(a), set()).add(subsystem(b))
    return out


def test_the_scanner_sees_lazy_and_relative_imports() -> None:
    graph = import_graph()
    assert "meshrun.launch.local" in graph["meshrun.monitor.scale"]  # inside a function
    assert "meshrun.config" in graph["meshrun"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle_between_modules() -> None:
    assert cycles(import_graph()) == []


def test_no_import_circle_between_subsystems() -> None:
    found = cycles(subsystem_graph(import_graph()))
    assert found == [], f"subsystems that import each other (lazy imports included): {found}"


def test_the_known_exception_is_still_real_and_documented() -> None:
    graph = import_graph()
    for a, b in KNOWN_UPWARD:
        assert b in graph[a], f"{a} no longer imports {b}: remove it from KNOWN_UPWARD and docs"
        doc = (ROOT / "docs" / "architecture.md").read_text()
        assert f"`{a.removeprefix('meshrun.').replace('.', '/')}.py`" in doc
