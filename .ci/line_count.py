"""Lines and statements of Python per package of src/meshrun, now and at a base commit, with
the delta, and each package against its budget (.ci/line_budgets.toml): printed by CI so that
growth is a decision someone saw, not a drift. tests/unit/test_line_budgets.py fails the suite
when a package is over its budget, or when a budget was raised without a new reason.

    python .ci/line_count.py [BASE]      # BASE defaults to HEAD~1 (the change CI checks)

Reads the base through git (nothing is checked out); a base git cannot resolve (a shallow
clone) prints the current counts alone. Budgets count statements (``ast.stmt`` nodes, nested
ones too), not physical lines: a line squeezed past the formatter hides nothing."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PKG = "src/meshrun/"
BUDGETS = ROOT / ".ci" / "line_budgets.toml"


def _package(path: str) -> str:
    """``src/meshrun/launch/k8s/job.py`` -> ``launch``; a top-level module -> ``(top)``."""
    rest = path[len(PKG) :]
    return rest.split("/", 1)[0] if "/" in rest else "(top)"


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout


def statements(text: str) -> int:
    """The statements of a module's source, nested ones (a method's body, a branch) too."""
    return sum(isinstance(node, ast.stmt) for node in ast.walk(ast.parse(text)))


def _sources_now() -> dict[str, str]:
    return {
        p.relative_to(ROOT).as_posix(): p.read_text() for p in sorted((ROOT / PKG).rglob("*.py"))
    }


def _sources_at(rev: str) -> dict[str, str]:
    files = [f for f in _git("ls-tree", "-r", "--name-only", rev, PKG).split() if f.endswith(".py")]
    return {rel: _git("show", f"{rev}:{rel}") for rel in files}


def _count(sources: dict[str, str], measure: Any) -> Counter[str]:
    out: Counter[str] = Counter()
    for rel, text in sources.items():
        out[_package(rel)] += measure(text)
    return out


def counts_now() -> Counter[str]:
    return _count(_sources_now(), lambda text: text.count("\n"))


def counts_at(rev: str) -> Counter[str]:
    return _count(_sources_at(rev), lambda text: text.count("\n"))


def statements_now() -> Counter[str]:
    return _count(_sources_now(), statements)


def _toml(text: str) -> dict[str, Any]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the project's own fallback
        import tomli as tomllib  # type: ignore[no-redef]
    return tomllib.loads(text)


def budgets(text: str | None = None) -> dict[str, dict[str, Any]]:
    """Package -> ``{"statements": N, "reason": "..."}`` from the budgets file (or ``text``)."""
    return _toml(BUDGETS.read_text() if text is None else text)


def budgets_at(rev: str) -> dict[str, dict[str, Any]]:
    return budgets(_git("show", f"{rev}:{BUDGETS.relative_to(ROOT).as_posix()}"))


def problems(
    now: Counter[str], table: dict[str, dict[str, Any]], base: dict[str, dict[str, Any]] | None
) -> list[str]:
    """Every breach, one line each: a package over its budget or without one, a budget without
    a reason, and (against ``base``, the budgets before this change) a budget raised with the
    reason it had."""
    out = []
    for name in sorted(set(now) | set(table)):
        entry = table.get(name)
        if entry is None:
            out.append(f"{name}: {now[name]} statements and no budget in .ci/line_budgets.toml")
            continue
        if not str(entry.get("reason", "")).strip():
            out.append(f"{name}: its budget says no reason")
        if now[name] > entry["statements"]:
            out.append(
                f"{name}: {now[name]} statements, over its budget of {entry['statements']}: "
                "shrink it, or raise the budget in .ci/line_budgets.toml in this commit with "
                "the reason the package needs the room"
            )
        old = (base or {}).get(name)
        raised = old is not None and entry["statements"] > old["statements"]
        if raised and entry.get("reason") == old.get("reason"):
            out.append(
                f"{name}: budget raised from {old['statements']} to {entry['statements']} "
                "with the reason it had: say why this change needs the room"
            )
    return out


def main(argv: list[str]) -> int:
    base = argv[0] if argv else "HEAD~1"
    now = counts_now()
    try:
        before: Counter[str] | None = counts_at(base)
    except (subprocess.CalledProcessError, OSError):  # no git, no history: counts alone
        before = None
    try:
        table, stmts = budgets(), statements_now()
    except (ModuleNotFoundError, OSError):  # no TOML reader under this Python: lines alone
        table, stmts = {}, Counter()
    print(
        f"lines of Python per package of {PKG}"
        + (f" (delta against {base})" if before else "")
        + ("; statements against the budget" if table else "")
    )
    for name in sorted(set(now) | set(before or {})):
        delta = "" if before is None else f" {now[name] - before[name]:+6d}"
        budget = table.get(name, {}).get("statements")
        mark = " OVER" if budget is not None and stmts[name] > budget else ""
        used = f"  {stmts[name]:6d} / {budget}{mark}" if table else ""
        print(f"  {name:<12} {now[name]:6d}{delta}{used}")
    total = sum(now.values())
    print(
        f"  {'total':<12} {total:6d}"
        + ("" if before is None else f" {total - sum(before.values()):+6d}")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
