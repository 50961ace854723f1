"""One replica group's side of torchft: the quorum before each step, the cross-group gradient
average, the commit decision, and healing from a live peer (docs/fault_tolerance.md).

Inside a group the layout runs as without fault tolerance (DDP, FSDP2, ...): after the
group's own backward sync every rank holds the gradient of its group's share of the batch
(whole under DDP, its shard under FSDP2). Rank ``r`` of each group then averages those local
tensors with rank ``r`` of the other live groups through torchft's Manager (the same shape on
every group: the groups run the same layout), so the result is the gradient of the live
groups' whole batch. torchft's own DDP wrapper is not used: its comm hook asserts
(``assert fut._fut``) when a peer dies inside the all-reduce; here the error goes to the
Manager, and ``should_commit`` then refuses the step on every rank of the group.

The quorum is synchronous (``use_async_quorum=False``): a restarted group loads its peer's
state before its first forward, so no step of it trains on stale weights. How the Manager is
built (its servers' addresses, the quorum check that keeps strangers out, the signed heals):
ft/manager.py.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from meshrun.config import ConfigError
from meshrun.config.fault_tolerance import FaultToleranceConfig
from meshrun.data.sampler import ResumableSampler
from meshrun.ft.data import live_share
from meshrun.ft.heal import HealState, StateCodec
from meshrun.ft.manager import build_manager
from meshrun.monitor import MetricsLogger
from meshrun.runtime.logs import one_line
from meshrun.runtime.schedule import scale_lr
from meshrun.runtime.state import TrainState

__all__ = ["ReplicaGroup", "StepOutcome", "scaled_lr"]

log = logging.getLogger("meshrun")


@dataclass(frozen=True)
class StepOutcome:
    """What the cross-group step decided (the same on every rank of the group)."""

    committed: bool
    loss: float  # the mean loss over the live groups (NaN when not committed)
    live_groups: int
    samples: int  # the positions the step covers: the live groups' shares of the batch
    lr_factor: float  # optim.lr_scaling's rule for `samples` against the global batch


class ReplicaGroup:
    """torchft's Manager for this process, with the step loop's three calls:
    :meth:`start_step` before a step's first micro-batch, :meth:`sync` at the optimizer
    boundary, :meth:`close` at the end."""

    def __init__(
        self,
        cfg: FaultToleranceConfig,
        state: TrainState,
        metrics: MetricsLogger,
        dp: int,
        *,
        global_batch: int,
        lr_scaling: str = "none",
    ) -> None:
        if not cfg.lighthouse:
            raise ConfigError(
                "fault_tolerance.replica_groups > 1 but fault_tolerance.lighthouse is empty: "
                "start the job with `meshrun launch --replica-groups N` (it starts one), or "
                "pass --lighthouse HOST:PORT of a running `meshrun lighthouse`"
            )
        self.cfg, self.state, self.metrics, self.dp = cfg, state, metrics, dp
        self.global_batch, self.lr_scaling = global_batch, lr_scaling
        self.codec = StateCodec(state, cfg.group_index)
        self.heal = HealState()
        self.refused: list[str] = []  # quorums refused since the last step (ft/auth.py)
        self.manager = build_manager(cfg, self.codec, self._load, self.refused)
        self.live_groups = 0
        self._first_quorum = True  # this process's first: resume the step, wait for all
        # A heal set a new data position, or the quorum a new share: the loop restarts its
        # loader (batches drawn under the old share are dropped).
        self.data_moved = False
        self._sampler: ResumableSampler | None = None  # the one whose share we set per step
        self._dp_rank = 0  # this rank's index among its group's data-parallel ranks
        # Under DiLoCo torchft's step counter counts outer synchronisations, restored with
        # DiLoCo's state (ft/diloco.py), not set from the run's steps.
        self.outer_steps = False

    # --- the step -------------------------------------------------------------------------

    def start_step(self) -> None:
        """The quorum of this step (blocks until one of ``min_replicas`` groups forms); a
        group behind the others loads a live peer's state here (healing)."""
        t0 = time.perf_counter()
        self.heal.begin()
        first, self._first_quorum = self._first_quorum, False
        if first:
            self._resume_step()
        self.manager.start_quorum()
        self._log_refused()
        live = self.manager.num_participants()
        if first and self.heal.loaded is None and live < self.cfg.replica_groups:
            live = self._wait_for_all_groups(live)
        if live != self.live_groups and self.live_groups:
            word = "left" if live < self.live_groups else "joined"
            self.metrics.log_event("ft_groups", step=self.state.step, live_groups=live, change=word)
            log.warning(
                "replica groups: %d live (a group %s) at step %d", live, word, self.state.step
            )
        self.live_groups = live
        self._apply_share(live)
        if self.heal.loaded is not None:
            self.data_moved = True
            self._log_heal(time.perf_counter() - t0)

    def _resume_step(self) -> None:
        """torchft's step counter from the run's, before this process's first quorum. A group
        resumed from a checkpoint (shared or node-local) is at that step, while a new Manager
        counts from 0: left so, groups that resumed different steps (each group has its own
        checkpoints) would all claim step 0 and none would heal, training on apart. The
        lighthouse heals the groups behind the highest step from a group at it."""
        if not self.outer_steps and self.manager.current_step() != self.state.step:
            self.manager.load_state_dict(
                {"step": self.state.step, "batches_committed": self.manager.batches_committed()}
            )

    def _apply_share(self, live: int) -> None:
        """This step's share of the global order (ft/data.py): this group's place among the
        quorum's participants; a new share restarts the loader at the data position."""
        sampler = self._sampler
        if sampler is None:
            return
        participant = self.manager.participating_rank()
        if participant is None:  # sync quorum: every group in the quorum takes part
            raise RuntimeError(
                f"replica group {self.cfg.group_index} is in the quorum of step "
                f"{self.state.step + 1} but torchft gives it no participant rank"
            )
        share = live_share(
            self.global_batch, self.cfg.replica_groups, self._dp_rank, self.dp, participant, live
        )
        if share != (sampler.rank, sampler.world_size, sampler.global_batch):
            sampler.set_share(*share)
            self.data_moved = True

    def _wait_for_all_groups(self, live: int) -> int:
        """A job's first quorum (fresh or resumed from checkpoints) waits for every group
        (they start seconds apart) rather than training the first steps on fewer: every group
        in this quorum sees the same count, so all of them ask again, until all are in or
        ``quorum_timeout_s`` passed. A restarted group that healed does not wait."""
        deadline = time.monotonic() + self.cfg.quorum_timeout_s
        while live < self.cfg.replica_groups and time.monotonic() < deadline:
            time.sleep(0.2)
            self.manager.start_quorum()
            live = self.manager.num_participants()
        if (
            live < self.cfg.replica_groups
            and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
        ):
            # A restarted group that finds no peer to heal from must not train from step 0
            # alone: the job has likely ended (its peers finished) or lost every group.
            raise RuntimeError(
                f"replica group {self.cfg.group_index} restarted but only {live} of "
                f"{self.cfg.replica_groups} groups answered in {self.cfg.quorum_timeout_s:.0f} s "
                "(fault_tolerance.quorum_timeout_s): no live group to heal from"
            )
        if live < self.cfg.replica_groups:
            log.warning(
                "replica groups: starting with %d of %d groups after %.0f s",
                live,
                self.cfg.replica_groups,
                self.cfg.quorum_timeout_s,
            )
        return live

    def sync(self, loss: float, finite: bool) -> StepOutcome:
        """Average the gradients (and the loss) over the live groups; whether to commit."""
        buf, grads = self._pack(loss, finite)
        try:
            self.manager.allreduce(buf).wait()
        except Exception as err:  # a dead peer: Gloo's "Connection reset by peer", a timeout
            self.manager.report_error(err)
        if self.manager.errored() is None and float(buf[-2]) > 0:
            # Some group's loss was NaN/Inf: no group commits (the numerics guard's rule).
            self.manager.report_error(FloatingPointError("non-finite loss in a replica group"))
        committed = self.manager.should_commit()
        live = self.live_groups
        samples = self.global_batch * live // self.cfg.replica_groups
        factor = scale_lr(1.0, samples, self.global_batch, self.lr_scaling)
        if committed:
            _unpack(buf, grads)
            return StepOutcome(True, float(buf[-1]), live, samples, factor)
        self.metrics.log_event(
            "ft_uncommitted",
            step=self.state.step + 1,
            live_groups=live,
            error=_one_line(self.manager.errored()),
        )
        return StepOutcome(False, float("nan"), live, 0, factor)

    def check_sampler(self, sampler: ResumableSampler | None) -> None:
        """The loader must read this group's share of the global order (ft/data.py): a
        ResumableSampler built for every group's ranks, whose share each quorum then sets."""
        if self.state.iterable is not None:
            raise ConfigError(
                "replica groups: the loader reads a ResumableIterable, whose share of the "
                "stream is fixed; the live groups take per-step shares of the global order "
                "(fault_tolerance.missing_group = shrink), which only a ResumableSampler "
                "serves: use a map-style dataset with run.dataloader(...) or run.sampler(...)"
            )
        if sampler is None:
            log.warning(
                "replica groups: the loader has no ResumableSampler, so meshrun cannot "
                "give each step's live groups their shares of the global order; build "
                "it with run.dataloader(...) or run.sampler(...)"
            )
        if sampler is None or sampler is self._sampler:
            return
        want, first = self.cfg.replica_groups * self.dp, self.cfg.group_index * self.dp
        if (sampler.world_size, sampler.global_batch) != (want, self.global_batch) or not (
            first <= sampler.rank < first + self.dp
        ):
            raise ConfigError(
                f"replica groups: the loader's sampler is rank {sampler.rank} of "
                f"{sampler.world_size} over global batch {sampler.global_batch}, but group "
                f"{self.cfg.group_index}'s ranks read ranks {first}..{first + self.dp - 1} of "
                f"{self.cfg.replica_groups} groups x {self.dp} data-parallel ranks ({want}) "
                f"over data.global_batch = {self.global_batch}: build its ResumableSampler "
                "with rank, world_size = meshrun.ft.data_share(run.config.fault_tolerance, "
                "run.dp_rank, run.dp_size), or use run.sampler(...)"
            )
        self._sampler, self._dp_rank = sampler, sampler.rank - first

    def apply_pending_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Load a healed optimizer state the step loop could not place before it knew the
        optimizer (a restarted group heals before its first ``optimizer_step``)."""
        self.codec.apply_pending_optimizer(optimizer)

    def close(self) -> None:
        self.manager.shutdown(wait=False)

    # --- internals ------------------------------------------------------------------------

    def _load(self, blob: dict[str, Any]) -> None:
        self.heal.loaded = self.codec.load(blob)

    def _log_refused(self) -> None:
        """The quorums refused in this step's quorum call (the client logged each line)."""
        for line in self.refused:
            self.metrics.log_event("ft_refused", step=self.state.step + 1, reason=line)
        self.refused.clear()

    def _log_heal(self, seconds: float) -> None:
        loaded = self.heal.loaded
        assert loaded is not None
        self.metrics.log_event(
            "ft_heal",
            step=self.state.step,
            bytes=loaded.nbytes,
            seconds=round(seconds, 4),
            source=loaded.source,
            live_groups=self.live_groups,
        )
        log.warning(
            "replica group %d healed from %s: %d bytes in %.2f s, continuing at step %d",
            self.cfg.group_index,
            loaded.source,
            loaded.nbytes,
            seconds,
            self.state.step,
        )

    def _pack(self, loss: float, finite: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One flat float32 buffer: the local gradients, a non-finite flag, the loss."""
        grads = _local_grads(self.state.models)
        parts = [g.detach().reshape(-1).float() for g in grads]
        tail = torch.tensor([0.0 if finite else 1.0, loss if finite else 0.0])
        return torch.cat([*parts, tail]), grads


@contextmanager
def scaled_lr(optimizer: torch.optim.Optimizer, factor: float) -> Iterator[None]:
    """The optimizer's LRs times ``factor`` for one update (a step the live groups trained
    with a smaller batch, under optim.lr_scaling), then back: the schedule stays its own."""
    if factor == 1.0:
        yield
        return
    saved = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * factor
    try:
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, saved, strict=True):
            group["lr"] = lr


def _local_grads(models: Sequence[nn.Module]) -> list[torch.Tensor]:
    """This rank's gradient tensors (the local shard of a DTensor), in parameter order."""
    out = []
    for model in models:
        for p in model.parameters():
            if p.grad is not None:
                g = p.grad
                out.append(g.to_local() if hasattr(g, "to_local") else g)
    return out


def _unpack(buf: torch.Tensor, grads: list[torch.Tensor]) -> None:
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(buf[offset : offset + n].view_as(g).to(g.dtype))
        offset += n


def _one_line(err: BaseException | None) -> str:
    if err is None:
        return ""
    return one_line(getattr(err, "original_exception", err))[:300]
