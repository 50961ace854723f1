"""Lines of Python per package of src/meshrun, now and at a base commit, with the delta: printed
by CI so that growth is a decision someone saw, not a drift.

    python .ci/line_count.py [BASE]      # BASE defaults to HEAD~1 (the change CI checks)

Reads the base through git (nothing is checked out); a base git cannot resolve (a shallow
clone) prints the current counts alone."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = "src/meshrun/"


def _package(path: str) -> str:
    """``src/meshrun/launch/k8s/job.py`` -> ``launch``; a top-level module -> ``(top)``."""
    rest = path[len(PKG) :]
    return rest.split("/", 1)[0] if "/" in rest else "(top)"


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout


def counts_now() -> Counter[str]:
    out: Counter[str] = Counter()
    for path in sorted((ROOT / PKG).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        out[_package(rel)] += path.read_text().count("\n")
    return out


def counts_at(rev: str) -> Counter[str]:
    out: Counter[str] = Counter()
    files = [f for f in _git("ls-tree", "-r", "--name-only", rev, PKG).split() if f.endswith(".py")]
    for rel in files:
        out[_package(rel)] += _git("show", f"{rev}:{rel}").count("\n")
    return out


def main(argv: list[str]) -> int:
    base = argv[0] if argv else "HEAD~1"
    now = counts_now()
    try:
        before: Counter[str] | None = counts_at(base)
    except (subprocess.CalledProcessError, OSError):  # no git, no history: counts alone
        before = None
    print(f"lines of Python per package of {PKG}" + (f" (delta against {base})" if before else ""))
    for name in sorted(set(now) | set(before or {})):
        delta = "" if before is None else f" {now[name] - before[name]:+6d}"
        print(f"  {name:<12} {now[name]:6d}{delta}")
    total = sum(now.values())
    print(
        f"  {'total':<12} {total:6d}"
        + ("" if before is None else f" {total - sum(before.values()):+6d}")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
