"""Checkpoints (first cut): a sharded save of model and optimizer with
``torch.distributed.checkpoint``. Atomic commit, manifests, auto-resume and resharding arrive
with the checkpoint issue; this writes the final checkpoint of a run."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

__all__ = ["save"]


def save(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> Path:
    """Write model + optimizer state to ``path`` (a directory) with DCP; every rank writes its
    part. Written to ``path.tmp`` first and renamed, so a crash never leaves a half directory
    under the final name."""
    final = Path(path)
    tmp = final.with_name(final.name + ".tmp")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "step": torch.tensor(step)}
    is_main = not dist.is_initialized() or dist.get_rank() == 0
    if is_main and tmp.exists():
        shutil.rmtree(tmp)
    if dist.is_initialized():
        dist.barrier()
    dcp.save(state, checkpoint_id=str(tmp))
    if dist.is_initialized():
        dist.barrier()
    if is_main:
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    if dist.is_initialized():
        dist.barrier()
    return final
