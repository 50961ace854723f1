"""Which samples a replica group's rank reads in a step (``fault_tolerance.missing_group =
"shrink"``, docs/fault_tolerance.md).

The data order is the sampler's one stream of positions, and its only state is ``consumed``,
the positions the committed steps used. A step with ``k`` of ``n`` groups live covers the
``k * G / n`` positions from ``consumed`` on (``G`` = ``data.global_batch``): the group with
participant index ``j`` in torchft's quorum (``Manager.participating_rank()``, of
``num_participants()``) reads as data-parallel rank ``j * D + r`` of ``k * D`` (``r``: its
rank among the group's ``D``), and a committed step advances ``consumed`` by exactly those
positions. So no position is trained twice or skipped, whatever the live groups: the missing
groups' share is not dropped, the live groups move on to it. With every group live (``j`` is
then the group's index) this is plain data parallelism over the whole world: the same samples
on the same ranks as without replica groups.

The share of a step is fixed by its quorum, before its first micro-batch is drawn; a quorum
that changes it makes the step loop restart its loader at ``consumed`` (batches a DataLoader
prefetched under the old share are dropped, never trained). A step that does not commit
moves nothing: its positions are read again under the next quorum's share.
"""

from __future__ import annotations

from meshrun.config.fault_tolerance import FaultToleranceConfig

__all__ = ["data_share", "live_share"]


def data_share(ft: FaultToleranceConfig, dp_rank: int, dp_size: int) -> tuple[int, int]:
    """(rank, world) of this process among all groups' data-parallel ranks with every group
    live, for the sampler (``ResumableSampler(rank=..., world_size=...)``) and the
    accumulation count; the step loop narrows it per step (:func:`live_share`)."""
    return ft.group_index * dp_size + dp_rank, ft.replica_groups * dp_size


def live_share(
    global_batch: int, groups: int, dp_rank: int, dp_size: int, participant: int, live: int
) -> tuple[int, int, int]:
    """(rank, world, positions) of one step's share for ``ResumableSampler.set_share``: the
    step covers ``live`` groups' shares of ``global_batch`` (of ``groups`` shares), and this
    rank reads as rank ``dp_rank`` of the group with participant index ``participant``."""
    if not 0 <= participant < live <= groups or global_batch % (groups * dp_size):
        raise ValueError(
            f"replica groups: participant {participant} of {live} live groups (of {groups}), "
            f"global batch {global_batch} over {groups} x {dp_size} data-parallel ranks: "
            "expected 0 <= participant < live <= groups and a global batch that every "
            "group's ranks divide evenly"
        )
    return participant * dp_size + dp_rank, live * dp_size, live * global_batch // groups
