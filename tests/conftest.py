"""Put tests/ on sys.path so test modules can ``from _dist import run_distributed``."""

import sys
from pathlib import Path

_TESTS = str(Path(__file__).parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
