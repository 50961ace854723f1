"""docs/plan.md's published-figure tables, read by the tests that keep them: the rows of a
section, and what is wrong with a row given what the planner predicts now. A table's columns
are ``name | source | setup | published | predicted | error | why``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

PLAN_DOC = Path(__file__).resolve().parents[1] / "docs" / "plan.md"


def table_rows(heading: str, text: str | None = None) -> dict[str, list[str]]:
    """The cells of each data row under ``heading`` (to the next ``## ``), by first cell."""
    text = PLAN_DOC.read_text() if text is None else text
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 7 and re.fullmatch(r"[\d.]+", cells[4].replace(",", "")):
            rows[cells[0]] = cells
    return rows


def number(cell: str) -> float:
    """A cell's figure: thousands separators, signs and a per-cent sign allowed."""
    return float(cell.replace(",", "").replace("%", "").replace("+", "").replace("\u2212", "-"))


def row_problems(
    name: str,
    cells: list[str] | None,
    published: float,
    now: float,
    *,
    table: str,
    within: float,
    published_abs: float | None = None,
) -> list[str]:
    """What is wrong with a docs row: a published figure other than the test's, a prediction
    that is not the planner's now, a wrong error, or an error over ``within`` with no reason."""
    if cells is None:
        return [f"docs/plan.md's {table} has no row {name!r}"]
    shown, predicted, error, why = cells[3], cells[4], cells[5], cells[6]
    out = []
    if number(shown) != pytest.approx(published, abs=published_abs):
        out.append(f"published {shown}, the test's row says {published:g}")
    if number(predicted) != pytest.approx(now, rel=0.01):
        out.append(f"predicted {predicted}, the planner prints {now:.0f} now")
    err = now / published - 1
    if number(error) != pytest.approx(100 * err, abs=0.15):
        out.append(f"error {error}, the planner gives {100 * err:+.1f} %")
    if abs(err) > within and why in ("", "-"):
        out.append(f"{100 * err:+.1f} % off and no reason given")
    return out
