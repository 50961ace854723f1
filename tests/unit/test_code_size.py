"""The size limits of STYLE.md's small modules, kept: no src file over 500 lines, no function
over 50, no class over 25 methods (the ``Run`` facade included)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 50
MAX_METHODS = 25


def oversized(root: Path) -> list[str]:
    """Every file, function and class under ``root`` past the limits, one line each."""
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        name = path.relative_to(root)
        if text.count("\n") > MAX_FILE_LINES:
            found.append(f"{name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    found.append(f"{name}: function {node.name} is {lines} lines")
            elif isinstance(node, ast.ClassDef):
                methods = [
                    n for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
                ]
                if len(methods) > MAX_METHODS:
                    found.append(f"{name}: class {node.name} has {len(methods)} methods")
    return found


def test_src_stays_within_the_size_limits() -> None:
    assert oversized(SRC) == []


def test_the_check_sees_a_long_function(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "m.py").write_text(f"def long() -> None:\n{body}\n")
    assert oversized(tmp_path) == [f"m.py: function long is {MAX_FUNCTION_LINES + 1} lines"]
