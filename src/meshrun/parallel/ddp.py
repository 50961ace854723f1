"""Data parallelism with torch's DistributedDataParallel, configured from ``[parallel]``."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel as DDP

from meshrun.config import ParallelConfig


def apply_ddp(model: nn.Module, mesh: DeviceMesh, cfg: ParallelConfig, device: torch.device) -> DDP:
    """Wrap ``model`` (already on ``device``) in DDP over the mesh's ``dp`` dimension."""
    return DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=mesh.get_group("dp"),
        bucket_cap_mb=cfg.bucket_cap_mb,
        gradient_as_bucket_view=cfg.gradient_as_bucket_view,
        static_graph=cfg.static_graph,
        find_unused_parameters=cfg.find_unused_parameters,
    )


# The accumulation switch for DDP and FSDP2 (set_grad_sync) lives in parallel/grads.py.
