"""The machinery of one training process, bundled once by ``startup.build_machinery``: every
part the step loop (train/loop.py) and ``Run``'s functions (train/stepping.py, evaluate.py,
model.py, record.py, ``startup.shut_down``) drive. The step loop is built whole from it and
``Run``'s functions take it whole, so no part is assigned after construction and no function
reaches into the loop for one. Frozen: the parts are never swapped (each keeps its own state:
the train state's counters, the monitor's clocks, the checkpointer's pending save)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.distributed import ProcessGroup

from meshrun.checkpoint import Checkpointer
from meshrun.monitor import MetricsLogger, StepMonitor
from meshrun.parallel.optim_params import FormerParams
from meshrun.runtime.state import TrainState

if TYPE_CHECKING:  # built only under fault_tolerance.replica_groups > 1
    from meshrun.ft.diloco import DiLoCoSync
    from meshrun.ft.replica import ReplicaGroup

__all__ = ["Machinery"]


@dataclass(frozen=True)
class Machinery:
    """What one ``Run`` drives (private to it)."""

    # The resolved batch figures: samples per optimizer step, per micro-batch, and the
    # micro-steps each rank accumulates per step (over every replica group's dp ranks).
    accum: int
    global_batch: int
    micro_batch: int
    total_steps: int  # optim.steps: where run.steps stops unless told otherwise
    grad_clip: float  # optim.grad_clip (0: no clipping, no norm taken)
    log_every: int  # metrics.log_every: steps whose line has memory, host and MoE figures
    # job.seed and this rank's data-parallel coordinate over every replica group: torch's RNG
    # stream once run.steps begins (loop.seed_per_dp), unless a resume restored it.
    seed: int
    dp_coord: int
    device: torch.device
    cp_group: ProcessGroup | None  # parallel.cp > 1: each batch cut to this rank's slice
    metrics: MetricsLogger
    # Step breakdown, numerics guard (it exchanges the run's one per-step agreement),
    # stragglers, the hang watchdog.
    monitor: StepMonitor
    # Counters, models, schedulers, data position, scaler: what the loop advances and the
    # checkpoints save.
    state: TrainState
    # The models' parameters before run.parallelize replaced them: names an optimizer built
    # on the old ones at its first step (parallel/optim_params.py).
    former: FormerParams
    checkpointer: Checkpointer
    replicas: ReplicaGroup | None = None  # fault_tolerance.replica_groups > 1: ft/replica.py
    # fault_tolerance.diloco_sync_every > 0: each group steps alone and syncs with the others
    # every H steps (ft/diloco.py), no per-step quorum.
    diloco: DiLoCoSync | None = None

    def __post_init__(self) -> None:
        if min(self.accum, self.global_batch, self.micro_batch) < 1:
            # An unset global batch (0) is resolved before the loop (launcher or Run): a 0 here
            # would count no samples per step and divide the loss by zero.
            raise ValueError(
                f"StepLoop needs resolved batch figures >= 1, got accum={self.accum}, "
                f"global_batch={self.global_batch}, micro_batch={self.micro_batch}; derive an "
                "unset data.global_batch with meshrun.config.resolve_global_batch first"
            )
