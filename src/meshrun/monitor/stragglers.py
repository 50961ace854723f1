"""Straggler detection: every N steps, one small all-gather of each rank's step components
(summed over the window), then a pure comparison against the median of the *other* ranks.

What is compared, and why: under synchronous data parallelism every rank's step *time* is the
same (the fast ranks wait for the slow one inside the collectives), so step time cannot say who
is slow. The components can: ``data_wait_s`` (blocked on the loader) and ``own_s``, the step
time outside backward and outside the guard collective, i.e. data, forward and optimizer, where
a rank does not wait for others under DDP. A rank that is slow in those is the one the others
wait for. Time a slow rank loses *inside* backward is also spent waiting by its peers there,
so it is not attributed (documented in docs/monitor.md).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["COMPONENTS", "Straggler", "find_stragglers", "gather_components"]

# Per-rank figures gathered at each check, summed over the steps since the last check: the
# step, the loader wait, the own time (below), compute (forward + backward less the exposed
# gradient all-reduce), the exposed all-reduce (DDP's hook) and the optimizer.
COMPONENTS = ("step_time_s", "data_wait_s", "own_s", "compute_s", "comm_exposed_s", "optimizer_s")
# Which of them can name a straggler (step time is equal on all ranks: see above).
COMPARED = ("data_wait_s", "own_s")


@dataclass(frozen=True)
class Straggler:
    rank: int
    host: str
    step: int
    component: str
    value_s: float  # per step, averaged over the window
    median_s: float  # the other ranks' median, per step
    slower_by: float  # value / median

    def fields(self) -> dict[str, object]:
        """The ``{"event": "straggler", ...}`` line's fields."""
        return {
            "rank": self.rank,
            "host": self.host,
            "step": self.step,
            "component": self.component,
            "value_s": self.value_s,
            "median_s": self.median_s,
            "slower_by": self.slower_by,
        }

    def message(self) -> str:
        return (
            f"straggler: rank {self.rank} on {self.host} at step {self.step}: "
            f"{self.component} {self.value_s * 1e3:.1f} ms/step vs median "
            f"{self.median_s * 1e3:.1f} ms of the other ranks (slower by {self.slower_by:.2f}x)"
        )


def find_stragglers(
    per_rank: Sequence[Mapping[str, float]],
    hosts: Sequence[str],
    step: int,
    steps: int,
    factor: float,
    min_s: float,
) -> list[Straggler]:
    """Ranks whose per-step component exceeds ``factor`` x the other ranks' median and the
    median by at least ``min_s`` seconds (so a 1 ms jitter on a 2 ms step is not flagged)."""
    found: list[Straggler] = []
    if len(per_rank) < 2 or steps < 1:
        return found
    for rank, row in enumerate(per_rank):
        for comp in COMPARED:
            value = row[comp] / steps
            median = statistics.median(r[comp] / steps for i, r in enumerate(per_rank) if i != rank)
            if value - median >= min_s and value >= factor * median:
                slower = value / median if median > 0 else float("inf")
                found.append(Straggler(rank, hosts[rank], step, comp, value, median, slower))
    return found


def gather_components(window: Mapping[str, float], device: torch.device) -> list[dict[str, float]]:
    """All ranks' window sums, in rank order: one all-gather of ``len(COMPONENTS)`` floats."""
    mine = torch.tensor([window[c] for c in COMPONENTS], dtype=torch.float64)
    if device.type == "cuda":
        mine = mine.to(device)
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [dict(zip(COMPONENTS, t.cpu().tolist(), strict=True)) for t in out]


def gather_hosts(hostname: str) -> list[str]:
    """Every rank's host name, once per run (an object all-gather)."""
    hosts: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, hostname)
    return [str(h) for h in hosts]
