"""``Run``'s step methods: the backward and the optimizer step of the user's loop, the hang
watchdog's phases, and the checkpoints (train/loop.py, checkpoint/)."""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from meshrun.checkpoint import Stateful
from meshrun.parallel import check_optimizer, maybe_loss_parallel
from meshrun.train.base import RunFields

if TYPE_CHECKING:  # parallel/pp*.py load only when a pipeline is built
    from meshrun.parallel import Pipeline


class LoopMethods(RunFields):
    """The step and checkpoint half of :class:`meshrun.Run` (a mixin: ``Run`` holds the
    state)."""

    def backward(self, loss: torch.Tensor) -> None:
        """``(loss / accumulation).backward()``; see train/loop.py for why this is the right scale.
        Under ``parallel.loss_parallel`` the backward runs inside ``loss_parallel()`` too."""
        self.checkpointer.flush()  # the last step's save, in a loop without run.steps
        with maybe_loss_parallel(self.config.parallel):
            self.loop.backward(loss)

    def loss_parallel(self) -> AbstractContextManager[None]:
        """Compute the loss inside this (``with run.loss_parallel(): loss = ...``): with
        ``parallel.loss_parallel`` the logits are sharded over the vocabulary and cross-entropy
        must run under ``torch.distributed.tensor.parallel.loss_parallel()``; else a no-op."""
        return maybe_loss_parallel(self.config.parallel)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step (and zero) ``optimizer`` at the end of an accumulation window and advance what
        moves with it (registered LR schedulers, the sampler's position, metrics, interval
        checkpoints); return whether this micro-step was the window's last (else nothing ran).
        A step the numerics guard skips still counts; under replica groups a step the quorum
        does not commit does not (False)."""
        check_optimizer(optimizer, self.config.parallel, self.dp_size)
        self.checkpointer.flush()  # the last step's save, in a loop without run.steps
        self.checkpointer.before_update()  # an async save's background copy must end first
        stepped = self.loop.optimizer_step(optimizer)
        if stepped:  # every `checkpoint.interval` steps, at the step boundary
            if self.state.optimizer is None:  # interval saves work without run.resume
                self.state.optimizer = optimizer
            # Saved when the loop body of this step is done (the user's own scheduler has
            # stepped): run.steps calls on_step_end as the next micro-batch is asked for. The
            # watchdog allows a save more than a step (the phase), not the agreement on whether
            # to save, which runs every step.
            self.checkpointer.step_done(self.step, phase=lambda: self.phase("checkpoint"))
            self.loop.on_step_end = self.checkpointer.flush
        return stepped

    def phase(self, name: str, timeout_s: float | None = None) -> AbstractContextManager[None]:
        """``with run.phase("eval"):`` gives the block the hang watchdog's longer limit
        (``timeout_s``, default ``monitor.phase_timeout_s``) instead of the step timeout."""
        return self.loop.monitor.phase(name, timeout_s)

    @property
    def step(self) -> int:
        """Optimizer steps done so far. With gradient accumulation it holds for all the
        micro-steps of a window: guard per-step work with ``run.is_step_end`` too."""
        return self.state.step

    @property
    def is_step_end(self) -> bool:
        """True on the micro-step whose ``run.optimizer_step`` steps the optimizer (the last
        of its accumulation window; every micro-step without accumulation), before and after
        that call. ``if run.is_step_end and run.step % 100 == 0:`` runs once per 100 steps,
        where ``run.step % 100 == 0`` alone runs on every micro-step of the window."""
        return self.loop.is_step_end

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum over the data-parallel ranks (e.g. eval loss sums and counts, once at the end)."""
        if self.mesh is not None:
            dist.all_reduce(value, op=dist.ReduceOp.SUM, group=self.mesh.get_group("dp"))
        return value

    # --- checkpoints (see checkpoint/) ----------------------------------------------------

    def resume(
        self,
        model: nn.Module | Pipeline,
        optimizer: torch.optim.Optimizer,
        loader: Any = None,
        per_rank: Mapping[str, Stateful] | None = None,
        **named: Stateful,
    ) -> int:
        """Register what is checkpointed (model, optimizer, the loader's data position, user
        objects by name; schedulers from ``run.lr_scheduler`` are included) and load the
        checkpoint chosen by ``checkpoint.resume``. Returns the step resumed at (0 = fresh).

        Objects by name (``sched=scheduler``) are replicated: the same on every rank (checked
        at each save). ``per_rank={"hidden": obj}``: objects whose state is each rank's own,
        saved and restored per rank (same world size; another one is refused). Every object
        is saved at the end of the step's loop body, with the model and optimizer of that
        step (docs/checkpoint.md, Your own state)."""
        if self.state.scaler is not None and "grad_scaler" not in named:
            scaler = cast(Stateful, self.state.scaler)  # its scale must survive restarts
            named = {**named, "grad_scaler": scaler}
        self.checkpointer.register(model, optimizer, loader, named, per_rank)
        if self.loop.diloco is not None:  # its state is loaded with the checkpoint's
            models = self.state.models or [cast(nn.Module, model)]
            self.loop.diloco.attach(models, optimizer)
        step = self.checkpointer.resume()
        if step:
            self.metrics.log_event("resume", from_step=step)  # later steps are redone
        return step

    def save_checkpoint(self) -> Path:
        """Checkpoint the current step now (collective: call on every rank)."""
        with self.phase("checkpoint"):
            return self.checkpointer.save()
