"""Load a script that belongs to no package (benchmarks/*.py, examples/*.py, .ci/*.py) as a
module by its path, for the tests that call its functions directly.

    bench = scripts.load(ROOT / "benchmarks" / "chaos.py", "_chaos_bench", register=True)
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load(path: Path, name: str, *, register: bool = False) -> ModuleType:
    """Run the script at ``path`` as a fresh module named ``name``.

    ``register`` puts the module in ``sys.modules`` under ``name`` before it runs: dataclasses
    look their module up there while they are built, and pickle finds functions by their
    module's name. A name registered twice is replaced by the later load."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
