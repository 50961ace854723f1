"""docs/architecture.md's import contract, checked on the source: every module sits in one layer
of the doc's table (a folder per layer), imports only from its own layer or those below it,
imports another package of its own layer only where the doc's allowed list says so, and no
circle joins modules or subsystems (top-level packages and modules). Lazy imports inside
functions count too (they close a circle as surely, only later); ``if TYPE_CHECKING:`` imports
never run, and a package's lazy exports (meshrun/_lazy.py's ``lazy_exports`` maps) run only on
first use, but both are dependencies of meaning: they count for circles and for direction (a
type named from a higher layer, or a name handed on from one, is an import running back up).
The pure layers the doc names import no ``torch.distributed`` and start no process group.

The checker takes a source root, so a test can plant a breach in a copy of the tree and see
it fail."""

from __future__ import annotations

import ast
import functools
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


def _imports(tree: ast.AST, typing: bool = False) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement that can run, at any depth; ``if TYPE_CHECKING:`` bodies never do
    (``typing=True`` adds them)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node) and not typing:
            yield from (i for n in node.orelse for i in _imports_in(n, typing))
            continue
        yield from _imports_in(node, typing)


def _imports_in(node: ast.AST, typing: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    else:
        yield from _imports(node, typing)


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


def _lazy_targets(mods: dict[str, Path], tree: ast.AST) -> set[str]:
    """The modules a ``lazy_exports(globals(), MAP)`` call names (``MAP`` a dict, or the name of
    a module-level dict): each is imported on first use of one of its names."""
    dicts = {
        t.id: node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
        for t in node.targets
        if isinstance(t, ast.Name)
    }
    found: set[str] = set()
    for node in ast.walk(tree):
        func = getattr(node, "func", None)
        if not isinstance(node, ast.Call) or getattr(func, "id", None) != "lazy_exports":
            continue
        for arg in node.args[1:]:
            table = dicts.get(arg.id) if isinstance(arg, ast.Name) else arg
            for value in ast.walk(table) if table is not None else ():
                if isinstance(value, ast.Constant) and value.value in mods:
                    found.add(value.value)
    return found


@functools.cache
def _scan(text: str, typing: bool) -> tuple[ast.AST, tuple[ast.Import | ast.ImportFrom, ...]]:
    """A file's tree and import statements, once per text: the planted-breach tests check
    copies of the tree that differ from it in one file (the walks cost most of their time)."""
    tree = ast.parse(text)
    return tree, tuple(_imports(tree, typing))


def import_graph(src: Path = SRC, typing: bool = False) -> Graph:
    """Module -> the meshrun modules it imports (``typing=True``: ``TYPE_CHECKING`` ones and
    the modules of its lazy exports too)."""
    mods = modules(src)
    graph: Graph = {}
    for name, path in mods.items():
        text = path.read_text()
        tree, imports = _scan(text, typing)
        deps = {t for node in imports for t in _targets(mods, name, node)}
        if typing and "lazy_exports" in text:
            deps |= _lazy_targets(mods, tree)
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
    ``config/`` a package, ``train/loop.py`` a module, relative to src/meshrun)."""
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:3] for line in section.splitlines() if line.startswith("| ")]
    rows = rows[: next((i for i, r in enumerate(rows[1:], 1) if not r[0].strip()), len(rows))]
    return [(layer.strip(), re.findall(r"`([^`]+)`", paths)) for layer, paths in rows[1:]]


def layer_of(layers: list[tuple[str, list[str]]]) -> dict[str, int]:
    """Each listed path as a module prefix (``meshrun.config``) -> its layer's height."""
    out: dict[str, int] = {}
    for height, (_, paths) in enumerate(layers):
        for path in paths:
            out[_prefix(path)] = height
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


def _section(text: str, title: str) -> str:
    return text.split(f"## {title}", 1)[1].split("\n## ", 1)[0] if f"## {title}" in text else ""


def _prefix(path: str) -> str:
    """A doc path (``parallel/``, ``launch/k8s/``, ``__init__.py``) as a module prefix."""
    stem = path.removesuffix("/").removesuffix(".py").replace("/", ".")
    return "meshrun" if stem == "__init__" else f"meshrun.{stem}"


