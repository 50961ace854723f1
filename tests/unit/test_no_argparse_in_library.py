"""Command-line code stays in the command-line layer (docs/architecture.md): argparse is
imported only under ``cli/`` and by the demo's own training script (a user script with its
own flags, as the porting guide shows). A library module takes typed
arguments. The checker reads imports with ``ast`` (lazy ones in functions count), and a test
plants an argparse import in a library module of a copy of the tree to see it fail."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "meshrun"

# Outside cli/ but command-line code by purpose (see the module docstring).
ALLOWED = {"demo/train.py"}


def is_cli_module(rel: Path) -> bool:
    return rel.parts[0] == "cli" or rel.as_posix() in ALLOWED


def imports_argparse(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import) and any(a.name == "argparse" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.module == "argparse":
            return True
    return False


def library_modules_with_argparse(src: Path = SRC) -> list[str]:
    found = []
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src)
        if not is_cli_module(rel) and imports_argparse(path):
            found.append(rel.as_posix())
    return found


def test_no_library_module_imports_argparse() -> None:
    assert library_modules_with_argparse() == []


def test_a_planted_argparse_import_fails(tmp_path: Path) -> None:
    copy = tmp_path / "meshrun"
    shutil.copytree(SRC, copy, ignore=shutil.ignore_patterns("__pycache__"))
    target = copy / "launch" / "torchrun_flags.py"
    target.write_text(target.read_text() + "\n\ndef _late() -> None:\n    import argparse\n")
    assert library_modules_with_argparse(copy) == ["launch/torchrun_flags.py"]


def test_cli_modules_are_recognised() -> None:
    # The command-line modules do use argparse: the allow-list is not vacuous.
    assert imports_argparse(SRC / "cli" / "torchrun.py")
    assert imports_argparse(SRC / "cli" / "main.py")
