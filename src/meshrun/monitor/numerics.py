"""The consistent numerics guard: every rank learns, in the same step, whether any rank's loss
is NaN/Inf, so all ranks skip the optimizer step together (or all stop) instead of one rank
stepping on garbage while another does not, or one rank raising while the others hang in the
next collective.

Cost: one all-reduce of ``world_size + 2`` floats per optimizer step. It replaces the loss
all-reduce the loop already did on logged steps (the global mean loss comes out of the same
collective), so with ``metrics.log_every = 1`` there is no extra collective at all.
The reduction runs over the whole world, not only the data-parallel group: under pipeline or
tensor parallelism the stages and shards must agree too. The mean is taken over the ranks that
recorded a loss; tensor-parallel peers hold the same loss, so their copies do not change it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["GuardResult", "NonFiniteLossError", "check_loss"]


class NonFiniteLossError(RuntimeError):
    """Raised on every rank together when ``monitor.nonfinite = "stop"`` and a loss is NaN/Inf."""


@dataclass(frozen=True)
class GuardResult:
    """What every rank learns from one guard collective."""

    loss: float  # mean loss over the ranks that recorded one (NaN if none did, or if bad)
    bad_ranks: tuple[int, ...]  # global ranks whose loss was NaN/Inf this step

    @property
    def finite(self) -> bool:
        return not self.bad_ranks


def _pack(loss_sum: torch.Tensor | None, accum: int, rank: int, world: int) -> torch.Tensor:
    """[sum of mean losses, ranks with a loss, one is-bad flag per rank] (float64 on CPU)."""
    buf = torch.zeros(world + 2, dtype=torch.float64)
    if loss_sum is not None:
        mean = float(loss_sum.item()) / accum
        finite = math.isfinite(mean)
        buf[0] = mean if finite else 0.0  # keep the sum finite: the flags carry the bad news
        buf[1] = 1.0
        buf[2 + rank] = 0.0 if finite else 1.0
    return buf


def check_loss(
    loss_sum: torch.Tensor | None, accum: int, device: torch.device, distributed: bool
) -> GuardResult:
    """One all-reduce (when ``distributed``) of this rank's loss and its is-finite flag.

    ``loss_sum`` is the sum of this rank's micro-step losses in the accumulation window
    (None when this rank recorded none). Every rank must call it at every optimizer step.
    """
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    buf = _pack(loss_sum, accum, rank, world)
    if distributed:
        # NCCL reduces only device tensors; the packing stays on the host either way. The
        # .item() above is the one host sync per step the loop already paid for its logging.
        wire = buf.to(device) if device.type == "cuda" else buf
        dist.all_reduce(wire, op=dist.ReduceOp.SUM)
        buf = wire.cpu()
    bad = tuple(int(r) for r in torch.nonzero(buf[2:] > 0.5).flatten().tolist())
    count = float(buf[1])
    loss = math.nan if bad or count == 0 else float(buf[0]) / count
    return GuardResult(loss=loss, bad_ranks=bad)


def describe(result: GuardResult, step: int, hosts: list[str] | None = None) -> str:
    """'non-finite loss (NaN/Inf) at step 7 on rank(s) 1 (host-a)'."""
    names = [
        f"{r} ({hosts[r]})" if hosts is not None and r < len(hosts) else str(r)
        for r in result.bad_ranks
    ]
    return f"non-finite loss (NaN/Inf) at step {step} on rank(s) {', '.join(names)}"