def allowed_same_layer(text: str) -> set[tuple[str, str]]:
    """The doc's ``### Imports within a layer`` list: lines `` `a/` -> `b/`, `c/` ``."""
    section = _section(text, "Layers").split("### Imports within a layer", 1)
    pairs = set()
    for line in (section[1] if len(section) > 1 else "").splitlines():
        head, sep, tail = line.partition("->")
        if sep and (src := re.findall(r"`([^`]+)`", head)):
            pairs |= {(_prefix(src[0]), _prefix(b)) for b in re.findall(r"`([^`]+)`", tail)}
    return pairs


def same_layer_imports(graph: Graph, heights: dict[str, int], allowed: set[tuple[str, str]]):
    """Imports between two subsystems of one layer that the doc does not allow, as pairs."""
    found = set()
    for a, deps in graph.items():
        for b in deps:
            sa, sb = subsystem(a), subsystem(b)
            ha, hb = height(a, heights), height(b, heights)
            if sa != sb and ha is not None and ha == hb and (sa, sb) not in allowed:
                found.add((sa, sb))
    return sorted(found)


def pure_paths(text: str) -> list[str]:
    """The module prefixes the doc's ``Pure:`` line names (no process group, no collective)."""
    line = next((x for x in _section(text, "Layers").splitlines() if x.startswith("Pure:")), "")
    return [_prefix(p) for p in re.findall(r"`([^`]+)`", line)]


def impure(src: Path, prefixes: list[str]) -> list[str]:
    """Modules under ``prefixes`` that import ``torch.distributed`` (at any depth, type-only
    imports aside) or call ``init_process_group``."""
    found = []
    for name, path in sorted(modules(src).items()):
        if not any(name == p or name.startswith(p + ".") for p in prefixes):
            continue
        tree, imports = _scan(path.read_text(), False)
        for node in imports:
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            if any(m == "torch.distributed" or m.startswith("torch.distributed.") for m in mods):
                found.append(f"{name} imports torch.distributed")
                break
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute | ast.Name)]
        if any(getattr(n, "attr", getattr(n, "id", "")) == "init_process_group" for n in calls):
            found.append(f"{name} starts a process group")
    return found


def check(src: Path, doc_text: str) -> list[str]:
    """Every breach of the contract, in words; empty when the tree keeps it."""
    graph, heights = import_graph(src), layer_of(doc_layers(doc_text))
    allowed = allowed_same_layer(doc_text)
    problems = [f"{m} is in no layer of docs/architecture.md" for m in unplaced(graph, heights)]
    problems += [f"upward import: {a} imports {b}" for a, b in upward_imports(graph, heights)]
    problems += [
        f"import within a layer not allowed by docs/architecture.md: {a} imports {b}"
        for a, b in same_layer_imports(graph, heights, allowed)
    ]
    problems += [f"import circle between modules: {c}" for c in cycles(graph)]
    problems += [f"import circle between subsystems: {c}" for c in cycles(subsystem_graph(graph))]
    typing = import_graph(src, typing=True)
    typed = [c for c in cycles(typing) if c not in cycles(graph)]
    problems += [f"import circle through TYPE_CHECKING imports: {c}" for c in typed]
    # Type-only imports and lazy exports keep the direction too (reported once, where only
    # they run up or across).
    ran = set(upward_imports(graph, heights))
    problems += [
        f"upward import (type-only or lazy export): {a} imports {b}"
        for a, b in upward_imports(typing, heights)
        if (a, b) not in ran
    ]
    across = set(same_layer_imports(graph, heights, allowed))
    problems += [
        "import within a layer not allowed by docs/architecture.md (type-only or lazy "
        f"export): {a} imports {b}"
        for a, b in same_layer_imports(typing, heights, allowed)
        if (a, b) not in across
    ]
    problems += [f"not pure: {p}" for p in impure(src, pure_paths(doc_text))]
    return problems


# --- the tests -----------------------------------------------------------------------------


