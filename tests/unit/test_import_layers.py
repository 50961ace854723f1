"""docs/architecture.md's import contract, checked on the source: every module sits in one layer
of the doc's table, imports only from its own layer or those below it, and no circle joins
modules or subsystems (top-level packages and modules). Lazy imports inside functions count
too (they close a circle as surely, only later); ``if TYPE_CHECKING:`` blocks never run.

The checker takes a source root, so a test can plant an upward import in a copy of the tree
and see it fail."""

from __future__ import annotations

import ast
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "meshrun"
ROOT = SRC.parents[1]
DOC = ROOT / "docs" / "architecture.md"

Graph = dict[str, set[str]]


def module_name(src: Path, path: Path) -> str:
    parts = path.relative_to(src.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(src: Path = SRC) -> dict[str, Path]:
    return {module_name(src, p): p for p in src.rglob("*.py")}


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


def _lazy_names(mods: dict[str, Path], package: str) -> dict[str, str]:
    """A package's lazy exports (PEP 562, meshrun/_lazy.py): the names its ``TYPE_CHECKING``
    block imports, each from the module that ``__getattr__`` will import."""
    tree = ast.parse(mods[package].read_text())
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            for sub in node.body:
                if isinstance(sub, ast.ImportFrom) and sub.module in mods:
                    out |= {a.asname or a.name: sub.module for a in sub.names}
    return out


def _base(mods: dict[str, Path], name: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = name if mods[name].name == "__init__.py" else name.rpartition(".")[0]
    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join([*parts, *([node.module] if node.module else [])])


def _targets(mods: dict[str, Path], name: str, node: ast.Import | ast.ImportFrom) -> Iterator[str]:
    if isinstance(node, ast.Import):
        for alias in node.names:
            parts = alias.name.split(".")
            found = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
            yield from [m for m in found if m in mods][:1]
        return
    base = _base(mods, name, node)
    if base not in mods:
        return
    lazy = _lazy_names(mods, base) if mods[base].name == "__init__.py" else {}
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        yield sub if sub in mods else lazy.get(alias.name, base)


def import_graph(src: Path = SRC) -> Graph:
    mods = modules(src)
    graph: Graph = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        deps = {t for node in _imports(tree) for t in _targets(mods, name, node)}
        # A module's own package __init__ runs before it anyway: not an edge of its own.
        graph[name] = {d for d in deps if d != name and not name.startswith(d + ".")}
    return graph


def cycles(graph: Graph) -> list[list[str]]:
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


def subsystem_graph(graph: Graph) -> Graph:
    out: Graph = {}
    for a, deps in graph.items():
        for b in deps:
            if subsystem(a) != subsystem(b):
                out.setdefault(subsystem(a), set()).add(subsystem(b))
    return out


# --- the layers of docs/architecture.md ----------------------------------------------------


def doc_layers(text: str) -> list[tuple[str, list[str]]]:
    """The ``## Layers`` table, bottom layer first: (layer, the paths in its second column:
    ``config/`` a package, ``loop.py`` a module, relative to src/meshrun)."""
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:3] for line in section.splitlines() if line.startswith("| ")]
    return [(layer.strip(), re.findall(r"`([^`]+)`", paths)) for layer, paths in rows[1:]]


def layer_of(layers: list[tuple[str, list[str]]]) -> dict[str, int]:
    """Each listed path as a module prefix (``meshrun.config``) -> its layer's height."""
    out: dict[str, int] = {}
    for height, (_, paths) in enumerate(layers):
        for path in paths:
            stem = path.removesuffix("/").removesuffix(".py").replace("/", ".")
            out["meshrun" if stem == "__init__" else f"meshrun.{stem}"] = height
    return out


def height(name: str, heights: dict[str, int]) -> int | None:
    """The layer of a module: its own entry, else its package's (``meshrun.plan.cost`` -> plan/)."""
    parts = name.split(".")
    if name == "meshrun":  # the package's own __init__.py; a prefix only for itself
        return heights.get(name)
    for i in range(len(parts), 1, -1):
        if (prefix := ".".join(parts[:i])) in heights:
            return heights[prefix]
    return None


