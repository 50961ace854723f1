"""The step loop: gradient accumulation, the all-reduce only on boundary micro-steps, timing and
metrics. The user's loop stays theirs: this only hands out micro-batches and decides when the
optimizer steps.

Normalisation: the user's loss is the mean over *their micro-batch*. ``backward`` divides it
by the accumulation count before ``.backward()``, and DDP averages over the data-parallel
ranks, so the gradient equals the mean over the whole global batch: the same gradient as one
process with the global batch. This is the only change to the loss, and it is documented here
and in the README (no hidden scaling).
"""

from __future__ import annotations

import logging
import math
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from meshrun.data.iterable import ResumableIterable
from meshrun.data.loader import WaitClock
from meshrun.data.permutation import mix_seed
from meshrun.data.sampler import ResumableSampler
from meshrun.monitor import memory_stats
from meshrun.monitor.moe import moe_metrics
from meshrun.monitor.throughput import resolve_tokens_per_sample
from meshrun.parallel import set_grad_sync
from meshrun.parallel.cp import shard_sequence
from meshrun.parallel.grads import clip_grads_, grad_norm, grad_sq_share
from meshrun.parallel.kinds import is_dtensor
from meshrun.parallel.optim_params import check_current
from meshrun.parallel.report import log_state_table
from meshrun.train.machinery import Machinery

log = logging.getLogger("meshrun")


