"""docs/porting.md stays true to its worked example: the number of changed lines it states is
the number of ``# [meshrun]`` lines in examples/nanogpt_style.py (and within the 20-line
budget), its table has a row per line, and every ``run.NAME`` it teaches exists on
``meshrun.Run``. The example itself runs in tests/e2e/test_ported_examples.py."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import meshrun

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "porting.md").read_text()
EXAMPLE = (ROOT / "examples" / "nanogpt_style.py").read_text()
MARK = "  # [meshrun]"


def test_the_stated_count_is_the_marked_lines_of_the_example() -> None:
    marked = [line.split(MARK)[0].strip() for line in EXAMPLE.splitlines() if MARK in line]
    stated = int(re.search(r"^## The changed lines: (\d+)$", DOC, re.M)[1])  # type: ignore[index]
    assert len(marked) == stated <= 20, marked
    rows = re.findall(r"^\| (\d+) \| `(.+?)` \|", DOC, re.M)
    assert [int(n) for n, _ in rows] == list(range(1, stated + 1))
    # Each row quotes one marked line (up to its comment), each line once.
    assert sorted(code for _, code in rows) == sorted(marked)


def test_every_run_call_in_the_doc_exists() -> None:
    names = set(re.findall(r"\brun\.([a-z_]+)", DOC))
    assert {"unwrap", "evaluate", "optimizer", "parallelize"} <= names
    assert [n for n in sorted(names) if not hasattr(meshrun.Run, n)] == []
    assert hasattr(meshrun.config, "split_overrides")


def test_the_python_blocks_parse() -> None:
    blocks = re.findall(r"^```python\n(.*?)^```", DOC, re.M | re.S)
    assert len(blocks) >= 2
    for block in blocks:
        ast.parse(block)
