"""What the two training workers of ``benchmarks/overhead.py --mode step`` share: their flags,
their clock and their result file.

Standard library only, so the plain worker stays a torch-only script. Both workers get the
same hyperparameters from ``benchmarks/overhead.py`` as flags; neither has defaults of its own
that could drift apart.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# The benchmark writes time.time() here just before it starts the launcher: startup is
# measured from that moment, so interpreter start, imports and rendezvous all count.
T0_ENV = "OVERHEAD_T0"


def parse_worker_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="one training worker of benchmarks/overhead.py --mode step"
    )
    p.add_argument("--result", type=Path, required=True, help="JSON written by rank 0")
    p.add_argument("--run-dir", type=Path, help="meshrun's run directory (meshrun worker only)")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--skip", type=int, required=True, help="warm-up steps left out of the times")
    p.add_argument("--size", required=True, choices=["tiny", "small"])
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--global-batch", type=int, required=True)
    p.add_argument("--micro-batch", type=int, required=True)
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--warmup-steps", type=int, required=True)
    p.add_argument("--min-lr-ratio", type=float, required=True)
    p.add_argument("--weight-decay", type=float, required=True)
    p.add_argument("--corpus-bytes", type=int, required=True)
    return p.parse_args(argv)


class Clock:
    """Marks seconds since the benchmark's launch (``T0_ENV``) and per-step times: wall time
    (the figure that matters) and this process's CPU time (all its threads), which a busy
    machine disturbs less: time spent waiting for a core or for the other rank is not in it."""

    def __init__(self) -> None:
        self.t0 = float(os.environ[T0_ENV])
        self.marks: dict[str, float] = {}
        self.step_times: list[float] = []
        self.cpu_times: list[float] = []
        self._last = time.perf_counter()
        self._last_cpu = time.process_time()

    def mark(self, name: str) -> None:
        self.marks[name] = time.time() - self.t0

    def start_steps(self) -> None:
        self._last, self._last_cpu = time.perf_counter(), time.process_time()

    def end_step(self) -> None:
        """Call right after each optimizer step: the interval since the previous one."""
        now, cpu = time.perf_counter(), time.process_time()
        self.step_times.append(now - self._last)
        self.cpu_times.append(cpu - self._last_cpu)
        self._last, self._last_cpu = now, cpu
        if len(self.step_times) == 1:
            self.mark("first_step")


def write_result(path: Path, variant: str, clock: Clock, skip: int, **extra: Any) -> None:
    """Rank 0's record of one run, read back by overhead.py."""
    record = {
        "variant": variant,
        "step_times_s": clock.step_times[skip:],
        "cpu_times_s": clock.cpu_times[skip:],
        "startup_s": clock.marks["first_step"],
        "marks_s": clock.marks,
        **extra,
    }
    path.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
