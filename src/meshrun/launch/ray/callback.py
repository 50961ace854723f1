"""A Ray Train callback that says each worker-group failure, one line, as ``meshrun launch``
does for torchrun's restarts. It runs in Ray Train's controller process (Ray forwards its
output to the driver), so it imports Ray: only launch/ray/job.py imports this module."""

from __future__ import annotations

import sys
from typing import Any

from ray.train import UserCallback

from meshrun.launch.ray.failures import read_failures

__all__ = ["RestartAnnouncer"]


def _short(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:160]


class RestartAnnouncer(UserCallback):
    def __init__(self, max_restarts: int, logs_dir: str) -> None:
        self.max_restarts = max_restarts
        self.logs_dir = logs_dir  # the workers' files: who died first comes first
        self.failures = 0

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        self.failures += 1
        # Ray may report the victim with the cause (a peer's Gloo error with the killed rank):
        # the summary's order, the rank that died or exited first leading.
        order = [f.rank for f in read_failures(self.logs_dir, worker_exceptions)]
        ranks = ", ".join(f"rank {r}: {_short(worker_exceptions[r])}" for r in order[:4])
        if self.failures <= self.max_restarts:
            then = f"Ray restarts it ({self.failures} of --max-restarts {self.max_restarts})"
        else:
            then = f"no restart left (--max-restarts {self.max_restarts})"
        print(f"meshrun ray launch: worker group failed ({ranks}); {then}", file=sys.stderr)
