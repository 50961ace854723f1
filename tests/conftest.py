"""Put tests/ on sys.path so test modules can ``from _dist import run_distributed``; skip the
heavy variants unless asked for."""

import os
import sys
from pathlib import Path

import pytest

_TESTS = str(Path(__file__).parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

HEAVY_ENV = "MESHRUN_HEAVY_TESTS"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``@pytest.mark.heavy``: a variant beyond what CI must show (a second spelling, a larger
    mesh of a feature already shown on 2 ranks), run with MESHRUN_HEAVY_TESTS=1 (`make
    test-heavy`) so CI's whole run stays within its time."""
    if os.environ.get(HEAVY_ENV):
        return
    skip = pytest.mark.skip(reason=f"heavy variant: set {HEAVY_ENV}=1 (make test-heavy) to run it")
    for item in items:
        if "heavy" in item.keywords:
            item.add_marker(skip)


# --- what the suite costs, per tier -------------------------------------------------------

# Worker-seconds each tier may take (the sum of its tests' setup, call and teardown; a skipped
# heavy variant costs nothing). CI runs two workers on 2 cores inside a 25-minute job; its
# installs, lint and the alone tests took 200 s there (CI's 1817 s against pytest's 1617 s),
# so with a minute's margin the three budgets add up to two workers' worth of 1240 s (2480 s).
# Measured on 2026-12-06 (an idle machine, pytest 1256 s): unit 130, dist 589, e2e 1724.
# A tier over its budget is printed as such (never failed on: a time is not a test's verdict);
# growth is then a decision.
TIER_BUDGET_S = {"unit": 150.0, "dist": 650.0, "e2e": 1680.0}
_DURATIONS: dict[str, dict[str, float]] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Add each phase's duration to its test (xdist sends the workers' reports here too)."""
    tests = _DURATIONS.setdefault(report.nodeid, {})
    tests[report.when] = report.duration


def _tier(nodeid: str) -> str:
    parts = nodeid.split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else "other"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Each tier's total against its budget, and every test's time in the file that
    ``MESHRUN_DURATIONS_FILE`` names (JSON: nodeid -> seconds), for the next change to compare."""
    if not _DURATIONS:
        return
    per_test = {k: round(sum(v.values()), 3) for k, v in sorted(_DURATIONS.items())}
    totals: dict[str, list[float]] = {}
    for nodeid, seconds in per_test.items():
        totals.setdefault(_tier(nodeid), []).append(seconds)
    terminalreporter.section("time per tier (worker-seconds)")
    for tier, times in sorted(totals.items()):
        budget = TIER_BUDGET_S.get(tier)
        verdict = "" if budget is None else f" of {budget:.0f} s budget"
        if budget is not None and sum(times) > budget:
            verdict += f": OVER by {sum(times) - budget:.0f} s"
        terminalreporter.write_line(f"{tier}: {len(times)} tests, {sum(times):.0f} s{verdict}")
    if path := os.environ.get("MESHRUN_DURATIONS_FILE"):
        import json

        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(per_test, indent=1) + "\n")
