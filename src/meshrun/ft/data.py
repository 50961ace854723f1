"""Which share of each global batch a replica group's rank reads.

Every group reads its own fixed share: rank ``r`` of the data-parallel ranks of group ``g``
(``D`` of them) is data-parallel rank ``g * D + r`` of ``replica_groups * D``. Without faults
that is exactly plain data parallelism over the whole world (the same samples per rank, the
same gradient). While a group is missing its share of those steps is not trained
(``fault_tolerance.missing_group = "shrink"``): the data position still advances by the whole
global batch, so the order stays a function of the global samples consumed and a group that
heals continues at its peers' position.
"""

from __future__ import annotations

from meshrun.config.fault_tolerance import FaultToleranceConfig

__all__ = ["data_share"]


def data_share(ft: FaultToleranceConfig, dp_rank: int, dp_size: int) -> tuple[int, int]:
    """(rank, world) of this process among all groups' data-parallel ranks, for the sampler
    (``ResumableSampler(rank=..., world_size=...)``) and the accumulation count."""
    return ft.group_index * dp_size + dp_rank, ft.replica_groups * dp_size
