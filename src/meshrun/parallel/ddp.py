"""Data parallelism with torch's DistributedDataParallel, configured from ``[parallel]``."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel as DDP

from meshrun.config import ParallelConfig
from meshrun.runtime.mesh import dp_cp_group_name


def apply_ddp(model: nn.Module, mesh: DeviceMesh, cfg: ParallelConfig, device: torch.device) -> DDP:
    """Wrap ``model`` (already on ``device``) in DDP over the mesh's ``dp`` dimension (``dp_cp``
    under context parallel: each cp rank's gradient is its slice's, averaged with the others)."""
    return DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=mesh.get_group(dp_cp_group_name(mesh)),
        bucket_cap_mb=cfg.bucket_cap_mb,
        gradient_as_bucket_view=cfg.gradient_as_bucket_view,
        static_graph=cfg.static_graph,
        find_unused_parameters=cfg.find_unused_parameters,
    )


def apply_replicate(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """DDP for a pipeline stage: gradients all-reduced over the ``dp`` dim, parameters whole.

    Why not DDP: a pipeline stage runs several chunks' backwards per step, and DDP's reducer
    rebuilds its buckets from the first step's gradient order; with the stage's no_sync chunks
    that trips an internal assert at step 2 (torch 2.13: "rebuilt parameter indices size is
    not same as original model parameters size", measured here). ``replicate`` is the FSDP2
    machinery without sharding, the replication ``PipelineStage`` drives natively (it reduces
    once, after the last chunk's backward), as torchtitan's PP x DDP does."""
    # Imported here: FSDP's replicate (with DTensor) costs about a second of CPU to import.
    from torch.distributed._composable.replicate_with_fsdp import replicate

    replicate(model, mesh=mesh["dp"])  # in place, like fully_shard
    return model


# The accumulation switch for DDP and FSDP2 (set_grad_sync) lives in parallel/grads.py.
