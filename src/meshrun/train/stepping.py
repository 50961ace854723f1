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

from meshrun.checkpoint import Checkpointer, Stateful
from meshrun.config import ParallelConfig
from meshrun.monitor import MetricsLogger
from meshrun.parallel import check_optimizer, maybe_loss_parallel
from meshrun.train.loop import StepLoop

if TYPE_CHECKING:  # parallel/pp*.py load only when a pipeline is built
    from meshrun.parallel import Pipeline


def backward(
    loss: torch.Tensor, cfg: ParallelConfig, loop: StepLoop, checkpointer: Checkpointer
) -> None:
    """``run.backward``: the last step's pending save first, then the loop's scaled backward
    (inside ``loss_parallel()`` under ``parallel.loss_parallel``)."""
    checkpointer.flush()  # the last step's save, in a loop without run.steps
    with maybe_loss_parallel(cfg):
        loop.backward(loss)


def optimizer_step(
    optimizer: torch.optim.Optimizer,
    cfg: ParallelConfig,
    dp_size: int,
    loop: StepLoop,
    checkpointer: Checkpointer,
) -> bool:
    """``run.optimizer_step``: the loop's step at a window's end, then the interval checkpoint
    of that step, written once the user's loop body of the step is done."""
    check_optimizer(optimizer, cfg, dp_size)
    checkpointer.flush()  # the last step's save, in a loop without run.steps
    checkpointer.before_update()  # an async save's background copy must end first
    stepped = loop.optimizer_step(optimizer)
    if stepped:  # every `checkpoint.interval` steps, at the step boundary
        if loop.state.optimizer is None:  # interval saves work without run.resume
            loop.state.optimizer = optimizer
        # Saved when the loop body of this step is done (the user's own scheduler has
        # stepped): run.steps calls on_step_end as the next micro-batch is asked for. The
        # watchdog allows a save more than a step (the phase), not the agreement on whether
        # to save, which runs every step.
        checkpointer.step_done(
            loop.state.step, phase=lambda: loop.monitor.phase("checkpoint", None)
        )
        loop.on_step_end = checkpointer.flush
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
    loop: StepLoop,
    checkpointer: Checkpointer,
    metrics: MetricsLogger,
) -> int:
    """``run.resume``: register what is checkpointed (the fp16 scaler too), attach DiLoCo's
    outer state, load the checkpoint ``checkpoint.resume`` chooses; the step resumed at."""
    state = loop.state
    if state.scaler is not None and "grad_scaler" not in named:
        scaler = cast(Stateful, state.scaler)  # its scale must survive restarts
        named = {**named, "grad_scaler": scaler}
    checkpointer.register(model, optimizer, loader, named, per_rank)
    if loop.diloco is not None:  # its state is loaded with the checkpoint's
        models = state.models or [cast(nn.Module, model)]
        loop.diloco.attach(models, optimizer)
    step = checkpointer.resume()
    if step:
        metrics.log_event("resume", from_step=step)  # later steps are redone
    return step
