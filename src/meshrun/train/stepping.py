"""The step side of :class:`meshrun.Run`, as plain functions: the backward and the optimizer
step of the user's loop with the checkpoints they drive, the data-parallel sum, and what
``run.resume`` registers and loads (train/loop.py, checkpoint/)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshrun.checkpoint import Stateful
from meshrun.config import ParallelConfig
from meshrun.parallel import check_optimizer, maybe_loss_parallel
from meshrun.train.loop import StepLoop
from meshrun.train.machinery import Machinery
from meshrun.train.record import maybe_record_step

if TYPE_CHECKING:  # parallel/pp*.py load only when a pipeline is built
    from meshrun.parallel import Pipeline


def backward(loss: torch.Tensor, cfg: ParallelConfig, parts: Machinery, loop: StepLoop) -> None:
    """``run.backward``: the last step's pending save first, then the loop's scaled backward
    (inside ``loss_parallel()`` under ``parallel.loss_parallel``)."""
    parts.checkpointer.flush()  # the last step's save, in a loop without run.steps
    with maybe_loss_parallel(cfg):
        loop.backward(loss)


def optimizer_step(
    optimizer: torch.optim.Optimizer,
    cfg: ParallelConfig,
    dp_size: int,
    parts: Machinery,
    loop: StepLoop,
) -> bool:
    """``run.optimizer_step``: the loop's step at a window's end, then the interval checkpoint
    of that step, written once the user's loop body of the step is done. The first call with
    an optimizer checks that it holds the model's current parameters."""
    check_optimizer(optimizer, cfg, dp_size)
    loop.check_params(optimizer)
    checkpointer, state = parts.checkpointer, parts.state
    checkpointer.flush()  # the last step's save, in a loop without run.steps
    checkpointer.before_update()  # an async save's background copy must end first
    maybe_record_step(parts, loop.is_step_end)  # monitor.record_steps: for meshrun compare
    stepped = loop.optimizer_step(optimizer)
    if stepped:  # every `checkpoint.interval` steps, at the step boundary
        if state.optimizer is None:  # interval saves work without run.resume
            state.optimizer = optimizer
        # Saved when the loop body of this step is done (the user's own scheduler has
        # stepped): run.steps flushes it as the next micro-batch is asked for. The watchdog
        # allows a save more than a step (the phase), not the agreement on whether to save,
        # which runs every step.
        checkpointer.step_done(state.step, phase=lambda: parts.monitor.phase("checkpoint", None))
    return stepped


def all_reduce_dp(value: torch.Tensor, mesh: DeviceMesh | None) -> torch.Tensor:
    """``run.all_reduce_sum``: ``value`` summed in place over the data-parallel ranks."""
    if mesh is not None:
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=mesh.get_group("dp"))
    return value


def resume(
    model: nn.Module | Pipeline,
    optimizer: torch.optim.Optimizer,
    loader: Any,
    per_rank: Mapping[str, Stateful] | None,
    named: Mapping[str, Stateful],
    parts: Machinery,
) -> int:
    """``run.resume``: register what is checkpointed (the fp16 scaler too), attach DiLoCo's
    outer state, load the checkpoint ``checkpoint.resume`` chooses; the step resumed at."""
    state = parts.state
    if state.scaler is not None and "grad_scaler" not in named:
        scaler = cast(Stateful, state.scaler)  # its scale must survive restarts
        named = {**named, "grad_scaler": scaler}
    parts.checkpointer.register(model, optimizer, loader, named, per_rank)
    if parts.diloco is not None:  # its state is loaded with the checkpoint's
        models = state.models or [cast(nn.Module, model)]
        parts.diloco.attach(models, optimizer)
    step = parts.checkpointer.resume()
    if step:
        parts.metrics.log_event("resume", from_step=step)  # later steps are redone
    return step