def test_the_scanner_sees_lazy_and_relative_imports() -> None:
    graph = import_graph()
    assert "meshrun.launch.agent.local" in graph["meshrun.cli.diagnose"]  # inside a function
    assert "meshrun.config" in graph["meshrun"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_doc_names_the_layers_bottom_first() -> None:
    layers = doc_layers(DOC.read_text())
    assert layers[0][0] == "config" and layers[-1][0] == "CLI"
    heights = layer_of(layers)
    assert heights["meshrun.config"] < heights["meshrun.parallel"] < heights["meshrun.cli"]
    assert heights["meshrun.runtime"] < heights["meshrun.launch"] < heights["meshrun.train"]
    assert height("meshrun.plan.cost", heights) == heights["meshrun.plan"]


def test_the_tree_keeps_the_layer_contract() -> None:
    assert check(SRC, DOC.read_text()) == []


def test_a_planted_upward_import_fails_the_check(tmp_path: Path) -> None:
    tree = tmp_path / "meshrun"
    shutil.copytree(SRC, tree, ignore=shutil.ignore_patterns("__pycache__"))
    logs = tree / "runtime" / "logs.py"  # runtime layer
    logs.write_text(
        logs.read_text() + "\n\ndef _later() -> None:\n    from meshrun.cli.main import main\n"
    )
    problems = check(tree, DOC.read_text())
    assert "upward import: meshrun.runtime.logs imports meshrun.cli.main" in problems


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
        "import within a layer not allowed by docs/architecture.md: meshrun.data imports meshrun.parallel",
        "import within a layer not allowed by docs/architecture.md: meshrun.parallel imports meshrun.data",
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


def _copy(tmp_path: Path) -> Path:
    tree = tmp_path / "meshrun"
    shutil.copytree(SRC, tree, ignore=shutil.ignore_patterns("__pycache__"))
    return tree


def _plant(path: Path, line: str) -> None:
    path.write_text(path.read_text() + f"\n\ndef _later() -> None:\n    {line}\n")


def test_a_planted_import_between_two_subsystems_of_one_layer_fails(tmp_path: Path) -> None:
    tree = _copy(tmp_path)
    _plant(tree / "hf" / "names.py", "from meshrun.ft import data_share")
    problems = check(tree, DOC.read_text())
    assert problems == [
        "import within a layer not allowed by docs/architecture.md: meshrun.hf imports meshrun.ft"
    ]


def test_the_pure_layers_start_no_process_group(tmp_path: Path) -> None:
    assert "meshrun.plan" in pure_paths(DOC.read_text())
    assert "meshrun.launch.k8s" in pure_paths(DOC.read_text())
    tree = _copy(tmp_path)
    _plant(tree / "plan" / "cost.py", "import torch.distributed as dist; dist.init_process_group()")
    _plant(tree / "launch" / "k8s" / "render.py", "from torch.distributed import barrier")
    assert check(tree, DOC.read_text()) == [
        "not pure: meshrun.launch.k8s.render imports torch.distributed",
        "not pure: meshrun.plan.cost imports torch.distributed",
        "not pure: meshrun.plan.cost starts a process group",
    ]


def test_a_planted_type_checking_circle_fails(tmp_path: Path) -> None:
    tree = _copy(tmp_path)
    mfu = tree / "monitor" / "mfu.py"
    text = mfu.read_text().replace(
        "if TYPE_CHECKING:\n",
        "if TYPE_CHECKING:\n    from meshrun.monitor.metrics import MetricsLogger\n",
    )
    mfu.write_text(text)
    assert check(tree, DOC.read_text()) == [
        "import circle through TYPE_CHECKING imports: ['meshrun.monitor.metrics', 'meshrun.monitor.mfu']"
    ]


def test_a_planted_upward_type_only_import_and_lazy_export_fail(tmp_path: Path) -> None:
    tree = _copy(tmp_path)
    state = tree / "runtime" / "state.py"  # runtime layer, naming a data/ type
    state.write_text(
        state.read_text().replace(
            "if TYPE_CHECKING:\n",
            "if TYPE_CHECKING:\n    from meshrun.data.sampler import ResumableSampler\n",
        )
    )
    face = tree / "monitor" / "__init__.py"  # subsystems layer, handing on a report/ name
    face.write_text(
        face.read_text().replace(
            '"memory_stats": "meshrun.monitor.memory",',
            '"memory_stats": "meshrun.monitor.memory",\n        "write_report": "meshrun.report.html",',
        )
    )
    assert check(tree, DOC.read_text()) == [
        "upward import (type-only or lazy export): meshrun.monitor imports meshrun.report.html",
        "upward import (type-only or lazy export): meshrun.runtime.state imports meshrun.data.sampler",
    ]
