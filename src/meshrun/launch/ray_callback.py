"""A Ray Train callback that says each worker-group failure, one line, as ``meshrun launch``
does for torchrun's restarts. It runs in Ray Train's controller process (Ray forwards its
output to the driver), so it imports Ray: only ray_job.py imports this module."""

from __future__ import annotations

import sys
from typing import Any

from ray.train import UserCallback

__all__ = ["RestartAnnouncer"]


def _short(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:160]


class RestartAnnouncer(UserCallback):
    def __init__(self, max_restarts: int) -> None:
        self.max_restarts = max_restarts
        self.failures = 0

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        self.failures += 1
        ranks = ", ".join(
            f"rank {r}: {_short(e)}" for r, e in sorted(worker_exceptions.items())[:4]
        )
        if self.failures <= self.max_restarts:
            then = f"Ray restarts it ({self.failures} of --max-restarts {self.max_restarts})"
        else:
            then = f"no restart left (--max-restarts {self.max_restarts})"
        print(f"meshrun ray launch: worker group failed ({ranks}); {then}", file=sys.stderr)
