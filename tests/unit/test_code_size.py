"""The size limits of STYLE.md's small modules, kept: no src file over 500 lines as the
formatter writes it (src has no ``# fmt: skip``: a line squeezed past the formatter hides the
size the limit is meant to show), no class over 25 methods counted over its whole MRO within
meshrun (mixins split a class into files, they do not make it smaller). A function's size is
measured by ruff in statements, branches, arguments and complexity (pyproject.toml), not in
physical lines."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
MAX_FILE_LINES = 500
MAX_METHODS = 25
# Classes allowed more, each with its reason (the count is the one measured when it was set).
METHOD_ALLOWANCE = {
    # One class, no bases: its 31 public names are the API scripts call (frozen by
    # test_public_api.py), each a short call into a plain function; the other 3 are
    # __init__, __enter__ and __exit__. Its private helpers are module functions.
    "meshrun.train.run.Run": 34,
}


def oversized(root: Path) -> list[str]:
    """Every file and class under ``root`` past the limits, one line each."""
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        name = path.relative_to(root)
        if text.count("\n") > MAX_FILE_LINES:
            found.append(f"{name}: {text.count(chr(10))} lines")
        module = ".".join(name.with_suffix("").parts)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                methods = [
                    n for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
                ]
                limit = METHOD_ALLOWANCE.get(f"{module}.{node.name}", MAX_METHODS)
                if len(methods) > limit:
                    found.append(f"{name}: class {node.name} has {len(methods)} methods")
    return found


def methods_over_mro(cls: type) -> set[str]:
    """The functions and properties a class has from itself and its meshrun bases."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass.__module__.startswith("meshrun"):
            names |= {n for n, v in vars(klass).items() if callable(v) or isinstance(v, property)}
    return names


def test_classes_with_bases_stay_within_the_method_limit_over_their_mro() -> None:
    import importlib
    import inspect

    found = []
    for path in sorted((SRC / "meshrun").rglob("*.py")):
        if path.name == "__main__.py":
            continue
        module = ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
        for _, cls in inspect.getmembers(importlib.import_module(module), inspect.isclass):
            if cls.__module__ != module or len(cls.__mro__) <= 2:
                continue
            count = len(methods_over_mro(cls))
            if count > METHOD_ALLOWANCE.get(f"{module}.{cls.__name__}", MAX_METHODS):
                found.append(f"{module}.{cls.__name__}: {count} methods over its MRO")
    assert found == []


def test_src_stays_within_the_size_limits() -> None:
    assert oversized(SRC) == []


def test_the_check_sees_a_long_file(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text("x = 1\n" * (MAX_FILE_LINES + 1))
    assert oversized(tmp_path) == [f"m.py: {MAX_FILE_LINES + 1} lines"]


def test_src_formats_every_line() -> None:
    skipped = [
        f"{p.relative_to(SRC)}:{i}"
        for p in sorted(SRC.rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if "fmt: skip" in line or "fmt: off" in line
    ]
    assert skipped == []


def test_skipped_formatting_states_its_reason() -> None:
    """Outside src a ``fmt: skip`` is allowed where the file says why in its docstring (a script
    a doc quotes as its user wrote it)."""
    unexplained = []
    for top in ("tests", "examples", "benchmarks"):
        for p in sorted((SRC.parent / top).rglob("*.py")):
            text = p.read_text()
            head = text.split('"""', 2)[1] if text.startswith('"""') else ""
            if "fmt: skip" in text.replace(head, "", 1) and "fmt: skip" not in head:
                unexplained.append(str(p.relative_to(SRC.parent)))
    assert unexplained == [], "a fmt: skip needs its reason in the file's docstring"
