"""The consistent numerics guard: every rank learns, in the same step, whether any rank's loss
is NaN/Inf, so all ranks skip the optimizer step together (or all stop) instead of one rank
stepping on garbage while another does not, or one rank raising while the others hang in the
next collective.

Cost: nothing of its own. The guard's flag (and the loss, whose global mean the metrics log) is
a slot of the run's one per-step agreement (``meshrun/runtime/agreement.py``: one all-reduce of a few
float64 plus one per rank, over the whole world, so pipeline stages and tensor-parallel shards
agree too). The mean is taken over the ranks that recorded a loss; tensor-parallel peers hold
the same loss, so their copies do not change it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshrun.runtime.agreement import Agreed, StepAgreement

__all__ = ["GuardResult", "NonFiniteLossError", "check_loss", "guard_result", "local_loss"]


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


def local_loss(loss_sum: torch.Tensor | None, accum: int) -> float | None:
    """This rank's mean loss of the step from the sum of its micro-step losses in the
    accumulation window (None when this rank recorded none). The ``.item()`` is the one host
    sync per step the loop pays for its logging."""
    return None if loss_sum is None else float(loss_sum.item()) / accum


def guard_result(agreed: Agreed) -> GuardResult:
    """The guard's reading of the step's agreement."""
    return GuardResult(loss=agreed.loss, bad_ranks=agreed.nonfinite_ranks)


def check_loss(
    loss_sum: torch.Tensor | None, accum: int, device: torch.device, distributed: bool
) -> GuardResult:
    """The guard on its own: one exchange of an agreement that carries only the loss (the run
    uses its :class:`~meshrun.runtime.agreement.StepAgreement`, which carries the other flags too).
    Collective when ``distributed``: every rank must call it."""
    agreement = StepAgreement(device, distributed)
    return guard_result(agreement.exchange(0, loss=local_loss(loss_sum, accum)))


def describe(result: GuardResult, step: int, hosts: list[str] | None = None) -> str:
    """'non-finite loss (NaN/Inf) at step 7 on rank(s) 1 (host-a)'."""
    names = [
        f"{r} ({hosts[r]})" if hosts is not None and r < len(hosts) else str(r)
        for r in result.bad_ranks
    ]
    return f"non-finite loss (NaN/Inf) at step {step} on rank(s) {', '.join(names)}"
