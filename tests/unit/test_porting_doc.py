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


def _run_fields() -> set[str]:
    """The public attributes ``Run.__init__`` sets, as declared on the class."""
    return {n for n in meshrun.Run.__annotations__ if not n.startswith("_")}


def _run_properties() -> set[str]:
    return {n for n, v in vars(meshrun.Run).items() if isinstance(v, property)}


def test_every_run_call_in_the_doc_exists() -> None:
    names = set(re.findall(r"(?<!/)\brun\.([a-z_]+)", DOC))
    assert {"unwrap", "evaluate", "optimizer", "parallelize", "is_step_end", "device"} <= names
    fields = _run_fields()
    assert [n for n in sorted(names) if not hasattr(meshrun.Run, n) and n not in fields] == []
    assert hasattr(meshrun.config, "split_overrides")


def test_the_attribute_table_covers_every_public_field() -> None:
    """Every public field and property a Run has is in the table, and the reverse."""
    section = DOC.split("## Run's public attributes", 1)[1].split("\n## ", 1)[0]
    in_table = set(re.findall(r"^\| `run\.([a-z_]+)`(?:, `run\.([a-z_]+)`)?", section, re.M))
    listed = {n for pair in in_table for n in pair if n}
    assert listed == _run_fields() | _run_properties(), sorted(listed)


def _shape_sections() -> list[tuple[str, str]]:
    """(script path, diff text) of each section under "Three other shapes of script"."""
    part = DOC.split("## Three other shapes of script", 1)[1].split("\n## ", 1)[0]
    found = []
    for sub in part.split("\n### ")[1:]:
        script = re.search(r"\(\.\./(tests/e2e/scripts/porting/\w+\.py)\)", sub)
        diff = re.search(r"^```diff\n(.*?)^```", sub, re.M | re.S)
        assert script and diff, sub[:80]
        found.append((script[1], diff[1]))
    return found


def test_each_shape_diff_is_the_code_of_its_script() -> None:
    """Every added and context line of a shape's diff is a line of the ported script."""
    sections = _shape_sections()
    assert len(sections) == 3
    for path, diff in sections:
        lines = {line.strip() for line in (ROOT / path).read_text().splitlines()}
        kept = [d[1:] for d in diff.splitlines() if d[:1] in "+ " and d[1:].strip() != "..."]
        missing = [line for line in kept if line.strip() not in lines]
        assert not missing, f"{path}: {missing}"


def test_the_python_blocks_parse() -> None:
    blocks = re.findall(r"^```python\n(.*?)^```", DOC, re.M | re.S)
    assert len(blocks) >= 2
    for block in blocks:
        ast.parse(block)
