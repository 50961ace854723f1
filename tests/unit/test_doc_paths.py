"""Every repository path that the README, docs/*.md and the docstrings under src/ send a reader
to exists: each `src/...py` and `docs/...md` path (backticked or not) and each Markdown link to
a .md or .py file. A file moved or removed takes its mentions along, or this test names each
one left behind (file, line, path)."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
# A path from the repository's root; a trailing :LINE, #anchor or full stop is not part of it.
PATH = re.compile(r"(?<![\w./-])((?:src|docs)/[\w./-]+?\.(?:py|md))(?![\w/-])")
LINK = re.compile(r"\]\(([\w./-]+?\.(?:py|md))(?:#[^)]*)?\)")  # relative to the document


def _docstrings(path: Path) -> Iterator[tuple[int, str]]:
    """Each docstring of a module (its own, its classes' and functions'), with its line."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        kinds = ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
        if isinstance(node, kinds) and (text := ast.get_docstring(node, clean=False)):
            yield node.body[0].lineno, text


def _texts(root: Path) -> Iterator[tuple[Path, int, str]]:
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            yield doc, number, line
    for source in sorted((root / "src").rglob("*.py")):
        for first, text in _docstrings(source):
            for offset, line in enumerate(text.splitlines()):
                yield source, first + offset, line


def missing_paths(root: Path = ROOT) -> list[str]:
    """``FILE:LINE: PATH`` for each path or link that names no file of the repository."""
    found = []
    for where, number, line in _texts(root):
        paths = [root / p for p in PATH.findall(line)]
        if where.suffix == ".md":
            paths += [where.parent / p for p in LINK.findall(line)]
        found += [
            f"{where.relative_to(root)}:{number}: {p.relative_to(root) if p.is_relative_to(root) else p}"
            for p in paths
            if not p.is_file()
        ]
    return found


def test_the_scanner_reads_paths_and_links() -> None:
    line = "see `src/meshrun/a.py`, ``docs/b.md#x``, src/c.py:12 and docs/d.md."
    assert PATH.findall(line) == ["src/meshrun/a.py", "docs/b.md", "src/c.py", "docs/d.md"]
    assert PATH.findall("`meshrun/a.py`, tests/src/x.py, docs/plan.mdx") == []
    assert LINK.findall("[the plan](plan.md#search), [code](../src/x.py)") == [
        "plan.md",
        "../src/x.py",
    ]


def test_a_planted_stale_path_is_named(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "src" / "pkg").mkdir(parents=True)
    (tmp_path / "src" / "pkg" / "here.py").write_text(
        '"""Read docs/gone.md and `src/pkg/here.py`."""\n'
    )
    (tmp_path / "docs" / "a.md").write_text("# A\n\n[b](b.md) and `src/pkg/moved.py`\n")
    (tmp_path / "README.md").write_text("[a](docs/a.md)\n")
    assert missing_paths(tmp_path) == [
        "docs/a.md:3: src/pkg/moved.py",
        "docs/a.md:3: docs/b.md",
        "src/pkg/here.py:1: docs/gone.md",
    ]


def test_every_path_in_the_readme_docs_and_docstrings_exists() -> None:
    assert missing_paths() == []
