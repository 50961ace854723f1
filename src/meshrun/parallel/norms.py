"""Batch-statistics layers under data parallelism: SyncBatchNorm, or a warning.

BatchNorm normalises with the mean and variance of the batch it sees. Under data parallelism
each rank sees only its share of the global batch, so without synchronisation the training
forward normalises with per-rank statistics (a model different from one process on the global
batch, noisier as the world grows) and each rank keeps its own running statistics.

``parallel.sync_batchnorm = true`` converts every BatchNorm to torch's ``SyncBatchNorm`` over
the ``dp`` process group (statistics of the whole data-parallel batch, in the forward and in the
backward). Without it: DDP broadcasts rank 0's buffers at every forward (all ranks evaluate
alike, with rank 0's statistics); FSDP2, HSDP and pipeline replication do not, so the running
statistics drift apart and a warning says so. docs/parallel.md, "Batch statistics".
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.modules.batchnorm import _BatchNorm

from meshrun.config import ConfigError, ParallelConfig
from meshrun.runtime.mesh import ParallelDims

log = logging.getLogger("meshrun")

# torch 2.13's SyncBatchNorm.forward raises "SyncBatchNorm expected input tensor to be on GPU
# or XPU or privateuseone" for any other device (its statistics kernels are CUDA/XPU only).
SYNC_BN_DEVICES = ("cuda", "xpu", torch._C._get_privateuse1_backend_name())


def batchnorm_names(model: nn.Module) -> list[str]:
    """The names of the BatchNorm layers that use batch statistics in training (SyncBatchNorm
    included; ``track_running_stats=False`` layers too: they normalise by the batch)."""
    return [n or "<root>" for n, m in model.named_modules() if isinstance(m, _BatchNorm)]


def maybe_sync_batchnorm(
    model: nn.Module,
    mesh: DeviceMesh | None,
    cfg: ParallelConfig,
    device: torch.device,
    broadcasts_buffers: bool,
) -> nn.Module:
    """Before data parallelism is applied: with ``parallel.sync_batchnorm`` and dp > 1, return
    the model with its BatchNorm layers converted to ``SyncBatchNorm`` over the ``dp`` group
    (the same module, changed in place, unless the model itself is a BatchNorm). Without it,
    warn when the layout keeps per-rank running statistics (``broadcasts_buffers``: DDP's
    broadcast of rank 0's buffers, the one layout that keeps them equal)."""
    dp = ParallelDims.from_mesh(mesh).dp
    names = batchnorm_names(model)
    if not names or dp == 1 or mesh is None:
        return model  # one data-parallel rank: its batch statistics are the global batch's
    if not cfg.sync_batchnorm:
        if not broadcasts_buffers:
            warn_per_rank_statistics(names, dp)
        return model
    check_sync_device(device, names)
    converted = nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group=mesh.get_group("dp"))
    log.info(
        "SyncBatchNorm: %d BatchNorm layer(s) use the statistics of all %d data-parallel ranks",
        *(len(names), dp),
    )
    return converted


def warn_per_rank_statistics(names: list[str], dp: int) -> None:
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    log.warning(
        "BatchNorm layers (%s) normalise with per-rank batch statistics and keep per-rank "
        "running statistics under this layout (%d data-parallel ranks; FSDP2, HSDP and "
        "pipeline stages do not broadcast buffers as DDP does): training differs from one "
        "process and the ranks evaluate differently; set parallel.sync_batchnorm=true "
        "(docs/parallel.md, 'Batch statistics')",
        *(shown, dp),
    )


def check_sync_device(device: torch.device, names: list[str]) -> None:
    """SyncBatchNorm only runs on accelerators: refuse before step 1, not in the first forward."""
    if device.type not in SYNC_BN_DEVICES:
        raise ConfigError(
            f"parallel.sync_batchnorm = true, but this run is on {device.type} and torch's "
            f"SyncBatchNorm runs only on {' / '.join(SYNC_BN_DEVICES)} devices (its forward "
            f"raises ValueError on {device.type}); {len(names)} BatchNorm layer(s) "
            f"({names[0]}, ...) would be converted. Run on GPUs, or set "
            "parallel.sync_batchnorm=false (per-rank statistics: docs/parallel.md, "
            "'Batch statistics')"
        )
