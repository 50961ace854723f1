"""Each package of src/meshrun within its statement budget (.ci/line_budgets.toml): growing past
one fails here unless the same commit raises the budget and says why (a raised budget with its
old reason fails too, checked against the commit before when git can read it)."""

from __future__ import annotations

import subprocess
from collections import Counter
from pathlib import Path
from types import ModuleType

import pytest

import scripts

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]


def _line_count() -> ModuleType:
    return scripts.load(ROOT / ".ci" / "line_count.py", "line_count")


def test_every_package_is_within_its_budget() -> None:
    lc = _line_count()
    try:
        base = lc.budgets_at("HEAD~1")
    except (subprocess.CalledProcessError, OSError):  # a shallow clone, or the file is new
        base = None
    assert lc.problems(lc.statements_now(), lc.budgets(), base) == []


def test_statements_count_nested_ones_and_not_lines() -> None:
    lc = _line_count()
    squeezed = "def f(x):\n    if x: return 1\n    return 2\n"
    assert lc.statements(squeezed) == 4  # def, if, two returns: on three lines
    assert lc.statements('"""Doc."""\n\n\n\nX = 1\n') == 2


def test_a_package_over_its_budget_or_raised_without_a_reason_is_named() -> None:
    lc = _line_count()
    table = {
        "cli": {"statements": 10, "reason": "its size plus 5 %"},
        "plan": {"statements": 30, "reason": "its size plus 5 %"},
        "ft": {"statements": 50, "reason": "torchft's heal needs its transport"},
    }
    base = {
        "plan": {"statements": 20, "reason": "its size plus 5 %"},
        "ft": {"statements": 40, "reason": "its size plus 5 %"},
    }
    now = Counter({"cli": 11, "plan": 25, "ft": 45, "data": 3})
    assert lc.problems(now, table, base) == [
        "cli: 11 statements, over its budget of 10: shrink it, or raise the budget in "
        ".ci/line_budgets.toml in this commit with the reason the package needs the room",
        "data: 3 statements and no budget in .ci/line_budgets.toml",
        "plan: budget raised from 20 to 30 with the reason it had: say why this change needs "
        "the room",
    ]
