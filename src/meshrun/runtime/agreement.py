"""The per-step agreement: one small all-reduce per optimizer step that carries every
"does any rank say yes?" of the run, so every rank takes the same decision at the same step.

Subsystems do not run collectives of their own to agree on a flag. They fill a named slot and
read the agreed value:

    agreement.provide(Slot.PREEMPT, lambda: signal_seen)       # asked at every exchange
    ...
    agreed = agreement.exchange(step, loss=mean_loss)          # the one collective (the loop)
    ...
    if agreement.agreed(step).any(Slot.PREEMPT): save_and_exit()

What travels: one float64 per slot (summed over the world group: a flag slot holds the number
of ranks that raised it, so "any" is ``> 0`` and "all" is ``== world``), then one is-non-finite
entry per rank, so the guard can name the ranks. The loss of the step rides in the same tensor
(its sum and the number of ranks that recorded one): the metrics log the global mean loss every
step, and carrying it here makes the agreement the step's only collective from meshrun. float64
holds the counts exactly and keeps the loss's sum the one the guard computed before (same
values, same order: bitwise the same logged loss).

The reduction runs over the whole world, not the data-parallel group: pipeline stages and
tensor-parallel shards must take the same decision too. Under NCCL the tensor goes to the
run's CUDA device (NCCL reduces device tensors only); under Gloo it stays on the CPU.

Adding a flag is one more ``Slot`` member and a ``provide`` call where the local value is known.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import IntEnum

import torch
import torch.distributed as dist

__all__ = ["Agreed", "Slot", "StepAgreement"]


class Slot(IntEnum):
    """The named slots of the agreement (indices into the tensor)."""

    LOSS = 0  # this rank's mean loss of the step; 0.0 when it has none or it is NaN/Inf
    LOSS_RANKS = 1  # 1 on a rank that recorded a loss: the global mean divides by their count
    NONFINITE = 2  # this rank's loss is NaN/Inf (which ranks: Agreed.nonfinite_ranks)
    PREEMPT = 3  # this rank received a preemption signal (SIGTERM/SIGUSR1)
    SAVE_WRITING = 4  # this rank's async checkpoint is still being written
    GRAD_SQ = 5  # this rank's share of the squared gradient norm (parallel/grads.grad_sq_share)


FLAGS = (Slot.NONFINITE, Slot.PREEMPT, Slot.SAVE_WRITING)
Provider = Callable[[], bool]


@dataclass(frozen=True)
class Agreed:
    """What every rank learned from one exchange (the same on every rank)."""

    step: int  # the optimizer step the exchange was for (1-based: the step about to be taken)
    world: int
    totals: tuple[float, ...]  # per slot, summed over the ranks
    nonfinite_ranks: tuple[int, ...]  # global ranks whose loss was NaN/Inf

    def count(self, slot: Slot) -> int:
        """How many ranks raised the flag ``slot``."""
        return round(self.totals[slot])

    def any(self, slot: Slot) -> bool:
        return self.count(slot) > 0

    def all(self, slot: Slot) -> bool:
        return self.count(slot) == self.world

    @property
    def loss(self) -> float:
        """The mean loss over the ranks that recorded one; NaN if none did or any was bad."""
        ranks = self.count(Slot.LOSS_RANKS)
        if self.nonfinite_ranks or ranks == 0:
            return math.nan
        return self.totals[Slot.LOSS] / ranks

    @property
    def grad_norm(self) -> float:
        """The 2-norm of the whole gradient: the square root of the ranks' shares."""
        return math.sqrt(self.totals[Slot.GRAD_SQ])


class StepAgreement:
    """One per run, on every rank. :meth:`exchange` is collective: every rank calls it once
    per optimizer step (the step loop does, in the numerics guard)."""

    def __init__(self, device: torch.device, distributed: bool | None = None) -> None:
        self.device = device
        self.distributed = dist.is_initialized() if distributed is None else distributed
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        self._providers: dict[Slot, Provider] = {}
        self.last: Agreed | None = None
        self.exchanges = 0  # collectives issued (for tests and benchmarks)

    def provide(self, slot: Slot, local: Provider) -> None:
        """Let ``local()`` fill the flag ``slot`` at every exchange (this rank's value; it
        must not block or run collectives). A second provider for a slot replaces the first."""
        if slot not in FLAGS:
            raise ValueError(
                f"agreement slot {slot.name}: only flag slots take a provider "
                f"({', '.join(s.name for s in FLAGS)}); the loss is passed to exchange()"
            )
        self._providers[slot] = local

    def exchange(
        self, step: int, *, loss: float | None = None, grad_sq: float | None = None
    ) -> Agreed:
        """The step's one collective. ``loss``: this rank's mean loss of the step (None when
        this rank recorded none, e.g. a pipeline stage without the head); a NaN/Inf raises
        the NONFINITE flag. ``grad_sq``: this rank's share of the squared gradient norm
        (summed as is). Returns (and keeps, for :meth:`agreed`) what every rank learned."""
        buf = self._pack(loss)
        if grad_sq is not None:
            buf[Slot.GRAD_SQ] = grad_sq
        if self.distributed:
            wire = buf.to(self.device) if self.device.type == "cuda" else buf
            dist.all_reduce(wire, op=dist.ReduceOp.SUM)
            buf = wire.cpu()
            self.exchanges += 1
        n = len(Slot)
        bad = tuple(int(r) for r in torch.nonzero(buf[n:] > 0.5).flatten().tolist())
        self.last = Agreed(step, self.world, tuple(buf[:n].tolist()), bad)
        return self.last

    def agreed(self, step: int) -> Agreed:
        """The exchange of ``step``: what a subsystem reads after the step's exchange."""
        if self.last is None or self.last.step != step:
            have = "none yet" if self.last is None else f"the last was for step {self.last.step}"
            raise RuntimeError(
                f"no per-step agreement for step {step} ({have}): the step loop exchanges it in "
                "run.optimizer_step; read it after that call, on every rank"
            )
        return self.last

    def moved_to(self, step: int) -> None:
        """The run's step jumped inside this step (a replica group healed from a peer at a
        DiLoCo sync, on every rank of the group alike): what the ranks agreed on holds for
        the step it continues at, where the checkpoints read it."""
        if self.last is not None:
            self.last = replace(self.last, step=step)

    def _pack(self, loss: float | None) -> torch.Tensor:
        buf = torch.zeros(len(Slot) + self.world, dtype=torch.float64)
        for slot, local in self._providers.items():
            buf[slot] = 1.0 if local() else 0.0
        if loss is not None:
            finite = math.isfinite(loss)
            buf[Slot.LOSS] = loss if finite else 0.0  # keep the sum finite: the flag says why
            buf[Slot.LOSS_RANKS] = 1.0
            if not finite:
                buf[Slot.NONFINITE] = 1.0
                buf[len(Slot) + self.rank] = 1.0
        return buf
