"""DDP gradient compression hooks: fp16/bf16 all-reduce, PowerSGD (low rank, error feedback).

torch's ``bf16_compress_hook`` checks its own name and refuses anything but NCCL; on Gloo it
runs through a renamed wrapper around the same function. ``batched_powerSGD_hook`` is avoided
(buggy in this torch); PowerSGD is the per-tensor ``powerSGD_hook``.

No ``from __future__ import annotations`` here: DDP checks a hook's annotations at runtime.
"""

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from meshrun.config import ParallelConfig


def bf16_compress(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's bf16 hook under another name, so that it also runs on Gloo."""
    return default_hooks.bf16_compress_hook(state, bucket)


def apply_comm_hook(
    model: DDP, cfg: ParallelConfig, wrap: Callable[[Any], Any] | None = None
) -> str:
    """Register the configured hook on ``model``; return its name for the start-up log.
    ``wrap(hook)`` (the monitor's timer, monitor/comm.py) wraps the hook registered here.
    Without compression nothing is registered here: the monitor times the default all-reduce
    only if the user has not registered a hook of their own by the first step."""
    group = model.process_group
    timed = wrap or (lambda hook: hook)
    if cfg.ddp_comm_hook == "fp16":
        model.register_comm_hook(group, timed(default_hooks.fp16_compress_hook))
    elif cfg.ddp_comm_hook == "bf16":
        model.register_comm_hook(group, timed(bf16_compress))
    elif cfg.ddp_comm_hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=group,
            matrix_approximation_rank=cfg.powersgd_rank,
            start_powerSGD_iter=2,  # the first steps all-reduce in full (error feedback warm-up)
        )
        model.register_comm_hook(state, timed(powerSGD_hook.powerSGD_hook))
    return cfg.ddp_comm_hook
