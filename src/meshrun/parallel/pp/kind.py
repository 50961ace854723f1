"""``isinstance(obj, Pipeline)`` without importing the pipeline modules: a plain run never
builds one. Its own module, not ``parallel/kinds.py``: the pipeline modules use those checks,
and the type here would close a circle through them."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TypeGuard

if TYPE_CHECKING:
    from meshrun.parallel.pp.pipeline import Pipeline


def is_pipeline(obj: object) -> TypeGuard[Pipeline]:
    """``isinstance(obj, Pipeline)`` (``run.pipeline``); ``False`` before the module is loaded,
    when no pipeline can exist."""
    mod = sys.modules.get("meshrun.parallel.pp.pipeline")
    return mod is not None and isinstance(obj, mod.Pipeline)
