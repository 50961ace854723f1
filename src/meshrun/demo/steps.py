"""The demo's ``--steps N``: ``optim.steps = N``, and a warmup that fits inside a short run
(demo.toml warms up for 10 steps; a warmup longer than the run is refused by the config)."""

from __future__ import annotations

import sys
from collections.abc import Collection

DEMO_WARMUP = 10  # demo.toml's optim.warmup_steps


def steps_overrides(steps: int, keys: Collection[str]) -> list[tuple[str, str]]:
    """The overrides ``--steps`` stands for; ``keys``: the keys the user set (kept as set)."""
    pairs = [("optim.steps", str(steps))]
    if steps < DEMO_WARMUP and "optim.warmup_steps" not in keys:
        # A short demo (a test, a smoke run) keeps its warmup inside the run, said aloud.
        print(
            f"meshrun demo: --steps {steps} is shorter than the demo's {DEMO_WARMUP}-step "
            f"warmup: optim.warmup_steps = {steps // 2}",
            file=sys.stderr,
        )
        pairs.append(("optim.warmup_steps", str(steps // 2)))
    return pairs
