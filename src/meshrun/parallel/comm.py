"""DDP gradient compression hooks: fp16/bf16 all-reduce, PowerSGD (low rank, error feedback).

torch's ``bf16_compress_hook`` checks its own name and refuses anything but NCCL; on Gloo it
runs through a renamed wrapper around the same function. ``batched_powerSGD_hook`` is avoided
(buggy in this torch); PowerSGD is the per-tensor ``powerSGD_hook``.

No ``from __future__ import annotations`` here: DDP checks a hook's annotations at runtime.
"""

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from meshrun.config import ParallelConfig


def bf16_compress(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's bf16 hook under another name, so that it also runs on Gloo."""
    return default_hooks.bf16_compress_hook(state, bucket)


def apply_comm_hook(model: DDP, cfg: ParallelConfig) -> str:
    """Register the configured hook on ``model``; return its name for the start-up log."""
    group = model.process_group
    if cfg.ddp_comm_hook == "fp16":
        model.register_comm_hook(group, default_hooks.fp16_compress_hook)
    elif cfg.ddp_comm_hook == "bf16":
        model.register_comm_hook(group, bf16_compress)
    elif cfg.ddp_comm_hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=group,
            matrix_approximation_rank=cfg.powersgd_rank,
            start_powerSGD_iter=2,  # the first steps all-reduce in full (error feedback warm-up)
        )
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return cfg.ddp_comm_hook
