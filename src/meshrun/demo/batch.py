"""The demo's batch fitted to any process count (``meshrun demo --nproc N``): its config asks
for 32 samples per step, which 3, 6 or 7 processes do not divide."""

from __future__ import annotations

import sys

from meshrun.config import Config, dp_size_for_world

__all__ = ["fit_micro_batch"]


def fit_micro_batch(cfg: Config, nproc: int, keep_global: bool = False) -> None:
    """Fit the demo's batch to any process count, said aloud, never silently: lower the
    micro-batch so the global batch divides; where none does (3, 6, 7 ... processes for 32),
    take the largest global batch up to the configured one that micro_batch (<= the
    configured) x data-parallel size x accumulation makes (demo.toml). A global batch the user
    passed is kept: then validation names what does not divide."""
    g, m = cfg.data.global_batch, cfg.data.micro_batch
    dp = dp_size_for_world(cfg, nproc)
    chunks = cfg.parallel.pp_microbatches if cfg.parallel.pp > 1 else 1  # micro splits in them
    micros = [k for k in range(m, 0, -1) if k % chunks == 0] or [m]
    fits = [k for k in micros if g % (k * dp) == 0]
    if fits or keep_global:
        if fits and fits[0] != m:
            print(
                f"meshrun demo: data.micro_batch {m} -> {fits[0]} so that the global batch {g} "
                f"divides over {dp} data-parallel processes",
                file=sys.stderr,
            )
            cfg.data.micro_batch = fits[0]
        return
    # (global batch, micro) pairs at most g, the largest global batch first, then the largest
    # micro-batch; one smallest micro-batch per rank when even that is more than g.
    pairs = [(k * dp * (g // (k * dp)), k) for k in micros if k * dp <= g]
    new_g, k = max(pairs) if pairs else (micros[-1] * dp, micros[-1])
    print(
        f"meshrun demo: data.global_batch {g} -> {new_g}, data.micro_batch {m} -> {k} "
        f"(accumulation {new_g // (k * dp)}): no micro_batch <= {m} splits {g} samples over "
        f"{dp} data-parallel processes; pass --data.global_batch=N to choose",
        file=sys.stderr,
    )
    cfg.data.global_batch, cfg.data.micro_batch = new_g, k
