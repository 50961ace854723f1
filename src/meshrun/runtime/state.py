"""The training state of one run, shared by the step loop and the checkpoints.

``Run`` owns one :class:`TrainState`. The loop advances it (the step and micro-step counters,
the data position of the loader it iterates), ``run.parallelize``/``run.pipeline``/
``run.lr_scheduler`` add to it, and the checkpoint code saves and restores it, all through
these public fields: neither reaches into the other's attributes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn
from torch.distributed import ProcessGroup

if TYPE_CHECKING:
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

__all__ = ["DataPosition", "TrainState"]


class DataPosition(Protocol):
    """A loader's position as the loop steps it and the checkpoints save it: data/'s
    ResumableSampler and ResumableIterable. The state names no meshrun subsystem, not even as a
    type, so every subsystem may import it."""

    def step(self, global_samples: int | None = None) -> None: ...

    def state_dict(self) -> dict[str, int]: ...

    def load_state_dict(self, state: Mapping[str, int]) -> None: ...


@dataclass
class TrainState:
    """What a run trains and where it is: the counters, the torch objects, the data position."""

    step: int = 0  # optimizer steps done
    micro: int = 0  # index of the current micro-step inside the accumulation window
    models: list[nn.Module] = field(default_factory=list)  # from run.parallelize/run.pipeline
    # The optimizer run.resume registered, else the first one run.optimizer_step saw:
    # checkpoints save it, and a replica group sends its state to a peer that heals.
    optimizer: torch.optim.Optimizer | None = None
    schedulers: list[torch.optim.lr_scheduler.LRScheduler] = field(default_factory=list)
    # The loader's position, set when run.steps(loader) begins: the loop steps it once per
    # optimizer step (a ResumableSampler's, or a ResumableIterable dataset's own).
    sampler: DataPosition | None = None
    iterable: DataPosition | None = None
    # fp16 loss scaler (parallel.param_dtype = float16), set by run.parallelize: it scales the
    # loss in backward, unscales before clipping and skips steps with inf/nan gradients.
    scaler: ShardedGradScaler | None = None
    pp_group: ProcessGroup | None = None  # set by run.pipeline: the stages' norms combine
    # Set by a resume that restored every rank's RNG streams (same world size); else the loop
    # seeds torch per data-parallel coordinate when run.steps begins (loop.seed_per_dp).
    rng_restored: bool = False

    def set_position(self, step: int) -> None:
        """Continue at optimizer step ``step``, at the start of its accumulation window."""
        self.step, self.micro = step, 0
