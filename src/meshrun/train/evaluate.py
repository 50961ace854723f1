"""``run.evaluate``'s function: a held-out loss computed on every rank, whatever the layout.

Why on every rank: under ZeRO-3 / FSDP2, TP and PP each forward is itself collective (FSDP2
all-gathers the parameters, TP all-reduces activations, PP sends them between stages), so an
evaluation run by rank 0 alone waits forever for the others. Every rank therefore runs the same
number of forwards: the ranks agree, batch by batch, whether any still has one (one small
all-reduce per batch), and a rank whose share ended earlier (the eval sampler gives each sample
exactly once, so shares may differ by one sample) repeats its last batch, not counted. The sums
of loss x count go over the data-parallel ranks once at the end (tp ranks hold equal values and
a pipeline's ranks the broadcast loss, so the dp sum counts every sample once).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshrun.parallel.kinds import is_dtensor
from meshrun.parallel.pp.kind import is_pipeline
from meshrun.runtime.mesh import dp_cp_group_name
from meshrun.train.loop import StepLoop
from meshrun.train.machinery import Machinery

if TYPE_CHECKING:  # parallel/pp*.py load only when a pipeline is built
    from meshrun.parallel import Pipeline

LossFn = Callable[[Any, Any], torch.Tensor]


def evaluate(
    model: nn.Module | Pipeline,
    batches: Iterable[Any],
    loss_fn: LossFn | None,
    max_batches: int | None,
    mesh: DeviceMesh | None,
    dp_size: int,
    parts: Machinery,
    loop: StepLoop,
) -> float:
    """``run.evaluate``: the mean loss over every rank's ``batches``, the same float on every
    rank (see the module docstring); its seconds are kept out of the next step's time."""
    t0 = time.perf_counter()
    fn = _eval_loss_fn(model, loss_fn, parts.accum)
    totals = torch.zeros(2, dtype=torch.float64, device=parts.device)  # [sum, count]
    with torch.no_grad(), parts.monitor.phase("eval", None), _eval_mode(model):
        for batch, counted in _agreed_batches(
            batches, max_batches, dp_size, parts.device, loop.place
        ):
            loss = fn(model, batch)  # a repeat too: its forward is collective
            if counted:
                totals += _sum_and_count(loss, _batch_size(batch), parts.device)
    if mesh is not None:
        # Under cp each rank's loss is its slice's: the mean is over dp x cp.
        dist.all_reduce(totals, group=mesh.get_group(dp_cp_group_name(mesh)))
    if totals[1] == 0:
        raise ValueError("run.evaluate: no rank had a batch to evaluate (empty batches)")
    mean, seconds = float(totals[0] / totals[1]), time.perf_counter() - t0
    loop.outside_step(seconds)
    parts.metrics.log_event("eval", step=parts.state.step, loss=mean, seconds=seconds)
    return mean


def _sum_and_count(loss: torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
    if is_dtensor(loss):  # under loss_parallel: a replicated DTensor
        loss = loss.full_tensor()
    out = torch.tensor([0.0, n], dtype=torch.float64, device=device)
    out[0] = loss.detach().double() * n
    return out


def _eval_loss_fn(model: nn.Module | Pipeline, loss_fn: LossFn | None, accum: int) -> LossFn:
    if loss_fn is not None:
        return loss_fn
    if not is_pipeline(model):
        raise TypeError(
            f"run.evaluate({type(model).__name__}, ...) needs loss_fn(model, batch) -> the "
            "batch's mean loss; only a Pipeline (run.pipeline) has a loss of its own"
        )
    from meshrun.parallel.pp.pipeline import (
        pipeline_eval,  # loaded already: model is a Pipeline
    )

    def pipeline_loss(pipe: Pipeline, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        return pipeline_eval(pipe, inputs, targets) * accum  # its loss_fn carries 1/accum

    return pipeline_loss


def _agreed_batches(
    batches: Iterable[Any],
    max_batches: int | None,
    dp_size: int,
    device: torch.device,
    place: Callable[[Any], Any],
) -> Iterator[tuple[Any, bool]]:
    """(batch placed by ``place``, counted) until no rank has a batch left: every rank yields
    the same number of times; a repeat of its last batch is not counted."""
    it, last, taken = iter(batches), None, 0
    while True:
        batch = next(it, None) if max_batches is None or taken < max_batches else None
        taken += 1
        mine = torch.tensor([batch is not None, batch is None and last is None])
        agreed = _any_rank(mine, device)
        if not agreed[0]:
            return
        if agreed[1]:  # some rank has nothing to repeat while others still evaluate
            raise ValueError(
                "run.evaluate: a rank has no batch at all while others have some; give "
                "every data-parallel rank at least one (an eval set of at least dp x "
                f"micro-batch samples; dp = {dp_size})"
            )
        if batch is not None:
            last = place(batch)  # on the device; under cp, this rank's slice
        yield last, batch is not None


def _any_rank(flags: torch.Tensor, device: torch.device) -> torch.Tensor:
    if not dist.is_initialized():
        return flags
    out = flags.to(device, torch.int32)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)  # the whole world: every forward is shared
    return out.cpu()


class _eval_mode:
    """Every module of ``model`` in eval mode inside the block; each one's own mode after."""

    def __init__(self, model: nn.Module | Pipeline) -> None:
        roots = model.modules if is_pipeline(model) else [cast(nn.Module, model)]
        self.modes = [(m, m.training) for root in roots for m in root.modules()]

    def __enter__(self) -> None:
        for m, _ in self.modes:
            m.training = False  # what Module.eval() sets, module by module

    def __exit__(self, *exc: object) -> None:
        for m, mode in self.modes:
            m.training = mode


def _batch_size(batch: Any) -> int:
    n = _first_dim(batch)
    if n is None:
        raise TypeError(
            f"run.evaluate: cannot tell the size of a batch of type {type(batch).__name__}; give "
            "batches that are tensors or dicts/tuples/lists holding tensors"
        )
    return n


def _first_dim(batch: Any) -> int | None:
    """The first dim of the first tensor in ``batch`` (nested dicts, lists, tuples)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, (dict, list, tuple)):
        for v in batch.values() if isinstance(batch, dict) else batch:
            n = _first_dim(v)
            if n is not None:
                return n
    return None
