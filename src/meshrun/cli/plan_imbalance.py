"""``meshrun plan --moe-imbalance``: a factor given, or one measured by a run: the mean of the
``moe_imbalance`` figures (the busiest expert's tokens over the mean, worst layer;
monitor/moe.py) on the logged rows of its ``metrics.jsonl``. The mean, because the planner's
step time is linear in the factor and a run's time is the sum of its steps'."""

from __future__ import annotations

import json
import math
from pathlib import Path

from meshrun.plan.errors import PlanError

METRIC = "moe_imbalance"


def read_imbalance(text: str) -> tuple[float, str]:
    """(the factor, where it came from: "" when given as a number)."""
    try:
        return float(text), ""
    except ValueError:
        pass
    path = Path(text)
    path = path / "metrics.jsonl" if path.is_dir() else path
    if not path.is_file():
        raise PlanError(
            f"--moe-imbalance {text!r} is not allowed: give a number >= 1.0 (e.g. 1.3) or a run "
            "directory (or its metrics.jsonl) that logged moe_imbalance"
        )
    values = _logged(path)
    if not values:
        raise PlanError(
            f"--moe-imbalance {text!r}: {path} has no {METRIC} figure (logged under parallel.ep "
            "only); give the factor as a number instead"
        )
    mean = sum(values) / len(values)
    return mean, f"the mean of {len(values)} logged {METRIC} figures in {path}"


def _logged(path: Path) -> list[float]:
    values = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash
        value = row.get(METRIC) if isinstance(row, dict) else None
        if isinstance(value, (int, float)) and math.isfinite(value):
            values.append(float(value))
    return values


__all__ = ["read_imbalance"]
