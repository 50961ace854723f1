"""Parallel layouts: plain functions that change a model, called in one documented order.

``parallelize`` owns the order: move to device, then (future: tensor parallel, activation
checkpointing, compile, FSDP) data parallelism last, as torchtitan does.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshrun.config import ParallelConfig
from meshrun.parallel.ddp import apply_ddp, set_grad_sync

__all__ = ["apply_ddp", "parallelize", "set_grad_sync"]

log = logging.getLogger("meshrun")


def parallelize(
    model: nn.Module, mesh: DeviceMesh | None, cfg: ParallelConfig, device: torch.device
) -> nn.Module:
    """Apply the configured layout to ``model``; returns a real torch module (DDP when dp > 1)."""
    model = model.to(device)
    if mesh is None or "dp" not in (mesh.mesh_dim_names or ()) or mesh["dp"].size() == 1:
        log.info("single data-parallel rank: model used as is (no DDP)")
        return model
    ddp = apply_ddp(model, mesh, cfg, device)
    log.info(
        "DDP over %d ranks (bucket_cap_mb=%s, static_graph=%s)",
        mesh["dp"].size(),
        cfg.bucket_cap_mb,
        cfg.static_graph,
    )
    return ddp
