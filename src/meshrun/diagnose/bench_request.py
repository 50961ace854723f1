"""What ``meshrun bench`` asks every rank to measure, as one JSON argument of the worker.

The flags and their checks live in cli/diagnose.py only; the worker (diagnose/bench_worker.py)
reads this record back, so it has no parser of its own to keep in step with the command line.
Kept apart from the worker so the command line builds it without importing the measurements.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass

MODULE = "meshrun.diagnose.bench_worker"


@dataclass(frozen=True)
class BenchRequest:
    """What ``meshrun bench`` asks every rank to measure (checked by cli/diagnose.py)."""

    out: str
    kind: str = "all"
    max_mb: float = 16.0
    precision: str = "fp32"
    seconds: float = 0.3
    pairs: bool = False
    pair_mb: float = 4.0
    nodes: int = 1  # > 1: the collectives cross the nodes' link (calibration.py's comm_inter)

    def to_argv(self) -> list[str]:
        return [json.dumps(asdict(self))]

    @classmethod
    def from_argv(cls, argv: Sequence[str]) -> BenchRequest:
        if len(argv) != 1:
            raise SystemExit(f"{MODULE}: expected one JSON request argument, got {list(argv)}")
        return cls(**json.loads(argv[0]))
