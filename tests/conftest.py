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
