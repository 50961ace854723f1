"""Evaluation through a V-shaped schedule: its own order with the backward actions left out.

torch 2.13's runtime (``_PipelineScheduleRuntime``) runs every action of the training order in
``schedule.eval()`` too, the backward ones as no-ops; under a V placement (ZB-V, DualPipeV) the
backward of stage pp then hands its input gradient to stage pp - 1 on the same rank, which has
none in eval, and torch asserts ("can't steal_bwd_input if this stage doesn't have backward").
So for the eval call the schedule runs the forwards of its own order, in that order (an
``OVERLAP_F_B`` pair contributes its forward), lowered by torch itself to sends, receives and
FSDP unshards (the lowering ``_prepare_schedule_with_comms`` does, without its check that
every stage runs its backwards); the training order is put back after. Each
forward waits only on earlier forwards, so the order without its backwards cannot deadlock.
The same schedule object keeps its own train/eval state: it re-infers the stages' buffers when
the mode changes, exactly as with ``eval()`` alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["forward_only"]


@contextmanager
def forward_only(schedule: Any) -> Iterator[None]:
    """Inside the block ``schedule`` runs only the forward actions of its order."""
    training = schedule.pipeline_order_with_comms
    if not hasattr(schedule, "meshrun_forward_order"):
        schedule.meshrun_forward_order = _lowered(schedule)
    schedule.pipeline_order_with_comms = schedule.meshrun_forward_order
    try:
        yield
    finally:
        schedule.pipeline_order_with_comms = training


def _lowered(schedule: Any) -> Any:
    from torch.distributed.pipelining.schedules import (
        _add_send_recv,
        _add_unshard_reshard,
        _ComputationType,
    )

    fwd, overlap = _ComputationType.FORWARD, _ComputationType.OVERLAP_F_B
    orders: dict[int, list[Any]] = {}
    for rank, actions in schedule.pipeline_order.items():
        kept: list[Any] = []
        for a in actions:
            if a is None:
                continue
            parts = a.sub_actions if a.computation_type == overlap else (a,)
            kept.extend(p for p in parts or () if p.computation_type == fwd)
        orders[rank] = _add_unshard_reshard(kept)
    rank_of = schedule.stage_index_to_group_rank
    return _add_send_recv(orders, stage_to_rank=lambda s: rank_of[s], num_stages=len(rank_of))
