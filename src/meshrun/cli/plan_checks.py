"""``meshrun plan``'s flags checked before any work: a bad number is one line naming the flag,
never a traceback after the search."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from meshrun.plan.errors import PlanError

SHAPE_FLAGS = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq")


def check_plan_numbers(a: argparse.Namespace) -> None:
    """Before any work: every number flag finite, every shape flag positive, and the file
    --emit-config names writable, so a bad flag is one line, not a traceback after the search."""
    for name, value in sorted(vars(a).items()):
        flag = f"--{name.replace('_', '-')}"
        if isinstance(value, float) and not math.isfinite(value):
            raise PlanError(f"{flag} {value} is not allowed: must be a finite number")
        if name in SHAPE_FLAGS and value is not None and value < 1:
            raise PlanError(f"{flag} {value} is not allowed: must be >= 1")
    target = Path(a.emit_config) if a.emit_config else None
    if target is not None and (target.is_dir() or not target.parent.is_dir()):
        what = "is a directory" if target.is_dir() else "is in a directory that does not exist"
        raise PlanError(
            f"--emit-config {a.emit_config!r} {what}; give a file path such as plan.toml"
        )
