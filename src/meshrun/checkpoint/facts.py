"""What the checkpoint code knows about the run besides ``[checkpoint]``, and its one collective.

:class:`RunFacts` is filled once by ``Run`` (from the resolved config and the process group):
the checkpoint modules take it and the ``CheckpointConfig``, never the whole ``Config``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

__all__ = ["RunFacts", "any_rank", "barrier"]


@dataclass(frozen=True)
class RunFacts:
    """The run's fixed figures a checkpoint records in its manifest or checks on resume."""

    root: Path  # the checkpoint directory (checkpoint.dir, else <run_dir>/checkpoints)
    rank: int
    world: int
    device: torch.device
    accum: int
    global_batch: int
    micro_batch: int
    seed: int  # job.seed: RNG streams are re-seeded from it when the world size changes
    lr_scaling: str  # optim.lr_scaling: the LR rule when the global batch changes on resume
    config_toml: str  # the resolved config, saved with every checkpoint
    config_digest: str

    @property
    def dp(self) -> int:
        """The data-parallel size, from the batch arithmetic (global = micro x accum x dp)."""
        return self.global_batch // (self.micro_batch * self.accum)


def any_rank(flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` is true on any rank (one small all-reduce over the world; collective)."""
    if not dist.is_initialized():
        return flag
    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
