"""Save and resume the whole training state with ``torch.distributed.checkpoint``.

One :class:`Checkpointer` per run (``Run`` owns it). It tracks what defines the run: the model
and optimizer (through DCP's ``get_state_dict``/``set_state_dict``, so any layout works: DDP,
FSDP2, TP), the LR schedulers, the step counter, the sampler's data position, every rank's RNG
states, the resolved config and user objects registered by name. Tensors go to DCP (every rank
writes its part); everything else to JSON (see ``runtime/state.py``: nothing is unpickled on load).

It reads and writes the run's :class:`~meshrun.runtime.state.TrainState` and delegates each concern
to a module of its own: what is saved (``targets.py``), the commit protocol, manifest and
retention (``commit.py``), async staging (``async_save.py``), preemption signals
(``preemption.py``) and resume with re-sharding (``resume.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from meshrun.checkpoint import on_disk
from meshrun.checkpoint.checks import CheckpointError, first_cause, layout_text
from meshrun.checkpoint.commit import Commit
from meshrun.checkpoint.facts import RunFacts
from meshrun.checkpoint.preemption import Preemption
from meshrun.checkpoint.resume import Resume
from meshrun.checkpoint.targets import Stateful, Targets
from meshrun.config import CheckpointConfig
from meshrun.monitor import MetricsLogger
from meshrun.runtime.agreement import Slot, StepAgreement
from meshrun.runtime.state import TrainState

# The node-local tier and async saves are imported where a run first uses them: a run with
# neither (checkpoint.local_interval = 0, checkpoint.async = false) never loads them (issue 19).
if TYPE_CHECKING:
    from meshrun.checkpoint.async_save import AsyncSaves
    from meshrun.checkpoint.local.tier import LocalTier

__all__ = ["CheckpointError", "Checkpointer", "RunFacts", "Stateful"]

log = logging.getLogger("meshrun")


class Checkpointer:
    """Saves on a schedule and resumes; all methods are collective (call them on every rank)."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        facts: RunFacts,
        state: TrainState,
        metrics: MetricsLogger,
        agreement: StepAgreement | None = None,
    ) -> None:
        self.cfg = cfg
        self.facts = facts
        self.root = facts.root
        self.state = state
        self.metrics = metrics
        self.last_saved: int | None = None
        # The step whose save is due once the user's loop body of that step has run (flush).
        self._due: tuple[int, Callable[[], AbstractContextManager[None]]] | None = None
        self.targets = Targets(state, facts.rank)
        self.commit = Commit(cfg, facts)
        self.preemption = Preemption(cfg.on_signal)
        # Made now with checkpoint.async (its gloo group is created at start-up), else at the
        # first save_async call.
        self.saves: AsyncSaves | None = self._async_saves() if cfg.async_ else None
        # The frequent node-local snapshots (checkpoint/local/tier.py); the shared ones stay the durable.
        self.local: LocalTier | None = None
        if cfg.local_interval:
            from meshrun.checkpoint.local.tier import LocalTier  # only a run with the tier

            self.local = LocalTier(cfg, facts, self.targets, metrics)
        # The "any rank signalled?" and "every rank's async write done?" questions ride in the
        # run's one per-step agreement (meshrun/runtime/agreement.py) when there is one; without it
        # (a Checkpointer driven by hand) each is a small all-reduce of its own.
        self.agreement = agreement
        if agreement is not None:
            agreement.provide(Slot.PREEMPT, self.preemption.requested_locally)
            agreement.provide(Slot.SAVE_WRITING, self._writing_locally)

    def _async_saves(self) -> AsyncSaves:
        from meshrun.checkpoint.async_save import AsyncSaves  # only a run that saves async

        return AsyncSaves(self.commit, self.facts.device, enabled=self.cfg.async_)

    def _writing_locally(self) -> bool:
        return self.saves is not None and self.saves.writing_locally()

    def register(
        self,
        model: Any,
        optimizer: torch.optim.Optimizer,
        loader: Any = None,
        named: Mapping[str, Stateful] | None = None,
        per_rank: Mapping[str, Stateful] | None = None,
    ) -> None:
        """``model``: the (parallelized) model, or the ``Pipeline`` from ``run.pipeline``."""
        self.targets.register(model, optimizer, loader, named, per_rank)
        self.install_signal_handlers()

    def register_internal(self, name: str, obj: Stateful) -> None:
        """meshrun's own state laid out like the model (``Targets.internal``), saved and
        resumed with it."""
        self.targets.internal[name] = obj

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGUSR1 only set a flag; the ranks agree on it at the next step boundary."""
        self.preemption.install()

    # --- save ----------------------------------------------------------------------------

    def step_done(
        self, step: int, phase: Callable[[], AbstractContextManager[None]] = nullcontext
    ) -> None:
        """``run.optimizer_step`` calls this after an optimizer step; :meth:`maybe_save` runs at
        :meth:`flush`, once the rest of the user's loop body has run. Why: the user's own
        objects (an LR scheduler stepped after ``run.optimizer_step``, a carried hidden state)
        must be saved at the same step as the model and optimizer, not one step behind."""
        self._due = (step, phase)

    def flush(self, exit_on_preempt: bool = True) -> Path | None:
        """The save of the step :meth:`step_done` reported, if not run yet (collective): when
        ``run.steps`` is asked for the next micro-batch (or ends), at the next ``run.backward``
        or ``run.optimizer_step``, a save, or ``run.close``."""
        due, self._due = self._due, None
        return None if due is None else self.maybe_save(*due, exit_on_preempt=exit_on_preempt)

    def maybe_save(
        self,
        step: int,
        phase: Callable[[], AbstractContextManager[None]] = nullcontext,
        exit_on_preempt: bool = True,
    ) -> Path | None:
        """Called at the end of each optimizer step (:meth:`flush`): save when
        ``checkpoint.interval`` divides ``step`` or when any rank received a preemption signal
        (then exit 0 once saved, unless not ``exit_on_preempt``: in ``run.close``). A save runs
        inside ``phase()`` (the hang watchdog's longer checkpoint limit); the per-step
        agreements before it do not: they are small collectives, and a rank stopped while its
        peers wait in one is a hang to report within ``monitor.step_timeout_s`` (inside the
        checkpoint phase it went unreported for ``monitor.phase_timeout_s``)."""
        interval = self.cfg.interval
        # Also without an interval: a preemption save (SLURM's USR1 before the time limit, a
        # SIGTERM) is the one checkpoint such a run gets, and the loop owns what is saved.
        self.install_signal_handlers()
        preempted = self._preempt_agreed()
        due = interval > 0 and step % interval == 0
        if self.local is not None and not preempted and step % self.cfg.local_interval == 0:
            with phase():
                self.local.snapshot(step)
        try:
            self._poll(block=False)
            if not preempted and not due:
                return None
            with phase():
                if self.cfg.async_ and not preempted:
                    self.save_async(step)
                    return None
                path = self.save(step)
        except CheckpointError as e:
            if preempted or self.cfg.on_error == "stop":
                raise
            log.error("%s; training goes on (checkpoint.on_error = 'warn')", e)
            return None
        if preempted and exit_on_preempt:
            if self.facts.rank == 0:
                name = self.preemption.signal_name
                log.warning("preempted (%s): checkpoint %s written; exiting 0", name, path)
            raise SystemExit(0)
        return path

    def _preempt_agreed(self) -> bool:
        """Whether any rank was signalled: the per-step agreement's answer for this step."""
        if self.agreement is None:
            return self.preemption.agreed(self.facts.device)
        if not self.preemption.installed:
            return False
        return self.preemption.consume(self.agreement.agreed(self.state.step).any(Slot.PREEMPT))

    def save(self, step: int | None = None) -> Path:
        """Write a checkpoint of the current state at ``step`` (default: the run's step)."""
        step = self.state.step if step is None else step
        self.wait()  # an async save still in flight is committed first
        final, tmp = on_disk.step_dir(self.root, step), on_disk.tmp_dir(self.root, step)
        if self.last_saved == step and final.is_dir():
            return final
        import torch.distributed.checkpoint as dcp  # at the first save: ~1 s of CPU to import
        from torch.distributed.checkpoint.api import CheckpointException as DCPException

        from meshrun.checkpoint.writer import hashing_writer

        t0 = time.perf_counter()
        tensors, plain = self.targets.collect()
        self.commit.prepare(tmp, self.targets.digests)  # the replicated objects checked there
        error: BaseException | None = None
        mine: dict[str, Any] = {}
        try:
            self.commit.write_rank_file(tmp, plain)
            writer, fs = hashing_writer(tmp)
            dcp.save(tensors, storage_writer=writer)
            mine = self.commit.my_digests(tmp, fs)
        except (Exception, DCPException) as e:  # DCP raises on every rank if any failed
            error = first_cause(e)
        self.commit.finish(step, tmp, plain, mine, error, self._layout())
        self.last_saved = step
        if self.facts.rank == 0:
            log.info("checkpoint %s written in %.2f s", final, time.perf_counter() - t0)
        # Training was blocked this long (`meshrun report` counts it against goodput).
        blocked = time.perf_counter() - t0
        self.metrics.log_event("checkpoint", after_step=step, blocked_s=blocked)
        return final

    def _layout(self) -> str:
        return layout_text(self.targets.model)

    # --- async save (async_save.py) --------------------------------------------------------

    def save_async(self, step: int | None = None) -> None:
        """Start an async save: the state is copied to CPU memory in the stager's thread
        (:meth:`before_update` waits for the copy before the next optimizer step), then DCP
        writes it from a background thread; committed at a later step boundary."""
        from meshrun.checkpoint.async_save import clone_volatile  # only a run that saves async

        step = self.state.step if step is None else step
        self.wait()  # at most one save in flight
        if self.saves is None:
            self.saves = self._async_saves()

        def collect() -> tuple[dict[str, Any], dict[str, Any]]:
            tensors, plain = self.targets.collect()
            return clone_volatile(tensors, *self.targets.resolve()), plain

        blocked = self.saves.start(step, collect, self._layout(), lambda: self.targets.digests)
        if blocked is not None:
            self.metrics.log_event("checkpoint", after_step=step, blocked_s=blocked)

    def before_update(self) -> None:
        """``run.optimizer_step`` calls this before the optimizer changes anything: the copy of
        the parameters and optimizer state that an async save makes in the background must be
        finished by then. The wait (usually none: the copy overlaps the forward and backward)
        counts as time training was blocked."""
        if self.saves is not None:
            self.saves.before_update()

    def _poll(self, block: bool) -> None:
        """Commit the async save in flight once every rank's write is done: at a step boundary
        from the step's agreement, else (``block``, or no agreement) by an all-reduce."""
        saves = self.saves  # None: no async save was ever started, so none is in flight
        if block or self.agreement is None:
            committed = saves.poll(block, self._layout) if saves is not None else None
        else:
            agreed = self.agreement.agreed(self.state.step)
            writing = agreed.any(Slot.SAVE_WRITING)
            committed = saves.commit_if(not writing, self._layout) if saves is not None else None
        if committed is not None:
            self.last_saved = committed

    def wait(self) -> None:
        """Run the save of the last step if still due, and commit the async save in flight,
        if any (collective); ``run.close`` calls it."""
        self.flush(exit_on_preempt=False)  # a loop that left run.steps before its end
        self._poll(block=True)

    def finish(self) -> None:
        """The run ended well (``run.close``): :meth:`wait`, then its node-local snapshots
        are removed unless ``checkpoint.local_keep`` (collective)."""
        self.wait()
        if self.local is not None:
            self.local.finish()

    # --- resume (resume.py) ----------------------------------------------------------------

    def resume(self) -> int:
        """Load the checkpoint chosen by ``checkpoint.resume``; return the step (0 = fresh)."""
        shared = Resume(self.cfg, self.facts, self.targets)
        step = shared.load() if self.local is None else self.local.resume(shared.load)
        if step is None:
            return 0
        self.last_saved = step
        return step

    def newest_valid_step(self, checksums: bool = True) -> int | None:
        return self.commit.newest_valid_step(checksums)