def to_device(batch: Any, device: torch.device) -> Any:
    """Move tensors in (nested) dicts, lists and tuples to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=device.type == "cuda")
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def seed_per_dp(seed: int, step: int, dp_coord: int) -> None:
    """Give torch's RNG (CPU and every CUDA device) a stream per data-parallel coordinate, so
    dropout draws its own masks on each data-parallel rank, as one process would over the
    global batch, while the tensor/context-parallel and pipeline ranks of one coordinate keep
    one stream (a replicated activation needs the same mask on each TP rank; DTensor's random
    ops, which shard one mask over the TP ranks, need one seed there).

    Called when ``run.steps`` begins, after the model was built from the same seed on every
    rank (identical initial weights). Data-parallel coordinate 0 of a fresh run keeps the
    stream it has: one process trains exactly as the same script without meshrun."""
    if step == 0 and dp_coord == 0:
        return
    torch.manual_seed(mix_seed(seed, step, dp_coord))


def _first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    values = batch.values() if isinstance(batch, dict) else batch
    if isinstance(values, Iterable) and not isinstance(values, (str, bytes)):
        for v in values:
            t = _first_tensor(v)
            if t is not None:
                return t
    return None


class StepLoop:
    """Counts micro-steps and optimizer steps for one run (one instance per ``Run``), driving
    the parts of its :class:`Machinery`."""

    def __init__(self, parts: Machinery) -> None:
        self.parts = parts  # every part it drives, built once by train/startup.py
        self._rng_placed = False  # seed_per_dp: once per process, before the first forward
        self._state_reported = False  # the per-rank model-state table, once per process
        self._boundary = parts.accum == 1
        self._loss_sum: torch.Tensor | None = None
        self._t_last, self._outside_s = time.perf_counter(), 0.0  # outside: see outside_step
        self._tokens_per_sample: int | None = None  # None: not known, samples/s only
        self.data_wait = WaitClock()  # this rank's time blocked on the loader, per step
        self.last_data_wait_s = 0.0  # that time in the last optimizer step (run.data_wait)
        self.grad_norm = math.nan  # the whole gradient's norm at the last step, before clipping
        self._target = parts.total_steps  # this run.steps' last step: no quorum beyond it
        self._boundary_calls = 0  # optimizer_step calls on a boundary (committed or not)
        # The optimizers already checked to hold the models' current parameters (check_params).
        self._checked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()

    # --- the loop -------------------------------------------------------------------------

    def steps(
        self, loader: Iterable[Any], steps: int | None = None, tokens_per_sample: int | None = None
    ) -> Iterator[Any]:
        """Yield micro-batches (on the device) until ``steps`` optimizer steps are done in all.
        The hang watchdog is armed while this runs (monitor.step_timeout_s)."""
        parts = self.parts
        parts.monitor.loop_starts(parts.state.step)
        try:
            yield from self._steps(loader, steps, tokens_per_sample)
        finally:
            parts.monitor.loop_ends()

    def _steps(
        self, loader: Iterable[Any], steps: int | None, tokens_per_sample: int | None
    ) -> Iterator[Any]:
        parts = self.parts
        target = parts.total_steps if steps is None else steps
        if parts.state.step >= target:
            # Typically a resumed run that had already finished: say so rather than exit quietly.
            log.warning(
                "nothing to train: already at step %d of %d (resumed from a finished run?); "
                "raise optim.steps, use a new job.run_dir, or set checkpoint.resume=never",
                parts.state.step,
                target,
            )
        self._begin(loader, target)
        first = True
        while parts.state.step < target:
            produced = False
            if parts.replicas is not None:  # a new iteration starts at the sampler's position
                parts.replicas.data_moved = False
            for batch in self.data_wait.wrap(loader):
                produced = True
                if first:
                    self._inspect_first(batch, tokens_per_sample)
                    first = False
                yield from self._one_micro_step(batch)
                if parts.state.step >= target:
                    return
                if parts.replicas is not None and parts.replicas.data_moved:
                    break  # healed or uncommitted: read from the (new) position again
            if not produced:
                raise RuntimeError("the data loader produced no batches: is the dataset empty?")

    def _begin(self, loader: Iterable[Any], target: int) -> None:
        """What a loop over ``loader`` sets up before its first batch: the data position the
        checkpoints save, the clocks, the per-rank RNG stream, the first quorum."""
        parts = self.parts
        sampler = getattr(loader, "sampler", None)
        parts.state.sampler = sampler if isinstance(sampler, ResumableSampler) else None
        dataset = getattr(loader, "dataset", None)
        parts.state.iterable = dataset if isinstance(dataset, ResumableIterable) else None
        self._t_last, self._outside_s = time.perf_counter(), 0.0
        self._target = target
        if not self._rng_placed:  # once per process, before the first forward
            self._rng_placed = True
            if not parts.state.rng_restored:
                seed_per_dp(parts.seed, parts.state.step, parts.dp_coord)
        if parts.replicas is not None:
            parts.replicas.check_sampler(parts.state.sampler)
        self._maybe_start_quorum()

    def _one_micro_step(self, batch: Any) -> Iterator[Any]:
        parts = self.parts
        self._boundary = parts.state.micro == parts.accum - 1
        for m in parts.state.models:
            set_grad_sync(m, self._boundary)
        before = self._boundary_calls
        batch = self.place(batch)
        parts.monitor.batch_ready()
        yield batch
        if self._boundary and self._boundary_calls == before:
            raise RuntimeError(
                "the step loop reached an optimizer boundary but run.optimizer_step(optimizer) "
                "was not called: call it once per micro-batch, after run.backward(loss)"
            )
        parts.state.micro = 0 if self._boundary else parts.state.micro + 1
        # The save of the step just taken (run.optimizer_step reported it to the checkpointer),
        # written once the user's loop body of that step is done; nothing when none is due.
        parts.checkpointer.flush()

    def place(self, batch: Any) -> Any:
        """``batch`` on the device, and under context parallel this rank's slice of it."""
        parts = self.parts
        batch = to_device(batch, parts.device)
        return batch if parts.cp_group is None else shard_sequence(batch, parts.cp_group)

    def _inspect_first(self, batch: Any, tokens_per_sample: int | None) -> None:
        parts = self.parts
        t = _first_tensor(batch)
        self._tokens_per_sample = resolve_tokens_per_sample(batch, tokens_per_sample)
        if t is not None and t.dim() >= 1 and t.shape[0] != parts.micro_batch:
            log.warning(
                "the loader's batch has %d samples but data.micro_batch = %d: throughput figures "
                "and the global batch (%d) assume data.micro_batch; build the loader with "
                "run.dataloader(...) or set --data.micro_batch=%d",
                t.shape[0],
                parts.micro_batch,
                parts.global_batch,
                t.shape[0],
            )

    @property
    def is_step_end(self) -> bool:
        """Whether this micro-step's ``optimizer_step`` steps the optimizer (the last of its
        accumulation window)."""
        return self._boundary

    def outside_step(self, seconds: float) -> None:
        """Time spent between steps on other work (``run.evaluate``): left out of the next
        step's time and reported in its line as ``eval_s``."""
        self._outside_s += seconds

    # --- what the user calls -------------------------------------------------------------

    def backward(self, loss: torch.Tensor) -> None:
        """``(loss / accumulation).backward()``, recording the loss for the metrics."""
        parts = self.parts
        self.record_loss(loss)
        t0 = parts.monitor.backward_starts()
        scaled = loss / parts.accum
        (scaled if parts.state.scaler is None else parts.state.scaler.scale(scaled)).backward()
        parts.monitor.add("backward_s", t0)

    def record_loss(self, loss: torch.Tensor) -> None:
        """Count a micro-step's loss in the metrics (the pipeline step's backward is its own)."""
        detached = loss.detach().float()
        if is_dtensor(detached):  # loss parallel: a replicated DTensor scalar
            detached = detached.full_tensor()
        self._loss_sum = detached if self._loss_sum is None else self._loss_sum + detached

    def check_params(self, optimizer: torch.optim.Optimizer) -> None:
        """Once per optimizer, at its first step: it holds the models' current parameters
        (parallel/optim_params.py), else the error names the first one it does not."""
        parts = self.parts
        if optimizer not in self._checked:
            world = parts.monitor.agreement.world
            check_current(optimizer, parts.state.models, parts.former, distributed=world > 1)
            self._checked.add(optimizer)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step (and zero) the optimizer on a boundary micro-step; return whether this was one.
        A step the numerics guard skips (NaN/Inf loss on some rank) still counts as a step;
        under replica groups a step the quorum does not commit does not (False)."""
        parts = self.parts
        if not self._boundary:
            return False
        self._boundary_calls += 1
        # Every rank learns whether any rank's loss is NaN/Inf; all skip (or stop) together.
        # The clip's gradient norm rides in the same collective (a share per rank:
        # parallel/grads.py); under replica groups it is taken after their average instead.
        clip = parts.grad_clip > 0 and (parts.replicas is None or parts.diloco is not None)
        share = self._grad_sq(optimizer) if clip else None
        guard = parts.monitor.guard(self._loss_sum, parts.accum, parts.state.step + 1, share)
        if share is not None:
            self.grad_norm = parts.monitor.agreement.agreed(parts.state.step + 1).grad_norm
        t0 = time.perf_counter()
        if parts.diloco is not None:
            return self._diloco_step(optimizer, guard.loss, guard.finite, t0)
        if parts.replicas is not None:
            return self._replicated_step(optimizer, guard.loss, guard.finite, t0)
        if guard.finite:
            self._apply_update(optimizer, self.grad_norm)
        if not self._state_reported:  # the state exists now: which rank holds how much of it
            self._state_reported = True
            log_state_table(optimizer, log)
        lr = self._advance(optimizer, t0)
        self._record(lr, guard.loss)
        return True

    def _replicated_step(
        self, optimizer: torch.optim.Optimizer, loss: float, finite: bool, t0: float
    ) -> bool:
        """The boundary under replica groups: average across the live groups, then step only
        if the quorum commits. An uncommitted step is not counted: the same data is read again
        (the position did not move) and the next quorum reconfigures around a lost group."""
        from meshrun.ft.replica import scaled_lr

        parts = self.parts

        assert parts.replicas is not None
        parts.replicas.apply_pending_optimizer(optimizer)
        outcome = parts.replicas.sync(loss, finite)
        if not outcome.committed:  # no step taken: False, so nothing runs "after a step"
            optimizer.zero_grad(set_to_none=True)
            self._loss_sum = None
            parts.replicas.data_moved = True
            self._maybe_start_quorum()
            return False
        # The live groups' shares only (fault_tolerance.missing_group = shrink, ft/data.py):
        # the position moves by them, the LR by optim.lr_scaling's rule for them.
        with scaled_lr(optimizer, outcome.lr_factor):
            self._apply_update(optimizer)
        lr = self._advance(optimizer, t0, outcome.samples) * outcome.lr_factor
        ft: dict[str, float | str] = {
            "live_groups": outcome.live_groups,
            "committed": True,
            "samples": outcome.samples,
        }
        self._record(lr, outcome.loss, outcome.samples, ft)
        self._maybe_start_quorum()
        return True

    def _diloco_step(
        self, optimizer: torch.optim.Optimizer, loss: float, finite: bool, t0: float
    ) -> bool:
        """The boundary under DiLoCo: the group's own (inner) step, as without replica groups,
        counted even when skipped, then torchft's outer synchronisation every H / fragments
        steps (it may heal this group: the step and data position are then its peer's)."""
        parts = self.parts
        assert parts.diloco is not None and parts.replicas is not None
        parts.diloco.attach(parts.state.models, optimizer)
        parts.replicas.apply_pending_optimizer(optimizer)
        parts.diloco.before_update()
        if finite:
            self._apply_update(optimizer, self.grad_norm)
        samples = parts.diloco.samples(parts.global_batch)
        lr = self._advance(optimizer, t0, samples)
        step = parts.state.step
        outer = parts.diloco.after_step()
        if parts.state.step != step:  # healed at the sync: the step is the peer's
            parts.monitor.agreement.moved_to(parts.state.step)
        ft: dict[str, float | str] = {"live_groups": parts.replicas.live_groups}
        if outer is not None:
            ft |= {"outer_fragment": outer.fragment, "committed": outer.committed}
        self._record(lr, loss, samples, ft)
        return True

    def _advance(
        self, optimizer: torch.optim.Optimizer, t0: float, samples: int | None = None
    ) -> float:
        """After an update: one step more, the schedulers and the data position (by
        ``samples``, default the whole global batch) moved; returns the step's LR."""
        parts = self.parts
        samples = parts.global_batch if samples is None else samples
        lr = float(optimizer.param_groups[0]["lr"])
        optimizer.zero_grad(set_to_none=True)
        parts.monitor.add("optimizer_s", t0)
        for s in parts.state.schedulers:
            s.step()
        parts.state.step += 1
        if parts.state.sampler is not None:
            parts.state.sampler.step(samples)
        if parts.state.iterable is not None:
            parts.state.iterable.step(samples)
        return lr

    def _maybe_start_quorum(self) -> None:
        """The next step's quorum; under DiLoCo torchft asks for one at each sync instead."""
        parts = self.parts
        if parts.replicas is not None and parts.diloco is None and parts.state.step < self._target:
            parts.replicas.start_step()

    def _grad_sq(self, optimizer: torch.optim.Optimizer) -> Callable[[], float]:
        """This rank's share of the squared norm of the (unscaled) gradient, for the agreement:
        each parameter is held by world / pp ranks (its stage's)."""
        parts = self.parts
        params = [p for g in optimizer.param_groups for p in g["params"]]
        pp = 1 if parts.state.pp_group is None else parts.state.pp_group.size()
        holders = parts.monitor.agreement.world // pp
        scaler = parts.state.scaler  # fp16: the gradients are still scaled here
        scale = 1.0 if scaler is None else float(scaler.get_scale())
        return lambda: grad_sq_share(params, holders) / scale**2

    def _apply_update(self, optimizer: torch.optim.Optimizer, norm: float | None = None) -> None:
        """Unscale, clip by ``norm`` (None: taken here, after the replica groups' average),
        step."""
        parts = self.parts
        if parts.state.scaler is not None:
            parts.state.scaler.unscale_(optimizer)  # clip the true gradient, not the scaled one
        if parts.grad_clip > 0:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            if norm is None:  # the norm of the whole gradient, also when it is sharded
                self.grad_norm = norm = grad_norm(params, pp_group=parts.state.pp_group)
            clip_grads_(params, parts.grad_clip, norm)  # one float64 coefficient on every rank
        if parts.state.scaler is None:
            optimizer.step()
        else:  # skipped on every rank alike when any rank found inf/nan (parallel/precision.py)
            parts.state.scaler.step(optimizer)
            parts.state.scaler.update()

    # --- metrics -------------------------------------------------------------------------

    def _record(
        self,
        lr: float,
        loss: float,
        samples: int | None = None,
        ft: dict[str, float | str] | None = None,
    ) -> None:
        """``loss``: the global mean loss, from the guard's collective (NaN on a skipped step);
        ``samples``: those trained (default the global batch); ``ft``: replica-group figures."""
        parts = self.parts
        now = time.perf_counter()
        step_time, self._t_last = now - self._t_last - self._outside_s, now
        outside, self._outside_s = self._outside_s, 0.0
        logged = parts.state.step % parts.log_every == 0 or parts.state.step == parts.total_steps
        self._loss_sum = None
        wait = self._data_wait(step_time)
        phases = parts.monitor.end_step(parts.state.step, step_time, wait["data_wait_s"])
        parts.metrics.log_step(
            parts.state.step,
            loss=loss,
            lr=lr,
            step_time_s=step_time,
            samples=parts.global_batch if samples is None else samples,
            tokens=self._tokens_per_sample
            and (parts.global_batch if samples is None else samples) * self._tokens_per_sample,
            extra={
                **(memory_stats(parts.device) | parts.monitor.host.sample() if logged else {}),
                # Tokens per expert since the last logged step (a collective on every rank).
                **(moe_metrics(parts.state.models) if logged else {}),
                **wait,
                # The clip's norm (without clipping it is not taken: docs/monitor.md).
                **({"grad_norm": self.grad_norm} if parts.grad_clip > 0 else {}),
                **phases,
                **(ft or {}),
                **({"eval_s": outside} if outside else {}),
            },
        )
        parts.monitor.add("loop_s", now)  # metrics and monitoring: the next step's time

    def _data_wait(self, step_time: float) -> dict[str, float]:
        """This rank's loader wait in the step, in seconds and as a share of the step time."""
        waited = self.last_data_wait_s = self.data_wait.take()
        return {"data_wait_s": waited, "data_wait_share": waited / step_time if step_time else 0.0}
