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

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from meshrun.parallel.kinds import is_dtensor
from meshrun.parallel.optim_params import named_parameters
from meshrun.runtime.agreement import Agreed, StepAgreement

__all__ = [
    "GuardResult",
    "NonFiniteLossError",
    "check_loss",
    "first_nonfinite",
    "guard_result",
    "local_loss",
]


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


def first_nonfinite(models: Sequence[nn.Module], distributed: bool) -> str:
    """Where the models' first NaN/Inf is, for the stop message: "parameter 'blocks.1.fc.weight'
    (rank 0)". Each rank looks at what it holds (its shards); collective when ``distributed``
    (every rank calls it: the guard stops on every rank together). Runs only when a run stops."""
    found = _local_first(models)
    hits = [(found[0], 0, found[1])] if found else []
    if distributed:
        everyone: list[tuple[int, str] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, found)
        hits = [(f[0], rank, f[1]) for rank, f in enumerate(everyone) if f is not None]
    if not hits:
        return (
            "every parameter and gradient is finite: the loss itself is not (check the inputs, "
            "the targets and the loss function)"
        )
    _, rank, what = min(hits)
    return f"the first non-finite tensor is {what} (rank {rank})"


def _local_first(models: Sequence[nn.Module]) -> tuple[int, str] | None:
    """(order, description) of this rank's first non-finite parameter, else gradient."""
    named = [(n, p) for m in models for n, p in named_parameters(m)]
    # The values first: one NaN weight makes every gradient before it NaN too.
    for i, (name, p) in enumerate(named):
        if not _finite(p):
            return i, f"parameter '{name}'"
    # Gradients from the output end: backward computes them in that order, so the first
    # non-finite one there is nearest where the NaN began.
    for i, (name, p) in enumerate(reversed(named)):
        if p.grad is not None and not _finite(p.grad):
            return len(named) + i, f"the gradient of '{name}'"
    return None


def _finite(t: torch.Tensor) -> bool:
    with torch.no_grad():
        local = t.to_local() if is_dtensor(t) else t
        return bool(torch.isfinite(local).all())