def unplaced(graph: Graph, heights: dict[str, int]) -> list[str]:
    return sorted(m for m in graph if height(m, heights) is None)


def upward_imports(graph: Graph, heights: dict[str, int]) -> list[tuple[str, str]]:
    """Every import of a module in a higher layer than the importer's."""
    found = []
    for a, deps in graph.items():
        for b in deps:
            ha, hb = height(a, heights), height(b, heights)
            if ha is not None and hb is not None and hb > ha:
                found.append((a, b))
    return sorted(found)


def check(src: Path, doc_text: str) -> list[str]:
    """Every breach of the contract, in words; empty when the tree keeps it."""
    graph, heights = import_graph(src), layer_of(doc_layers(doc_text))
    problems = [f"{m} is in no layer of docs/architecture.md" for m in unplaced(graph, heights)]
    problems += [f"upward import: {a} imports {b}" for a, b in upward_imports(graph, heights)]
    problems += [f"import circle between modules: {c}" for c in cycles(graph)]
    problems += [f"import circle between subsystems: {c}" for c in cycles(subsystem_graph(graph))]
    return problems


# --- the tests -----------------------------------------------------------------------------


def test_the_scanner_sees_lazy_and_relative_imports() -> None:
    graph = import_graph()
    assert "meshrun.launch.local" in graph["meshrun.diagnose.cli"]  # inside a function
    assert "meshrun.config" in graph["meshrun"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_doc_names_the_layers_bottom_first() -> None:
    layers = doc_layers(DOC.read_text())
    assert layers[0][0] == "config" and layers[-1][0] == "CLI"
    heights = layer_of(layers)
    assert heights["meshrun.config"] < heights["meshrun.parallel"] < heights["meshrun.cli"]
    assert height("meshrun.plan.cost", heights) == heights["meshrun.plan"]


def test_the_tree_keeps_the_layer_contract() -> None:
    assert check(SRC, DOC.read_text()) == []


def test_a_planted_upward_import_fails_the_check(tmp_path: Path) -> None:
    tree = tmp_path / "meshrun"
    shutil.copytree(SRC, tree, ignore=shutil.ignore_patterns("__pycache__"))
    logs = tree / "logs.py"  # runtime layer
    logs.write_text(
        logs.read_text() + "\n\ndef _later() -> None:\n    from meshrun.cli import main\n"
    )
    problems = check(tree, DOC.read_text())
    assert "upward import: meshrun.logs imports meshrun.cli" in problems


def test_a_planted_circle_and_an_unplaced_module_fail_the_check(tmp_path: Path) -> None:
    tree = tmp_path / "meshrun"
    (tree / "parallel").mkdir(parents=True)
    (tree / "__init__.py").write_text("")
    (tree / "parallel" / "__init__.py").write_text("")
    (tree / "parallel" / "a.py").write_text("from meshrun.data import b\n")
    (tree / "data").mkdir()
    (tree / "data" / "__init__.py").write_text("")
    (tree / "data" / "b.py").write_text("import meshrun.parallel.a\n")
    (tree / "extra.py").write_text("")
    doc = "## Layers\n\n| layer | modules |\n|---|---|\n| subsystems | `parallel/`, `data/`, `__init__.py` |\n"
    assert check(tree, doc) == [
        "meshrun.extra is in no layer of docs/architecture.md",
        "import circle between modules: ['meshrun.data.b', 'meshrun.parallel.a']",
        "import circle between subsystems: ['meshrun.data', 'meshrun.parallel']",
    ]


def test_every_package_names_its_entry_points_and_they_resolve() -> None:
    import importlib

    for name, path in sorted(modules().items()):
        if path.name != "__init__.py":
            continue
        package = importlib.import_module(name)
        exports = getattr(package, "__all__", None)
        assert exports, f"{name}: __init__.py names no entry points (__all__)"
        for export in exports:
            assert getattr(package, export) is not None, f"{name}.{export}"
